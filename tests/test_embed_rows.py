"""The embedding-row op (kernels/embed_rows.py, csrc/embed_rows.cpp) against the `gguf` package's dequantizer, with
no download: random raw rows of every type it decodes (any bytes are a valid block once the fp16 scale fields are
finite; a float type: random finite values) looked up in a random order with repeats, at 1 and 2 threads and
several call widths, are bitwise the rows `gguf.quants.dequantize` gives; GGUFRowsEmbedding's forward takes the op
and gives bitwise its gguf path's rows, an id out of range raises IndexError on both paths. The check is shown to
catch planted decoders (a Q6_K scale taken one sub-block off, ql's nibbles swapped, a Q8_0 scale read from the
wrong end). No timing asserted."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.kernels import embed_rows
from draftwise.models.quant import GGUFRowsEmbedding

# type -> (values per block, bytes per block, byte offsets of its fp16 scale fields)
LAYOUTS = {"Q6_K": (256, 210, (208,)), "Q8_0": (32, 34, (0,)), "F16": (1, 2, ()), "BF16": (1, 2, ()),
           "F32": (1, 4, ())}
H = 2048

pytestmark = pytest.mark.skipif(not embed_rows.available(), reason="the kernel library cannot be built here")


def _random_rows(kind: str, V: int, seed: int = 0) -> torch.Tensor:
    """raw [V, row bytes] uint8 of `kind` with finite, moderate fp16 scales (a float type: random normal values)."""
    rng = np.random.default_rng(seed)
    values, size, scales = LAYOUTS[kind]
    if values == 1:
        x = torch.from_numpy(rng.standard_normal((V, H), dtype=np.float32))
        x = x.to({"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[kind])
        return x.view(torch.uint8).reshape(V, -1).contiguous()
    raw = rng.integers(0, 256, size=(V * H // values, size), dtype=np.uint8)
    for at in scales:
        raw[:, at:at + 2] = rng.uniform(-0.01, 0.01, size=raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(V, -1))


def _gguf(kind: str, raw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """ids [n] -> [n, H] float32: the rows as gguf.quants.dequantize gives them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows = raw.index_select(0, ids).numpy()
    return torch.from_numpy(dequantize(rows, GGMLQuantizationType[kind]).reshape(len(ids), H).astype(np.float32))


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _ids(V: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randint(0, V, (n - 3,), generator=g), torch.tensor([0, V - 1, 0])])  # both ends, a repeat


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_rows_are_bitwise_the_gguf_dequantizer(kind):
    assert kind in embed_rows.DECODED_TYPES
    V = 300
    raw = _random_rows(kind, V, seed=1)
    ids = _ids(V, 400, seed=2)
    want = _gguf(kind, raw, ids)
    assert torch.isfinite(want).all()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert _bitwise(embed_rows.rows(raw, ids, kind, H), want)
            for width in (1, 3, 17):  # a row's bits never depend on the call's other rows
                got = torch.cat([embed_rows.rows(raw, ids[i:i + width], kind, H) for i in range(0, 60, width)])
                assert _bitwise(got, want[:len(got)])
    finally:
        torch.set_num_threads(threads)


def _planted_q6_k(raw: torch.Tensor, ids: torch.Tensor, scale_shift: int = 0, swap_nibbles: bool = False):
    """A Q6_K decoder in torch, gguf's layout and order ((d * scale) * (q - 32)), with a planted fault: the scale
    of sub-block s + scale_shift (mod 16), or ql's low and high nibbles swapped. Unplanted it is the reference."""
    b = raw.index_select(0, ids).reshape(-1, 210).long()
    ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = b[:, 208:210].to(torch.uint8).contiguous().view(torch.float16).float()  # [blocks, 1]
    sc = torch.where(sc > 127, sc - 256, sc).roll(-scale_shift, dims=1).float()
    shifts = torch.tensor([4, 0] if swap_nibbles else [0, 4])
    lo = ((ql.view(-1, 2, 1, 64) >> shifts.view(1, 1, 2, 1)) & 15).reshape(-1, 256)
    hi = ((qh.view(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).view(1, 1, 4, 1)) & 3).reshape(-1, 256)
    q = ((lo | (hi << 4)) - 32).float().view(-1, 16, 16)
    return ((d * sc).unsqueeze(-1) * q).reshape(len(ids), H)


def test_the_check_catches_planted_q6_k_decoders():
    V = 64
    raw = _random_rows("Q6_K", V, seed=3)
    ids = _ids(V, 50, seed=4)
    want = _gguf("Q6_K", raw, ids)
    assert _bitwise(_planted_q6_k(raw, ids), want)  # the planting decoder, unplanted, is the reference
    assert not _bitwise(_planted_q6_k(raw, ids, scale_shift=1), want)
    assert not _bitwise(_planted_q6_k(raw, ids, swap_nibbles=True), want)
    # and a decoder reading a Q8_0 row's scale from its last two bytes instead of its first
    raw8 = _random_rows("Q8_0", V, seed=5)
    good = _gguf("Q8_0", raw8, ids)
    b = raw8.index_select(0, ids).reshape(-1, 34)
    wrong = b[:, 32:34].contiguous().view(torch.float16).float() * b[:, 2:].view(torch.int8).float()
    assert not _bitwise(wrong.reshape(len(ids), H), good)


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
def test_the_embedding_takes_the_op_and_gives_its_gguf_rows(kind):
    V = 100
    emb = GGUFRowsEmbedding(_random_rows(kind, V, seed=6), kind, V, H)
    ids = _ids(V, 24, seed=7).view(2, 3, 4)
    out = emb(ids)
    assert emb._op is True and out.shape == (2, 3, 4, H) and out.dtype == torch.float32
    assert _bitwise(out.reshape(-1, H), emb._gguf_rows(ids.reshape(-1)))
    for bad in (torch.tensor([3, V]), torch.tensor([-1])):
        with pytest.raises(IndexError):
            emb(bad)
        with pytest.raises(IndexError):
            emb._gguf_rows(bad)
    assert emb(torch.zeros(0, dtype=torch.long)).shape == (0, H)


def test_a_type_without_a_decoder_keeps_the_gguf_path():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    assert "Q4_K" not in embed_rows.DECODED_TYPES
    V = 8
    raw = torch.from_numpy(quantize(np.random.default_rng(8).standard_normal((V, H), dtype=np.float32),
                                    GGMLQuantizationType.Q5_0).reshape(V, -1))
    emb = GGUFRowsEmbedding(raw, "Q5_0", V, H)
    ids = torch.tensor([1, 7, 1])
    assert _bitwise(emb(ids), _gguf("Q5_0", raw, ids)) and emb._op is False

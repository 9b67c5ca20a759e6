"""Our GGUF block kernels (kernels/ggml_blocks.py, csrc/q6k.h, csrc/q8_0.h; q8_1: q8_0.h's min term): Q6_K, Q8_0
and Q5_0 blocks read exactly as ggml dequantizes them (the other types: tests/test_blocktypes_kernels.py); every ISA path bitwise the scalar oracle; every row bitwise that row alone at
every width 1..96 and thread count 1..2, per ISA path, on the packaged models' shapes; a planted split-K
reduction for wide calls fails that check. No timing asserts. About 2 minutes on 2 busy cores (the packaged shapes
dominate: every width 1..96 at 2 thread counts on 2 paths)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.kernels import autotune, ggml_blocks
from draftwise.kernels.linear import (LINEARS, Q4CLinear, Q5MLinear, Q5X8Linear, Q6KLinear, Q80Linear, Q81Linear, available,
                                     block_paths, merge)
from draftwise.kernels.probe import probe

WIDTHS = range(1, 97)  # 8 sequences x 12 tokens: every step width the engine runs
THREADS = [1, 2]
KERNELS = {"q6k": Q6KLinear, "q8_0": Q80Linear, "q8_1": Q81Linear, "q4c": Q4CLinear, "q5m": Q5MLinear, "q5x8": Q5X8Linear}
# (N, K) of the packaged models' tensors stored in these types (models/gguf.py types of the two Qwen GGUFs), the
# LM heads cut to their first 1024 rows (the same K and layout; rows only repeat the work)
PACKAGED = {
    "q6k": [(256, 1536), (1536, 8960), (896, 4864), (1024, 1536)],  # 1.5B attn_v, ffn_down, 0.5B ffn_down, head
    "q8_0": [(896, 896), (128, 896), (4864, 896), (896, 4864), (1024, 896)],  # 0.5B q/o, k/v, gate/up, down, head
    "q8_1": [(256, 1536), (1536, 8960)],  # the 1.5B's shapes a Q5_K_M file stores in Q5_K: attn_k, ffn_down
    "q5m": [(256, 1536), (1536, 8960)],  # the same shapes in a Q5_1 file
    "q5x8": [(256, 1536), (1536, 8960)],  # the same Q5_K tensors held as the table holds them now
    "q4c": [(256, 1536), (8960, 1536)],  # a Q4_0 / IQ4_XS file's attn_k, ffn_gate
}


@pytest.fixture(scope="module")
def machine() -> dict:
    return probe(bandwidth=False)


@pytest.fixture(scope="module", params=sorted(KERNELS))
def kernel(request, machine):
    if request.param not in available(machine):
        pytest.skip(f"{request.param} cannot run here (no C++ compiler)")
    return request.param


def _weight(N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g)


def _random_blocks(kind: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of a type (any bytes are a valid block) with a finite, moderate fp16 scale."""
    rng = np.random.default_rng(seed)
    nbytes = ggml_blocks.BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, size=(N * K // ggml_blocks.BLOCK_VALUES[kind], nbytes), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.01, size=raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind == "Q6_K":
        raw[:, 208:210] = scale
    else:
        raw[:, 0:2] = scale
        if kind == "Q8_0":
            raw[:, 2:] = np.where(raw[:, 2:] == 128, 129, raw[:, 2:])  # -128: never written by ggml, refused
    return raw.reshape(N, -1)


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0", "Q5_0"])
def test_blocks_are_read_as_ggml_dequantizes_them(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    N, K = 20, 512
    raw = _random_blocks(kind, N, K)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(N, K).astype(np.float32))
    parts = ggml_blocks.FROM_BLOCKS[kind](raw, N, K)
    ours = ggml_blocks.dequantize_q6k(parts) if kind == "Q6_K" else ggml_blocks.dequantize_q8_0(parts)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0", "Q5_0"])
def test_every_path_computes_the_blocks_weights_and_agrees_bitwise(kind):
    """The kernel's result is the dequantized weight times the int8 activations (only activation rounding
    remains), and every ISA path is bitwise the scalar oracle, with N not a multiple of 16."""
    N, K = 40, 512
    cls = Q6KLinear if kind == "Q6_K" else Q80Linear
    parts = ggml_blocks.FROM_BLOCKS[kind](_random_blocks(kind, N, K, seed=1), N, K)
    w = ggml_blocks.dequantize_q6k(parts) if kind == "Q6_K" else ggml_blocks.dequantize_q8_0(parts)
    bias = torch.randn(N)
    x = torch.randn(13, K)
    ref = x @ w.T + bias
    ys = {p: cls(parts=parts, bias=bias, path=p)(x) for p in block_paths(cls.name)}
    for p, y in ys.items():
        assert torch.equal(y, ys["scalar"]), p
    err = float((ys["scalar"] - ref).norm() / (ref - bias).norm())
    assert err < 0.02, err  # int8 activations only


def test_q8_0_refuses_a_value_its_avx2_product_cannot_take():
    parts = ggml_blocks.quantize_q8_0(torch.randn(16, 64))
    parts["v"][3, 5] = -128
    with pytest.raises(ValueError, match="-128"):
        Q80Linear(parts=parts)


def test_rows_are_exact_at_every_width_and_thread_count_on_every_path(kernel):
    """Small shapes with a partial column block on every path (the scalar one included)."""
    cls = KERNELS[kernel]
    N, K = 40, 512
    weight, bias = _weight(N, K)
    for path in block_paths(kernel):
        mod = cls(weight, bias, path=path)
        assert autotune.rows_exact(mod, K, WIDTHS, THREADS) is None, path


def test_rows_are_exact_on_the_packaged_shapes_on_every_simd_path(kernel):
    cls = KERNELS[kernel]
    simd = [p for p in block_paths(kernel) if p != "scalar"]
    if not simd:
        pytest.skip("no SIMD path on this CPU")
    for N, K in PACKAGED[kernel]:
        weight, bias = _weight(N, K, seed=N + K)
        for path in simd:
            mod = cls(weight, bias, path=path)
            assert autotune.rows_exact(mod, K, WIDTHS, THREADS) is None, (path, N, K)


class _SplitK(torch.nn.Module):
    """Planted: for calls wider than 32 rows, the reduction over K is split in two halves whose outputs are
    added — the same weights and activations, another float order (what a blocked wide-GEMM path does)."""

    def __init__(self, cls, weight: torch.Tensor, path: str):
        super().__init__()
        K = weight.shape[1]
        self.whole = cls(weight, path=path)
        self.lo, self.hi = cls(weight[:, : K // 2], path=path), cls(weight[:, K // 2:], path=path)
        self.K = K

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
        if x.shape[0] <= 32:
            return self.whole(x)
        return self.lo(x[:, : self.K // 2].contiguous()) + self.hi(x[:, self.K // 2:].contiguous())


def test_a_planted_split_k_reduction_for_wide_calls_fails_the_check(kernel):
    cls = KERNELS[kernel]
    weight, _ = _weight(48, 512)
    path = block_paths(kernel)[-1]
    assert autotune.rows_exact(cls(weight, path=path), 512, WIDTHS, THREADS) is None
    got = autotune.rows_exact(_SplitK(cls, weight, path), 512, WIDTHS, THREADS)
    assert got is not None and got.startswith("row ") and " of 33 " in got, got


def test_merged_and_trimmed_modules_are_bitwise_the_parts(kernel):
    """q/k/v merge into one call bitwise (columns never meet); rows(ids) of a head is bitwise its outputs."""
    cls = KERNELS[kernel]
    K = 512
    parts = [cls(*_weight(n, K, seed=n)) for n in (64, 32, 40)]
    merged = merge(parts)
    x = torch.randn(5, K)
    assert merged is not None and torch.equal(merged(x), torch.cat([p(x) for p in parts], -1))
    head = parts[2]
    for ids in (torch.arange(20), torch.tensor([3, 39, 17, 0])):
        assert torch.equal(head.rows(ids)(x), head(x)[:, ids])


def test_registered_with_their_stored_form(kernel):
    cls = LINEARS[kernel]
    mod = cls(*_weight(24, 512))
    again = cls.from_state(mod.state(), 24, 512)
    x = torch.randn(3, 512)
    assert torch.equal(again(x), mod(x))
    assert sum(t.numel() * t.element_size() for t in mod.state().values()) == cls.nbytes(24, 512, bias=True)


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
def test_dense_rows_are_the_blocks_weights(kind):
    N, K = 40, 512
    cls = Q6KLinear if kind == "Q6_K" else Q80Linear
    parts = ggml_blocks.FROM_BLOCKS[kind](_random_blocks(kind, N, K, seed=2), N, K)
    w = ggml_blocks.dequantize_q6k(parts) if kind == "Q6_K" else ggml_blocks.dequantize_q8_0(parts)
    mod = cls(parts=parts)
    for n0, n1 in ((0, 40), (3, 17), (16, 32), (33, 40)):
        assert torch.equal(mod.dense_rows(n0, n1), w[n0:n1]), (n0, n1)

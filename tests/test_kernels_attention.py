"""draftwise.kernels.attention: the row-exact decode/verification attention op against a float64 SDPA reference
(GQA, sliding windows, several sequences at different positions and lengths, T = 1..16, padding rows), its
row-exactness (a query's output is bitwise the same alone and inside any batch or chunk, on every ISA path, at
any thread count), and its use by the decoder (one call per layer, the same logits as the masked SDPA path).
Tiny tensors; no timing asserts. The first run builds the C++ extension once (shared with q4x8)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftwise.kernels import attention
from tests.harness import one_torch_thread  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# fp32 tolerance: |out - ref| <= REL_TOL * max |ref| per (query, head) row, ref in float64. The op's own error is
# a few ulp (fp32 dot products and sums, a Cephes exp good to ~1 ulp); an off-by-one key is ~1e-2 here.
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def paths() -> list[str]:
    if not attention.available():
        pytest.skip("the C++ extension cannot be built here (no compiler)")
    return attention.cpu_paths()


def _case(S, H, Hkv, C, D, firsts, ntoks, T, seed=0, dtype=torch.float32):
    """A random cache (stale entries everywhere: a key outside a query's range changes its result), queries
    [B, H, T, D] laid out as the decoder makes them (a transposed [B, T, H, D]), slots in scrambled order, each one
    block of the whole capacity (block tables [B, 1]: the contiguous layout; `_paged` cuts it into blocks)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(S, Hkv, C, D, generator=g).to(dtype)
    values = torch.randn(S, Hkv, C, D, generator=g).to(dtype)
    B = len(firsts)
    q = (torch.randn(B, T, H, D, generator=g) * 2).to(dtype).transpose(1, 2)
    slots = torch.randperm(S, generator=g)[:B, None]  # [B, 1] block tables
    positions = torch.tensor(firsts)[:, None] + torch.arange(T)  # [B, T]
    return q, keys, values, slots, positions, list(ntoks)


def _reference(q, keys, values, slots, positions, ntoks, scale, window):  # -> [B, H, T, D] float64, padding 0
    B, H, T, D = q.shape
    gqa = keys.shape[1] != H
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        s = int(slots[b, 0])
        for t in range(ntoks[b]):
            end = int(positions[b, 0]) + t + 1
            start = max(0, end - window) if window else 0
            out[b, :, t:t + 1] = F.scaled_dot_product_attention(
                q[b:b + 1, :, t:t + 1].double(), keys[s:s + 1, :, start:end].double(),
                values[s:s + 1, :, start:end].double(), scale=scale, enable_gqa=gqa)[0]
    return out


def _rel_row_err(out, ref) -> float:  # worst over (b, h, t) rows of max |diff| / max |ref|
    diff = (out.double() - ref).abs().amax(-1)
    return float((diff / ref.abs().amax(-1).clamp(min=1e-30)).max())


SHAPES = [  # (H, Hkv, D): MHA, GQA 4:1 and 6:1 (the 1.5B's 12:2), head_dim not a multiple of 16 (portable path)
    (4, 4, 16), (8, 2, 64), (6, 1, 128), (4, 2, 24)]


@pytest.mark.parametrize("H,Hkv,D", SHAPES)
@pytest.mark.parametrize("window", [None, 5, 23])
def test_matches_sdpa_reference(paths, H, Hkv, D, window):
    # four sequences at different positions (short and > 16 keys: whole and partial blocks of keys), T = 16 with
    # 16, 9, 1 and 4 real queries (the rest padding)
    case = _case(S=5, H=H, Hkv=Hkv, C=80, D=D, firsts=[0, 37, 63, 20], ntoks=[16, 9, 1, 4], T=16, seed=H + D)
    scale = D ** -0.5
    ref = _reference(*case, scale, window)
    for path in paths:
        out = attention.attend_rows(*case, scale, window, path=path)
        assert out.shape == case[0].shape and out.dtype == torch.float32
        assert _rel_row_err(out, ref) <= REL_TOL, (path, _rel_row_err(out, ref))
        for b, n in enumerate(case[5]):
            assert not out[b, :, n:].any()  # padding rows are zero


@pytest.mark.parametrize("T", [1, 2, 5, 16])
def test_every_chunk_width(paths, T):
    case = _case(S=2, H=6, Hkv=2, C=64, D=32, firsts=[30, 3], ntoks=[T, max(1, T // 2)], T=T, seed=T)
    ref = _reference(*case, 0.3, None)
    out = attention.attend_rows(*case, 0.3, None)
    assert _rel_row_err(out, ref) <= REL_TOL


def test_catches_a_wrong_key_range(paths):
    """The reference check is sharp enough to see one key too many or too few (what an off-by-one would do)."""
    q, keys, values, slots, positions, ntoks = _case(S=2, H=4, Hkv=2, C=64, D=64, firsts=[40, 7], ntoks=[9, 3], T=9)
    ref = _reference(q, keys, values, slots, positions, ntoks, 0.125, None)
    assert _rel_row_err(attention.attend_rows(q, keys, values, slots, positions, ntoks, 0.125), ref) <= REL_TOL
    shifted = _reference(q, keys, values, slots, positions + 1, ntoks, 0.125, None)  # one key more per query
    assert _rel_row_err(shifted, ref) > 100 * REL_TOL
    narrower = _reference(q, keys, values, slots, positions, ntoks, 0.125, 40)  # the first key dropped at 40
    assert _rel_row_err(narrower, ref) > 100 * REL_TOL


def test_rows_are_bitwise_independent_of_the_batch(paths):
    """A query computed alone (B = 1, T = 1) equals the same query inside a chunk and a padded batch, whatever
    the other rows hold, on every path and at 1 or 2 threads."""
    H, Hkv, D, C = 12, 2, 128, 96
    q, keys, values, slots, positions, _ = _case(S=4, H=H, Hkv=Hkv, C=C, D=D, firsts=[50, 9, 71], ntoks=[9, 9, 9],
                                                 T=9, seed=7)
    for path in paths:
        for window in (None, 33):
            alone = {}
            for b in range(3):
                for t in range(9):
                    qs = q[b:b + 1, :, t:t + 1].contiguous()  # [1, H, 1, D], a different layout too
                    alone[b, t] = attention.attend_rows(qs, keys, values, slots[b:b + 1], positions[b:b + 1, t:t + 1],
                                                        [1], D ** -0.5, window, path=path)[0, :, 0]
            noisy = q.clone()
            noisy[1] = torch.randn(H, 9, D) * 5  # another sequence's rows change: nothing else may
            for threads in (1, 2):
                torch.set_num_threads(threads)
                try:
                    for qq, ntoks in ((q, [9, 9, 9]), (q, [9, 4, 1]), (noisy, [9, 9, 9])):
                        out = attention.attend_rows(qq, keys, values, slots, positions, ntoks, D ** -0.5, window,
                                                    path=path)
                        for b in (0, 2):
                            for t in range(ntoks[b]):
                                assert torch.equal(out[b, :, t], alone[b, t]), (path, window, threads, b, t)
                finally:
                    torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_isa_paths_agree_bitwise(paths, dtype):
    if len(paths) < 2:
        pytest.skip("only one path can run on this CPU")
    case = _case(S=3, H=8, Hkv=2, C=70, D=64, firsts=[0, 45, 17], ntoks=[16, 7, 3], T=16, seed=11, dtype=dtype)
    outs = {p: attention.attend_rows(*case, 0.125, 29 if dtype == torch.float32 else None, path=p) for p in paths}
    for p in paths[1:]:
        assert torch.equal(outs[p], outs[paths[0]]), (p, paths[0])


@pytest.mark.parametrize("H,Hkv,D", [(12, 2, 128), (8, 2, 64), (6, 3, 48), (4, 1, 32), (4, 4, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_queries_are_bitwise_the_oracle(paths, H, Hkv, D, dtype):
    """The SIMD paths attend up to DW_ATTN_QBLOCK queries of one (b, kv head) per pass over the keys (absolute key
    blocks; queries with different window starts and lengths share them): every path is bitwise the portable
    oracle at every chunk width T = 1..16, with ragged real rows and padding, full and sliding windows (starts
    on and off the 16-key grid), whole and partial key blocks, at 1 and 2 threads (a split inside a run)."""
    if len(paths) < 2:
        pytest.skip("only one path can run on this CPU")
    for T in range(1, 17):
        case = _case(S=3, H=H, Hkv=Hkv, C=96, D=D, firsts=[0, 61, 29], ntoks=[T, max(1, T - 3), T // 2], T=T,
                     seed=100 + T, dtype=dtype)
        for window in (None, 7, 21, 40):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                try:
                    outs = {p: attention.attend_rows(*case, D ** -0.5, window, path=p) for p in paths}
                finally:
                    torch.set_num_threads(1)
                for p in paths[1:]:
                    assert torch.equal(outs[p], outs[paths[0]]), (p, T, window, threads)


def _paged(keys, values, tables, bs, seed=0):
    """The contiguous case's caches [S, Hkv, C, D] cut into blocks of bs positions, the blocks shuffled in one pool
    [S * C / bs, Hkv, bs, D] (plus stale blocks nobody holds), and the block tables [B, C / bs] that name them."""
    S, Hkv, C, D = keys.shape
    n = C // bs
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(S * n + 3, generator=g)  # block (s, i) -> pool block perm[s * n + i]
    pools = []
    for t in (keys, values):
        pool = torch.randn(S * n + 3, Hkv, bs, D, generator=g).to(t.dtype)  # 3 stale blocks
        pool[perm[: S * n]] = t.view(S, Hkv, n, bs, D).permute(0, 2, 1, 3, 4).reshape(S * n, Hkv, bs, D)
        pools.append(pool)
    paged = perm[: S * n].view(S, n)[tables[:, 0]]  # [B, n]
    return pools[0], pools[1], paged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_blocks_give_bitwise_the_contiguous_result(paths, dtype):
    """K/V cut into blocks of 16 or 32 positions scattered over a pool (block tables) give every query bitwise
    what the contiguous layout gives (one block per sequence), on every path, window, GQA shape and tree row:
    where the keys lie changes no float operation."""
    for (H, Hkv, D), bs in (((4, 4, 16), 16), ((12, 2, 128), 32), ((8, 2, 64), 16), ((4, 2, 24), 16)):
        q, keys, values, tables, positions, ntoks = _case(S=5, H=H, Hkv=Hkv, C=96, D=D, firsts=[40, 7, 0, 79],
                                                          ntoks=[12, 9, 1, 4], T=12, seed=3, dtype=dtype)
        pk, pv, ptables = _paged(keys, values, tables, bs, seed=H + D)
        anc = torch.tensor([[(1 << t) | (1 if t else 0) for t in range(12)]] * 4)  # a star: each row, and row 0
        for path in paths:
            for window in (None, 5, 23):
                want = attention.attend_rows(q, keys, values, tables, positions, ntoks, 0.3, window, path=path)
                got = attention.attend_rows(q, pk, pv, ptables, positions, ntoks, 0.3, window, path=path)
                assert torch.equal(want, got), (H, D, bs, path, window)
                want = attention.attend_tree(q, keys, values, tables, positions, ntoks, anc, 0.3, window, path=path)
                got = attention.attend_tree(q, pk, pv, ptables, positions, ntoks, anc, 0.3, window, path=path)
                assert torch.equal(want, got), ("tree", H, D, bs, path, window)


def test_bfloat16_kv_is_bitwise_its_float32_widening(paths):
    """A bfloat16 cache under float32 queries (--kv-cache-dtype bfloat16) gives bitwise what the float32 cache
    holding the same values gives, on every path, window and tree: K/V are widened exactly, nothing else changes."""
    for (H, Hkv, D), bs in (((4, 4, 16), 16), ((12, 2, 128), 32), ((4, 2, 24), 16)):
        q, keys, values, tables, positions, ntoks = _case(S=5, H=H, Hkv=Hkv, C=96, D=D, firsts=[40, 7, 0, 79],
                                                          ntoks=[12, 9, 1, 4], T=12, seed=4)
        pk, pv, ptables = _paged(keys.bfloat16(), values.bfloat16(), tables, bs, seed=D)
        anc = torch.tensor([[(1 << t) | (1 if t else 0) for t in range(12)]] * 4)
        for path in paths:
            for window in (None, 23):
                want = attention.attend_rows(q, pk.float(), pv.float(), ptables, positions, ntoks, 0.3, window, path=path)
                got = attention.attend_rows(q, pk, pv, ptables, positions, ntoks, 0.3, window, path=path)
                assert got.dtype == torch.float32 and torch.equal(want, got), (H, D, path, window)
                want = attention.attend_tree(q, pk.float(), pv.float(), ptables, positions, ntoks, anc, 0.3, window,
                                             path=path)
                got = attention.attend_tree(q, pk, pv, ptables, positions, ntoks, anc, 0.3, window, path=path)
                assert torch.equal(want, got), ("tree", H, D, path, window)


def test_paged_refuses_bad_tables(paths):
    q, keys, values, tables, positions, _ = _case(S=2, H=4, Hkv=2, C=32, D=16, firsts=[0, 15], ntoks=[4, 4], T=4)
    pk, pv, ptables = _paged(keys, values, tables, 16)
    with pytest.raises(RuntimeError, match="outside the cache's"):  # a table entry past the pool
        attention.attend_rows(q, pk, pv, ptables.clone().fill_(99), positions, [4, 4], 0.25)
    with pytest.raises(RuntimeError, match="multiple of 16"):  # blocks that 16-key reads would straddle
        attention.attend_rows(q, pk[:, :, :8], pv[:, :, :8], ptables, positions, [4, 4], 0.25)


def test_bfloat16_accumulates_in_float32(paths):
    case = _case(S=2, H=4, Hkv=2, C=50, D=64, firsts=[33, 2], ntoks=[5, 2], T=5, seed=5, dtype=torch.bfloat16)
    ref = _reference(*case, 0.125, None)  # on the very bf16 inputs, in float64
    out = attention.attend_rows(*case, 0.125, None)
    assert out.dtype == torch.bfloat16
    assert _rel_row_err(out.float(), ref) <= 2 ** -8  # one rounding of the output to bf16


def test_refuses_bad_arguments(paths):
    q, keys, values, slots, positions, _ = _case(S=2, H=4, Hkv=2, C=20, D=16, firsts=[0, 15], ntoks=[4, 4], T=4)
    attention.attend_rows(q, keys, values, slots, positions + 1, [4, 4], 0.25)  # positions 16..19 fit in 20
    with pytest.raises(RuntimeError, match="outside the 20 positions"):  # 17..20 do not
        attention.attend_rows(q, keys, values, slots, positions + 2, [4, 4], 0.25)
    with pytest.raises(RuntimeError, match="num_tokens"):
        attention.attend_rows(q, keys, values, slots, positions, [5, 4], 0.25)
    with pytest.raises(RuntimeError, match="multiple"):
        attention.attend_rows(q[:, :3], keys, values, slots, positions, [4, 4], 0.25)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        attention.attend_rows(q.double(), keys, values, slots, positions, [4, 4], 0.25)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        attention.attend_rows(q, keys.half(), values.half(), slots, positions, [4, 4], 0.25)


@pytest.mark.parametrize("family,dtype", [("qwen3", torch.float32), ("gemma3", torch.float32),  # head_dim 16
                                          ("llama", torch.float32), ("qwen3", torch.bfloat16)])  # (+ sliding), 8
def test_decoder_uses_one_call_per_layer_and_matches_masked_sdpa(paths, family, dtype, monkeypatch):
    from draftwise.kv_cache import KVCache
    from tests.tiny_models import tiny_decoder

    m = tiny_decoder(family, 0, 64, dtype=dtype)
    c = m.config
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 64, (2, 12), generator=g)
    chunk = torch.randint(1, 64, (2, 6), generator=g)
    caches = [KVCache(c.num_layers, 2, c.num_kv_heads, 64, c.head_dim, m.dtype, m.device) for _ in range(2)]
    for cache in caches:
        m(prompts, torch.arange(12)[None].expand(2, 12), cache, torch.tensor([0, 1]))
    calls = []
    real = attention.attend_rows
    monkeypatch.setattr(attention, "attend_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    pos = 12 + torch.arange(6)[None].expand(2, 6)
    exact = m(chunk, pos, caches[0], torch.tensor([0, 1]), num_tokens=[6, 6])
    assert len(calls) == c.num_layers
    masked = m(chunk, pos, caches[1], torch.tensor([0, 1]))  # the batched, masked SDPA path
    assert len(calls) == c.num_layers
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(exact.float(), masked.float(), rtol=tol, atol=tol)

"""draftwise.kernels.glue: the decoder's per-layer glue ops against the torch reference the decoder otherwise runs
(RMSNorm within NORM_TOLERANCE, the silu activation within GLU_TOLERANCE; RoPE, the K/V cache write and the gelu
activation bitwise), every ISA path of the row loops bitwise the portable one, their row-exactness
(a row's result is bitwise the same alone, inside any batch, from a strided slice, at any thread count), and the
decoder's use of them (fused == reference within the norm's tolerance for every family; merged + fused
verification rows are bitwise single steps), and a mixture's router logits (the exact sums) and routing (torch's
within ulps). Tiny tensors; no timing asserts. The first run builds the C++ extension once (shared with q4x8)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftwise.kernels import glue
from draftwise.kv_cache import KVCache
from draftwise.models.transformer import rotate_half
from tests.harness import one_torch_thread  # noqa: F401 (a fixture)
from tests.tiny_models import FAMILIES, tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def built():
    if not glue.available():
        pytest.skip("the C++ extension cannot be built here (no compiler)")


def ref_norm(x, w, eps, offset):  # transformer.RMSNorm's torch reference (float32)
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return xf * (offset + w) if offset else w * xf


def ref_rope(x, cos, sin):  # x [..., D], cos / sin [..., D / 2] -> the reference's x * cos + rotate_half(x) * sin
    c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return x * c + rotate_half(x) * s


def angles(n, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4000, (n,), generator=g).float()
    freqs = pos[:, None] * (1.0 / (1e6 ** (torch.arange(0, D, 2).float() / D)))
    return freqs.cos(), freqs.sin()  # [n, D / 2]


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_within_tolerance_and_add_is_bitwise(offset):
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 1, 1536), (3, 7, 896), (5, 64)):
        x, h = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
        w = torch.randn(shape[-1], generator=g)
        ref = ref_norm(x, w, 1e-6, offset)
        y = glue.rms_norm(x, w, 1e-6, offset)
        assert y.shape == x.shape and y.is_contiguous()
        assert (y - ref).abs().max() <= glue.NORM_TOLERANCE * ref.abs().max()
        s, n = glue.add_rms_norm(x, h, w, 1e-6, offset)
        assert torch.equal(s, x + h)
        assert torch.equal(n, glue.rms_norm(x + h, w, 1e-6, offset))
    wide = torch.randn(4, 2 * 640, generator=g)  # a column slice of a wider tensor (row stride != N)
    w = torch.randn(640, generator=g)
    assert torch.equal(glue.rms_norm(wide[:, 640:], w, 1e-6, offset), glue.rms_norm(wide[:, 640:].contiguous(), w,
                                                                                     1e-6, offset))


def test_rope_is_bitwise_the_reference_on_slices_of_a_merged_projection():
    g = torch.Generator().manual_seed(1)
    B, T, H, Hk, D = 2, 5, 6, 2, 64
    qkv = torch.randn(B, T, (H + 2 * Hk) * D, generator=g)
    q, k, _ = qkv.split([H * D, Hk * D, Hk * D], dim=-1)  # strided views, as the decoder passes them
    cos, sin = angles(B * T, D)
    rq, rk = glue.rope_qk(q, k, cos, sin, D)
    ref_q = ref_rope(q.reshape(B * T, H, D), cos[:, None], sin[:, None]).reshape(B, T, H * D)
    ref_k = ref_rope(k.reshape(B * T, Hk, D), cos[:, None], sin[:, None]).reshape(B, T, Hk * D)
    assert torch.equal(rq, ref_q) and torch.equal(rk, ref_k)
    # with the per-head q / k norm first (qwen3, gemma3): the norm's tolerance, then the same rotation
    qn, kn = torch.randn(D, generator=g), torch.randn(D, generator=g)
    for offset in (0.0, 1.0):
        rq, rk = glue.rope_qk(q, k, cos, sin, D, qn, kn, 1e-6, offset)
        want_q = ref_rope(ref_norm(q.reshape(B * T, H, D), qn, 1e-6, offset), cos[:, None], sin[:, None])
        want_k = ref_rope(ref_norm(k.reshape(B * T, Hk, D), kn, 1e-6, offset), cos[:, None], sin[:, None])
        assert (rq.reshape(B * T, H, D) - want_q).abs().max() <= 4 * glue.NORM_TOLERANCE * want_q.abs().max()
        assert (rk.reshape(B * T, Hk, D) - want_k).abs().max() <= 4 * glue.NORM_TOLERANCE * want_k.abs().max()


def test_rope_cache_write_is_kvcache_write():
    """The fused op stores exactly what KVCache.write stores (scrambled slots, several positions, blocks of 16
    positions taken out of order), and returns rope_qk's q."""
    g = torch.Generator().manual_seed(2)
    B, T, H, Hk, D = 3, 4, 4, 2, 16
    ours, ref = (KVCache(1, 5, Hk, 32, D, torch.float32) for _ in range(2))
    slots = torch.tensor([4, 0, 2])
    for c in (ours, ref):
        c.reserve([1], [16])  # a block held by another slot: slot 4's first block is not block 0
        c.reserve([4, 0, 2], [7, 4, 24])
        # stale contents that must survive outside the written positions
        c.keys[0].copy_(torch.arange(c.keys[0].numel()).view_as(c.keys[0]).float())
        c.values[0].copy_(-c.keys[0])
    tables = ours.table(slots)
    assert tables[0, 0] != 0 and torch.equal(tables, ref.table(slots))
    qkv = torch.randn(B, T, (H + 2 * Hk) * D, generator=g)
    q, k, v = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    positions = torch.tensor([[3, 4, 5, 6], [0, 1, 2, 3], [20, 21, 22, 23]])
    cos, sin = angles(B * T, D, seed=3)
    rq = glue.rope_qk_cache(q, k, v, cos, sin, D, None, None, 0.0, 0.0, ours.keys[0], ours.values[0], tables,
                            positions)
    want_q, want_k = glue.rope_qk(q, k, cos, sin, D)
    assert torch.equal(rq, want_q)
    ref.write(0, tables, positions, want_k.view(B, T, Hk, D).transpose(1, 2), v.reshape(B, T, Hk, D).transpose(1, 2))
    assert torch.equal(ours.keys[0], ref.keys[0]) and torch.equal(ours.values[0], ref.values[0])
    with pytest.raises(RuntimeError, match="beyond the 32 positions"):
        glue.rope_qk_cache(q, k, v, cos, sin, D, None, None, 0.0, 0.0, ours.keys[0], ours.values[0], tables,
                           positions + 30)
    with pytest.raises(RuntimeError, match="out of range"):  # a table entry past the pool
        glue.rope_qk_cache(q, k, v, cos, sin, D, None, None, 0.0, 0.0, ours.keys[0], ours.values[0], tables + 99,
                           positions)


def test_rope_cache_write_rounds_into_a_bfloat16_cache_as_kvcache_write():
    g = torch.Generator().manual_seed(5)
    B, T, H, Hk, D = 2, 3, 4, 2, 16
    ours, ref = (KVCache(1, 3, Hk, 32, D, torch.bfloat16) for _ in range(2))
    slots = torch.tensor([2, 0])
    for c in (ours, ref):
        c.reserve([2, 0], [20, 3])
    tables = ours.table(slots)
    q, k, v = torch.randn(B, T, (H + 2 * Hk) * D, generator=g).split([H * D, Hk * D, Hk * D], dim=-1)
    positions = torch.tensor([[17, 18, 19], [0, 1, 2]])
    cos, sin = angles(B * T, D, seed=6)
    glue.rope_qk_cache(q, k, v, cos, sin, D, None, None, 0.0, 0.0, ours.keys[0], ours.values[0], tables, positions)
    _, want_k = glue.rope_qk(q, k, cos, sin, D)
    ref.write(0, tables, positions, want_k.view(B, T, Hk, D).transpose(1, 2), v.reshape(B, T, Hk, D).transpose(1, 2))
    for a, b in zip(ours.gather(0, 20) + ours.gather(2, 20), ref.gather(0, 20) + ref.gather(2, 20)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_silu_glu_is_within_its_tolerance_and_gelu_is_bitwise():
    g = torch.Generator().manual_seed(4)
    gu = torch.randn(2, 3, 2 * 96, generator=g) * 4
    gu[0, 0, :12] = torch.tensor([0.0, -0.0, 20.0, -20.0, 80.0, -80.0, 86.9, -86.9, 87.5, -87.5, 1e-20, -1e-20])
    gate, up = gu.split(96, dim=-1)
    for fused in (glue.glu(gu, None, "silu"), glue.glu(gate.contiguous(), up.contiguous(), "silu")):
        ref = F.silu(gate) * up
        assert ((fused - ref).abs() <= glue.GLU_TOLERANCE * ref.abs()).all()
    assert torch.equal(glue.glu(gu, None, "gelu_tanh"), F.gelu(gate, approximate="tanh") * up)
    assert torch.equal(glue.glu(gate.contiguous(), up.contiguous(), "gelu_tanh"), F.gelu(gate, approximate="tanh") * up)


def test_silu_glu_saturates_like_silu_far_out():
    """Past the exp's clamp silu(g) is g (g > 87) or a tiny negative number (g < -88): no inf, no NaN."""
    g = torch.tensor([[90.0, 1e4, 3e38, -90.0, -1e4, -3e38]])
    out = glue.glu(g, torch.ones_like(g), "silu")
    assert torch.equal(out[0, :3], g[0, :3])
    assert (out[0, 3:] <= 0).all() and (out[0, 3:] > -1e-35).all()


def test_every_isa_path_is_bitwise_the_portable_one():
    paths = glue.cpu_paths()
    if len(paths) < 2:
        pytest.skip("only the portable path runs on this CPU")
    g = torch.Generator().manual_seed(8)
    n = 1539  # not a multiple of 8 or 16: every path's tail
    x, h, w = torch.randn(9, n, generator=g) * 3, torch.randn(9, n, generator=g), torch.randn(n, generator=g)
    gu = torch.randn(9, 2 * 9000 + 14, generator=g) * 6  # longer than a silu task: rows split into chunks
    q, k = torch.randn(9, 4 * 40, generator=g), torch.randn(9, 2 * 40, generator=g)
    cos, sin = angles(9, 40)
    nw = torch.randn(40, generator=g)
    router = torch.randn(33, n, generator=g)
    router[:, ::7] = 0.0  # exact zeros and negative zeros among the products (a lane must never turn -0)
    router[::2, ::11] = -0.0

    def ops():
        return [glue.rms_norm(x, w, 1e-6, 0.0), glue.rms_norm(x, w, 1e-6, 1.0), *glue.add_rms_norm(x, h, w, 1e-5, 0.0),
                glue.glu(gu, None, "silu"), *glue.rope_qk(q, k, cos, sin, 40, nw, nw, 1e-6, 0.0),
                glue.router_logits(x, router)]

    before = glue.use_path("scalar")
    try:
        want = ops()
        for path in paths:
            glue.use_path(path)
            assert all(torch.equal(a, b) for a, b in zip(ops(), want)), path
    finally:
        glue.use_path(before)
    with pytest.raises(KeyError):
        glue.use_path("neon")


def argmax_rows() -> list[torch.Tensor]:
    """Rows that test an argmax's every branch: lengths around each path's vector widths and its four accumulators,
    a vocabulary row, ties across lanes, accumulators and the tail, -inf rows, signed zeros, NaNs anywhere."""
    g = torch.Generator().manual_seed(11)
    rows = [torch.randn(n, generator=g) for n in (1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 1539,
                                                   151_936)]
    for n in (5, 40, 100, 1539):  # the maximum repeated: the first copy must win, wherever the others lie
        for spots in ((0, n - 1), (n - 1, n // 2, 3), (n // 3, n // 3 + 16, n // 3 + 1)):
            r = torch.randn(n, generator=g)
            r[[s % n for s in spots]] = 9.0
            rows.append(r)
    rows += [torch.full((n,), float("-inf")) for n in (1, 33, 1539)]
    lone = torch.full((1539,), float("-inf"))
    lone[1200] = -3.0e38
    rows += [lone, torch.zeros(70), torch.tensor([-0.0] + [0.0] * 40), torch.tensor([0.0] * 20 + [-0.0] + [0.0] * 20)]
    for spots in ((0,), (5,), (70, 20), (1538,), (1530, 1537)):  # NaN: its first index, in lane, body or tail
        r = torch.randn(1539, generator=g)
        r[list(spots)] = float("nan")
        rows.append(r)
    rows.append(torch.tensor([float("nan")] * 3))
    return rows


def test_argmax_is_torch_argmax_on_every_path():
    rows = argmax_rows()
    before = glue.use_path("auto")
    try:
        for path in glue.cpu_paths():
            glue.use_path(path)
            for r in rows:
                assert int(glue.argmax(r)) == int(r.argmax()), (path, r.shape[0])
            batch = torch.randn(3, 5, 2000)  # [..., N] -> [...], rows through the threads and a non-row-stride view
            assert torch.equal(glue.argmax(batch), batch.argmax(-1))
            assert torch.equal(glue.argmax(batch[:, :, 7:]), batch[:, :, 7:].argmax(-1))
            assert torch.equal(glue.argmax(batch.transpose(0, 2)), batch.transpose(0, 2).argmax(-1))
    finally:
        glue.use_path(before)
    with pytest.raises(RuntimeError, match="float32"):
        glue.argmax(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="N >= 1"):
        glue.argmax(torch.zeros(2, 0))


@pytest.mark.parametrize("threads", [1, 2])
def test_every_op_is_row_exact(threads):
    """Each row's result is bitwise the same alone (a one-token decode step) and inside any batch: 9 rows
    (a verification), 100 rows (a prompt, split among threads)."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(5)
    N, D, H, Hk = 256, 32, 4, 2
    x, h, w = torch.randn(100, N, generator=g), torch.randn(100, N, generator=g), torch.randn(N, generator=g)
    qkv = torch.randn(100, (H + 2 * Hk) * D, generator=g)
    q, k, _ = qkv.split([H * D, Hk * D, Hk * D], dim=-1)
    cos, sin = angles(100, D)
    nw = torch.randn(D, generator=g)
    gu = torch.randn(100, 2 * N, generator=g)

    def ops(rows: slice):
        out = [glue.rms_norm(x[rows], w, 1e-6, 1.0), *glue.add_rms_norm(x[rows], h[rows], w, 1e-6, 0.0),
               *glue.rope_qk(q[rows], k[rows], cos[rows], sin[rows], D, nw, nw, 1e-6, 0.0),
               glue.glu(gu[rows], None, "silu")]
        return out

    full = ops(slice(0, 100))
    for lo, hi in ((0, 1), (37, 38), (99, 100), (10, 19), (50, 100)):
        for part, whole in zip(ops(slice(lo, hi)), full):
            assert torch.equal(part, whole[lo:hi])


@pytest.mark.parametrize("threads", [1, 2])
def test_router_logits_are_the_exact_sums_and_row_exact(threads):
    """router_logits: each logit within a few float64 ulps of the exact sum (float64 products of float32 values are
    exact; math.fsum of them is the exact sum rounded once), and each row's logits bitwise the same alone (a decode
    step) and inside any batch (a verification's rows), at 1 and 2 threads."""
    import math

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(11)
    M, E, H = 16, 40, 300  # H not a multiple of 8: the lanes' tail
    x, w = torch.randn(M, H, generator=g), torch.randn(E, H, generator=g)
    got = glue.router_logits(x, w)
    assert got.dtype == torch.float64 and got.shape == (M, E)
    prods = x.double()[:, None, :] * w.double()[None]  # [M, E, H], exact
    exact = torch.tensor([[math.fsum(prods[m, e].tolist()) for e in range(E)] for m in range(M)], dtype=torch.float64)
    scale = prods.abs().sum(-1)  # a sum's rounding error is bounded by ulps of the sum of |terms|
    assert ((got - exact).abs() <= 4 * H * 2.0 ** -53 * scale).all()
    for lo, hi in ((0, 1), (7, 8), (15, 16), (3, 12)):
        assert torch.equal(glue.router_logits(x[lo:hi], w), got[lo:hi])


@pytest.mark.parametrize("norm", [False, True])
def test_route_is_the_torch_routing_within_ulps_and_row_exact(norm):
    """route: the experts torch's softmax / topk / sort pick (random logits: no ties), the weights within a few
    float32 ulps of torch's, and each row bitwise the same alone and inside any batch."""
    g = torch.Generator().manual_seed(12)
    M, E, k = 40, 64, 8
    logits = torch.randn(M, E, generator=g, dtype=torch.float64) * 3
    experts, weights = glue.route(logits, k, norm)
    probs = torch.softmax(logits.to(torch.float32), dim=-1)
    w, e = torch.topk(probs, k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    e, order = e.sort(dim=-1)
    assert torch.equal(experts, e)
    assert torch.allclose(weights, w.gather(-1, order), rtol=4e-7, atol=0)
    for lo, hi in ((0, 1), (13, 14), (39, 40), (5, 14)):
        part = glue.route(logits[lo:hi], k, norm)
        assert torch.equal(part[0], experts[lo:hi]) and torch.equal(part[1], weights[lo:hi])


# ---- the decoder's use of the ops ------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_fused_decoder_matches_the_reference_path(family):
    """use_fused_glue(False) runs the torch reference: the logits differ only through the norms' summation and silu's exp."""
    model = tiny_decoder(family, seed=6)
    assert model.fused and all(layer.mlp.fused for layer in model.model.layers)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (2, 11), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(11)[None].expand(2, 11)

    def logits() -> torch.Tensor:
        cache = KVCache(c.num_layers, 2, c.num_kv_heads, 32, c.head_dim, model.dtype)
        prompt = model(ids[:, :8], pos[:, :8], cache, torch.tensor([0, 1]), num_tokens=[8, 8])
        return torch.cat([prompt, model(ids[:, 8:], pos[:, 8:], cache, torch.tensor([0, 1]), num_tokens=[3, 3])], 1)

    fused = logits()
    assert not model.use_fused_glue(False) and not model.fused
    ref = logits()
    assert model.use_fused_glue(True)
    assert (fused - ref).abs().max() <= 1e-5 * ref.abs().max()

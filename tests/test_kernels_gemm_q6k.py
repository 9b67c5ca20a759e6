"""q6k's wide sides (csrc/gemm_q6k*.cpp: the AMX int8 tile GEMM that path-'auto' Q6_K calls of many rows take, and
on an AVX-512 VNNI CPU without AMX the GEMV over row chunks, `wide_vnni`, tested on AMX machines too): every
row each computes is bitwise the row the Q6_K GEMV computes, at every width 1..512, on 1 and 2 threads, for each K of
the packaged models' Q6_K tensors (attn_v, ffn_down, the heads: K = hidden or intermediate size), on every packaged
projection shape, against each GEMV ISA path (scalar, AVX2, AVX-512); 'auto' hands wide calls to it only from the
measured width on, to the VNNI side under a $DRAFTWISE_MAX_ISA=avx512 cap and to none below it; and the check used
here catches a planted kernel whose reduction order depends on the width. q6m (GGUF Q2_K: q6k.h's min term) has the
VNNI side alone, also on AMX CPUs (the tiles carry no min term): its rows are the q6m GEMV's at widths 1..96 and past
the chunk, on 1 and 2 threads, on every GEMV path, through its own switch, and its planted reduction fails too. q3k
(GGUF Q3_K in q6k.h's 3-bit planes) computes bitwise what q6k computes holding the same blocks as Q6_K values
q3 + 32 (the exact tot is one integer), on every GEMV path, width 1..96 and thread count, and on its VNNI side
(also on AMX CPUs: q6k's tiles are built from Q6_K's planes), through its own switch. No timing asserts. Skipped where the CPU has neither side: there 'auto' never leaves the GEMV."""
from __future__ import annotations

import pytest
import torch

from draftwise.kernels import ggml_blocks
from draftwise.kernels.linear import Q3KLinear, Q6KLinear, Q6MLinear, block_paths
from tests.harness import (KS, SHAPES, WIDTHS, assert_wide_is_gemv, first_inexact_width, ops, side,  # noqa: F401
                           threads, wide_state, wide_x)  # (fixtures)

WIDE_KIND = "q6k"  # the `ops` fixture's kernel

Q6K_KS = [k for k in KS if k % 256 == 0]  # Q6_K needs whole super-blocks: 1024 1536 2048 4864 8960 (640, 896: no)


def _linear(N: int, K: int, seed: int, path: str = "avx512", bias: bool = True) -> Q6KLinear:
    """Random Q6_K parts as a GGUF may hold them: 6-bit weights over 0..63 and int8 scales over the whole -128..127
    (llama.cpp's quantizer writes negative scales too), so sc * (q - 32) spans -4096..4064."""
    g = torch.Generator().manual_seed(seed)
    parts = {"q": torch.randint(0, 64, (N, K), generator=g, dtype=torch.uint8),
             "sc": torch.randint(-128, 128, (N, K // 16), generator=g).to(torch.int8),
             "d": torch.rand(N, K // 256, generator=g) * 1e-3}
    parts["q"][0, :16], parts["sc"][0, 0] = 0, -128  # the extreme product, -128 * -32 = 4096
    return Q6KLinear(bias=torch.randn(N, generator=g) if bias else None, parts=parts, path=path)


def _wide(ops, lin: Q6KLinear, x: torch.Tensor, side: str = "wide") -> torch.Tensor:  # x [M, K] -> [M, N]
    b = lin._buffers
    return getattr(ops, side)(x.contiguous(), b["ql"], b["qh"], b["sc"], b["d"], b["bias"], lin.out_features)


def test_the_test_weights_reach_the_scale_and_weight_extremes():
    """What the base-256 split must carry exactly: int8 scales at both ends, 6-bit weights at 0 and 63."""
    lin = _linear(40, 1536, seed=1)
    sc = lin._buffers["sc"]
    assert sc.min() == -128 and sc.max() == 127
    q = ggml_blocks.unpack_q6k(lin._buffers, 0, 3)["q"]
    assert q.min() == 0 and q.max() == 63


@pytest.mark.parametrize("K", Q6K_KS)
def test_wide_rows_are_the_gemv_rows_at_every_width_and_thread_count(ops, side, threads, K):
    """Every width 1..512 on a 40-column weight (two whole 16-column blocks and a partial one) of each K, on 1 and
    2 threads, against the GEMV's rows (themselves each row alone: spot-checked here)."""
    lin = _linear(40, K, seed=K)  # the AVX-512 GEMV
    assert_wide_is_gemv(lin, lambda xs: _wide(ops, lin, xs, side), wide_x(max(WIDTHS), K, seed=K + 1), WIDTHS,
                        threads, spot=(0, 1, 31, 32, 255, 511))


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_wide_rows_are_the_gemv_rows_on_every_projection_shape(ops, side, threads, model):
    shapes = [(N, K) for N, K in SHAPES[model] if K % 256 == 0]
    if not shapes:
        pytest.skip(f"{model}: no K a multiple of 256 (its GGUF holds no Q6_K linear)")
    for i, (N, K) in enumerate(shapes):
        lin = _linear(N, K, seed=100 + i, bias=i % 2 == 0)
        x = wide_x(512, K, seed=200 + i)
        ref = lin(x)
        for n in (1, 2):
            threads(n)
            assert first_inexact_width(lambda xs: _wide(ops, lin, xs, side), x, ref, (1, 16, 33, 64, 200, 512)) is None, \
                (model, N, K, n)


def test_wide_rows_are_every_gemv_paths_rows(ops, side):
    """The GEMV's ISA paths agree bitwise (test_kernels_ggml.py); the wide kernel agrees with each of them."""
    K = 1536
    x = wide_x(64, K, seed=7)
    for path in block_paths("q6k"):
        lin = _linear(40, K, seed=8, path=path)
        ref = lin(x)
        assert first_inexact_width(lambda xs: _wide(ops, lin, xs, side), x, ref, range(1, 65)) is None, path


def test_auto_takes_the_wide_kernel_from_the_measured_width_and_stays_exact(ops):
    """Q6KLinear's default path 'auto' switches at the q6k wide_min_rows; the rows do not change across it."""
    assert ops.wide_min_rows() >= 1
    auto, gemv = _linear(40, 1536, seed=9, path="auto"), _linear(40, 1536, seed=9, path="avx512")
    x = wide_x(96, 1536, seed=10)
    ref = gemv(x)
    before = ops.wide_min_rows()
    try:
        for at in (2, 32, 33):
            ops.set_wide_min_rows(at)
            assert ops.wide_takes(at) and not ops.wide_takes(at - 1)
            assert first_inexact_width(auto, x, ref, range(1, 97)) is None, at
    finally:
        ops.set_wide_min_rows(before)
    with pytest.raises(RuntimeError):
        ops.set_wide_min_rows(0)


def test_bad_arguments_are_clear_errors(ops):
    lin = _linear(40, 1536, seed=2)
    b = lin._buffers
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.wide(torch.zeros(4, 640), b["ql"], b["qh"], b["sc"], b["d"], None, 40)
    with pytest.raises(RuntimeError, match="ql: bad shape"):
        ops.wide(torch.zeros(4, 1536), b["ql"][:1], b["qh"], b["sc"], b["d"], None, 40)
    with pytest.raises(RuntimeError, match="float32"):
        ops.wide(torch.zeros(4, 1536, dtype=torch.bfloat16), b["ql"], b["qh"], b["sc"], b["d"], None, 40)


def test_an_isa_cap_or_the_override_keeps_auto_off_the_wide_kernel(ops):
    """DRAFTWISE_MAX_ISA=avx512 is a CPU without AMX (a Zen 4): the VNNI side; avx2 (a Zen 3): no wide side (in a
    fresh process: read once); DRAFTWISE_WIDE_MIN_ROWS sets the width without measuring (0: never), as for q4x8."""
    def run(**env):
        return wide_state("q6k", **env)

    assert run(DRAFTWISE_MAX_ISA="avx512", DRAFTWISE_WIDE_MIN_ROWS="48") == [True, 48, True, "vnni"]
    capped = run(DRAFTWISE_MAX_ISA="avx2")
    assert capped[0] is False and capped[2] is False
    assert run(DRAFTWISE_WIDE_MIN_ROWS="48")[:3] == [True, 48, True]
    assert run(DRAFTWISE_WIDE_MIN_ROWS="0")[1] > 2 ** 40


def test_a_planted_width_dependent_reduction_fails_the_check(ops, side):
    """A kernel that sums the super-blocks in reverse order from 33 rows on (the same exact integer terms, another
    float order: what splitting K differently by width does) must be caught by first_inexact_width."""
    N, K = 40, 1536
    S = K // 256
    g = torch.Generator().manual_seed(11)
    parts = ggml_blocks.quantize_q6k(torch.randn(N, K, generator=g) * 0.05)
    rev = {"q": parts["q"].view(N, S, 256).flip(1).reshape(N, K),
           "sc": parts["sc"].view(N, S, 16).flip(1).reshape(N, -1), "d": parts["d"].flip(1)}
    assert set(rev) == set(parts)
    lin, lin_rev = Q6KLinear(parts=parts), Q6KLinear(parts={k: v.contiguous() for k, v in rev.items()})
    x = wide_x(64, K, seed=12)
    ref = torch.cat([lin(x[i:i + 1]) for i in range(64)])

    def planted(xs):
        if xs.shape[0] <= 32:
            return _wide(ops, lin, xs, side)
        return _wide(ops, lin_rev, xs.view(-1, S, 256).flip(1).reshape(-1, K), side)

    assert first_inexact_width(lambda xs: _wide(ops, lin, xs, side), x, ref, range(1, 65)) is None
    assert first_inexact_width(planted, x, ref, range(1, 65)) == 33
    assert torch.allclose(planted(x), ref, rtol=1e-4, atol=1e-4)  # close (same integers): only exactness tells


# q6m (GGUF Q2_K): the VNNI side with the min term; WIDTHS_Q6M reach past a 48-row chunk (csrc/gemm_wide.h) and beyond
WIDTHS_Q6M = [*range(1, 97), 143, 144, 145, 191, 200]


@pytest.fixture(scope="module")
def q6m_ops(ops):  # ops: skipped where q6k has no wide side (q6m's is the same VNNI side)
    lib = torch.ops.draftwise_q6m
    assert lib.wide_available() and lib.wide_kind() == "vnni"  # never "amx": the AMX tiles carry no min term
    return lib


def _q6m_linear(N: int, K: int, seed: int, path: str = "avx512", bias: bool = True) -> Q6MLinear:
    """Random q6m parts: q6k's 6-bit values and int8 scales over the whole range, Q2_K's 4-bit mins and its dmin."""
    g = torch.Generator().manual_seed(seed)
    parts = {"q": torch.randint(0, 64, (N, K), generator=g, dtype=torch.uint8),
             "sc": torch.randint(-128, 128, (N, K // 16), generator=g).to(torch.int8),
             "d": torch.rand(N, K // 256, generator=g) * 1e-3,
             "mn": torch.randint(0, 16, (N, K // 16), generator=g).to(torch.int8),
             "dmin": torch.rand(N, K // 256, generator=g) * 1e-3}
    return Q6MLinear(bias=torch.randn(N, generator=g) if bias else None, parts=parts, path=path)


def _q6m_wide(ops, lin: Q6MLinear, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
    b = lin._buffers
    return ops.wide(x.contiguous(), b["ql"], b["qh"], b["sc"], b["d"], b["mn"], b["dmin"], b["bias"],
                    lin.out_features)


@pytest.mark.parametrize("K", [1536, 8960])
def test_q6m_wide_rows_are_the_gemv_rows_at_every_width_and_thread_count(q6m_ops, threads, K):
    lin = _q6m_linear(40, K, seed=K)  # the AVX-512 GEMV (with its min term)
    assert_wide_is_gemv(lin, lambda xs: _q6m_wide(q6m_ops, lin, xs), wide_x(max(WIDTHS_Q6M), K, seed=K + 1),
                        WIDTHS_Q6M, threads, spot=(0, 1, 47, 48, 199))


def test_q6m_wide_rows_are_every_gemv_paths_rows(q6m_ops):
    x = wide_x(64, 1536, seed=7)
    for path in block_paths("q6m"):
        lin = _q6m_linear(40, 1536, seed=8, path=path, bias=False)
        ref = lin(x)
        assert first_inexact_width(lambda xs: _q6m_wide(q6m_ops, lin, xs), x, ref, range(1, 65)) is None, path


def _own_switch_keeps_rows(lib, ops, auto, gemv) -> torch.Tensor:
    """`auto` (a path-'auto' linear of `lib`'s kernel, 40 x 1536) takes the wide side at `lib`'s own wide_min_rows, not
    q6k's, and its rows at widths 1..96 are `gemv`'s across the switch; returns the x used [96, 1536]."""
    x = wide_x(96, 1536, seed=10)
    ref = gemv(x)
    before, before_q6k = lib.wide_min_rows(), ops.wide_min_rows()
    try:
        ops.set_wide_min_rows(2 ** 40)
        for at in (2, 33):
            lib.set_wide_min_rows(at)
            assert lib.wide_takes(at) and not lib.wide_takes(at - 1) and not ops.wide_takes(at)
            assert first_inexact_width(auto, x, ref, range(1, 97)) is None, at
    finally:
        lib.set_wide_min_rows(before)
        ops.set_wide_min_rows(before_q6k)
    return x


def test_q6m_auto_takes_the_wide_side_from_its_own_switch_and_stays_exact(q6m_ops, ops):
    """Q6MLinear's path 'auto' (the linear op hands it over: csrc/q6k.cpp) switches at q6m's wide_min_rows, which is
    not q6k's; the rows do not change across it."""
    auto, gemv = _q6m_linear(40, 1536, seed=9, path="auto"), _q6m_linear(40, 1536, seed=9, path="avx512")
    x = _own_switch_keeps_rows(q6m_ops, ops, auto, gemv)
    b = gemv._buffers
    with pytest.raises(RuntimeError, match="mn: bad shape"):
        q6m_ops.wide(x, b["ql"], b["qh"], b["sc"], b["d"], b["mn"][:1], b["dmin"], None, 40)


def test_q6m_wide_side_is_vnni_only_and_obeys_the_isa_cap(q6m_ops):
    """No cap (an AMX CPU included) and an avx512 cap: the VNNI side; avx2: none (a fresh process: read once)."""
    def run(**env):
        return wide_state("q6m", **env)

    assert run(DRAFTWISE_WIDE_MIN_ROWS="48") == [True, 48, True, "vnni"]
    assert run(DRAFTWISE_MAX_ISA="avx512", DRAFTWISE_WIDE_MIN_ROWS="48") == [True, 48, True, "vnni"]
    capped = run(DRAFTWISE_MAX_ISA="avx2", DRAFTWISE_WIDE_MIN_ROWS="48")
    assert capped[0] is False and capped[2] is False and capped[3] == "none"


def test_q6m_planted_width_dependent_reduction_fails_the_check(q6m_ops):
    """q6m's super-blocks summed in reverse from 33 rows on (same exact integers, another float order) is caught."""
    N, K = 40, 1536
    S = K // 256
    g = torch.Generator().manual_seed(11)
    parts = ggml_blocks.quantize_q6m(torch.randn(N, K, generator=g) * 0.05)
    per16 = lambda t: t.view(N, S, 16).flip(1).reshape(N, -1)  # noqa: E731
    rev = {"q": parts["q"].view(N, S, 256).flip(1).reshape(N, K), "sc": per16(parts["sc"]),
           "mn": per16(parts["mn"]), "d": parts["d"].flip(1), "dmin": parts["dmin"].flip(1)}
    assert set(rev) == set(parts)
    lin, lin_rev = Q6MLinear(parts=parts), Q6MLinear(parts={k: v.contiguous() for k, v in rev.items()})
    x = wide_x(64, K, seed=12)
    ref = torch.cat([lin(x[i:i + 1]) for i in range(64)])

    def planted(xs):
        if xs.shape[0] <= 32:
            return _q6m_wide(q6m_ops, lin, xs)
        return _q6m_wide(q6m_ops, lin_rev, xs.view(-1, S, 256).flip(1).reshape(-1, K))

    assert first_inexact_width(lambda xs: _q6m_wide(q6m_ops, lin, xs), x, ref, range(1, 65)) is None
    assert first_inexact_width(planted, x, ref, range(1, 65)) == 33
    assert torch.allclose(planted(x), ref, rtol=1e-4, atol=1e-4)


# q3k (GGUF Q3_K at its own width): bitwise q6k holding the same blocks as Q6_K values

def _q3k_pair(N: int, K: int, seed: int, path: str = "avx512", bias: bool = True) -> tuple[Q3KLinear, Q6KLinear]:
    """Random Q3_K blocks (any bytes, a finite fp16 d) on q3k, and the same parts held as q6k held them before q3k:
    q3 + 32 = q + 28 in Q6_K's planes, the same sc and d. Row 0's first sub-block reaches q3 = -4 at scale -32."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (N * K // 256, 110), generator=g, dtype=torch.uint8)
    raw[:, 108:110] = (torch.rand(raw.shape[0], generator=g) * 0.01 + 0.001).half().view(torch.uint8).view(-1, 2)
    raw[0, 0:32], raw[0, 32:64], raw[0, 96] = 0, 0, raw[0, 96] & 0xF0  # values 0..15 of row 0: q = 0, scale 0 (- 32)
    raw[0, 104] &= 0xFC
    parts = ggml_blocks.q3k_from_blocks(raw.numpy(), N, K)
    b = torch.randn(N, generator=g) if bias else None
    return (Q3KLinear(bias=b, parts=parts, path=path),
            Q6KLinear(bias=b, parts={**parts, "q": parts["q"] + 28}, path=path))


def test_q3k_holds_q3_k_in_3_bit_planes_at_the_extremes():
    q3, q6 = _q3k_pair(40, 512, seed=1)
    q = ggml_blocks.unpack_q3k(q3._buffers, 0, 3)["q"]
    assert q.min() == 0 and q.max() == 7 and q[0, :16].eq(0).all() and q3._buffers["sc"][0, 0, 0, 0] == -32
    assert tuple(q3._buffers["ql"].shape) == (3, 16, 2, 64) and tuple(q3._buffers["qh"].shape) == (3, 16, 1, 64)
    assert q3.weight_bytes * 6.625 == q6.weight_bytes * 3.625  # 3.625 bits per weight held, q6k's 6.625


@pytest.mark.parametrize("K", [512, 1536])
def test_q3k_is_bitwise_what_q6k_computed_on_every_path_width_and_thread_count(threads, K):
    """Each GEMV path of q3k against the same path of q6k holding q3 + 32, at every width 1..96 and on 1 and 2
    threads: the outputs are bitwise equal (KL of a Q3_K file therefore unchanged), and q3k's rows are each row alone."""
    x = wide_x(96, K, seed=K + 2)
    for path in block_paths("q3k"):
        q3, q6 = _q3k_pair(40, K, seed=K, path=path)
        alone = torch.cat([q3(x[i:i + 1]) for i in range(96)])
        for n in (1, 2):
            threads(n)
            assert first_inexact_width(q3, x, q6(x), range(1, 97)) is None, (path, n)
            assert first_inexact_width(q3, x, alone, range(1, 97)) is None, (path, n)


@pytest.fixture(scope="module")
def q3k_ops(ops):  # ops: skipped where q6k has no wide side (q3k's is the same VNNI side)
    lib = torch.ops.draftwise_q3k
    assert lib.wide_available() and lib.wide_kind() == "vnni"  # never "amx": the tiles are built from Q6_K's planes
    return lib


def _q3k_wide(ops, lin: Q3KLinear, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
    b = lin._buffers
    return ops.wide(x.contiguous(), b["ql"], b["qh"], b["sc"], b["d"], b["bias"], lin.out_features)


@pytest.mark.parametrize("K", [1536, 8960])
def test_q3k_wide_rows_are_the_gemv_rows_and_q6k_s_at_every_width_and_thread_count(q3k_ops, threads, K):
    q3, q6 = _q3k_pair(40, K, seed=K)
    x = wide_x(max(WIDTHS_Q6M), K, seed=K + 1)
    ref = q3(x)  # the AVX-512 GEMV
    assert torch.equal(ref, q6(x))
    for n in (1, 2):
        threads(n)
        assert first_inexact_width(lambda xs: _q3k_wide(q3k_ops, q3, xs), x, ref, WIDTHS_Q6M) is None, (K, n)


def test_q3k_auto_takes_the_wide_side_from_its_own_switch_and_stays_exact(q3k_ops, ops):
    auto, gemv = _q3k_pair(40, 1536, seed=9, path="auto")[0], _q3k_pair(40, 1536, seed=9)[0]
    x = _own_switch_keeps_rows(q3k_ops, ops, auto, gemv)
    b = gemv._buffers
    with pytest.raises(RuntimeError, match="qh: bad shape"):  # Q6_K's 2-row high plane is not q3k's
        q3k_ops.wide(x, b["ql"], torch.cat([b["qh"], b["qh"]], 2), b["sc"], b["d"], None, 40)


def test_q3k_wide_side_is_vnni_only_and_obeys_the_isa_cap(q3k_ops):
    assert wide_state("q3k", DRAFTWISE_WIDE_MIN_ROWS="48") == [True, 48, True, "vnni"]
    capped = wide_state("q3k", DRAFTWISE_MAX_ISA="avx2", DRAFTWISE_WIDE_MIN_ROWS="48")
    assert capped[0] is False and capped[2] is False and capped[3] == "none"

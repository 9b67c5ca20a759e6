"""The per-32 family's wide side (csrc/gemm_q8_0*.cpp: what path-'auto' calls of many rows of q8_0, q8_1, q4c and q5m
take on an AVX-512 VNNI CPU: the GEMV's tile over row chunks, with the activations quantized per chunk by the
quantizer's vector form): every row it computes is bitwise the row the GEMV computes, for each weight form (bytes,
codes, codes + fifth-bit plane; with and without the min term), at every width 1..96 and at widths about and past
the chunk's (48 rows) up to 200, on 1 and 2 threads, on the 1.5B's projection shapes, against each GEMV ISA path
(scalar, AVX2, AVX-512); 'auto' hands calls to it only from the kernel's switch width on, and to none under a
$DRAFTWISE_MAX_ISA=avx2 cap; and the check used here catches a planted kernel whose float order depends on the width.
No timing asserts. Skipped where the CPU has no AVX-512 VNNI: there 'auto' never leaves the GEMV."""
from __future__ import annotations

import pytest
import torch

from draftwise.kernels import blocktypes, ggml_blocks, library
from draftwise.kernels.linear import LINEARS, available, block_paths
from draftwise.kernels.probe import probe
from tests.harness import SHAPES, assert_wide_is_gemv, first_inexact_width, threads, wide_state, wide_x  # noqa: F401

KINDS = ("q8_0", "q8_1", "q4c", "q5m")  # bytes; bytes + min; codes; codes + plane + min (csrc/q8_0.h)
WIDTHS = (*range(1, 97), 143, 144, 145, 191, 200)  # every width to two chunks, then a third chunk's edges and a tail
K = 1536


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    """One of the family's kernels, skipped where it or its wide side cannot run."""
    if request.param not in available(probe(bandwidth=False)):
        pytest.skip(f"{request.param} cannot run here")
    library.load()
    if not getattr(torch.ops, f"draftwise_{request.param}").wide_available():
        pytest.skip("no AVX-512 VNNI here (or capped by $DRAFTWISE_MAX_ISA): 'auto' stays on the GEMV")
    return request.param


def _ops(kind: str):
    return getattr(torch.ops, f"draftwise_{kind}")


def _parts(kind: str, N: int, K: int, seed: int) -> dict:  # the kernel's parts of a random [N, K] float weight
    g = torch.Generator().manual_seed(seed)
    return getattr(ggml_blocks, f"quantize_{kind}")(torch.randn(N, K, generator=g) * 0.05)


def _linear(kind: str, N: int, K: int, seed: int, path: str = "avx512", bias: bool = True, parts=None):
    g = torch.Generator().manual_seed(seed + 1)
    return LINEARS[kind](parts=parts or _parts(kind, N, K, seed), path=path,
                         bias=torch.randn(N, generator=g) if bias else None)


def _wide(lin, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N], the wide side whatever M is
    b = lin._buffers
    return _ops(lin.name).wide(x.contiguous(), *(b[n] for n in lin.PACKED), b["bias"], lin.out_features)


def test_every_kernel_of_the_family_reads_wide_in_the_table():
    assert all(blocktypes.KERNELS[k].wide for k in KINDS)


def test_wide_rows_are_the_gemv_rows_at_every_width_and_thread_count(kind, threads):
    """A 40-column weight (two whole 16-column blocks and a partial one), against the GEMV's rows (each row alone:
    spot-checked here), on 1 and 2 threads."""
    lin = _linear(kind, 40, K, seed=1)  # the AVX-512 GEMV
    assert_wide_is_gemv(lin, lambda xs: _wide(lin, xs), wide_x(max(WIDTHS), K, seed=2), WIDTHS, threads,
                        spot=(0, 1, 47, 48, 199))


def test_wide_rows_are_the_gemv_rows_on_every_projection_shape(kind, threads):
    for i, (N, K_) in enumerate(SHAPES["qwen2.5-coder-1.5b"]):
        lin = _linear(kind, N, K_, seed=100 + i, bias=i % 2 == 0)
        x = wide_x(100, K_, seed=200 + i)
        ref = lin(x)
        for n in (1, 2):
            threads(n)
            assert first_inexact_width(lambda xs: _wide(lin, xs), x, ref, (1, 17, 48, 49, 100)) is None, (N, K_, n)


def test_wide_rows_are_every_gemv_paths_rows(kind):
    """The GEMV's ISA paths agree bitwise (test_blocktypes_kernels.py); the wide side agrees with each of them."""
    x = wide_x(100, K, seed=7)
    parts = _parts(kind, 40, K, seed=8)
    for path in block_paths(kind):
        lin = _linear(kind, 40, K, seed=8, path=path, parts=parts)
        assert first_inexact_width(lambda xs: _wide(lin, xs), x, lin(x), (1, 2, 13, 48, 49, 100)) is None, path


def test_auto_takes_the_wide_side_from_the_switch_width_only_and_stays_exact(kind):
    """A path-'auto' linear switches at its kernel's wide_min_rows (each kernel its own); the rows do not change
    across it. The width is measured (library.wide_min_rows) and at least 1."""
    ops = _ops(kind)
    assert ops.wide_min_rows() >= 1
    auto, gemv = _linear(kind, 40, K, seed=9, path="auto"), _linear(kind, 40, K, seed=9)
    x = wide_x(96, K, seed=10)
    ref = gemv(x)
    before = ops.wide_min_rows()
    others = {k: _ops(k).wide_min_rows() for k in KINDS if k != kind}
    try:
        for at in (2, 32, 33):
            ops.set_wide_min_rows(at)
            assert ops.wide_takes(at) and ops.wide_takes(at + 100) and not ops.wide_takes(at - 1)
            assert first_inexact_width(auto, x, ref, range(1, 97)) is None, at
        assert {k: _ops(k).wide_min_rows() for k in others} == others  # the other kernels' switches are their own
    finally:
        ops.set_wide_min_rows(before)
    with pytest.raises(RuntimeError):
        ops.set_wide_min_rows(0)


def test_bad_arguments_are_clear_errors(kind):
    lin = _linear(kind, 40, K, seed=2)
    b = [lin._buffers[n] for n in lin.PACKED]
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _ops(kind).wide(torch.zeros(4, 1530), *b, None, 40)
    with pytest.raises(RuntimeError, match="bad shape"):
        _ops(kind).wide(torch.zeros(4, K), b[0][:1], *b[1:], None, 40)
    with pytest.raises(RuntimeError, match="float32"):
        _ops(kind).wide(torch.zeros(4, K, dtype=torch.bfloat16), *b, None, 40)


def test_an_isa_cap_or_the_override_keeps_auto_off_the_wide_side(kind):
    """DRAFTWISE_MAX_ISA=avx512 (a Zen 4, and an AMX CPU capped): the VNNI side; avx2 (a Zen 3): no wide side (in a
    fresh process: read once); DRAFTWISE_WIDE_MIN_ROWS sets the width without measuring (0: never)."""
    def run(**env):
        return wide_state(kind, **env)

    assert run(DRAFTWISE_MAX_ISA="avx512", DRAFTWISE_WIDE_MIN_ROWS="48") == [True, 48, True, "vnni"]
    capped = run(DRAFTWISE_MAX_ISA="avx2", DRAFTWISE_WIDE_MIN_ROWS="48")
    assert capped[0] is False and capped[2] is False
    assert run(DRAFTWISE_WIDE_MIN_ROWS="0")[1] > 2 ** 40


def test_a_planted_width_dependent_reduction_fails_the_check(kind):
    """A side that sums the groups in reverse order from 33 rows on (the same exact integer terms, another float
    order: what splitting K differently by width does) must be caught by first_inexact_width."""
    N, G = 40, K // 32
    parts = _parts(kind, N, K, seed=11)
    rev = {n: (t.view(N, G, 32).flip(1).reshape(N, K) if n == "v" else t.flip(1)).contiguous()
           for n, t in parts.items()}
    lin = _linear(kind, N, K, seed=11, bias=False, parts=parts)
    lin_rev = _linear(kind, N, K, seed=11, bias=False, parts=rev)
    x = wide_x(64, K, seed=12)
    ref = torch.cat([lin(x[i:i + 1]) for i in range(64)])

    def planted(xs):
        if xs.shape[0] <= 32:
            return _wide(lin, xs)
        return _wide(lin_rev, xs.view(-1, G, 32).flip(1).reshape(-1, K))

    assert first_inexact_width(lambda xs: _wide(lin, xs), x, ref, range(1, 65)) is None
    assert first_inexact_width(planted, x, ref, range(1, 65)) == 33
    assert torch.allclose(planted(x), ref, rtol=1e-4, atol=1e-4)  # close (same integers): only exactness tells

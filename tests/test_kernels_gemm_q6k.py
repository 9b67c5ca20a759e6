"""q6k's wide sides (csrc/gemm_q6k*.cpp: the AMX int8 tile GEMM that path-'auto' Q6_K calls of many rows take, and
on an AVX-512 VNNI CPU without AMX the GEMV over row chunks, `wide_vnni`, tested on AMX machines too): every
row each computes is bitwise the row the Q6_K GEMV computes, at every width 1..512, on 1 and 2 threads, for each K of
the packaged models' Q6_K tensors (attn_v, ffn_down, the heads: K = hidden or intermediate size), on every packaged
projection shape, against each GEMV ISA path (scalar, AVX2, AVX-512); 'auto' hands wide calls to it only from the
measured width on, to the VNNI side under a $DRAFTWISE_MAX_ISA=avx512 cap and to none below it; and the check used
here catches a planted kernel whose reduction order depends on the width. No timing asserts. Skipped where the CPU
has neither side: there 'auto' never leaves the GEMV."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from draftwise.kernels import ggml_blocks
from draftwise.kernels.linear import Q6KLinear, block_paths
from tests.harness import KS, SHAPES, WIDTHS, first_inexact_width, ops, side, threads, wide_x  # noqa: F401 (fixtures)

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
    lin = _linear(40, K, seed=K)
    x = wide_x(max(WIDTHS), K, seed=K + 1)
    ref = lin(x)  # [512, 40], the AVX-512 GEMV
    for i in (0, 1, 31, 32, 255, 511):
        assert torch.equal(lin(x[i:i + 1]), ref[i:i + 1])
    for n in (1, 2):
        threads(n)
        assert first_inexact_width(lambda xs: _wide(ops, lin, xs, side), x, ref, WIDTHS) is None, (K, n)


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
    code = ("import json, torch; from draftwise.kernels import q4x8; q4x8.load(); o = torch.ops.draftwise_q6k; "
            "print(json.dumps([o.wide_available(), o.wide_min_rows(), o.wide_takes(4096), o.wide_kind()]))")

    def run(**env):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=600, check=True).stdout.strip().splitlines()[-1]
        return json.loads(out)

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

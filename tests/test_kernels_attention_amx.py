"""draftwise.kernels.attention, the AMX path (csrc/attention_amx.cpp: q K^T and P V on bfloat16 tiles, bf16 K/V).

What holds, and what does not: TDPBF16PS does not round like a chain of fp32 fused multiply-adds, so the AMX path
is NOT bitwise the scalar / AVX2 / AVX-512 paths (those still agree among themselves: test_kernels_attention.py).
On a machine that has it, 'auto' takes it for every width (decode width 1 included), so the invariants the engine
rests on are checked on the AMX path itself: a row is bitwise the same at every chunk width 1..N and every start
offset, in a padded batch or alone, at 1 or 2 threads, paged or contiguous; a token-tree row is bitwise its
chain's (test_tree_attention.py runs it too); and a planted implementation that switches path by width fails the
same check. Its error against a float64 reference stays within AMX_TOL (q and p are split into bf16 hi + lo parts).
With $DRAFTWISE_MAX_ISA set (any cap: a CPU without AMX), 'auto' is the AVX-512 path again, bitwise.
Tiny tensors; no timing asserts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from draftwise.kernels import attention
from tests.harness import one_torch_thread  # noqa: F401 (a fixture)
from tests.test_kernels_attention import _case, _reference, _rel_row_err

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# |out - ref| <= AMX_TOL * max |ref| per row (ref float64 over the same bf16 K/V). Measured worst ~1.3e-5 (the
# SIMD paths: ~6e-7); a key too many or too few moves a row by ~1e-2 (test_kernels_attention.py).
AMX_TOL = 5e-5


@pytest.fixture(scope="module")
def amx() -> None:
    if not attention.available():
        pytest.skip("the C++ extension cannot be built here (no compiler)")
    if not attention.amx():
        pytest.skip("no AMX-BF16 tiles here (or $DRAFTWISE_MAX_ISA caps them)")


def _bf16(case):
    q, keys, values, slots, positions, ntoks = case
    return q, keys.bfloat16(), values.bfloat16(), slots, positions, ntoks


@pytest.mark.parametrize("H,Hkv,D", [(4, 4, 32), (8, 2, 64), (12, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("window", [None, 5, 23])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_matches_sdpa_reference(amx, H, Hkv, D, window, qdtype):
    q, *rest = _bf16(_case(S=5, H=H, Hkv=Hkv, C=80, D=D, firsts=[0, 37, 63, 20], ntoks=[16, 9, 1, 4], T=16,
                           seed=H + D))
    q = q.to(qdtype)
    ref = _reference(q, *rest, D ** -0.5, window)
    out = attention.attend_rows(q, *rest, D ** -0.5, window, path="amx")
    assert out.dtype == qdtype and out.shape == q.shape
    tol = AMX_TOL if qdtype == torch.float32 else 1e-2  # a bf16 output rounds to 8 bits
    assert _rel_row_err(out, ref) <= tol, _rel_row_err(out, ref)
    for b, n in enumerate(rest[-1]):
        assert not out[b, :, n:].any()  # padding rows are zero
    assert torch.equal(attention.attend_rows(q, *rest, D ** -0.5, window), out)  # 'auto' takes it


def width_exact(attend, N: int = 200, H: int = 12, Hkv: int = 2, D: int = 128, window: int | None = None) -> list:
    """Every chunk width w = 1..N, each at a start offset s that moves with w, against the whole prefill's rows
    [s, s + w): the (w, s) whose rows differ in any bit. attend(q [1, H, T, D], keys, values, tables, positions,
    ntoks, scale, window) -> [1, H, T, D]. At H 12, Hkv 2, widths 1-2 read the keys in place and wider calls pack
    them once (attention_amx.cpp), so this also checks that both ways give the same bits."""
    g = torch.Generator().manual_seed(N + D)
    keys = torch.randn(1, Hkv, N + 16, D, generator=g).bfloat16()
    values = torch.randn(1, Hkv, N + 16, D, generator=g).bfloat16()
    q = (torch.randn(1, N, H, D, generator=g) * 2).transpose(1, 2)
    tables = torch.zeros(1, 1, dtype=torch.long)
    whole = attend(q, keys, values, tables, torch.arange(N)[None], [N], D ** -0.5, window)
    bad = []
    for w in range(1, N + 1):
        s = (w * 7) % (N - w + 1)
        part = attend(q[:, :, s:s + w].contiguous(), keys, values, tables, torch.arange(s, s + w)[None], [w],
                      D ** -0.5, window)
        if not torch.equal(part, whole[:, :, s:s + w]):
            bad.append((w, s))
    return bad


@pytest.mark.parametrize("window", [None, 37])
def test_rows_are_bitwise_the_same_at_every_width_and_offset(amx, window):
    assert width_exact(lambda *a: attention.attend_rows(*a, path="amx"), window=window) == []


def test_a_width_dependent_implementation_fails_the_check(amx):
    """Planted: AMX for chunks of 33 rows or more, AVX-512 below (a kernel switch by width, the classic way to
    lose row-exactness); the width check must catch it."""
    def planted(q, *rest):
        return attention.attend_rows(q, *rest, path="amx" if q.shape[2] >= 33 else "avx512")
    bad = width_exact(planted, N=64)
    assert bad and all(w < 33 for w, _ in bad) and len(bad) >= 16


def test_rows_are_bitwise_independent_of_the_batch_threads_and_pages(amx):
    """Alone (B = 1, T = 1) == inside a chunk and a padded batch, whatever the other rows hold, at 1 or 2 threads,
    and paged (blocks of 16 positions in scrambled order) == contiguous."""
    H, Hkv, D, C = 12, 2, 128, 96
    q, keys, values, slots, positions, _ = _bf16(_case(S=4, H=H, Hkv=Hkv, C=C, D=D, firsts=[50, 9, 71],
                                                       ntoks=[9, 9, 9], T=9, seed=7))
    for window in (None, 33):
        alone = {}
        for b in range(3):
            for t in range(9):
                qs = q[b:b + 1, :, t:t + 1].contiguous()
                alone[b, t] = attention.attend_rows(qs, keys, values, slots[b:b + 1], positions[b:b + 1, t:t + 1],
                                                    [1], D ** -0.5, window, path="amx")[0, :, 0]
        noisy = q.clone()
        noisy[1] = torch.randn(H, 9, D) * 5
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                for qq, ntoks in ((q, [9, 9, 9]), (q, [9, 4, 1]), (noisy, [9, 9, 9])):
                    out = attention.attend_rows(qq, keys, values, slots, positions, ntoks, D ** -0.5, window,
                                                path="amx")
                    for b in (0, 2):
                        for t in range(ntoks[b]):
                            assert torch.equal(out[b, :, t], alone[b, t]), (window, threads, b, t)
            finally:
                torch.set_num_threads(1)
        # paged: each slot's C = 96 positions cut into 6 blocks of 16, the blocks of all slots shuffled
        nblk = C // 16
        perm = torch.randperm(4 * nblk, generator=torch.Generator().manual_seed(3))
        pk = torch.empty(4 * nblk, Hkv, 16, D, dtype=keys.dtype)
        pv = torch.empty_like(pk)
        tables = torch.empty(3, nblk, dtype=torch.long)
        for b in range(3):
            s = int(slots[b, 0])
            for i in range(nblk):
                page = int(perm[s * nblk + i])
                pk[page] = keys[s, :, 16 * i:16 * (i + 1)]
                pv[page] = values[s, :, 16 * i:16 * (i + 1)]
                tables[b, i] = page
        want = attention.attend_rows(q, keys, values, slots, positions, [9, 9, 9], D ** -0.5, window, path="amx")
        got = attention.attend_rows(q, pk, pv, tables, positions, [9, 9, 9], D ** -0.5, window, path="amx")
        assert torch.equal(want, got), window


def test_refuses_what_it_cannot_run(amx):
    q, keys, values, slots, positions, ntoks = _case(S=2, H=4, Hkv=2, C=40, D=48, firsts=[3, 5], ntoks=[2, 2], T=2)
    with pytest.raises(RuntimeError, match="multiple of 32"):  # head_dim 48
        attention.attend_rows(q, keys.bfloat16(), values.bfloat16(), slots, positions, ntoks, 0.1, path="amx")
    with pytest.raises(RuntimeError, match="bfloat16 K/V"):  # float32 K/V
        attention.attend_rows(q[..., :32].contiguous(), keys[..., :32].contiguous(), values[..., :32].contiguous(),
                              slots, positions, ntoks, 0.1, path="amx")


def test_a_capped_isa_runs_the_simd_paths_bitwise():
    """$DRAFTWISE_MAX_ISA=avx512 (a CPU without AMX): amx() is false and 'auto' is bitwise the best SIMD path, for
    bf16 K/V too (what a Zen 4 runs). In a child process: the cap is read once per process."""
    if not attention.available():
        pytest.skip("the C++ extension cannot be built here (no compiler)")
    code = (
        "import torch\n"
        "from draftwise.kernels import attention\n"
        "from tests.test_kernels_attention import _case\n"
        "assert attention.available() and not attention.amx()\n"
        "q, k, v, s, p, n = _case(S=3, H=12, Hkv=2, C=70, D=128, firsts=[0, 45, 17], ntoks=[16, 7, 3], T=16)\n"
        "k, v = k.bfloat16(), v.bfloat16()\n"
        "best = attention.cpu_paths()[-1]\n"
        "assert torch.equal(attention.attend_rows(q, k, v, s, p, n, 0.1), attention.attend_rows(q, k, v, s, p, n, 0.1,"
        " path=best))\n"
        "print('ok', best)\n")
    env = dict(os.environ, DRAFTWISE_MAX_ISA="avx512", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]

"""q4x8's wide sides (csrc/gemm_q4x8*.cpp, what 'auto' calls of many rows take: the AMX int8 tile GEMM, and on an
AVX-512 VNNI CPU without AMX the GEMV's register tile blocked over rows, `wide_vnni`, tested here on AMX machines
too): every row each computes is bitwise the row the GEMV computes, at every width 1..512, on 1 and 2 threads, on
every projection shape of the packaged models (random weights of those shapes; the LM heads on their first rows),
against each GEMV ISA path; 'auto' hands wide calls to it only from the measured width on, to the VNNI side under a
$DRAFTWISE_MAX_ISA=avx512 cap and to none below it; and the check used here catches a planted kernel whose reduction
order depends on the width. q5x8 (GGUF Q5_K: csrc/q4x8.h's fifth-bit plane) has the VNNI side alone, also on AMX
CPUs (the tiles carry no plane): its rows are the q5x8 GEMV's at widths 1..96 and past the chunk, on 1 and 2
threads, on every GEMV path, through its own switch, and a planted reduction fails there too. No timing asserts.
Skipped where the CPU has neither: there 'auto' never leaves the GEMV."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from draftwise.kernels import library, q4x8
from draftwise.kernels.linear import Q4x8Linear, Q5X8Linear, block_paths
from tests.harness import (KS, SHAPES, WIDTHS, assert_wide_is_gemv, first_inexact_width, ops, side,  # noqa: F401
                           threads, wide_state, wide_x)

WIDE_KIND = "q4x8"  # the `ops` fixture's kernel


def _linear(N: int, K: int, seed: int, path: str = "avx512", bias: bool = True) -> Q4x8Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[:, :32] *= 20  # groups of very different ranges: sc and mn span their 8 bits
    return Q4x8Linear(w, torch.randn(N, generator=g) if bias else None, path=path)


def _wide(ops, lin: Q4x8Linear, x: torch.Tensor, side: str = "wide") -> torch.Tensor:  # x [M, K] -> [M, N]
    b = lin._buffers
    return getattr(ops, side)(x.contiguous(), b["packed"], b["sc"], b["mn"], b["d"], b["dmin"], b["bias"], lin.out_features)


@pytest.mark.parametrize("K", KS)
def test_wide_rows_are_the_gemv_rows_at_every_width_and_thread_count(ops, side, threads, K):
    """Every width 1..512 on a 40-column weight (two whole 16-column blocks and a partial one) of each K the
    packaged models have, on 1 and 2 threads, against the GEMV's rows (which are themselves each row alone:
    spot-checked here, tested at length in test_kernels.py)."""
    lin = _linear(40, K, seed=K)  # the AVX-512 GEMV
    assert_wide_is_gemv(lin, lambda xs: _wide(ops, lin, xs, side), wide_x(max(WIDTHS), K, seed=K + 1), WIDTHS,
                        threads, spot=(0, 1, 31, 32, 255, 511))


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_wide_rows_are_the_gemv_rows_on_every_projection_shape(ops, side, threads, model):
    for i, (N, K) in enumerate(SHAPES[model]):
        lin = _linear(N, K, seed=100 + i, bias=i % 2 == 0)
        x = wide_x(512, K, seed=200 + i)
        ref = lin(x)
        for n in (1, 2):
            threads(n)
            assert first_inexact_width(lambda xs: _wide(ops, lin, xs, side), x, ref, (1, 16, 33, 64, 200, 512)) is None, \
                (model, N, K, n)


def test_wide_rows_are_every_gemv_paths_rows(ops, side):
    """The GEMV's ISA paths agree bitwise (test_kernels.py); the wide kernel agrees with each of them."""
    K = 1536
    x = wide_x(64, K, seed=7)
    for path in q4x8.cpu_paths():
        lin = _linear(40, K, seed=8, path=path)
        ref = lin(x)
        assert first_inexact_width(lambda xs: _wide(ops, lin, xs, side), x, ref, range(1, 65)) is None, path


def test_auto_takes_the_wide_kernel_from_the_measured_width_and_stays_exact(ops):
    """'auto' (Q4x8Linear's default path, and the C++ layer loop's) switches at wide_min_rows; the rows do not
    change across it. The threshold is measured (q4x8.wide_min_rows) and at least 1."""
    assert ops.wide_min_rows() >= 1
    auto, gemv = _linear(40, 1536, seed=9, path="auto"), _linear(40, 1536, seed=9, path="avx512")
    x = wide_x(96, 1536, seed=10)
    ref = gemv(x)
    before = ops.wide_min_rows()
    try:
        for at in (1, 32, 33):
            ops.set_wide_min_rows(at)
            assert first_inexact_width(auto, x, ref, range(1, 97)) is None, at
    finally:
        ops.set_wide_min_rows(before)
    with pytest.raises(RuntimeError):
        ops.set_wide_min_rows(0)


def test_the_switch_file_is_kept_per_cpu_and_clock_and_remeasured_otherwise(ops, tmp_path, monkeypatch):
    """wide_min_rows reads back a width kept under this CPU's key and the probe's clock, and measures again (and
    rewrites the file) where the key differs, as a file written by the old wall-clock probe does: a width a busy
    machine once measured wrong is not kept for good."""
    from draftwise.kernels.probe import probe

    monkeypatch.delenv(library.WIDE_ENV, raising=False)
    monkeypatch.setattr(library, "busy_meter", lambda: lambda: 0.0)  # quiet (a busy probe: the test below)
    kept = tmp_path / f"wide_{ops.wide_kind()}.txt"
    key = library.wide_probe_key(probe(bandwidth=False)["cpu"])
    kept.write_text(f"{key}\n77")
    assert library.wide_min_rows(ops, tmp_path) == 77
    old = f"{probe(bandwidth=False)['cpu']}|{os.cpu_count()}"
    for stale in (old, f"{old}|{library.WIDE_PROBE_CLOCK}"):  # no clock; no widths (the probe up to 256 rows)
        kept.write_text(f"{stale}\n77")
        rows = library.wide_min_rows(ops, tmp_path)
        assert rows in library.WIDE_PROBE_WIDTHS or rows == 2 ** 62
        assert kept.read_text() == f"{key}\n{rows}"


def test_the_switch_is_the_smallest_width_the_wide_side_wins_from_up_to_the_widest_probed():
    """The rule over the probed widths: from the smallest width at which the wide side wins at every wider one; never
    where it loses at the widest. The widest probe outgrows a core's L2 (where a VNNI side's row chunks pay: a prompt's
    calls), so a side that only ties while the activations fit in L2 still serves prompts. Planted: the old widths,
    up to 256 rows, give 'never' for that side."""
    widths = library.WIDE_PROBE_WIDTHS
    assert widths == tuple(sorted(widths)) and widths[-1] * 2048 > 1 << 20  # the widest: past a 1 MiB L2
    tie_in_l2 = [False, True, False, True, False] + [True] * (len(widths) - 5)  # noise up to 256 rows, wins beyond
    assert library.switch_width(widths, tie_in_l2) == widths[5]
    assert library.switch_width(widths, [True] * len(widths)) == widths[0]
    assert library.switch_width(widths, [True] * (len(widths) - 1) + [False]) == 2 ** 62
    assert library.switch_width(widths[:5], tie_in_l2[:5]) == 2 ** 62  # the probe before: no width past L2


def test_a_width_measured_on_a_busy_machine_is_provisional_and_measured_again_when_quiet(ops, tmp_path, monkeypatch):
    """The probe measured while other processes kept cores busy (a test suite beside it once made the VNNI side
    'never'): the width is used and kept marked provisional; a later load keeps it while the machine is still busy
    and measures again, unmarked, once it is quiet. The probe and the busy meter are planted."""
    from draftwise.kernels.probe import probe

    monkeypatch.delenv(library.WIDE_ENV, raising=False)
    kept = tmp_path / f"wide_{ops.wide_kind()}.txt"
    key = library.wide_probe_key(probe(bandwidth=False)["cpu"])
    widths = iter([2 ** 62, 64])  # busy: 'never'; quiet: 64
    monkeypatch.setattr(library, "_probe_wide", lambda ops, kind="q4x8": next(widths))
    load = {"cores": 1.5}
    monkeypatch.setattr(library, "busy_meter", lambda: lambda: load["cores"])
    monkeypatch.setattr(library, "busy_now", lambda window_s=0.5: load["cores"])
    assert library.wide_min_rows(ops, tmp_path) == 2 ** 62
    assert kept.read_text() == f"{key}{library.WIDE_PROVISIONAL}\n{2 ** 62}"
    assert library.wide_min_rows(ops, tmp_path) == 2 ** 62  # still busy: the provisional width, not measured again
    load["cores"] = 0.1
    assert library.wide_min_rows(ops, tmp_path) == 64
    assert kept.read_text() == f"{key}\n64"
    assert library.wide_min_rows(ops, tmp_path) == 64  # quiet and kept: the probe is not run again (none left)


def test_an_isa_cap_or_the_override_keeps_auto_off_the_wide_kernel(ops):
    """DRAFTWISE_MAX_ISA=avx512 is a CPU without AMX (a Zen 4): the VNNI side; avx2 (a Zen 3): no wide side at all
    (in a fresh process: read once); DRAFTWISE_WIDE_MIN_ROWS sets the width without measuring (0: never)."""
    code = ("import json; from draftwise.kernels import q4x8; o = q4x8.load(); "
            "print(json.dumps([o.wide_available(), o.wide_min_rows(), o.wide_kind()]))")

    def run(**env):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=600, check=True).stdout.strip().splitlines()[-1]
        return json.loads(out)

    assert run(DRAFTWISE_MAX_ISA="avx512", DRAFTWISE_WIDE_MIN_ROWS="48") == [True, 48, "vnni"]
    assert run(DRAFTWISE_MAX_ISA="avx2")[0] is False
    assert run(DRAFTWISE_WIDE_MIN_ROWS="48")[:2] == [True, 48]
    assert run(DRAFTWISE_WIDE_MIN_ROWS="0")[1] > 2 ** 40


def test_a_planted_width_dependent_reduction_fails_the_check(ops, side):
    """A kernel that sums the super-blocks in reverse order from 33 rows on (the same exact integer terms, another
    float order: what splitting K differently by width does) must be caught by first_inexact_width."""
    N, K = 40, 1536
    g = torch.Generator().manual_seed(11)
    parts = q4x8.quantize_q4(torch.randn(N, K, generator=g) * 0.05)
    S = K // 256
    rev = {"q": parts["q"].view(N, S, 256).flip(1).reshape(N, K), "sc": parts["sc"].view(N, S, 8).flip(1).reshape(N, -1),
           "mn": parts["mn"].view(N, S, 8).flip(1).reshape(N, -1), "d": parts["d"].flip(1), "dmin": parts["dmin"].flip(1)}
    lin, lin_rev = Q4x8Linear.from_parts(parts), Q4x8Linear.from_parts({k: v.contiguous() for k, v in rev.items()})
    x = wide_x(64, K, seed=12)
    ref = _linear_rows(lin, x)

    def planted(xs):
        if xs.shape[0] <= 32:
            return _wide(ops, lin, xs, side)
        return _wide(ops, lin_rev, xs.view(-1, S, 256).flip(1).reshape(-1, K), side)

    assert first_inexact_width(lambda xs: _wide(ops, lin, xs, side), x, ref, range(1, 65)) is None
    assert first_inexact_width(planted, x, ref, range(1, 65)) == 33
    # the planted kernel is close (same integers): only exactness tells it apart
    assert torch.allclose(planted(x), ref, rtol=1e-4, atol=1e-4)


def _linear_rows(lin: Q4x8Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([lin(x[i:i + 1]) for i in range(x.shape[0])])


def test_chunked_prefill_is_the_whole_prefill_across_the_switch(ops):
    """A tiny q4x8 decoder (tests/test_prefix_cache.py's): a 40-token prompt prefilled whole (the wide kernel, with
    the switch at 33 rows) and in two chunks of which one or both stay on the GEMV give bitwise the same logits
    and K/V (what chunked prefill and the prefix cache rely on)."""
    from draftwise.kv_cache import KVCache
    from tests.test_prefix_cache import VOCAB, q4x8_decoder

    model = q4x8_decoder()
    c = model.config
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    before = ops.wide_min_rows()
    try:
        ops.set_wide_min_rows(33)
        for cut in (1, 7, 20, 39):
            whole = KVCache(c.num_layers, 1, c.num_kv_heads, 48, c.head_dim, model.dtype)
            parts = KVCache(c.num_layers, 1, c.num_kv_heads, 48, c.head_dim, model.dtype)
            slot = torch.tensor([0])
            a = model(ids, torch.arange(40)[None], whole, slot, last_only=True, num_tokens=[40])
            model(ids[:, :cut], torch.arange(cut)[None], parts, slot, last_only=True, num_tokens=[cut])
            b = model(ids[:, cut:], torch.arange(cut, 40)[None], parts, slot, last_only=True, num_tokens=[40 - cut])
            assert torch.equal(a, b), cut
            for x, y in zip(whole.keys + whole.values, parts.keys + parts.values):
                assert torch.equal(x[0, :, :40], y[0, :, :40]), cut
    finally:
        ops.set_wide_min_rows(before)


def test_the_wide_sides_report_lists_every_kernel_with_a_wide_side(ops):
    """`draftwise kernels` prints every blocktypes row with `wide` (not q4x8's alone), each with its side and its
    switch's width as the library holds them."""
    from draftwise.kernels import blocktypes

    rows = library.wide_sides()
    assert [r["kernel"] for r in rows] == [k.name for k in blocktypes.KERNELS.values() if k.wide]
    assert {"q4x8", "q6k", "q6m", "q8_0"} <= {r["kernel"] for r in rows}
    q6m = torch.ops.draftwise_q6m
    before = q6m.wide_min_rows()
    try:
        q6m.set_wide_min_rows(40)
        by = {r["kernel"]: r for r in library.wide_sides()}
        assert by["q6m"] == {"kernel": "q6m", "side": "vnni", "from_rows": 40}
        assert by["q4x8"]["side"] == ops.wide_kind()
        text = library.format_wide_sides(list(by.values()))
        assert "q6m    AVX-512 VNNI row chunks  from 40 rows" in text
        q6m.set_wide_min_rows(2 ** 62)
        assert {r["kernel"]: r for r in library.wide_sides()}["q6m"]["from_rows"] is None
    finally:
        q6m.set_wide_min_rows(before)


# q5x8 (GGUF Q5_K): the VNNI side with the fifth-bit plane; WIDTHS_Q5X8 reach past a 48-row chunk (csrc/gemm_wide.h)
WIDTHS_Q5X8 = [*range(1, 97), 143, 144, 145, 191, 200]


@pytest.fixture(scope="module")
def q5x8_ops(ops):  # ops: skipped where q4x8 has no wide side (q5x8's is q4x8's VNNI side)
    lib = torch.ops.draftwise_q5x8
    assert lib.wide_available() and lib.wide_kind() == "vnni"  # never "amx": the AMX tiles carry no plane
    return lib


def _q5x8_linear(N: int, K: int, seed: int, path: str = "avx512", bias: bool = True) -> Q5X8Linear:
    """Random q5x8 parts over their whole ranges: 5-bit values, 8-bit sub-scales and mins (Q5_K's are 6-bit), and
    a group at the extreme (every value 31, sc 255: |isum| and |isc| at their bounds, csrc/q4x8.h)."""
    g = torch.Generator().manual_seed(seed)
    G = K // 32
    parts = {"q": torch.randint(0, 32, (N, K), generator=g, dtype=torch.uint8),
             "sc": torch.randint(0, 256, (N, G), generator=g, dtype=torch.uint8),
             "mn": torch.randint(0, 256, (N, G), generator=g, dtype=torch.uint8),
             "d": torch.rand(N, -(-G // 8), generator=g) * 1e-4, "dmin": torch.rand(N, -(-G // 8), generator=g) * 1e-4}
    parts["q"][0, :256], parts["sc"][0, :8] = 31, 255
    return Q5X8Linear(bias=torch.randn(N, generator=g) if bias else None, parts=parts, path=path)


def _q5x8_wide(ops, lin: Q5X8Linear, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
    b = lin._buffers
    return ops.wide(x.contiguous(), *(b[n] for n in Q5X8Linear.PACKED), b["bias"], lin.out_features)


@pytest.mark.parametrize("K", [1536, 8960])
def test_q5x8_wide_rows_are_the_gemv_rows_at_every_width_and_thread_count(q5x8_ops, threads, K):
    lin = _q5x8_linear(40, K, seed=K)  # the AVX-512 GEMV
    x = wide_x(max(WIDTHS_Q5X8), K, seed=K + 1)
    x[3] = 1.0  # a row of int8 127s: with the extreme group, the integer sums' bounds
    assert_wide_is_gemv(lin, lambda xs: _q5x8_wide(q5x8_ops, lin, xs), x, WIDTHS_Q5X8, threads,
                        spot=(0, 1, 3, 47, 48, 199))


def test_q5x8_wide_rows_are_every_gemv_paths_rows(q5x8_ops):
    x = wide_x(64, 1536, seed=7)
    x[3] = -1.0
    for path in block_paths("q5x8"):
        lin = _q5x8_linear(40, 1536, seed=8, path=path, bias=False)
        ref = lin(x)
        assert first_inexact_width(lambda xs: _q5x8_wide(q5x8_ops, lin, xs), x, ref, range(1, 65)) is None, path


def test_q5x8_auto_takes_the_wide_side_from_its_own_switch_and_stays_exact(q5x8_ops, ops):
    """Q5X8Linear's path 'auto' (the linear op hands it over: csrc/q4x8.cpp) switches at q5x8's wide_min_rows, which
    is not q4x8's; the rows do not change across it; a plane of the wrong size is refused."""
    auto, gemv = _q5x8_linear(40, 1536, seed=9, path="auto"), _q5x8_linear(40, 1536, seed=9, path="avx512")
    x = wide_x(96, 1536, seed=10)
    ref = gemv(x)
    before, before_q4x8 = q5x8_ops.wide_min_rows(), ops.wide_min_rows()
    try:
        ops.set_wide_min_rows(2 ** 40)
        for at in (2, 33):
            q5x8_ops.set_wide_min_rows(at)
            assert q5x8_ops.wide_takes(at) and not q5x8_ops.wide_takes(at - 1)
            assert first_inexact_width(auto, x, ref, range(1, 97)) is None, at
    finally:
        q5x8_ops.set_wide_min_rows(before)
        ops.set_wide_min_rows(before_q4x8)
    b = gemv._buffers
    with pytest.raises(RuntimeError, match="qh: bad shape"):
        q5x8_ops.wide(x, b["packed"], b["qh"][:1], b["sc"], b["mn"], b["d"], b["dmin"], None, 40)


def test_q5x8_wide_side_is_vnni_only_and_obeys_the_isa_cap(q5x8_ops):
    """No cap (an AMX CPU included) and an avx512 cap: the VNNI side; avx2: none (a fresh process: read once)."""
    assert wide_state("q5x8", DRAFTWISE_WIDE_MIN_ROWS="48") == [True, 48, True, "vnni"]
    assert wide_state("q5x8", DRAFTWISE_MAX_ISA="avx512", DRAFTWISE_WIDE_MIN_ROWS="48") == [True, 48, True, "vnni"]
    assert wide_state("q5x8", DRAFTWISE_MAX_ISA="avx2")[0] is False


def test_a_planted_width_dependent_reduction_fails_the_q5x8_check(q5x8_ops):
    """The q5x8 wide side's rows from 33 rows on summed in reverse super-block order (planted: the same exact
    integer terms, another float order) are caught."""
    N, K = 40, 1536
    lin = _q5x8_linear(N, K, seed=11)
    parts = _q5x8_parts(lin)
    S = K // 256
    rev = {"q": parts["q"].view(N, S, 256).flip(1).reshape(N, K), "sc": parts["sc"].view(N, S, 8).flip(1).reshape(N, -1),
           "mn": parts["mn"].view(N, S, 8).flip(1).reshape(N, -1), "d": parts["d"].flip(1), "dmin": parts["dmin"].flip(1)}
    lin_rev = Q5X8Linear(bias=lin.bias, parts={k: v.contiguous() for k, v in rev.items()})
    x = wide_x(64, K, seed=12)
    ref = lin(x)

    def planted(xs):
        if xs.shape[0] <= 32:
            return _q5x8_wide(q5x8_ops, lin, xs)
        return _q5x8_wide(q5x8_ops, lin_rev, xs.view(-1, S, 256).flip(1).reshape(-1, K))

    assert first_inexact_width(lambda xs: _q5x8_wide(q5x8_ops, lin, xs), x, ref, range(1, 65)) is None
    assert first_inexact_width(planted, x, ref, range(1, 65)) == 33
    assert torch.allclose(planted(x), ref, rtol=1e-4, atol=1e-4)  # close (same integers): only exactness tells


def _q5x8_parts(lin: Q5X8Linear) -> dict:
    """The q5x8 parts a module holds (kernels/ggml_blocks.py unpack_q5x8), its N rows."""
    from draftwise.kernels import ggml_blocks

    parts = ggml_blocks.unpack_q5x8(lin._buffers, 0, -(-lin.out_features // 16))
    return {k: v[:lin.out_features] for k, v in parts.items()}

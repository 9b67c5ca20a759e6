"""draftwise.kernels: the probe, every linear implementation against the fp32 reference, our q4x8 kernel's
exactness (rows independent of M and of the other rows, every ISA path bitwise the same, Q4_K exact), and the
autotuner's choice logic and cache with injected timing tables. No timing asserts. The first run builds the
C++ extension once into ~/.cache/draftwise/kernels (or $DRAFTWISE_CACHE_DIR)."""
from __future__ import annotations

import json
import math

import os

import pytest
import torch
import torch.nn.functional as F

from draftwise.kernels import autotune, library, q4x8
from draftwise.kernels.linear import LINEARS, Q4x8Linear, available, make_linear
from draftwise.kernels.probe import (cuda_probe, format_probe, measure_bandwidth, measure_stream_bandwidth, probe,
                                    stream_read_sum)


@pytest.fixture(scope="module")
def machine() -> dict:
    return probe(bandwidth=False)


@pytest.fixture(scope="module")
def paths(machine) -> list[str]:
    if "q4x8" not in available(machine):
        pytest.skip("q4x8 cannot run here (no AVX2/AVX-512 VNNI, or no C++ compiler)")
    return q4x8.cpu_paths()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


# ---- probe -----------------------------------------------------------------------------------------------

def test_probe_reports_machine(machine):
    for key in ("cpu", "machine", "flags", "torch_cpu_capability", "torch_threads", "torch_version", "fbgemm"):
        assert key in machine
    assert all(isinstance(v, bool) for v in machine["flags"].values())
    if machine["machine"] in ("x86_64", "amd64"):
        assert {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"} <= set(machine["flags"])
    assert measure_bandwidth(mib=8, seconds=0.01) > 0
    assert "instruction sets" in format_probe(machine)
    json.dumps(machine)


def test_the_streaming_read_reads_every_word_and_measures_a_bandwidth():
    """stream_read.c sums every word of the buffer (odd lengths: the tail past the last group of four; any thread
    count) and its measured bandwidth is a positive finite number (no bound on its value: a loaded machine reads
    slower). Skipped only where no C compiler builds it."""
    words = torch.randint(-2**62, 2**62, (1_000_003,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    if stream_read_sum(words[:5]) is None:
        pytest.skip("no C compiler builds kernels/stream_read.c here")
    for n in (1, 3, 4, 7, 1_000_003):
        for threads in (1, 2, 3):
            assert stream_read_sum(words[:n], threads) == int(words[:n].sum()), (n, threads)
    gbs = measure_stream_bandwidth(mib=8, seconds=0.01)
    assert gbs is not None and math.isfinite(gbs) and gbs > 0
    assert "streaming sum" in format_probe({**probe(bandwidth=False), "bandwidth_gbs": 1.0, "stream_gbs": gbs})


def test_one_build_routine_publishes_a_whole_library_or_nothing(tmp_path):
    """kernels/cbuild.py, which builds the kernel library and the probe's streaming read: a library whose units
    compile is published at its target with build.log beside it (every command); a unit that does not compile
    raises BuildError naming its command and publishes nothing, no temporary folder left behind (only the lock
    file that keeps a second builder of the same target waiting)."""
    import ctypes
    import shutil

    from draftwise.kernels import cbuild

    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        pytest.skip("no C compiler here")
    good, bad = tmp_path / "good.c", tmp_path / "bad.c"
    good.write_text("int draftwise_answer(void) { return 42; }\n")
    bad.write_text("int draftwise_answer(void) { return }\n")
    target = tmp_path / "out" / "ok.so"
    cbuild.build_shared(cc, [(good, ["-O1", "-fPIC"], "good.o")], [], target)
    assert ctypes.CDLL(str(target)).draftwise_answer() == 42
    assert "-c " + str(good) in (target.parent / "build.log").read_text()
    failed = tmp_path / "failed" / "no.so"
    with pytest.raises(cbuild.BuildError, match="compiling .*bad.c"):
        cbuild.build_shared(cc, [(good, ["-fPIC"], "good.o"), (bad, ["-fPIC"], "bad.o")], [], failed)
    assert [p.name for p in failed.parent.iterdir()] == ["no.so.lock"]
    assert cbuild.cache_key([b"a", b"b"]) == cbuild.cache_key([b"ab"]) != cbuild.cache_key([b"a", b"c"])


def test_a_build_runs_no_more_compilers_at_once_than_its_jobs(tmp_path, monkeypatch):
    """build_shared compiles `build_jobs` units at a time (all ~30 at once took ~15 GiB): a logging compiler over
    six units sees at most DRAFTWISE_BUILD_JOBS=2 running together, and every unit built; planted, 6 jobs lets
    more than two overlap (the measure can fail). A bad value is a clear error."""
    import shutil
    import sys

    from draftwise.kernels import cbuild

    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        pytest.skip("no C compiler here")
    events = tmp_path / "events"
    fake = tmp_path / "cc.py"  # logs its start and end, holds the slot a moment, then compiles for real
    fake.write_text(f"import os, subprocess, sys, time\n"
                    f"log = open({str(events)!r}, 'a')\nlog.write('+\\n'); log.flush(); time.sleep(0.3)\n"
                    f"r = subprocess.run([{cc!r}, *sys.argv[1:]]).returncode\nlog.write('-\\n'); log.flush()\n"
                    f"sys.exit(r)\n")
    wrapper = tmp_path / "cc"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    wrapper.chmod(0o755)

    def most_at_once(jobs: str) -> int:
        events.write_text("")
        monkeypatch.setenv("DRAFTWISE_BUILD_JOBS", jobs)
        units = []
        for i in range(6):
            (tmp_path / f"u{i}.c").write_text(f"int draftwise_u{i}(void) {{ return {i}; }}\n")
            units.append((tmp_path / f"u{i}.c", ["-fPIC"], f"u{i}.o"))
        cbuild.build_shared(str(wrapper), units, [], tmp_path / f"j{jobs}" / "lib.so")
        now = peak = 0
        for e in events.read_text().split():
            now += 1 if e == "+" else -1
            peak = max(peak, now)
        return peak

    assert most_at_once("2") <= 2
    assert most_at_once("6") > 2  # planted: the same count over unbounded jobs
    monkeypatch.setenv("DRAFTWISE_BUILD_JOBS", "zero")
    with pytest.raises(cbuild.BuildError, match="DRAFTWISE_BUILD_JOBS"):
        cbuild.build_jobs(4)
    monkeypatch.delenv("DRAFTWISE_BUILD_JOBS")
    assert 1 <= cbuild.build_jobs(30) <= 30 and cbuild.build_jobs(1) == 1


def test_processes_started_together_build_a_library_once(tmp_path):
    """Three processes asking build_shared for the same missing target at once (four `draftwise serve` started
    together each built the whole kernel library, ~5 min of two cores instead of ~1): one compiles, the others wait
    on its lock and find the library built. The count can fail: without the lock each process compiles."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        pytest.skip("no C compiler here")
    events = tmp_path / "events"
    fake = tmp_path / "cc.py"  # logs each compile, held a moment so the builders overlap
    fake.write_text(f"import subprocess, sys, time\n"
                    f"if '-c' in sys.argv: open({str(events)!r}, 'a').write('+\\n'); time.sleep(1.0)\n"
                    f"sys.exit(subprocess.run([{cc!r}, *sys.argv[1:]]).returncode)\n")
    wrapper = tmp_path / "cc"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    wrapper.chmod(0o755)
    (tmp_path / "u.c").write_text("int draftwise_u(void) { return 7; }\n")
    target = tmp_path / "lib" / "u.so"
    code = ("import sys; from pathlib import Path; from draftwise.kernels import cbuild; "
            f"cbuild.build_shared({str(wrapper)!r}, [(Path({str(tmp_path / 'u.c')!r}), ['-fPIC'], 'u.o')], [], "
            f"Path({str(target)!r}))")
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
             for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert target.exists() and events.read_text().split() == ["+"]


# ---- every implementation vs the fp32 reference -----------------------------------------------------------

def device_probe(device: str, machine: dict) -> dict:
    if device == "cpu":
        return machine
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    return cuda_probe(bandwidth=False)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(LINEARS))
def test_impl_matches_fp32_reference(name, device, machine):
    if not LINEARS[name].available(device_probe(device, machine)):
        pytest.skip(f"{name} cannot run on {device} here")
    g = torch.Generator().manual_seed(1)
    for N, K in ((272, 512), (64, 1536)):
        weight = torch.randn(N, K, generator=g) / K ** 0.5  # [N, K]
        bias = torch.randn(N, generator=g) * 0.1  # [N]
        lin = make_linear(name, weight.to(device), bias.to(device))
        assert lin.weight_bytes > 0
        for M in (1, 3, 9, 17):
            x = torch.randn(M, K, generator=g)  # [M, K]
            ref = F.linear(x.double(), weight.double(), bias.double())
            y = lin(x.to(device))
            assert y.shape == (M, N) and y.dtype == torch.float32 and y.device.type == device
            assert rel_err(y.cpu(), ref) <= lin.tolerance, (name, N, K, M, rel_err(y.cpu(), ref))
        xb = torch.randn(2, 5, K, generator=g).bfloat16()  # [B, T, K] in the caller's dtype
        yb = lin(xb.to(device)).cpu()
        assert yb.shape == (2, 5, N) and yb.dtype == torch.bfloat16
        ref = F.linear(xb.double(), weight.double(), bias.double())
        assert rel_err(yb, ref) <= lin.tolerance + 0.01


# ---- q4x8: exactness -------------------------------------------------------------------------------------

# What int8 activations (one scale per row and 256 K values, Q8_K-style) leave against the exact product with the
# kernel's own weights, for Gaussian rows: rel. error median ~0.007, p99 ~0.011 (300 seeds of the GGUF test's setup)
ACT_TOL = 0.015

def _case(N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=g) / K ** 0.5  # [N, K]
    bias = torch.randn(N, generator=g)  # [N]
    return weight, bias, g


def test_q4x8_matches_its_dequantized_weights_tightly(paths):
    weight, bias, g = _case(200, 416)  # N not a multiple of 16; K = 13 groups: a short last super-block
    parts = q4x8.quantize_q4(weight)
    wq = q4x8.dequantize_q4(parts)
    assert rel_err(wq, weight) < 0.1
    x = torch.randn(9, 416, generator=g) * 3  # [9, K]
    ref = F.linear(x.double(), wq.double(), bias.double())
    for path in paths:
        y = Q4x8Linear.from_parts(parts, bias, path=path)(x)
        assert rel_err(y, ref) < ACT_TOL, (path, rel_err(y, ref))  # only the int8 activations remain


def test_q4x8_rows_are_bitwise_independent_of_m_and_other_rows(paths):
    for path in paths:
        N, K = (48, 256) if path == "scalar" else (520, 1536)
        weight, bias, g = _case(N, K, seed=2)
        lin = Q4x8Linear(weight, bias, path=path)
        rows = 17 if path == "scalar" else 70
        x = torch.randn(rows, K, generator=g)  # [rows, K]
        alone = torch.cat([lin(x[i:i + 1].clone()) for i in range(rows)])  # each row on its own, M = 1
        for M in (2, 5, 9, 16, 17) + (() if path == "scalar" else (64, 70)):  # and prefill widths
            mixed = x[:M].clone()
            mixed[1:] = torch.randn(M - 1, K, generator=g) * 10  # other rows: different values and scales
            y = lin(mixed)
            assert torch.equal(y[0], alone[0]), (path, M)
            assert torch.equal(lin(x[:M].clone()), alone[:M]), (path, M)


def test_q4x8_all_isa_paths_agree_bitwise(paths):
    if len(paths) < 2:
        pytest.skip("only one path can run on this CPU")
    weight, bias, g = _case(200, 416, seed=3)
    parts = q4x8.quantize_q4(weight)
    x = torch.randn(11, 416, generator=g)  # [11, K]
    ys = {p: Q4x8Linear.from_parts(parts, bias, path=p)(x) for p in paths}
    for p in paths[1:]:
        assert torch.equal(ys[p], ys[paths[0]]), (p, paths[0])


def _q8k(x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, K]: the int8 activations the kernel uses, dequantized
    """csrc/q4x8.h's activation quantization in torch: per row and super-block of 256 K values (the last may be
    short), dx = amax / 127, q = round_half_even(x * (127 / amax)); returns q * dx in float64."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for k0 in range(0, x.shape[1], 256):
        blk = x[:, k0:k0 + 256]
        amax = blk.abs().amax(-1, keepdim=True)  # [M, 1]
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # as float32
        out[:, k0:k0 + 256] = torch.round(blk * inv).double() * (amax / 127.0).double()
    return out


@pytest.mark.parametrize("K", [32, 96, 288, 416, 864])  # 1, 3, 9, 13, 27 groups: the last super-block is short
def test_q4x8_short_last_super_block(paths, K):
    """K not a multiple of 256: the last super-block's activation scale covers only its own groups, and every
    path gives bitwise the same result as the scalar oracle, for any M, and the product of the kernel's own int8
    activations with its own weights to float32 rounding."""
    weight, bias, g = _case(40, K, seed=K)
    parts = q4x8.quantize_q4(weight)
    wq = q4x8.dequantize_q4(parts).double()
    x = torch.randn(13, K, generator=g)  # [13, K]
    x[3, -32:] *= 100  # an outlier in the last group: only the last super-block's scale may see it
    ys = {p: Q4x8Linear.from_parts(parts, bias, path=p)(x) for p in paths}
    for p in paths:
        assert torch.equal(ys[p], ys["scalar"]), (p, K)
    ref = _q8k(x) @ wq.T + bias.double()  # [13, 40]
    assert rel_err(ys["scalar"], ref) < 1e-5, rel_err(ys["scalar"], ref)
    for M in (1, 4, 12):
        assert torch.equal(Q4x8Linear.from_parts(parts, bias, path=paths[-1])(x[:M]), ys[paths[-1]][:M])


@pytest.mark.parametrize("top", [15, 31])
def test_q4x8_integer_terms_do_not_overflow(paths, top):
    """The extremes of q4x8.h's integer terms: q = 15, sc = mn = 255 and activations all +-127 give per group
    isum = +-60960 and qsum = +-4064, per super-block isc = sc * isum summed = +-124,358,400 (int32; AVX2 sums
    int16 lanes of +-30480 before its madd) and imn = +-8,290,560 (VPDPWSSD pairs +-2,072,640). Any wrap in int16 or
    int32 would be far off the exact K * (255 * 15 - 255) * x; a short last super-block (K = 864) is included.
    top = 31: q5x8 (the fifth-bit plane), isum +-125,984, isc +-257,007,360, AVX2's int16 lanes +-31,496 (its sums
    taken every 2 chunks)."""
    N, K = 32, 864
    G, S = K // 32, -(-K // 256)
    cls = {15: Q4x8Linear, 31: LINEARS["q5x8"]}[top]
    parts = {"q": torch.full((N, K), top, dtype=torch.uint8), "sc": torch.full((N, G), 255, dtype=torch.uint8),
             "mn": torch.full((N, G), 255, dtype=torch.uint8), "d": torch.ones(N, S), "dmin": torch.ones(N, S)}
    parts["mn"][N // 2:] = 0  # half the columns without the min term: the scale term alone at its extreme
    x = torch.ones(5, K)  # [5, K]: q = +127 everywhere
    x[1] = -1  # q = -127
    x[2, ::2] = -1  # alternating signs: isum = 0 in every group, the min term alone
    x[3] *= 3e4  # the scale cancels: still q = 127
    x[4, :256] = -1e-3  # per super-block scales differ within the row
    exact = x.double() @ q4x8.dequantize_q4(parts).double().T  # [5, N]
    assert float(exact.abs().max()) == K * 255 * top * 3e4  # the weights really are at the extremes
    for p in paths:
        y = cls(parts=parts, path=p)(x)
        assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-6, p
        assert torch.equal(y, cls(parts=parts, path="scalar")(x)), p


def test_q4x8_forced_avx2_path_matches_reference(paths):
    if "avx2" not in paths:
        pytest.skip("no AVX2 here")
    weight, bias, g = _case(272, 1536, seed=4)
    lin = Q4x8Linear(weight, bias, path="avx2")
    assert lin.path == "avx2"
    x = torch.randn(9, 1536, generator=g)  # [9, K]
    assert rel_err(lin(x), F.linear(x.double(), weight.double(), bias.double())) <= LINEARS["q4x8"].tolerance


def test_q4x8_represents_q4k_blocks_exactly(paths):
    N, K = 32, 512  # two Q4_K super-blocks per row
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (N, K), generator=g)
    sc = torch.randint(0, 64, (N, K // 32), generator=g)  # 6-bit sub-block scales
    mn = torch.randint(0, 64, (N, K // 32), generator=g)  # 6-bit sub-block mins
    d = (torch.rand(N, K // 256, generator=g) * 1e-3).half()  # fp16 super-block scales
    dmin = (torch.rand(N, K // 256, generator=g) * 1e-3).half()
    # ggml's Q4_K: y = d * sc * q - dmin * m, with d * sc and dmin * m formed in float32
    dg, dmg = d.float().repeat_interleave(8, 1), dmin.float().repeat_interleave(8, 1)  # [N, K/32]
    ggml = ((dg * sc.float())[..., None] * q.view(N, K // 32, 32).float()
            - (dmg * mn.float())[..., None]).view(N, K)
    parts = q4x8.q4k_parts(q, d, dmin, sc, mn)
    assert torch.equal(q4x8.dequantize_q4(parts), ggml)
    x = torch.randn(3, K, generator=g)  # [3, K]
    y = Q4x8Linear.from_parts(parts, path=paths[-1])(x)
    assert rel_err(y, F.linear(x.double(), ggml.double())) < ACT_TOL


def test_q4x8_rejects_a_path_this_cpu_lacks(paths):
    weight, _, _ = _case(16, 64)
    with pytest.raises(ValueError):
        Q4x8Linear(weight, path="neon")
    if "avx512" not in paths:
        with pytest.raises(q4x8.KernelBuildError):
            Q4x8Linear(weight, path="avx512")


def test_an_isa_cap_runs_this_cpu_as_a_lower_class(paths):
    """DRAFTWISE_MAX_ISA=avx2 (`make test ISA=avx2`): the probe drops the AVX-512 and AMX flags and the C++
    dispatch offers only the paths an AVX2 CPU has, in a fresh process (the dispatch reads it once)."""
    import subprocess
    import sys

    code = ("import json; from draftwise.kernels import q4x8, probe; p = probe.probe(bandwidth=False); "
            "print(json.dumps([q4x8.cpu_paths(), [f for f, v in p['flags'].items() if v], p['isa_cap']]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DRAFTWISE_MAX_ISA": "avx2"},
                         capture_output=True, text=True, timeout=600, check=True).stdout.strip().splitlines()[-1]
    got_paths, flags, cap = json.loads(out)
    assert cap == "avx2" and "avx512" not in got_paths and set(got_paths) <= set(paths)
    assert not [f for f in flags if f.startswith(("avx512", "amx"))]
    bad = subprocess.run([sys.executable, "-c", "from draftwise.kernels import probe; probe.probe(False)"],
                         env={**os.environ, "DRAFTWISE_MAX_ISA": "sse9"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "one of avx512, avx2, scalar" in bad.stderr


def test_the_library_lives_under_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path))
    path = library.library_path()
    assert path.parent.parent == tmp_path / "kernels" and path.name.endswith(".so")


def test_the_library_key_covers_every_flag_and_source(monkeypatch):
    """Any change to the warning, compile, include or per-unit flags, or a new file in csrc, is a new library."""
    before = library.library_path()
    monkeypatch.setattr(library, "WARNINGS", library.WARNINGS + ["-Wconversion"])
    assert library.library_path() != before
    monkeypatch.undo()
    flags = library._flags()
    monkeypatch.setattr(library, "_flags", lambda: (flags[0], flags[1] + ["-I/elsewhere"], flags[2]))
    assert library.library_path() != before
    monkeypatch.undo()
    assert "dispatch.h" in library.SOURCES and library.library_path() == before


def test_isa_path_names_come_from_the_library(paths):
    """csrc/dispatch.h names the paths: PATHS is filled from it, and it also takes "portable" for the scalar path."""
    ops = q4x8.load()
    assert q4x8.PATHS == {"auto": -1, **{name: i for i, name in enumerate(ops.path_names())}}
    assert set(paths) <= set(q4x8.PATHS) and paths[0] == "scalar"
    assert ops.path_id("portable") == ops.path_id("scalar") == 0
    with pytest.raises(RuntimeError, match="no ISA path named 'neon'"):
        ops.path_id("neon")
    with pytest.raises(RuntimeError, match="cannot run on this CPU"):
        u8 = torch.zeros(0, dtype=torch.uint8)
        ops.linear(torch.zeros(1, 32), u8, u8, u8, torch.zeros(0), torch.zeros(0), None, 0, 7)


# ---- autotuner: choice logic with injected timings ----------------------------------------------------------

def _table(ms: dict, indep: dict, rows=(1, 2, 4, 8, 16, 128), spread: dict | None = None) -> dict:
    exact = {n: {"step": v, "prefill": v} for n, v in indep.items()}
    return {"rows": list(rows), "prefill_rows": 128, "ms": ms, "row_exact": exact, "spread": spread or {}}


def test_choose_prefers_flat_cost_over_cheapest_single_row():
    ms = {
        "int4": {1: 10.0, 2: 20, 4: 35, 8: 60, 16: 110, 128: 900},  # cheapest at M=1, steep in rows
        "q4x8": {1: 12.0, 2: 12.5, 4: 13, 8: 15, 16: 23, 128: 150},  # flat up to 8-16 rows
        "fp32": {1: 40.0, 2: 41, 4: 42, 8: 44, 16: 48, 128: 100},
    }
    choice = autotune.choose(_table(ms, {n: True for n in ms}))
    assert choice["step"] == "q4x8"  # (12 + 16) / 2 = 14 beats (10 + 66.25) / 2
    assert choice["prefill"] == "fp32"
    assert choice["step_score_ms"]["q4x8"] == pytest.approx((12 + 16) / 2)
    assert choice["verify_over_decode"]["q4x8"] == pytest.approx(16 / 12)


def test_choose_never_takes_a_row_dependent_step_kernel_when_an_exact_one_exists():
    ms = {"int8_dynamic": {1: 5.0, 8: 5, 16: 6, 128: 50}, "q4x8": {1: 9.0, 8: 10, 16: 12, 128: 60}}
    choice = autotune.choose(_table(ms, {"int8_dynamic": False, "q4x8": True}, rows=(1, 8, 16, 128)))
    assert choice["step"] == "q4x8" and choice["step_eligible"] == ["q4x8"]
    assert choice["prefill"] == "q4x8"  # prefill must be row-exact too: batched prompts == each prompt alone
    fallback = autotune.choose(_table(ms, {}, rows=(1, 8, 16, 128)))  # nothing exact: every one is eligible
    assert fallback["step"] == "int8_dynamic" and fallback["prefill"] == "int8_dynamic"


def test_choose_ties_within_the_noise_go_to_the_fixed_preference_order_and_rejects_empty_tables():
    """Two quiet machines of one kind time q4x8 and fp32 a few percent apart either way round: both choose the
    same (the preference order's first), whichever measured faster; a clear difference still decides."""
    a = {"q4x8": {1: 1.03, 8: 1.03, 16: 1.03, 128: 1.03}, "fp32": {1: 1.0, 8: 1, 16: 1, 128: 1}}
    b = {"q4x8": {1: 1.0, 8: 1, 16: 1, 128: 1}, "fp32": {1: 1.03, 8: 1.03, 16: 1.03, 128: 1.03}}
    exact = {"q4x8": True, "fp32": True}
    for ms in (a, b):
        choice = autotune.choose(_table(ms, exact, rows=(1, 8, 16, 128)))
        assert choice["step"] == "q4x8" and choice["prefill"] == "q4x8" and set(choice["step_tied"]) == set(ms)
    clear = {"q4x8": {1: 1.2, 8: 1.2, 16: 1.2, 128: 1.2}, "fp32": {1: 1.0, 8: 1, 16: 1, 128: 1}}
    assert autotune.choose(_table(clear, exact, rows=(1, 8, 16, 128)))["step"] == "fp32"
    # noisy rounds widen the band: 20% apart is a tie when the rounds themselves spread by 30%
    noisy = autotune.choose(_table(clear, exact, rows=(1, 8, 16, 128), spread={"q4x8": 0.3, "fp32": 0.3}))
    assert noisy["step"] == "q4x8" and noisy["tie_band"] == pytest.approx(0.3)
    with pytest.raises(ValueError):
        autotune.choose(_table({}, {}))


def test_cost_interpolation():
    curve = {1: 1.0, 8: 8.0, 16: 24.0}
    assert autotune.cost_at(curve, 9) == pytest.approx(10.0)
    assert autotune.cost_at(curve, 1) == 1.0 and autotune.cost_at(curve, 64) == 24.0


def test_decoder_shapes_of_the_15b():
    shapes = autotune.decoder_shapes(1536, 8960, 12, 2, 128, 28, 151936)
    by = {(s.N, s.K): s for s in shapes}
    assert by[(1536, 1536)].count == 56 and by[(256, 1536)].count == 56
    assert by[(8960, 1536)].count == 56 and by[(1536, 8960)].count == 28 and by[(151936, 1536)].count == 1


def test_autotune_caches_its_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path))
    shapes = autotune.decoder_shapes(64, 128, 2, 1, 32, 2, 256)
    ms = {"fp32": {1: 2.0, 2: 2, 4: 2, 8: 2, 16: 3, 128: 10}, "q4x8": {1: 1.0, 2: 1, 4: 1, 8: 1, 16: 2, 128: 30}}
    calls = []
    monkeypatch.setattr(autotune, "measure", lambda shapes, **kw: calls.append(kw) or
                        _table(ms, {"fp32": True, "q4x8": True}))
    monkeypatch.setattr(autotune, "busy_now", lambda: 0.0)  # a quiet machine (provisional plans:
    monkeypatch.setattr(autotune, "busy_meter", lambda: lambda: 0.0)  # tests/test_kernels_autotune.py)
    monkeypatch.setattr(autotune, "load_candidates", lambda p: ["q4x8", "fp32"])  # no kernel build in tmp_path
    first = autotune.autotune(shapes, progress=False)
    assert first["choice"]["step"] == "q4x8" and first["choice"]["prefill"] == "fp32"
    files = list((tmp_path / "kernels" / "autotune").glob("*.json"))
    assert len(files) == 1 and files[0].stem == first["key"]
    again = autotune.autotune(shapes, progress=False)
    assert len(calls) == 1 and again["choice"] == first["choice"] and again["table"]["ms"] == ms
    other = autotune.autotune(autotune.decoder_shapes(64, 256, 2, 1, 32, 2, 256), progress=False)
    assert len(calls) == 2 and other["key"] != first["key"]
    assert "<- step" in autotune.format_table(first["table"], first["choice"], first["probe"])
    fast = autotune.autotune(shapes, progress=False, fast=True)  # the trimmed load-time tuning: its own entry
    assert len(calls) == 3 and fast["key"] != first["key"]
    assert calls[-1]["rows"] == autotune.FAST_ROWS and calls[-1]["prefill_samples"] == 1
    assert set(calls[-1]["names"]) <= {"q4x8", "int4", "bf16", "fp32"}
    autotune.autotune(shapes, progress=False, fast=True)
    assert len(calls) == 3


def test_load_candidates_time_bf16_only_where_it_is_native():
    base = {"flags": {"avx2": True, "fma": True}, "machine": "x86_64"}
    assert "bf16" not in autotune.load_candidates(base)
    assert "bf16" in autotune.load_candidates({**base, "flags": {**base["flags"], "avx512_bf16": True}})
    assert "fp32" in autotune.load_candidates(base) and "int8_dynamic" not in autotune.load_candidates(base)


def test_a_gpu_probe_picks_the_gpu_candidates_and_its_own_cache_key(machine):
    """On a CUDA device the candidates are the implementations that run there (never q4x8 or fbgemm), tinygemm
    int4 only from compute capability 8.0, and the cache key names the GPU (a CPU key is unchanged by it)."""
    gpu = {"device": "cuda", "gpu": "NVIDIA H200", "capability": [9, 0], "torch_version": torch.__version__,
           "cpu": machine["cpu"], "flags": {}}
    names = autotune.load_candidates(gpu)
    assert {"int4", "bf16", "fp32"} <= set(names) <= {"int4", "int8", "bf16",
                                                                           "fp32"}
    assert "int4" not in autotune.load_candidates({**gpu, "capability": [7, 5]})
    assert "q4x8" not in available(gpu) and "int8_dynamic" not in available(gpu)
    shapes = autotune.decoder_shapes(64, 128, 2, 1, 32, 2, 256)
    keys = {autotune.cache_key(p, shapes) for p in (machine, gpu, {**gpu, "gpu": "NVIDIA H100"})}
    assert len(keys) == 3
    assert autotune.cache_key(machine, shapes) == autotune.cache_key({**machine, "device": "cpu"}, shapes)
    text = format_probe({**gpu, "multiprocessors": 132, "memory_gib": 139.8, "l2_bytes": 60 << 20,
                         "cuda_version": "13.0", "bandwidth_gbs": 4200.0})
    assert "NVIDIA H200" in text and "compute capability 9.0" in text and "4200.0 GB/s" in text


def test_a_shape_a_kernel_cannot_take_costs_its_dense_fallback(machine):
    """torch int4 cannot take N % 16 != 0 (an odd LM head): the model built with it runs that projection dense in
    bf16, so the table times that there instead of dropping int4 from the choice."""
    if not LINEARS["int4"].available(machine):
        pytest.skip("torch int4 cannot run here")
    shapes = [autotune.ProjShape("a", 48, 64, 2), autotune.ProjShape("head", 40, 64, 1)]
    table = autotune.measure(shapes, ["int4", "fp32"], rows=(1, 2), prefill_rows=4, samples=1,
                             cold=False, progress=False)
    assert set(table["ms"]) == {"int4", "fp32"} and table["fallback"] == {"int4": ["head"]}
    assert set(table["per_shape"]["int4"]) == {"a", "head"}
    step_widths = range(1, autotune.EXACT_STEP_ROWS + 1)
    assert table["row_exact"]["int4"]["step"] == all(
        autotune.rows_exact(make_linear(name, torch.randn(N, 64)), 64, step_widths) is None
        for name, N in (("int4", 48), ("bf16", 40)))


def test_measure_produces_a_table_on_tiny_shapes(machine):
    names = [n for n in ("fp32", "q4x8") if LINEARS[n].available(machine)]
    shapes = [autotune.ProjShape("a", 48, 64, 2), autotune.ProjShape("b", 32, 96, 1)]
    table = autotune.measure(shapes, names, rows=(1, 2), prefill_rows=4, samples=1, cold=False, progress=False)
    assert set(table["ms"]) == set(names) and table["rows"] == [1, 2, 4]
    assert all(v > 0 for c in table["ms"].values() for v in c.values())
    if "q4x8" in names:
        assert table["row_exact"]["q4x8"] == {"step": True, "prefill": True, "why": {}}
    assert autotune.choose(table)["step"] in names


def test_q4x8_maps_gguf_q4k_bytes_exactly(paths):
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    N, K = 24, 512
    g = torch.Generator().manual_seed(6)
    blocks = torch.randint(0, 256, (N, K // 256, 144), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(N, K // 256, 2, generator=g) * 1e-2).half()  # finite fp16 d and dmin
    blocks[:, :, 0:4] = scales.view(torch.uint8).view(N, K // 256, 4)
    ggml = torch.from_numpy(quants.dequantize(blocks.numpy().reshape(N, -1), GGMLQuantizationType.Q4_K)).float()
    parts = q4x8.q4k_from_blocks(blocks, N, K)
    assert torch.equal(q4x8.dequantize_q4(parts), ggml.view(N, K))
    x = torch.randn(5, K, generator=g)  # [5, K]
    y = Q4x8Linear.from_parts(parts, path=paths[-1])(x)
    assert rel_err(y, F.linear(x.double(), ggml.double())) < ACT_TOL


def test_q4x8_quantizes_wide_weights_in_row_chunks(monkeypatch):
    weight, _, _ = _case(40, 64, seed=7)
    whole = q4x8.quantize_q4(weight)
    monkeypatch.setattr(q4x8, "QUANT_CHUNK_ROWS", 16)
    chunked = q4x8.quantize_q4(weight)
    assert all(torch.equal(whole[k], chunked[k]) for k in whole)


# ---- q4x8 embedding table (the packed layout read row by row) ------------------------------------------

def test_q4x8_embedding_rows_are_exact_row_exact_and_within_the_quantization_bound():
    """Q4x8Embedding reads an id's row straight out of the packed layout: bitwise the row of the dequantized table
    (so a tied head and the embedding agree), the same vector alone or in any batch, refused past the table; and
    the table is within the documented bound of the float32 weights: |w' - w| <= max(s / 2, 7.5 d + dmin / 2)
    per group of 32 (s the group's scale, d / dmin its super-block's), for Gaussian rows with outliers too."""
    weight, _, g = _case(200, 416, seed=8)  # 200 rows: a padded last block of 16; 13 groups: a short super-block
    weight[::17, ::5] *= 30  # outliers
    parts = q4x8.quantize_q4(weight)
    table = q4x8.dequantize_q4(parts)
    emb = q4x8.Q4x8Embedding.from_parts(parts)
    assert (emb.num_embeddings, emb.embedding_dim) == (200, 416)
    ids = torch.randint(0, 200, (3, 7), generator=g)
    ids[0, :3] = torch.tensor([0, 199, 0])
    got = emb(ids)  # [3, 7, 416]
    assert got.dtype == torch.float32 and torch.equal(got, table[ids])
    assert all(torch.equal(emb(torch.tensor([int(i)]))[0], got.view(-1, 416)[n]) for n, i in enumerate(ids.view(-1)))
    with pytest.raises(IndexError):
        emb(torch.tensor([200]))
    s, _ = q4x8.effective_scale_min(parts["d"], parts["sc"], parts["dmin"], parts["mn"])  # [N, G]
    G = s.shape[1]
    d = parts["d"].repeat_interleave(q4x8.SUPER, 1)[:, :G]
    dmin = parts["dmin"].repeat_interleave(q4x8.SUPER, 1)[:, :G]
    bound = torch.maximum(s / 2, 7.5 * d + dmin / 2)  # [N, G]
    err = (table - weight).view(200, G, 32).abs().amax(-1)
    assert bool((err <= bound * (1 + 1e-6) + 1e-7).all())
    plain = torch.arange(200) % 17 != 0  # the rows without outliers: Gaussian, the linears' documented tolerance
    assert rel_err(table[plain], weight[plain]) < LINEARS["q4x8"].tolerance


def test_q4x8_embedding_shares_a_linears_buffers_and_counts_its_bytes(paths):
    weight, _, _ = _case(40, 512, seed=9)
    lin = Q4x8Linear(weight, path=paths[-1])
    emb = q4x8.Q4x8Embedding.from_linear(lin)
    assert all(getattr(emb, n).data_ptr() == getattr(lin, n).data_ptr() for n in q4x8.PACKED)
    assert torch.equal(emb(torch.arange(40)), q4x8.dequantize_q4(q4x8.quantize_q4(weight)))
    held = sum(getattr(emb, n).numel() * getattr(emb, n).element_size() for n in q4x8.PACKED)
    assert held == q4x8.packed_bytes(40, 512) == 48 * 512 // 2 + 48 * 16 * 2 + 48 * 2 * 8  # N padded to 48
    assert q4x8.packed_bytes(4096, 4096) * 8 == 4.75 * 4096 * 4096  # 4.75 bits per weight

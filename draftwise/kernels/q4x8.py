"""Our CPU kernel "q4x8": int4 weights (groups of 32 along K, asymmetric like GGUF Q4_K) x int8 activations
(quantized per row with one scale per 256 K values, symmetric like GGUF's Q8_K, plus per-32 integer sums for the
weights' min term), a C++ torch operator with an AVX-512 VNNI path and an AVX2 path chosen at run time from cpuid
(one binary serves both kinds of CPU).

Owns: building the extension (JIT on first use, cached under ${DRAFTWISE_CACHE_DIR:-~/.cache/draftwise}/kernels/
<hash of every csrc file + all compiler flags + torch version + compiler>; `build()` is what `make setup` calls; the
same library carries the attention, glue and layer-loop ops of kernels/attention.py, glue.py and stack.py; each unit
is compiled with WARNINGS (-Wall -Wextra ...), torch's headers as system headers, and the compiler's output kept in
build.log next to the library: warnings are printed, only errors fail the build), quantizing an fp32 weight
to the Q4_K-style representation, mapping Q4_K sub-blocks onto it exactly, packing it into the kernel's layout
(csrc/q4x8.h documents it) and the packed embedding table `Q4x8Embedding`. The linear module is
kernels/linear.py's `Q4x8Linear`. Also the wide side's switch: `wide_min_rows` measures once per build and CPU from
how many rows 'auto' calls take the wide kernel (csrc/gemm_q4x8*.cpp, gemm_q6k*.cpp for Q6_K: the AMX GEMM, or on an
AVX-512 VNNI CPU without AMX the GEMV's register tile blocked over rows: bitwise the GEMVs' rows) and
`prefill_table` times both at prompt widths (`draftwise kernels`). Knows nothing of checkpoints or decoders.

ISA paths: every op of the library picks its path by csrc/dispatch.h's one rule ('auto': the best this CPU runs for
that op, by cpuid; an explicit path only where the CPU runs it). The path names and their ids come from there too:
`PATHS` (shared by kernels/attention.py and glue.py) is filled from the library when it is loaded.

Exactness: every output row is bitwise the same whatever M is and whatever other rows share the call, on a
given path; the AVX-512, AVX2 and scalar paths perform the same float sequence, so they agree bitwise too.
Per super-block of 256 K values the scale and min terms are summed exactly in int32 (sc * isum and mn * qsum,
csrc/q4x8.h) and only then meet d, dmin and the activation scale in three float operations.
Why it is fast for verification: each weight block is unpacked once and used for all rows of the call
(up to 12 rows per tile on AVX-512, 4 on AVX2, further tiles re-read it from L1/L2), so decode is bound by
weight bandwidth (4.75 bits per weight) and a 9-row call costs little more than a 1-row call; at more rows the
arithmetic bounds it, and what each row adds per group beyond the dot products is one integer multiply and add.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
from torch import nn

from draftwise.kernels.threads import busy_meter, busy_now, is_busy
from draftwise.paths import default_cache_dir

GROUP = 32  # K values per scale/min group (a Q4_K sub-block)
SUPER = 8  # groups per super-block (Q4_K: 8 x 32 = 256), which share the fp32 d and dmin
COLS = 16  # output columns per packed block
QUANT_CHUNK_ROWS = 8192
PATHS: dict[str, int] = {}  # ISA path name -> the library's id ("auto", "scalar", "avx2", "avx512"): filled by load()
PACKED = ("packed", "sc", "mn", "d", "dmin")  # the buffers `pack` returns, as a module's state holds them
CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(p.name for p in CSRC.iterdir() if p.suffix in (".h", ".cpp")))  # all hashed into the cache key
WARNINGS = ["-Wall", "-Wextra", "-Wshadow", "-Wpedantic"]  # every unit; a warning is printed (build.log), never fatal
_X86 = platform.machine().lower() in ("x86_64", "amd64")


class KernelBuildError(RuntimeError):
    """The C++ extension could not be compiled or loaded here (no compiler, unsupported platform)."""


_lock = threading.Lock()
_loaded: str | None = None
_failed: str | None = None


def cache_dir() -> Path:
    return Path(default_cache_dir()) / "kernels"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"no C++ compiler ({cxx!r}) on PATH; install g++ or set CXX")
    return cxx


def _flags() -> tuple[list[str], list[str], list[str]]:
    """(common compile flags, include flags, link flags) for this torch."""
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    common = ["-O3", "-std=c++20", "-fPIC", "-ffp-contract=off", "-fno-math-errno", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
              *WARNINGS]
    # torch's headers as system headers: their own warnings (unused parameters) are not ours to fix
    includes = [a for p in cpp_extension.include_paths() for a in ("-isystem", p)] + [f"-I{CSRC}"]
    libdir = cpp_extension.library_paths()[0]
    link = [f"-L{libdir}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{libdir}", "-fopenmp"]
    return common, includes, link


def _units() -> list[tuple[str, list[str]]]:
    """(source, extra flags) per translation unit; the ISA units get their own -m flags and no torch headers."""
    main_flags = ["-fopenmp"] + (["-DDW_HAVE_X86"] if _X86 else [])
    mains = [("q4x8.cpp", main_flags), ("attention.cpp", main_flags), ("glue.cpp", main_flags),
             ("stack.cpp", main_flags), ("q6k.cpp", main_flags), ("q8_0.cpp", main_flags),
             ("gemm_q4x8.cpp", main_flags),
             ("gemm_q6k.cpp", main_flags)]
    if not _X86:
        return mains
    return mains + [
        ("q4x8_avx2.cpp", ["-mavx2", "-mfma"]),
        ("q4x8_avx512.cpp", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"]),
        ("attention_avx2.cpp", ["-mavx2", "-mfma"]),
        ("attention_avx512.cpp", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                                  "-mprefer-vector-width=512"]),
        ("gemm_q4x8_amx.cpp", ["-mamx-tile", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                               "-mfma"]),
        ("gemm_q6k_amx.cpp", ["-mamx-tile", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                              "-mfma"]),
        ("attention_amx.cpp", ["-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                               "-mfma", "-mprefer-vector-width=512"]),
        ("glue_avx2.cpp", ["-mavx2"]),
        ("glue_avx512.cpp", ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mprefer-vector-width=512"]),
        ("q6k_avx2.cpp", ["-mavx2", "-mfma"]),
        ("q6k_avx512.cpp", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"]),
        ("q8_0_avx2.cpp", ["-mavx2", "-mfma"]),
        ("q8_0_avx512.cpp", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"]),
    ]


def _flags_key() -> str:
    """_flags() as the cache key sees them: every flag, but not where this checkout or torch lie (torch's version
    is keyed on its own), so checkouts of the same sources share one build."""
    text = repr(_flags())
    for root, name in ((str(CSRC), "<csrc>"), (os.path.dirname(torch.__file__), "<torch>")):
        text = text.replace(root, name)
    return text


def library_path() -> Path:
    """Where the built library lives for these sources, these flags, this torch and this compiler."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(torch.__version__.encode())
    h.update(platform.machine().encode())
    h.update(_flags_key().encode())  # compile, include and link flags: any change to them rebuilds
    h.update(repr(_units()).encode())
    try:
        h.update(subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30, check=False).stdout.encode())
    except (OSError, subprocess.SubprocessError):
        pass
    return cache_dir() / h.hexdigest()[:16] / "draftwise_q4x8.so"


def build(verbose: bool = False) -> Path:
    """Compile the extension into the cache if it is not there yet; returns the library's path."""
    target = library_path()
    if target.exists():
        return target
    cxx = _compiler()
    common, includes, link = _flags()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"draftwise: building the CPU kernels (q4x8, q6k, q8_0, attention, glue, layer loop) once (~20-40 s) into {target.parent}", file=sys.stderr,
          flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        procs = []
        for src, extra in _units():
            obj = os.path.join(tmp, src.replace(".cpp", ".o"))
            cmd = [cxx, *common, *extra, *includes, "-c", str(CSRC / src), "-o", obj]
            if verbose:
                print(" ".join(cmd), file=sys.stderr)
            procs.append((obj, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        log, outputs = [], []  # every command with its output; the outputs alone (warnings: the build goes on)
        for obj, cmd, p in procs:
            out = p.communicate()[0]
            if p.returncode != 0:
                raise KernelBuildError(f"compiling {' '.join(cmd)} failed:\n{out[-4000:]}")
            log.append(f"$ {' '.join(cmd)}\n{out}")
            outputs.append(out.strip())
        so = os.path.join(tmp, "draftwise_q4x8.so")
        cmd = [cxx, "-shared", "-o", so, *[o for o, _, _ in procs], *link]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise KernelBuildError(f"linking failed:\n{(r.stdout + r.stderr)[-4000:]}")
        log.append(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        outputs.append((r.stdout + r.stderr).strip())
        Path(tmp, "build.log").write_text("\n".join(log))
        os.replace(Path(tmp, "build.log"), target.parent / "build.log")
        said = "\n".join(t for t in outputs if t)
        if said:  # warnings: shown, never fatal (only errors fail the build)
            print(f"draftwise: the kernel build printed warnings (the whole log: {target.parent / 'build.log'}):\n"
                  f"{said[-4000:]}", file=sys.stderr, flush=True)
        os.replace(so, target)  # atomic: a concurrent builder either sees nothing or a whole library
    return target


def load() -> object:
    """Build if needed, load once per process; returns the `torch.ops.draftwise_q4x8` namespace (the same library
    also registers `torch.ops.draftwise_attn`, see kernels/attention.py)."""
    global _loaded, _failed
    with _lock:
        if _loaded is None:
            if _failed is not None:
                raise KernelBuildError(_failed)
            try:
                path = build()
                torch.ops.load_library(str(path))
                ops = torch.ops.draftwise_q4x8
                PATHS.update({name: int(ops.path_id(name)) for name in ("auto", *ops.path_names())})
                ops.set_wide_min_rows(wide_min_rows(ops, path.parent))
                q6k = torch.ops.draftwise_q6k
                q6k.set_wide_min_rows(wide_min_rows(q6k, path.parent, "q6k"))
            except (KernelBuildError, OSError, RuntimeError) as e:
                _failed = str(e)
                raise KernelBuildError(_failed) from e
            _loaded = str(path)
    return torch.ops.draftwise_q4x8


WIDE_ENV = "DRAFTWISE_WIDE_MIN_ROWS"  # an integer: 'auto' calls of at least this many rows take the wide kernel; 0: never
WIDE_PROBE_WIDTHS = (16, 32, 64, 128, 256)  # the row counts the probe times (the AMX tile loop takes 32 rows a pass)
WIDE_PROBE_SHAPE = (2048, 2048)  # N, K of the probe's weight: a mid-sized projection, K 8 super-blocks
WIDE_PROBE_REPEATS = 7  # interleaved timings per kernel and width; the best of each is compared
WIDE_PROBE_CLOCK = "thread-cpu"  # part of the kept file's key: a file measured by another clock is measured again
WIDE_PROVISIONAL = "|provisional"  # appended to the key of a width measured while other processes were busy


def wide_min_rows(ops, where: Path, kind: str = "q4x8") -> int:
    """The smallest row count from which 'auto' calls of the `kind` kernel ("q4x8" or "q6k": `ops` is its
    torch.ops namespace) take its wide kernel (AMX tiles, or the AVX-512 VNNI row-blocked side where AMX is absent or
    capped off: `ops.wide_kind()`) instead of the GEMV: both give bitwise the same rows, so this is a speed choice
    only, measured here once per library build, kind, wide side and CPU and kept in `where`/wide_<side>.txt (q4x8)
    or wide_q6k_<side>.txt ($DRAFTWISE_WIDE_MIN_ROWS overrides both; 0 or no wide side: never). The probe times both
    kernels on one thread on a WIDE_PROBE_SHAPE weight at each of WIDE_PROBE_WIDTHS (best of WIDE_PROBE_REPEATS
    interleaved calls, in thread CPU time) and takes the smallest width from which the wide kernel is faster at every
    larger width too. Thread CPU time does not shield the probe from other processes' use of the caches and memory
    (a full test suite beside it made the VNNI side 'never'), so a width measured while other processes kept
    threads.PROVISIONAL_BUSY_CORES busy is kept as provisional, as the autotuner's plans are: used, and measured
    again by the first load that finds the machine quiet."""
    never = 2 ** 62
    env = os.environ.get(WIDE_ENV)
    if env is not None:
        try:
            rows = int(env)
        except ValueError:
            raise KernelBuildError(f"{WIDE_ENV}={env!r}: an integer (0: never the wide kernel)") from None
        return rows if rows > 0 else never
    if not ops.wide_available():
        return never
    from draftwise.kernels.probe import probe  # same layer; imported here: only a first load with a wide side needs it
    side = ops.wide_kind()  # "amx" or "vnni" (csrc/gemm_wide.h): one file each, so a capped process keeps its own
    cache = where / f"wide{'' if kind == 'q4x8' else '_' + kind}_{side}.txt"
    key = f"{probe(bandwidth=False)['cpu']}|{os.cpu_count()}|{WIDE_PROBE_CLOCK}"
    try:
        saved_key, saved = cache.read_text().rsplit("\n", 1)
        if saved_key == key or (saved_key == key + WIDE_PROVISIONAL and is_busy(busy_now())):
            return int(saved)  # measured quiet; or measured busy and still busy: a quiet load measures again
    except (OSError, ValueError):
        pass
    others = busy_meter()
    rows = _probe_wide(ops, kind)
    busy = others()
    provisional = is_busy(busy)
    print(f"draftwise: {kind} wide ({side}) kernel from {rows if rows < never else 'no'} rows on (measured once, kept "
          f"in {cache}" + (f"; provisional: other processes kept {busy} cores busy, a quiet load measures again"
                           if provisional else "") + ")", file=sys.stderr, flush=True)
    try:
        cache.write_text(f"{key}{WIDE_PROVISIONAL if provisional else ''}\n{rows}")
    except OSError:
        pass
    return rows


def _probe_args(kind: str, N: int, K: int, gen: torch.Generator) -> tuple:
    """The weight arguments (after x) of the `kind` kernel's linear and wide ops for a random [N, K] weight."""
    w = torch.randn(N, K, generator=gen)
    if kind == "q4x8":
        t = pack(quantize_q4(w))
        return t["packed"], t["sc"], t["mn"], t["d"], t["dmin"], None, N
    from draftwise.kernels import ggml_blocks  # same layer; only the q6k probe needs it

    t = ggml_blocks.pack_q6k(ggml_blocks.quantize_q6k(w))
    return t["ql"], t["qh"], t["sc"], t["d"], None, N


def _probe_wide(ops, kind: str = "q4x8") -> int:
    import time

    N, K = WIDE_PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    args = _probe_args(kind, N, K, gen)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        faster = []
        for M in WIDE_PROBE_WIDTHS:
            x = torch.randn(M, K, generator=gen)
            runs = {"gemv": lambda: ops.linear(x, *args, int(ops.paths()[-1])),  # the best GEMV path, explicitly
                    "wide": lambda: ops.wide(x, *args)}
            best = {name: float("inf") for name in runs}
            for name, run in runs.items():
                run()
            # interleaved, and timed in the calling thread's CPU time (torch is at 1 thread, so the kernel runs on
            # it): a busy machine slows both sides alike and time spent descheduled counts for neither
            for _ in range(WIDE_PROBE_REPEATS):
                for name, run in runs.items():
                    t0 = time.thread_time()
                    run()
                    best[name] = min(best[name], time.thread_time() - t0)
            faster.append(best["wide"] < best["gemv"])
    finally:
        torch.set_num_threads(before)
    rows = 2 ** 62
    for M, ok in reversed(list(zip(WIDE_PROBE_WIDTHS, faster))):
        if not ok:
            break
        rows = M
    return rows


PREFILL_WIDTHS = (64, 512)  # rows per call the prefill table times: a short prompt chunk and a long one


def prefill_table(shapes, widths=PREFILL_WIDTHS, repeats: int = 3) -> list[dict]:
    """Per (name, N, K) of `shapes` (autotune.ProjShape-like, the LM head skipped: prefill computes it on one row)
    and per width: ms per call of the best GEMV path and of the wide kernel (None where it cannot run), best
    of `repeats`, on random weights, and which one 'auto' takes there. Both give bitwise the same rows."""
    import time

    ops = load()
    gemv_path = int(ops.paths()[-1])
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in shapes:
        if shape.name == "lm_head":
            continue
        t = pack(quantize_q4(torch.randn(shape.N, shape.K, generator=gen)))
        args = (t["packed"], t["sc"], t["mn"], t["d"], t["dmin"], None, shape.N)
        for M in widths:
            x = torch.randn(M, shape.K, generator=gen)
            ms = {}
            kernels = {"gemv": lambda: ops.linear(x, *args, gemv_path)}
            if ops.wide_available():
                kernels["wide"] = lambda: ops.wide(x, *args)
            for name, run in kernels.items():
                run()
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    run()
                    best = min(best, time.perf_counter() - t0)
                ms[name] = best * 1e3
            rows.append({"name": shape.name, "N": shape.N, "K": shape.K, "rows": M, "gemv_ms": ms["gemv"],
                         "wide_ms": ms.get("wide"), "auto": "wide" if M >= ops.wide_min_rows() and "wide" in ms
                         else "gemv"})
    return rows


def format_prefill_table(rows: list[dict]) -> str:
    ops = load()
    side = {"amx": "the AMX GEMM", "vnni": "the AVX-512 VNNI row-blocked GEMM"}.get(ops.wide_kind(), "none")
    head = (f"q4x8 at prefill widths (ms per call; 'wide' = {side}, bitwise the GEMV's rows; 'auto' takes it "
            f"from {ops.wide_min_rows() if ops.wide_available() else 'no'} rows on)")
    lines = [head, f"  {'projection':28s} {'N x K':>12s} {'rows':>5s} {'gemv ms':>9s} {'wide ms':>9s} {'speed-up':>8s}  auto"]
    for r in rows:
        wide = f"{r['wide_ms']:9.2f}" if r["wide_ms"] is not None else f"{'-':>9s}"
        up = f"{r['gemv_ms'] / r['wide_ms']:7.2f}x" if r["wide_ms"] else f"{'-':>8s}"
        lines.append(f"  {r['name'][:28]:28s} {r['N']:>5d} x {r['K']:<5d} {r['rows']:5d} {r['gemv_ms']:9.2f} {wide} {up}  "
                     f"{r['auto']}")
    return "\n".join(lines)


def path_id(name: str) -> int:
    """The library's id of an ISA path name (PATHS; loads the library first). KeyError for a name it lacks."""
    if not PATHS:
        load()
    return PATHS[name]


def path_names(ids) -> list[str]:
    """Path ids (an op's `paths()`, or one id in a list) -> their names (loads the library first)."""
    if not PATHS:
        load()
    by_id = {i: name for name, i in PATHS.items()}
    return [by_id[int(i)] for i in ids]


def cpu_paths() -> list[str]:
    """The ISA paths the loaded kernel can run on this CPU, slowest first (the last is what 'auto' picks)."""
    return path_names(load().paths())


def check_path(path: str) -> None:
    """A ValueError for an unknown path name, KernelBuildError for one this CPU cannot run."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {sorted(PATHS)}")
    if path != "auto" and path not in cpu_paths():
        raise KernelBuildError(f"q4x8 path {path!r} cannot run on this CPU (it can run {cpu_paths()})")


# ---- weights -------------------------------------------------------------------------------------------------

def quantize_q4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] -> Q4_K-style parts: q [N, K] uint8 (0..15), sc/mn [N, G] uint8, d/dmin [N, S] float32,
    with w ~= d * sc * q - dmin * mn per group of 32 (the group's range min(w, 0)..max(w), like Q4_K, but with
    8-bit sub-scales where Q4_K has 6)."""
    N, K = weight.shape
    if K % GROUP:
        raise ValueError(f"q4x8 needs K divisible by {GROUP}, got K={K}")
    if N > QUANT_CHUNK_ROWS:  # rows are independent: bound the float32 temporaries (an LM head is 150k rows)
        chunks = [quantize_q4(weight[i:i + QUANT_CHUNK_ROWS]) for i in range(0, N, QUANT_CHUNK_ROWS)]
        return {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}
    w = weight.detach().float()
    G = K // GROUP
    S = (G + SUPER - 1) // SUPER
    wg = w.view(N, G, GROUP)
    lo = wg.amin(-1).clamp(max=0.0)  # [N, G]
    hi = wg.amax(-1)
    scale = (hi - lo) / 15.0  # [N, G] >= 0
    minv = -lo  # [N, G] >= 0

    def split(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # v [N, G] >= 0 -> d [N, S], code [N, G]
        pad = torch.zeros(N, S * SUPER, dtype=v.dtype)
        pad[:, :G] = v
        d = pad.view(N, S, SUPER).amax(-1) / 255.0  # [N, S]
        dg = d.repeat_interleave(SUPER, dim=1)[:, :G]
        code = torch.where(dg > 0, (v / dg.clamp(min=1e-30)).round(), torch.zeros_like(v)).clamp(0, 255)
        return d.contiguous(), code.to(torch.uint8)

    d, sc = split(scale)
    dmin, mn = split(minv)
    s_eff, m_eff = effective_scale_min(d, sc, dmin, mn)  # [N, G] each, exactly as the kernel computes them
    q = torch.where(s_eff[..., None] > 0, ((wg + m_eff[..., None]) / s_eff[..., None].clamp(min=1e-30)).round(),
                    torch.zeros_like(wg))
    q = q.clamp(0, 15).to(torch.uint8).view(N, K)
    return {"q": q, "sc": sc, "mn": mn, "d": d, "dmin": dmin}


def effective_scale_min(d, sc, dmin, mn) -> tuple[torch.Tensor, torch.Tensor]:
    """d/dmin [N, S] float32, sc/mn [N, G] uint8 -> per-group scale and min [N, G] float32 (fp32 products)."""
    G = sc.shape[1]
    s = d.repeat_interleave(SUPER, dim=1)[:, :G] * sc.float()
    m = dmin.repeat_interleave(SUPER, dim=1)[:, :G] * mn.float()
    return s, m


def dequantize_q4(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [N, K] float32 that the parts represent (w = s * q - m)."""
    q = parts["q"]
    N, K = q.shape
    s, m = effective_scale_min(parts["d"], parts["sc"], parts["dmin"], parts["mn"])
    return (s[..., None] * q.view(N, K // GROUP, GROUP).float() - m[..., None]).view(N, K)


def pack(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q4 parts -> the kernel's layout (csrc/q4x8.h): packed [NB, G, 4, 64], sc/mn [NB, G, 16], d/dmin [NB, S, 16]."""
    q, sc, mn, d, dmin = (parts[k] for k in ("q", "sc", "mn", "d", "dmin"))
    N, K = q.shape
    G = K // GROUP
    NB = (N + COLS - 1) // COLS
    Np = NB * COLS

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == Np:
            return t
        out = torch.zeros(Np, *t.shape[1:], dtype=t.dtype)
        out[:N] = t
        return out

    qb = pad(q).view(NB, COLS, G, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [b, g, c, col, t, half]
    packed = (qb[..., 0] | (qb[..., 1] << 4)).contiguous().view(NB, G, 4, 64)
    cols = lambda t: pad(t).view(NB, COLS, -1).transpose(1, 2).contiguous()
    return {"packed": packed, "sc": cols(sc), "mn": cols(mn), "d": cols(d.float()), "dmin": cols(dmin.float())}


def q4k_parts(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> dict:
    """GGUF Q4_K, already unpacked per row: q [N, K] (0..15), d/dmin [N, K/256] (the fp16 super-block scales, any
    float dtype), sc/mn [N, K/32] (the 6-bit sub-block scales and mins). The kernel represents these exactly:
    w = d * sc * q - dmin * mn, as ggml defines Q4_K."""
    if q.shape[1] % (GROUP * SUPER):
        raise ValueError("Q4_K rows are whole super-blocks of 256")
    return {"q": q.to(torch.uint8), "sc": sc.to(torch.uint8), "mn": mn.to(torch.uint8),
            "d": d.float().contiguous(), "dmin": dmin.float().contiguous()}


Q4K_BLOCK_BYTES = 144  # GGUF Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles


def q4k_from_blocks(blocks, N: int, K: int) -> dict:
    """A GGUF Q4_K tensor's raw bytes (N rows of K / 256 blocks, 144 bytes each: any uint8 array or tensor) ->
    q4x8 parts that represent it exactly. Block layout (ggml): d and dmin as fp16; 8 sub-block scales and mins
    of 6 bits packed in 12 bytes (sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7, sub-blocks 4-7 in the
    nibbles of bytes 8-11 plus the top 2 bits of bytes 0-7); 128 bytes where byte i of the j-th 32 holds
    sub-block 2j's value i in its low nibble and sub-block 2j+1's in its high nibble."""
    if K % 256:
        raise ValueError("Q4_K rows are whole super-blocks of 256")
    nb = K // 256
    raw = torch.as_tensor(blocks).reshape(-1).view(torch.uint8).reshape(N * nb, Q4K_BLOCK_BYTES)
    d = raw[:, 0:2].contiguous().view(torch.float16).float().view(N, nb)
    dmin = raw[:, 2:4].contiguous().view(torch.float16).float().view(N, nb)
    sb = raw[:, 4:16].to(torch.int32)  # [blocks, 12]
    lo_sc, lo_mn = sb[:, 0:4] & 63, sb[:, 4:8] & 63
    hi_sc = (sb[:, 8:12] & 15) | ((sb[:, 0:4] >> 6) << 4)
    hi_mn = (sb[:, 8:12] >> 4) | ((sb[:, 4:8] >> 6) << 4)
    sc = torch.cat([lo_sc, hi_sc], 1).to(torch.uint8).view(N, nb * 8)
    mn = torch.cat([lo_mn, hi_mn], 1).to(torch.uint8).view(N, nb * 8)
    qs = raw[:, 16:].reshape(N * nb, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(N, K)  # [N, K]: chunk j -> sub-blocks 2j, 2j + 1
    return q4k_parts(q, d, dmin, sc, mn)


def packed_bytes(N: int, K: int) -> int:
    """Bytes of `pack`'s output for a weight [N, K] (csrc/q4x8.h): N padded to NB = ceil(N / 16) blocks of 16
    columns; per block and group of 32 K values 256 bytes of nibbles (0.5 B per weight) and 16 + 16 bytes of sc and
    mn; per block and super-block of 8 groups 16 + 16 float32 d and dmin. 4.75 bits per weight when N % 16 == 0 and
    K % 256 == 0: 4 (nibbles) + 0.5 (sc, mn) + 0.25 (d, dmin)."""
    NB, G = -(-N // COLS), K // GROUP
    S = -(-G // SUPER)
    return NB * G * (4 * 64 + 2 * COLS) + NB * S * COLS * 4 * 2


class Q4x8Embedding(nn.Module):
    """An embedding table [V, H] kept in q4x8's packed layout (`pack`'s tensors: 4.75 bits per weight instead of
    16 or 32); `from_linear` shares a Q4x8Linear's buffers, so a tied LM head and the embedding hold one copy.

    forward(ids [...] int64) -> [..., H] float32: gathers each id's column of its 16-column block and dequantizes
    that row only, w = (d * sc) * q - dmin * mn in float32 — `dequantize_q4`'s very operations, so a row equals
    the corresponding row of dequantize_q4(parts) bitwise, and the same id always gives the same vector whatever
    else is in the batch (row-exact). Pure torch: needs no C++ (only the B x T looked-up rows are touched)."""

    def __init__(self, tensors: dict[str, torch.Tensor], num_embeddings: int):
        super().__init__()
        packed = tensors["packed"]
        if packed.dim() != 4 or packed.dtype != torch.uint8 or not 0 < num_embeddings <= packed.shape[0] * COLS:
            raise ValueError(f"not a packed q4x8 table for {num_embeddings} rows: {tuple(packed.shape)} {packed.dtype}")
        self.num_embeddings, self.embedding_dim = num_embeddings, packed.shape[1] * GROUP
        for name in PACKED:
            self.register_buffer(name, tensors[name])  # as given: a tied head's buffers stay shared

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor]) -> Q4x8Embedding:
        """From `quantize_q4` / `q4k_from_blocks` output for the table [V, H] (exact for Q4_K)."""
        return cls(pack(parts), parts["q"].shape[0])

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Q4x8Embedding:
        """The table a q4x8 linear over it holds (kernels/linear.py Q4x8Linear; a tied LM head: weight [V, H]),
        sharing its buffers (no copy)."""
        return cls({name: getattr(linear, name) for name in PACKED}, linear.out_features)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., H] float32
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        block, col = flat // COLS, flat % COLS
        NB, G = self.packed.shape[:2]
        nib = self.packed.view(NB, G, 4, COLS, 4)[block, :, :, col]  # [M, G, chunk, t]: column col's bytes
        q = torch.cat([(nib & 15).reshape(-1, G, 16), (nib >> 4).reshape(-1, G, 16)], dim=-1)  # [M, G, 32]
        sc, mn = self.sc[block, :, col], self.mn[block, :, col]  # [M, G]
        d, dmin = self.d[block, :, col], self.dmin[block, :, col]  # [M, S]
        s, m = effective_scale_min(d, sc, dmin, mn)  # [M, G]
        w = s[..., None] * q.float() - m[..., None]  # [M, G, 32]
        return w.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q4x8 packed"

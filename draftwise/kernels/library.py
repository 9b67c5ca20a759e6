"""The one C++ library of draftwise's CPU kernels: building it, loading it, and what every op of it shares.

Owns: building the extension (JIT on first use, cached under ${DRAFTWISE_CACHE_DIR:-~/.cache/draftwise}/kernels/
<hash of every csrc file + all compiler flags + torch version + compiler>; `build()` is what `make setup` calls;
each unit is compiled with WARNINGS (-Wall -Wextra ...), torch's headers as system headers, and the compiler's
output kept in build.log next to the library: warnings are printed, only errors fail the build; the compile, link
and atomic publish are kernels/cbuild.py's, which the probe's streaming read is built by too), loading it once
per process (`load`: the q4x8, q6k, q8_0 (and every block type's), attention, glue, layer-loop and embedding-row
ops), the ISA
path names and ids every op selects by (csrc/dispatch.h's one rule; `PATHS` is filled from the library when it is
loaded), and the wide side's switch (`wide_sides` lists every kernel's, as `draftwise kernels` prints it):
`wide_min_rows` measures once per build and CPU from how many rows 'auto' calls of each kernel with a wide side
(blocktypes' `wide`: q4x8, q5x8, q6k, q6m, and the per-32 family q8_0, q8_1, q4c, q5m) take it (csrc/gemm_q4x8*.cpp, gemm_q6k*.cpp: the AMX GEMM, or on an AVX-512 VNNI CPU without AMX the GEMV's
register tile blocked over rows; q5x8, q6m and csrc/gemm_q8_0*.cpp: the latter only): bitwise the GEMVs' rows.

Which C++ units a block type brings is its row's in kernels/blocktypes.py (`units`); the library compiles the
units of every row with a kernel, plus the ops that are no block type's (attention, glue, layer loop, experts,
embedding rows).
Knows nothing of weight formats, checkpoints or decoders: the wide probe times the ops on random packed bytes
(any bytes are a valid packed weight once its float scales are finite).
"""
from __future__ import annotations

import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

from draftwise.kernels import blocktypes, cbuild
from draftwise.kernels.threads import busy_meter, busy_now, is_busy
from draftwise.paths import default_cache_dir

LIBRARY = "draftwise_kernels.so"
PATHS: dict[str, int] = {}  # ISA path name -> the library's id ("auto", "scalar", "avx2", "avx512"): filled by load()
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


ISA_FLAGS = {  # blocktypes' ISA levels -> the -m flags of a unit compiled for one (csrc/dispatch.h checks them)
    blocktypes.AVX2: ["-mavx2", "-mfma"],
    blocktypes.AVX512_VNNI: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"],
    blocktypes.AMX_INT8: ["-mamx-tile", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"],
}


def _units() -> list[tuple[str, list[str], str]]:
    """(source, extra flags, object name) per translation unit: the units of every kernel row of
    kernels/blocktypes.py (a float row's shared units once per row: -DDW_FLOAT=<name> and its header <name>.h,
    objects <name>_<unit>.o), then the ops that are no block type's; the ISA units get their own -m flags and no
    torch headers."""
    main_flags = ["-fopenmp"] + (["-DDW_HAVE_X86"] if _X86 else [])
    units = []
    for k in blocktypes.KERNELS.values():
        per_row = [f"-DDW_FLOAT={k.name}", f'-DDW_FLOAT_HEADER="{k.name}.h"'] if k.element else []
        units += [(src, (main_flags if isa == blocktypes.MAIN else ISA_FLAGS[isa]) + per_row,
                   (f"{k.name}_" if k.element else "") + src.replace(".cpp", ".o"))
                  for src, isa in k.units if isa == blocktypes.MAIN or _X86]
    units += [(src, main_flags, src.replace(".cpp", ".o"))
              for src in ("attention.cpp", "glue.cpp", "stack.cpp", "experts.cpp", "embed_rows.cpp")]
    if not _X86:
        return units
    return units + [(src, flags, src.replace(".cpp", ".o")) for src, flags in [
        ("attention_avx2.cpp", ["-mavx2", "-mfma"]),
        ("attention_avx512.cpp", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                                  "-mprefer-vector-width=512"]),
        ("attention_amx.cpp", ["-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                               "-mfma", "-mprefer-vector-width=512"]),
        ("glue_avx2.cpp", ["-mavx2"]),
        ("glue_avx512.cpp", ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mprefer-vector-width=512"]),
    ]]


def _flags_key() -> str:
    """_flags() as the cache key sees them: every flag, but not where this checkout or torch lie (torch's version
    is keyed on its own), so checkouts of the same sources share one build."""
    text = repr(_flags())
    for root, name in ((str(CSRC), "<csrc>"), (os.path.dirname(torch.__file__), "<torch>")):
        text = text.replace(root, name)
    return text


def library_path() -> Path:
    """Where the built library lives for these sources, these flags, this torch and this compiler."""
    version = cbuild.compiler_version(_compiler())  # KernelBuildError where there is no compiler
    parts = [b for name in SOURCES for b in (name.encode(), (CSRC / name).read_bytes())]
    parts += [torch.__version__.encode(), platform.machine().encode(),
              _flags_key().encode(),  # compile, include and link flags: any change to them rebuilds
              repr(_units()).encode(), version.encode()]
    return cache_dir() / cbuild.cache_key(parts) / LIBRARY


def build(verbose: bool = False) -> Path:
    """Compile the extension into the cache if it is not there yet; returns the library's path."""
    target = library_path()
    if target.exists():
        return target
    cxx = _compiler()
    common, includes, link = _flags()
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"draftwise: building the CPU kernels ({', '.join(blocktypes.KERNELS)}, attention, glue, layer loop) once "
          f"(~20-40 s) into {target.parent}", file=sys.stderr, flush=True)
    units = [(CSRC / src, [*common, *extra, *includes], name) for src, extra, name in _units()]
    try:
        said = cbuild.build_shared(cxx, units, link, target, verbose=verbose)
    except cbuild.BuildError as e:
        raise KernelBuildError(str(e)) from None
    if said:  # warnings: shown, never fatal (only errors fail the build)
        print(f"draftwise: the kernel build printed warnings (the whole log: {target.parent / 'build.log'}):\n"
              f"{said[-4000:]}", file=sys.stderr, flush=True)
    return target


def load() -> object:
    """Build if needed, load once per process; returns the `torch.ops.draftwise_q4x8` namespace (the same library
    registers every kernel row's `torch.ops.draftwise_<name>`, and `draftwise_attn`, `draftwise_glue`,
    `draftwise_stack`); sets each wide kernel's switch (`wide_min_rows`)."""
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
                for k in blocktypes.KERNELS.values():
                    if k.wide:
                        wops = getattr(torch.ops, f"draftwise_{k.name}")
                        wops.set_wide_min_rows(wide_min_rows(wops, path.parent, k.name))
            except (KernelBuildError, OSError, RuntimeError) as e:
                _failed = str(e)
                raise KernelBuildError(_failed) from e
            _loaded = str(path)
    return torch.ops.draftwise_q4x8


def loads() -> bool:
    """Whether the library builds and loads here (built on first use; False, once and for all, where it cannot be:
    `load` keeps the first failure): what each op module's `available` answers."""
    try:
        load()
    except KernelBuildError:
        return False
    return True


WIDE_ENV = "DRAFTWISE_WIDE_MIN_ROWS"  # an integer: 'auto' calls of at least this many rows take the wide kernel; 0: never
# the row counts the probe times (the AMX tile loop takes 32 rows a pass); the widest one's activations (1024 x 2048
# bytes) outgrow a core's L2, where the VNNI sides' row chunks pay and a prompt's calls are: probed only up to 256
# rows (L2-resident), a noisy tie made q4x8's VNNI side 'never' on a Zen 4, and its 4k prompts ran the GEMV
WIDE_PROBE_WIDTHS = (16, 32, 64, 128, 256, 1024)
WIDE_PROBE_SHAPE = (2048, 2048)  # N, K of the probe's weight: a mid-sized projection, K 8 super-blocks
WIDE_PROBE_REPEATS = 7  # interleaved timings per kernel and width; the best of each is compared
WIDE_PROBE_CLOCK = "thread-cpu"  # part of the kept file's key: a file measured by another clock is measured again
# (the widths are part of it too: a file measured over other widths is measured again)
WIDE_PROVISIONAL = "|provisional"  # appended to the key of a width measured while other processes were busy


def wide_min_rows(ops, where: Path, kind: str = "q4x8") -> int:
    """The smallest row count from which 'auto' calls of the `kind` kernel (a blocktypes row with `wide`: `ops` is
    its torch.ops namespace) take its wide kernel (AMX tiles, or the AVX-512 VNNI row-blocked side where AMX is absent or
    capped off: `ops.wide_kind()`) instead of the GEMV: both give bitwise the same rows, so this is a speed choice
    only, measured here once per library build, kind, wide side and CPU and kept in `where`/wide_<side>.txt (q4x8)
    or wide_<kind>_<side>.txt ($DRAFTWISE_WIDE_MIN_ROWS overrides all; 0 or no wide side: never). The probe times both
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
    key = wide_probe_key(probe(bandwidth=False)["cpu"])
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


def wide_sides() -> list[dict]:
    """Every kernel row of kernels/blocktypes.py with a wide side (`wide`), as this process runs it (loads the
    library): {"kernel", "side" ("amx", "vnni" or "none": the op's wide_kind), "from_rows" (the switch's width,
    None where 'auto' never takes it)}."""
    load()
    out = []
    for k in blocktypes.KERNELS.values():
        if k.wide:
            ops = getattr(torch.ops, f"draftwise_{k.name}")
            on = ops.wide_available() and ops.wide_min_rows() < 2 ** 62
            out.append({"kernel": k.name, "side": str(ops.wide_kind()), "from_rows": int(ops.wide_min_rows()) if on
                        else None})
    return out


def format_wide_sides(rows: list[dict]) -> str:
    """wide_sides() as the lines `draftwise kernels` prints."""
    names = {"amx": "AMX GEMM", "vnni": "AVX-512 VNNI row chunks", "none": "none here"}
    lines = ["wide (prompt) sides, bitwise the GEMVs' rows ('auto' takes each from its measured width on):"]
    for r in rows:
        lines.append(f"  {r['kernel']:6s} {names.get(r['side'], r['side']):24s} "
                     f"{'from ' + str(r['from_rows']) + ' rows' if r['from_rows'] is not None else 'never (GEMV)'}")
    return "\n".join(lines)


def _probe_args(kind: str, N: int, K: int, gen: torch.Generator) -> tuple:
    """The weight arguments (after x) of the `kind` kernel's linear and wide ops for a random packed [N, K] weight:
    random bytes in csrc/q4x8.h's, csrc/q6k.h's or csrc/q8_0.h's layout, small positive float scales (the
    arithmetic, and so the time, does not depend on the values)."""
    NB, G, S = -(-N // 16), K // 32, K // 256
    byte = lambda *shape: torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)  # noqa: E731
    scale = lambda *shape: torch.rand(shape, generator=gen) * 0.01 + 0.001  # noqa: E731
    if kind in ("q4x8", "q5x8"):  # q5x8: q4x8's buffers and the fifth-bit plane qh, second
        plane = (byte(NB, G, 4, 2, 8),) if kind == "q5x8" else ()
        return byte(NB, G, 4, 64), *plane, byte(NB, G, 16), byte(NB, G, 16), scale(NB, S, 16), scale(NB, S, 16), None, N
    if kind in ("q6k", "q6m", "q3k"):  # q6m: q6k's buffers and the min term's mn, dmin; q3k: 3-bit planes
        lb, hb = (2, 1) if kind == "q3k" else (4, 2)
        q6k = byte(NB, G, lb, 64), byte(NB, G, hb, 64), byte(NB, G, 2, 16).view(torch.int8), scale(NB, S, 16)
        mins = (byte(NB, G, 2, 16).view(torch.int8), scale(NB, S, 16)) if kind == "q6m" else ()
        return *q6k, *mins, None, N
    # csrc/q8_0.h's forms: bytes (q8_0, with a min q8_1), codes through a table (q4c), codes and a plane (q5m)
    packed = {"q8_0": (byte(NB, G, 8, 64), scale(NB, G, 16)),
              "q8_1": (byte(NB, G, 8, 64), scale(NB, G, 16), scale(NB, G, 16)),
              "q4c": (byte(NB, G, 4, 64), byte(NB, 16), scale(NB, G, 16)),
              "q5m": (byte(NB, G, 4, 64), byte(NB, G, 8, 8), byte(NB, 16), scale(NB, G, 16), scale(NB, G, 16))}[kind]
    return *packed, None, N


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
    return switch_width(WIDE_PROBE_WIDTHS, faster)


def wide_probe_key(cpu: str) -> str:
    """The key a kept switch width is valid under: the CPU, its logical core count, the probe's clock and widths."""
    return f"{cpu}|{os.cpu_count()}|{WIDE_PROBE_CLOCK}|{','.join(map(str, WIDE_PROBE_WIDTHS))}"


def switch_width(widths: tuple[int, ...], faster: list[bool]) -> int:
    """The smallest of the probed `widths` (ascending) from which the wide kernel was faster at every larger one
    too (`faster[i]`: at widths[i]); 2 ** 62 (never) where it lost at the widest."""
    rows = 2 ** 62
    for M, ok in reversed(list(zip(widths, faster))):
        if not ok:
            break
        rows = M
    return rows


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


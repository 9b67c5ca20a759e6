"""Machine probe: what this CPU can do, as the kernels and the autotuner need to know it.

Owns: reading instruction-set flags (/proc/cpuinfo on Linux, sysctl on macOS), the CPU model name,
torch's own view (ATen CPU capability, threads, version), the kernel's transparent-huge-page policy
(kernels/hugepages.py places weights there on request), the C heap's policy for a forward's temporaries
(kernels/heap.py) and two short measured memory read bandwidths: torch's matrix-vector product
(`measure_bandwidth`, "bandwidth_gbs") and a plain streaming sum in C at the same thread count
(`measure_stream_bandwidth`, "stream_gbs": stream_read.c, compiled once per machine with the system's C compiler
into the cache by kernels/cbuild.py, as the kernel library is, but not part of it; absent where no compiler builds
it): the second is the nearer to
what the memory can deliver, the ceiling a decode step's weight reads are held to (scripts/compare.py).
`cuda_probe()` is the same for a CUDA device (name, compute capability, multiprocessors, memory, L2,
torch's CUDA version, measured device-memory bandwidth), marked "device": "cuda" (a CPU probe has no
"device" key: it means "cpu"). Knows nothing of models or of which kernel is chosen; both return a
plain dict (JSON-able) that bench manifests can record as it is, and `format_probe()` prints either for people.
"""
from __future__ import annotations

import ctypes
import math
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch

from draftwise.kernels import cbuild, heap
from draftwise.kernels.hugepages import thp_mode
from draftwise.paths import default_cache_dir

# flag names as /proc/cpuinfo spells them (x86) -> the key we report
X86_FLAGS = (
    "avx2", "fma", "f16c",
    "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
)
ARM_FLAGS = ("asimd", "asimddp", "i8mm", "bf16", "sve", "sve2")

_CACHE: dict | None = None


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo, or from sysctl on macOS; empty where neither exists."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and not name:
                    name = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    if not name and platform.system() == "Darwin":
        try:
            name = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=2, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
        if platform.machine() == "arm64":
            flags |= {"asimd", "asimddp"}  # every Apple silicon core has NEON with dot product
    return name or platform.processor() or "unknown", flags


def measure_bandwidth(mib: int = 128, seconds: float = 0.5) -> float:
    """Memory read bandwidth in GB/s with torch's threads: a matrix-vector product over a float32 matrix far
    larger than the caches (it streams the matrix once, like a decode step streams the weights); the best
    of a few passes within `seconds`, since a shared machine's other jobs only ever make a pass slower."""
    cols = 4096
    rows = mib * 1024 * 1024 // 4 // cols
    mat = torch.ones(rows, cols, dtype=torch.float32)  # [rows, cols], touched once so every page is mapped
    vec = torch.ones(cols, dtype=torch.float32)  # [cols]
    torch.mv(mat, vec)
    best, t_end = float("inf"), time.perf_counter() + seconds
    for i in range(50):
        t0 = time.perf_counter()
        torch.mv(mat, vec)
        best = min(best, time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() > t_end:
            break
    return rows * cols * 4 / best / 1e9


STREAM_SOURCE = Path(__file__).parent / "stream_read.c"
STREAM_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC"]  # compiling stream_read.c
STREAM_LINK = ["-fopenmp"]  # linking it (cbuild.build_shared adds -shared)
_STREAM: list = []  # [the loaded function] once built, [None] when it cannot be built here


def _stream_read():
    """stream_read.c's function (uint64 *, n, threads) -> uint64, built once per source, flags and compiler into
    <cache>/probe/<hash>/; None where no C compiler builds or loads it."""
    if _STREAM:
        return _STREAM[0]
    fn = None
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is not None:
        try:
            key = cbuild.cache_key([STREAM_SOURCE.read_bytes(), repr((STREAM_FLAGS, STREAM_LINK)).encode(),
                                    cbuild.compiler_version(cc).encode(), platform.machine().encode()])
            target = Path(default_cache_dir()) / "probe" / key / "stream_read.so"
            if not target.exists():
                cbuild.build_shared(cc, [(STREAM_SOURCE, STREAM_FLAGS, "stream_read.o")], STREAM_LINK, target,
                                    timeout=120)
            fn = ctypes.CDLL(str(target)).draftwise_stream_read
            fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, cbuild.BuildError, AttributeError):
            fn = None
    _STREAM.append(fn)
    return fn


def stream_read_sum(words: torch.Tensor, threads: int | None = None) -> int | None:
    """The wrapping sum of `words` [n] int64 (contiguous) as stream_read.c reads it, on `threads` (default torch's)
    threads; None where it cannot be built here."""
    fn = _stream_read()
    if fn is None:
        return None
    if words.dtype != torch.int64 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError("stream_read_sum takes a contiguous 1-D int64 tensor")
    total = fn(words.data_ptr(), words.numel(), threads or torch.get_num_threads())
    return total - (1 << 64) if total >= 1 << 63 else total


def measure_stream_bandwidth(mib: int = 256, seconds: float = 0.5, threads: int | None = None) -> float | None:
    """Memory read bandwidth in GB/s as a plain streaming sum reads it (stream_read.c) on `threads` (default
    torch's) threads: every byte of a buffer far larger than the caches read once, in order, with nothing else to
    do; the best of a few passes within `seconds` (other jobs only ever make a pass slower). None where no C
    compiler builds the kernel."""
    if _stream_read() is None:
        return None
    words = torch.ones(mib * 1024 * 1024 // 8, dtype=torch.int64)  # [mib MiB / 8], every page mapped
    stream_read_sum(words, threads)
    best, t_end = float("inf"), time.perf_counter() + seconds
    for i in range(50):
        t0 = time.perf_counter()
        stream_read_sum(words, threads)
        best = min(best, time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() > t_end:
            break
    gbs = words.numel() * 8 / best / 1e9
    return gbs if math.isfinite(gbs) else None


ISA_CAP_ENV = "DRAFTWISE_MAX_ISA"
ISA_CAPS = {  # cap -> the flags a CPU of that class lacks (the C++ dispatch applies the same cap: csrc/dispatch.h)
    "avx512": ("amx_", "avx512_fp16"),  # an AVX-512 CPU without AMX (Zen 4 class)
    "avx2": ("avx512", "amx_", "avx_vnni"),  # AVX2 only (Zen 3 class)
    "scalar": ("avx", "fma", "f16c", "amx_"),  # no SIMD extension our kernels use
}


def isa_cap() -> str | None:
    """$DRAFTWISE_MAX_ISA: run as a CPU of a lower class (tests and benchmarks of other machines' paths on this
    one). torch's own kernels take ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA for the same (`make test ISA=...`)."""
    cap = os.environ.get(ISA_CAP_ENV) or None
    if cap is not None and cap not in ISA_CAPS:
        raise ValueError(f"{ISA_CAP_ENV}={cap!r}: one of {', '.join(ISA_CAPS)}")
    return cap


def probe(bandwidth: bool = True, refresh: bool = False) -> dict:
    """Everything the kernels need to know about this machine (cached per process)."""
    global _CACHE
    if _CACHE is not None and not refresh and (not bandwidth or "bandwidth_gbs" in _CACHE):
        return _with_heap(_CACHE)
    name, raw = _cpuinfo()
    machine = platform.machine().lower()
    x86 = machine in ("x86_64", "amd64", "i386", "i686")
    arm = machine in ("aarch64", "arm64")
    flags = {f: f in raw for f in (X86_FLAGS if x86 else ARM_FLAGS if arm else ())}
    if arm:
        flags["neon"] = flags.get("asimd", False) or machine == "arm64"
    cap = isa_cap()
    if cap is not None:
        flags = {f: v and not f.startswith(ISA_CAPS[cap]) for f, v in flags.items()}
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):  # older torch
        capability = "unknown"
    out = {
        "cpu": name,
        "machine": machine,
        "flags": flags,
        "torch_cpu_capability": capability,
        "torch_threads": torch.get_num_threads(),
        "os_cpus": os.cpu_count(),
        "torch_version": torch.__version__,
        "fbgemm": "fbgemm" in torch.backends.quantized.supported_engines,
        "thp": thp_mode(),
    }
    if cap is not None:
        out["isa_cap"] = cap
    if bandwidth:
        out["bandwidth_gbs"] = round(measure_bandwidth(), 1)
        stream = measure_stream_bandwidth()
        if stream is not None:
            out["stream_gbs"] = round(stream, 1)
    _CACHE = out
    return _with_heap(out)


def _with_heap(p: dict) -> dict:
    """A copy of a cached CPU probe with the heap's policy as it is now (kernels/heap.py sets it at load)."""
    return dict(p, heap=heap.describe(heap.heap_policy()))


_CUDA_CACHE: dict | None = None


def cuda_seconds(fn) -> float:
    """Seconds the current CUDA stream spends on what `fn()` queues, from CUDA events around it (the device's
    time, not the host's wait for the result)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure_cuda_bandwidth(mib: int = 1024) -> float:
    """Device-memory read bandwidth in GB/s: the best of a few reductions over a float32 buffer far larger than
    the L2 cache, timed with CUDA events."""
    buf = torch.ones(mib * 1024 * 1024 // 4, device="cuda")  # [mib MiB / 4]
    buf.sum()
    best = min(cuda_seconds(buf.sum) for _ in range(5))
    del buf
    return mib * 1024 * 1024 / best / 1e9


def cuda_probe(bandwidth: bool = True, refresh: bool = False) -> dict:
    """What the kernels need to know about the current CUDA device (cached per process); raises RuntimeError
    where torch sees none."""
    global _CUDA_CACHE
    if not torch.cuda.is_available():
        raise RuntimeError("this torch build sees no CUDA device")
    if _CUDA_CACHE is not None and not refresh and (not bandwidth or "bandwidth_gbs" in _CUDA_CACHE):
        return dict(_CUDA_CACHE)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    out = {
        "device": "cuda",
        "gpu": props.name,
        "capability": [props.major, props.minor],
        "multiprocessors": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_bytes": int(getattr(props, "L2_cache_size", 0)),
        "cuda_version": torch.version.cuda,
        "torch_version": torch.__version__,
        "cpu": _cpuinfo()[0],  # the host: the engine's Python and the launches run there
        "flags": {},
    }
    if bandwidth:
        out["bandwidth_gbs"] = round(measure_cuda_bandwidth(), 1)
    _CUDA_CACHE = out
    return dict(out)


def flag_summary(p: dict) -> str:
    """The present flags as one short string, e.g. 'avx2 fma avx512f ... avx512_vnni avx512_bf16'."""
    text = " ".join(k for k, v in p["flags"].items() if v) or "none of the tracked flags"
    return text + (f" (capped at {p['isa_cap']} by ${ISA_CAP_ENV})" if p.get("isa_cap") else "")


def format_probe(p: dict) -> str:
    if p.get("device") == "cuda":
        lines = [f"gpu               {p['gpu']} (compute capability {p['capability'][0]}.{p['capability'][1]}, "
                 f"{p['multiprocessors']} multiprocessors, {p['memory_gib']} GiB, L2 {p['l2_bytes'] / 2**20:.0f} MiB)",
                 f"torch             {p['torch_version']}, CUDA {p['cuda_version']}; host cpu {p['cpu']}"]
        if "bandwidth_gbs" in p:
            lines.append(f"memory read       {p['bandwidth_gbs']:.1f} GB/s (measured, device memory)")
        return "\n".join(lines)
    lines = [
        f"cpu               {p['cpu']} ({p['machine']}, {p['os_cpus']} logical cpus)",
        f"instruction sets  {flag_summary(p)}",
        (f"torch             {p['torch_version']}, ATen capability {p['torch_cpu_capability']}, "
        f"{p['torch_threads']} threads, fbgemm {'yes' if p['fbgemm'] else 'no'}"),
    ]
    if "thp" in p:  # probes recorded before it was added lack it
        lines.append(f"huge pages        transparent, policy {p['thp']!r} (DRAFTWISE_HUGE_PAGES=1 moves weights there)")
    if "heap" in p:
        lines.append(f"heap              {p['heap']}")
    if "bandwidth_gbs" in p:
        lines.append(f"memory read       {p['bandwidth_gbs']:.1f} GB/s (measured, {p['torch_threads']} threads)"
                     + (f"; streaming sum {p['stream_gbs']:.1f} GB/s (C, same threads)" if "stream_gbs" in p else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_probe(probe()))

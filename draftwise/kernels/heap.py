"""The C heap's policy for a forward's large temporaries: reused from the heap instead of mapped afresh each call.

Owns: whether this process's allocator is glibc's malloc and whether the user already chose its policy
(`heap_policy`: MALLOC_* tunables in the environment, or another allocator preloaded), the one mallopt(3) call
that keeps blocks up to MMAP_THRESHOLD on the heap and up to TRIM_THRESHOLD of freed heap mapped between calls
(`keep_temporaries_on_heap`), and the process's minor page faults (`minor_faults`, for tests and reports).
Knows nothing of models or kernels: torch's CPU allocator is malloc, so every tensor a forward allocates goes here.

Why: glibc maps any block above its mmap threshold (dynamic, at most 32 MiB on 64-bit) afresh and unmaps it on
free, so every projection output of a prompt chunk (the 1.5B's gate|up at 2,048 rows: 147 MB) is faulted in page
by page and zeroed by the kernel, call after call: ~5 million minor faults and 12 s of system time for a 512-, a
2k- and a 4k-token prompt on the packaged 1.5B (docs/PERFORMANCE.md, "Prompts: temporaries on the heap").
llama.cpp sizes one compute buffer once for the same reason. Applied after the weights are loaded (api.LLM), so
loading's own temporaries are returned to the system as before; DRAFTWISE_MALLOC=system leaves glibc's defaults.
"""
from __future__ import annotations

import ctypes
import functools
import os
import resource

MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap (a 7B's gate|up at 2,048 rows is ~310 MB)
TRIM_THRESHOLD = 1 << 30  # freed heap at the top is kept mapped up to 1 GiB: the next chunk reuses it
TOP_PAD = 64 << 20  # each heap growth asks the system for 64 MiB more than needed
# mallopt(3) parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_USER_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_applied: dict | None = None


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        version.restype = ctypes.c_char_p
        return libc, version().decode()
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None, None


def heap_policy() -> dict:
    """What keep_temporaries_on_heap does (or did) here: {"allocator", "applied", "reason", and the sizes}."""
    if _applied is not None:
        return dict(_applied)
    libc, version = _libc()
    preload = os.environ.get("LD_PRELOAD", "")
    if libc is None:
        return {"allocator": "not glibc", "applied": False, "reason": "mallopt is glibc's"}
    allocator = f"glibc {version}"
    if any(a in preload for a in _OTHER_ALLOCATORS):
        return {"allocator": f"preloaded ({preload})", "applied": False, "reason": "another allocator is preloaded"}
    if os.environ.get("DRAFTWISE_MALLOC", "") == "system":
        return {"allocator": allocator, "applied": False, "reason": "DRAFTWISE_MALLOC=system"}
    set_by_user = [t for t in _USER_TUNABLES if t in os.environ and (t != "GLIBC_TUNABLES" or "malloc" in
                                                                      os.environ[t])]
    if set_by_user:
        return {"allocator": allocator, "applied": False, "reason": f"the user set {', '.join(set_by_user)}"}
    return {"allocator": allocator, "applied": False, "reason": "not applied yet (api.LLM applies it after loading)",
            "mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD, "top_pad": TOP_PAD}


def keep_temporaries_on_heap() -> dict:
    """Set the policy once per process (later calls return the first call's outcome); see heap_policy."""
    global _applied
    if _applied is not None:
        return dict(_applied)
    policy = heap_policy()
    if "mmap_threshold" in policy:
        libc, _ = _libc()
        ok = all(libc.mallopt(param, value) == 1 for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
        policy.update(applied=ok, reason="set" if ok else "mallopt refused")
        if not ok:  # glibc's defaults stand: the sizes would describe a policy that is not in force
            for size in ("mmap_threshold", "trim_threshold", "top_pad"):
                del policy[size]
    _applied = policy
    return dict(policy)


def minor_faults() -> int:
    """This process's minor page faults so far (getrusage)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def describe(policy: dict) -> str:
    if "mmap_threshold" not in policy:
        return f"{policy['allocator']}: defaults kept ({policy['reason']})"
    mib = lambda b: f"{b >> 20} MiB" if b < 1 << 30 else f"{b >> 30} GiB"  # noqa: E731
    state = "set" if policy["applied"] else "to be set at load"
    return (f"{policy['allocator']}: blocks up to {mib(policy['mmap_threshold'])} from the heap, freed heap kept up "
            f"to {mib(policy['trim_threshold'])}, growth padded by {mib(policy['top_pad'])} ({state}; "
            f"DRAFTWISE_MALLOC=system keeps glibc's defaults)")

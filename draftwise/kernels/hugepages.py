"""Model weights in transparent huge pages (2 MiB) where the kernel offers them only on request.

Owns: whether this machine's Linux hands out transparent huge pages (THP) on request (`thp_mode`), one
anonymous private mapping per model (`place_in_huge_pages`) into which every large parameter and buffer storage
of a module tree is copied and rebound (views and tensors sharing a storage, such as a tied embedding and LM
head, stay shared), the collapse of those mappings into huge pages once the caller is done loading
(`collapse_pending`: MADV_COLLAPSE, Linux 6.1+, in chunks, on a daemon thread; MADV_HUGEPAGE lets khugepaged do it
slowly where that is missing), and how much of this process the kernel backs with huge pages (`huge_bytes`).
The collapse keeps every address, so nothing is rebound while the engine already runs. Faulting the mapping in
as huge pages directly is slower at load (the kernel compacts memory first) than copying in 4 KiB pages and
collapsing; a collapse (ours or khugepaged's) while the next model loads slows that load (its page faults wait
for the collapse's lock), hence "once the caller is done" (docs/PERFORMANCE.md, memory pages).
Knows nothing of models, formats or the engine: it moves storages, the values stay bitwise.

Why: decoding streams every weight once per step. With 4 KiB pages the 1.5B model's ~1 GB is ~260k pages, far
beyond the TLB, and the hardware prefetchers stop at page boundaries; with 2 MiB pages it is ~500. Most
distributions ship THP in "madvise" mode, where ordinary allocations (torch's, via malloc) never get huge pages;
under "always" they may already have them and the copy changes little; under "never" (or off Linux) nothing is
done. Opt-in (api.load_model with DRAFTWISE_HUGE_PAGES=1): on AMD Zen 4 it sped the kernel up in a harness but did
not show end to end beyond a noisy host's spread, while costing seconds of load (docs/PERFORMANCE.md).
"""
from __future__ import annotations

import errno
import mmap
import threading
import weakref
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20  # bytes in one x86-64 / arm64 transparent huge page
MIN_BYTES = 1 << 20  # storages smaller than this stay where they are (not worth a copy; a page holds several)
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)  # Linux 6.1+; Python 3.11's mmap module does not name it
COLLAPSE_CHUNK = 32 << 20  # bytes collapsed per call, so other threads keep running between calls
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = _THP) -> str:
    """The kernel's THP policy: "always", "madvise", "never", or "unavailable" (no such file: not Linux or no THP)."""
    try:
        text = path.read_text()
    except OSError:
        return "unavailable"
    chosen = [w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")]
    return chosen[0] if chosen else "unavailable"


def huge_bytes() -> int | None:
    """Bytes of this process's anonymous memory the kernel backs with huge pages (None where it cannot say)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def tensors_of(module: nn.Module):  # (owner, kind, name, tensor): every parameter and buffer slot of a module tree
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is not None:
                yield owner, "param", name, p
        for name, b in owner._buffers.items():
            if b is not None:
                yield owner, "buffer", name, b


def place_in_huge_pages(module: nn.Module, min_bytes: int = MIN_BYTES, mode: str | None = None) -> dict:
    """Copy every CPU parameter/buffer storage of `module` of at least `min_bytes` into one anonymous mapping and
    rebind the tensors to it, in place; `collapse_pending()` later has the kernel back it with huge pages. A storage is
    copied once and every tensor on it (views, tied weights) is rebound at its own offset, shape and strides, so
    sharing survives. Old storages are freed as their last tensor moves, so the peak stays near the model's size
    plus one storage. Returns {"mode", "moved_bytes", "storages"};
    moves nothing unless `mode` (default: `thp_mode()`) is "madvise" or "always" and this Python can advise a
    mapping."""
    mode = thp_mode() if mode is None else mode
    report = {"mode": mode, "moved_bytes": 0, "storages": 0}
    if mode not in ("madvise", "always") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return report
    groups: dict[int, list] = {}  # storage data_ptr -> [(owner, kind, name, tensor, offset, size, stride), ...]
    sizes: dict[int, int] = {}
    for owner, kind, name, t in tensors_of(module):
        if t.device.type != "cpu":
            continue
        st = t.untyped_storage()
        if st.nbytes() < min_bytes:
            continue
        # the layout is read now: a Parameter shared by two modules is one object, rebound once for both
        groups.setdefault(st.data_ptr(), []).append((owner, kind, name, t, t.storage_offset(), t.size(), t.stride()))
        sizes[st.data_ptr()] = st.nbytes()
    if not groups:
        return report
    offsets, total = {}, 0
    for ptr in groups:  # each storage starts on a 64-byte boundary (what torch's allocator guarantees)
        offsets[ptr] = total
        total += -(-sizes[ptr] // 64) * 64
    length = -(-total // HUGE) * HUGE
    arena = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # faulted in 4 KiB pages by the copy
    base = torch.frombuffer(arena, dtype=torch.uint8)  # keeps `arena` alive as long as any view of it lives
    for ptr, users in groups.items():
        raw = base[offsets[ptr]:offsets[ptr] + sizes[ptr]]
        raw.copy_(torch.empty(0, dtype=torch.uint8).set_(users[0][3].untyped_storage()))
        for owner, kind, name, t, offset, size, stride in users:
            moved = torch.empty(0, dtype=t.dtype).set_(raw.untyped_storage(), raw.storage_offset() // t.element_size()
                                                      + offset, size, stride)
            if kind == "param":
                owner._parameters[name].data = moved
            else:
                # (register_buffer, not the dict: torch's registration hooks see it, kernels/stack.py generation)
                owner.register_buffer(name, moved, persistent=name not in owner._non_persistent_buffers_set)
        report["moved_bytes"] += sizes[ptr]
        report["storages"] += 1
    with _lock:
        _pending.append(weakref.ref(arena))
    return report


# mappings placed and not yet collapsed, weakly: a model dropped before `collapse_pending` frees its mapping
_pending: list[weakref.ref[mmap.mmap]] = []
_lock = threading.Lock()


def collapse_pending(background: bool = True) -> threading.Thread | None:
    """Collapse every mapping placed so far into huge pages: on a daemon thread (returned; join it to wait), or
    now. Call once loading is over (api.LLM does, after assembling the engine)."""
    with _lock:
        arenas = [a for ref in _pending if (a := ref()) is not None]
        _pending.clear()
    if not arenas:
        return None
    if not background:
        for a in arenas:
            _collapse(a)
        return None
    thread = threading.Thread(target=lambda: [_collapse(a) for a in arenas], daemon=True, name="draftwise-huge-pages")
    thread.start()
    return thread


def _collapse(arena: mmap.mmap) -> None:
    """Ask the kernel to back `arena` with huge pages, COLLAPSE_CHUNK bytes per call (same addresses, same bytes).
    Advised only now: advised at once, khugepaged started collapsing it while the next model loaded, and every page
    fault of that load waited for it (the KV caches' zeroing took several times longer)."""
    try:
        arena.madvise(mmap.MADV_HUGEPAGE)  # khugepaged's to collapse where MADV_COLLAPSE is missing
    except (OSError, ValueError):  # a kernel built without THP, or the mapping is closed: stay in 4 KiB pages
        return
    length = len(arena)
    for off in range(0, length, COLLAPSE_CHUNK):
        try:
            arena.madvise(MADV_COLLAPSE, off, min(COLLAPSE_CHUNK, length - off))
        except OSError as e:
            if e.errno == errno.EINVAL:  # a kernel before 6.1: leave it to khugepaged
                return
            # EAGAIN / ENOMEM: no free huge page for this chunk now; the rest may still get one
        except ValueError:  # the mapping was closed (the model is gone)
            return

"""Model weights in transparent huge pages (2 MiB) where the kernel offers them only on request.

Owns: whether this machine's Linux hands out transparent huge pages (THP) on request (`thp_mode`), one
anonymous private mapping advised MADV_HUGEPAGE per model (`place_in_huge_pages`) into which every large
parameter and buffer storage of a module tree is copied and rebound (views and tensors sharing a storage, such
as a tied embedding and LM head, stay shared), and how much of this process the kernel backs with huge pages
(`huge_bytes`). Knows nothing of models, formats or the engine: it moves storages, the values stay bitwise.

Why: decoding streams every weight once per step. With 4 KiB pages the 1.5B model's ~1 GB is ~260k pages, far
beyond the TLB, and the hardware prefetchers stop at page boundaries; with 2 MiB pages it is ~500. Measured on
AMD Zen 4, 2 threads (docs/ARCHITECTURE.md, hardware facts): a 1-row forward of the packaged 1.5B took 35.0 ms
instead of 41.3 ms. Most distributions ship THP in "madvise" mode, where ordinary allocations (torch's, via
malloc) never get huge pages; under "always" they may already have them and the copy changes little; under
"never" (or off Linux) nothing is done.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20  # bytes in one x86-64 / arm64 transparent huge page
MIN_BYTES = 1 << 20  # storages smaller than this stay where they are (not worth a copy; a page holds several)
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
    """Copy every CPU parameter/buffer storage of `module` of at least `min_bytes` into one anonymous mapping
    advised MADV_HUGEPAGE and rebind the tensors to it, in place. A storage is copied once and every tensor on it
    (views, tied weights) is rebound at its own offset, shape and strides, so sharing survives. Old storages are
    freed as their last tensor moves, so the peak stays near the model's size plus one storage.
    Returns {"mode", "moved_bytes", "storages"}; moves nothing unless `mode` (default: `thp_mode()`) is
    "madvise" or "always" and this Python can advise a mapping."""
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
    arena = mmap.mmap(-1, -(-total // HUGE) * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arena.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP refuses the advice: leave everything where it is
        arena.close()
        return report
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
                owner._buffers[name] = moved
        report["moved_bytes"] += sizes[ptr]
        report["storages"] += 1
    return report

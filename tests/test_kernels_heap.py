"""kernels/heap.py: a forward's large temporaries are reused from the heap, not faulted in afresh each call.

Each case runs in a child process (mallopt is process-wide and cannot be undone cleanly): 64 MB tensors, the size
class of a prompt chunk's projection outputs, are allocated, written and freed ten times after ten to settle the
heap; with the policy no page is faulted in again, with glibc's defaults (the planted control,
DRAFTWISE_MALLOC=system) every page of every block. The
user's own malloc tunables are left alone. About 3 s."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CHILD = r"""
import json, torch
from draftwise.kernels import heap
policy = heap.keep_temporaries_on_heap()
n = 16 << 20  # float32 elements: 64 MiB
for _ in range(10):  # the heap settles (a block freed behind a newer small one is not merged back at once)
    torch.empty(n).fill_(1.0)
before = heap.minor_faults()
for _ in range(10):
    torch.empty(n).fill_(1.0)
print(json.dumps({"faults": heap.minor_faults() - before, "policy": policy}))
"""


def pages_per_block() -> int:
    """Page faults one fresh 64 MiB block takes: 4 KiB pages, or 2 MiB ones where THP is "always" (the kernel's
    choice for a large anonymous mapping there)."""
    from draftwise.kernels.hugepages import HUGE, thp_mode

    return (64 << 20) // (HUGE if thp_mode() == "always" else 4096)


def child(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES",
                                                                                               "DRAFTWISE_MALLOC")}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, cwd=ROOT,
                         env={**base, "PYTHONPATH": str(ROOT), **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_temporaries_are_faulted_in_once_with_the_policy_and_every_call_without():
    pages = pages_per_block()
    kept = child()
    if kept["policy"]["allocator"].startswith("glibc"):
        assert kept["policy"]["applied"], kept
        assert kept["faults"] < pages, kept  # ten 64 MiB blocks: not even one block's pages
    system = child(DRAFTWISE_MALLOC="system")
    assert not system["policy"]["applied"] and "DRAFTWISE_MALLOC" in system["policy"]["reason"]
    if kept["policy"]["allocator"].startswith("glibc"):  # the control: glibc's defaults map each block afresh
        assert system["faults"] > 5 * pages, system


def test_the_users_own_malloc_settings_are_left_alone():
    mine = child(MALLOC_MMAP_THRESHOLD_="131072")
    assert not mine["policy"]["applied"]
    if mine["policy"]["allocator"].startswith("glibc"):
        assert "MALLOC_MMAP_THRESHOLD_" in mine["policy"]["reason"]
        assert mine["faults"] > 5 * pages_per_block(), mine  # their threshold, so blocks are mapped afresh

"""Intra-op threads under CPU contention: fewer torch threads while other processes hold cores.

Every parallel region of a forward (a q4x8 projection, an attention call: ~700 per 1-row forward of the 1.5B)
ends at a barrier that waits for all of torch's threads. When another process takes a core, each barrier waits
for a descheduled thread's next time slice, so two processes with 2 threads each on 2 cores run a forward
several times slower than with 1 thread each (docs/PERFORMANCE.md, thread guard).

ThreadGuard measures, over windows of at least WINDOW_S, how many cores the OTHER processes keep busy:
(busy jiffies of the CPUs this process may run on, from /proc/stat − this process's CPU time from
/proc/self/stat) / jiffies per core, and runs with threads = max(1, min(requested, cores − others rounded to the nearest core)) once two
windows in a row agree.
With the machine to itself it returns to the requested count. The engine calls `tick` once per step; it costs
two small file reads per window. Used only where a thread count cannot change a result (api.py: kernels that
split work by output, never a reduction, i.e. q4x8 and our attention), so greedy output stays identical.
The same /proc reading times one measurement's contention (`busy_meter`, `busy_now`, `is_busy`): a timing taken
while other processes kept PROVISIONAL_BUSY_CORES busy is provisional (autotune's plans, q4x8's wide switch).
Knows nothing of models or of the engine; Linux only (no /proc/stat: never changes anything).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch

WINDOW_S = 1.0  # seconds of engine time per measurement window
PROVISIONAL_BUSY_CORES = 0.5  # other processes' busy cores, before or during a timing, that make it provisional
QUIET_WINDOW_S = 0.5  # how long contention is measured before a timing (busy_now)


def our_cpus() -> set[int] | None:
    """The CPUs this process may run on (None where the OS does not say)."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def read_proc(cpus: set[int] | None = None) -> tuple[int, int] | None:
    """(busy jiffies of `cpus` — all CPUs when None —, CPU jiffies of this process) or None where /proc is missing.
    Only our own CPUs count: a neighbour pinned to other CPUs takes nothing from us."""
    try:
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if not name.startswith("cpu"):
                    break
                if (cpus is None and name == "cpu") or (cpus is not None and name[3:].isdigit() and int(name[3:]) in cpus):
                    fields = [int(v) for v in values]
                    busy += sum(fields[:8]) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle, iowait
        with open("/proc/self/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None
    return busy, int(stat[11]) + int(stat[12])  # utime + stime


def clock_ticks() -> int:
    """Jiffies per second (the unit of /proc/stat and /proc/self/stat)."""
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def others_busy(prev: tuple[int, int], cur: tuple[int, int], seconds: float, hz: int) -> float:
    """Cores the OTHER processes kept busy between two read_proc() readings `seconds` apart: (busy jiffies of our
    CPUs - this process's jiffies) / the jiffies one core has in that time."""
    return max(0.0, ((cur[0] - prev[0]) - (cur[1] - prev[1])) / (seconds * hz))


def threads_for(requested: int, cores: int, others: float) -> int:
    """Threads to run with when other processes keep `others` cores busy (pure; tests inject the numbers)."""
    return max(1, min(requested, cores - int(max(0.0, others) + 0.5)))


class BusyWindows:
    """Other processes' busy cores, one reading per window of at least `window_s` seconds (two small file reads
    each). `sample()` is cheap to call often: None until a window has passed (or where /proc cannot say)."""

    def __init__(self, read: Callable[[], tuple[int, int] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, hz: int | None = None, window_s: float = WINDOW_S):
        cpus = our_cpus()
        self.read = read or (lambda: read_proc(cpus))
        self.clock, self.hz, self.window_s = clock, hz or clock_ticks(), window_s
        self._last = (self.clock(), self.read())

    def sample(self, force: bool = False) -> float | None:
        """Busy cores of the others since the last reading, once `window_s` has passed (`force`: now)."""
        now = self.clock()
        t0, prev = self._last
        if (now - t0 < self.window_s and not force) or now <= t0 or prev is None:
            return None
        cur = self.read()
        self._last = (now, cur)
        return None if cur is None else others_busy(prev, cur, now - t0, self.hz)


class ThreadGuard:
    def __init__(self, requested: int | None = None, cores: int | None = None,
                 read: Callable[[], tuple[int, int] | None] | None = None, clock: Callable[[], float] = time.monotonic,
                 set_threads: Callable[[int], None] = torch.set_num_threads, hz: int | None = None,
                 log: bool = True):
        self.requested = requested or torch.get_num_threads()
        cpus = our_cpus()
        self.cores = cores or (len(cpus) if cpus else os.cpu_count() or 1)
        self.windows = BusyWindows(read, clock, hz)
        self.set_threads, self.log = set_threads, log
        self.threads = self.requested
        self.others = 0.0  # cores the other processes kept busy in the last window
        self.changes = 0
        self._proposal: int | None = None  # the previous window's count, if it differed from the current one

    def tick(self) -> int | None:
        """Call once per engine step. Returns the new thread count when it changed, else None."""
        others = self.windows.sample()
        if others is None:
            return None
        self.others = others
        want = threads_for(self.requested, self.cores, self.others)
        if want == self.threads:
            self._proposal = None
            return None
        if self._proposal != want:  # one window is a blip: wait for a second that agrees
            self._proposal = want
            return None
        self._proposal = None
        if self.log:
            print(f"draftwise: other processes keep ~{self.others:.1f} of {self.cores} cores busy: {want} torch "
                  f"thread(s) (was {self.threads})", file=sys.stderr)
        self.threads = want
        self.changes += 1
        self.set_threads(want)
        return want


# ---- one timing's contention: autotune's plans and q4x8's wide switch are provisional where it was high ----

def busy_meter():
    """Start measuring how many cores OTHER processes keep busy; the returned function gives the mean since the
    start (None where /proc cannot say). A timing taken while they did is slower than this machine is."""
    cpus = our_cpus()
    t0, first = time.monotonic(), read_proc(cpus)

    def others() -> float | None:
        last, dt = read_proc(cpus), time.monotonic() - t0
        if first is None or last is None or dt <= 0:
            return None
        return round(others_busy(first, last, dt, clock_ticks()), 2)

    return others


def busy_now(window_s: float = QUIET_WINDOW_S) -> float | None:
    """Cores other processes keep busy over the next `window_s` seconds (this process sleeps meanwhile)."""
    others = busy_meter()
    time.sleep(window_s)
    return others()


def is_busy(cores: float | None) -> bool:
    """Other processes kept enough cores busy (PROVISIONAL_BUSY_CORES) that a timing taken then is provisional."""
    return cores is not None and cores >= PROVISIONAL_BUSY_CORES

"""The server's memory ceiling (`draftwise serve --memory-limit`): what it defaults to, how much of it the K/V pool
may take, and the admission's check of the RSS actually held.

Owns three things. `resolve_limit(flag)`: bytes from the flag (a size through cli_args.parse_size, the command
line's one size parser: a bare G is GiB; "auto": the cgroup's limit — v2 memory.max, v1 memory.limit_in_bytes —
else the RAM available now; "none": no ceiling). `plan_kv_memory(limit, prediction)`:
the K/V budget (--kv-cache-memory) that keeps the engine's predicted peak under the ceiling, from `draftwise memory
--rss`'s prediction (bench/memory.predict_peak_rss: measured runtime, resident weights, one prefill chunk's
activations, K/V per token of the target and a draft); the engine's paged pool then never holds more, and
requests beyond what it holds wait in the admission queue (429 with Retry-After once that is full), so a flood of
long prompts meets a queue instead of the OOM killer. `MemoryGuard`: the admission's second line — the measured
RSS of the server and engine processes (read at most every `interval_s`), above `hold_fraction` of the ceiling
no new request goes to the engine (it waits in its queue), whatever the prediction said. Knows nothing of HTTP
or the engine's internals: the CLI passes the numbers in, runner.py asks `holds()`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from draftwise.cli_args import parse_size
from draftwise.config import ConfigError
from draftwise.kv_cache import available_memory

UNLIMITED_CGROUP = 2**60  # a v1 cgroup without a limit reports about 2^63
# the HTTP process beside the engine: its RSS measured when the plan is made (torch and the package imported:
# ~345 MB) plus what serving adds — the tokenizer, request bodies and streams: 484 MB measured (VmRSS) serving the
# 1.5B through floods of 4k and 16k-token prompts, ~140 MB above the plan-time figure. SERVER_RESERVE_BYTES is the
# whole reserve when nothing was measured (a constant 256 MiB let a 2.35 GiB ceiling be overrun by ~13%).
SERVER_GROWTH_BYTES = 192 * 2**20
SERVER_RESERVE_BYTES = 512 * 2**20
# the standby engine process (engine_host.EngineProcess.prepare_standby: its LLM built, idle; the weights are mapped
# from the prepared file and untouched until it serves): 388 MB RSS measured for the 1.5B (305 MB PSS)
STANDBY_BYTES = 400 * 2**20
HEADROOM = 0.05  # of the ceiling kept free of the prediction (allocator slack, page tables, the suffix cache)
HOLD_FRACTION = 0.95  # measured RSS above this share of the ceiling holds admission


def cgroup_limit() -> int | None:
    """This process's cgroup memory limit in bytes (v2 memory.max, v1 memory.limit_in_bytes); None: none."""
    try:
        lines = [line.strip().split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    except OSError:
        lines = []
    files = [f"/sys/fs/cgroup{p.rstrip('/')}/memory.max" for h, c, p in lines if h == "0" and c == ""]
    files += [f"/sys/fs/cgroup/memory{p.rstrip('/')}/memory.limit_in_bytes" for h, c, p in lines
              if "memory" in c.split(",")]
    files += ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]  # in a container
    for f in files:
        try:
            value = Path(f).read_text().strip()
        except OSError:
            continue
        if value == "max":
            return None
        if value.isdigit():
            n = int(value)
            return None if n >= UNLIMITED_CGROUP else n
    return None


def limit_arg(text: str) -> str | int:
    """--memory-limit's value: "auto", "none" (also "off", "0"), or a size (cli_args.parse_size: bytes)."""
    t = str(text).strip().lower()
    if t in ("auto", "none", "off", "0"):
        return "none" if t != "auto" else "auto"
    return parse_size(text, "--memory-limit")


def resolve_limit(flag: str | int | None) -> tuple[int | None, str]:
    """(bytes or None, where it came from) for --memory-limit `flag` ("auto" / None, "none", a size's text, or
    bytes)."""
    value = "auto" if flag is None else flag if isinstance(flag, int) else limit_arg(flag)
    if value == "none":
        return None, "off"
    if isinstance(value, int):
        text = getattr(value, "text", "") or str(int(value))
        return int(value), f"--memory-limit {text} = {int(value)} bytes"
    limit = cgroup_limit()
    if limit is not None:
        return limit, "the cgroup's memory limit"
    ram = available_memory()
    return (ram, "the RAM available at start (MemAvailable)") if ram else (None, "unknown (no ceiling)")


@dataclass
class KVPlan:
    """What the ceiling leaves the K/V pool: `kv_cache_memory` (the target's pool budget; a draft's pool holds the
    same tokens), the prediction's fixed part (the engine before any K/V, its allocator's retained heap included),
    what the other processes are given (the HTTP server, a standby engine), and the K/V bytes per token of target
    and draft together."""

    limit: int
    fixed_bytes: int
    kv_bytes_per_token: int
    kv_cache_memory: int
    tokens: int  # positions the pool then holds
    server_bytes: int = SERVER_RESERVE_BYTES
    standby_bytes: int = 0
    heap_bytes: int = 0  # of fixed_bytes: the allocator's retained heap beyond the prediction

    def describe(self) -> str:
        gib = 2**30
        standby = f" + a standby engine {self.standby_bytes / gib:.2f} GiB" if self.standby_bytes else ""
        return (f"memory limit {self.limit / gib:.2f} GiB: predicted runtime + weights + activations + retained heap "
                f"{self.fixed_bytes / gib:.2f} GiB + the HTTP process {self.server_bytes / gib:.2f} GiB{standby} + "
                f"headroom {HEADROOM:.0%}; the K/V pool gets {self.kv_cache_memory / gib:.2f} GiB ({self.tokens} "
                f"tokens at {self.kv_bytes_per_token} B each, target and draft)")


def server_reserve(measured_rss: int | None) -> int:
    """The HTTP process's share of the ceiling: its RSS now (plan time) plus SERVER_GROWTH_BYTES, else the
    constant SERVER_RESERVE_BYTES."""
    return SERVER_RESERVE_BYTES if not measured_rss else measured_rss + SERVER_GROWTH_BYTES


def retained_heap_bytes() -> int:
    """Freed heap the engine's allocator keeps mapped beyond the prediction's live peak: the top pad each heap
    growth asks for (kernels/heap.py's mallopt policy keeps freed blocks for reuse, so RSS stays at the
    high-water mark of a chunk's temporaries, which the activations row already counts); 0 when the policy is not
    applied there (not glibc, or the user chose the allocator's settings)."""
    from draftwise.kernels import heap

    return int(heap.heap_policy().get("top_pad", 0))  # the engine's environment is this process's


def plan_kv_memory(limit: int, prediction: dict, requested: int | None = None, server_bytes: int | None = None,
                   standby_bytes: int = 0, heap_bytes: int = 0) -> KVPlan:
    """The K/V budget under `limit` from predict_peak_rss's `prediction` (its "bytes" rows: "<role> K/V" are the
    pools' part, the rest is fixed; "models"[role]["kv_blocks"] how many blocks of BLOCK_SIZE those rows are),
    at most `requested` (the --kv-cache-memory asked for, in bytes), with `server_bytes` (server_reserve: default
    SERVER_RESERVE_BYTES), `standby_bytes` and the engine's retained heap `heap_bytes` set aside. ConfigError when
    not even one block fits."""
    from draftwise.kv_cache import BLOCK_SIZE

    server = SERVER_RESERVE_BYTES if server_bytes is None else server_bytes
    rows = prediction["bytes"]
    kv_rows = {k: v for k, v in rows.items() if k.endswith(" K/V")}
    fixed = sum(v for k, v in rows.items() if k not in kv_rows) + heap_bytes
    per_token = {role: rows[f"{role} K/V"] / (info["kv_blocks"] * BLOCK_SIZE)
                 for role, info in prediction["models"].items() if f"{role} K/V" in rows and info["kv_blocks"]}
    total_per_token = int(sum(per_token.values()))
    others = server + standby_bytes
    spare = limit * (1 - HEADROOM) - fixed - others
    tokens = int(spare // total_per_token) if total_per_token else 0
    if tokens < BLOCK_SIZE:
        need = fixed + others + BLOCK_SIZE * total_per_token
        raise ConfigError(f"--memory-limit {limit / 2**30:.2f} GiB is below what serving this model needs "
                          f"(about {need / (1 - HEADROOM) / 2**30:.2f} GiB: {fixed / 2**30:.2f} GiB predicted before "
                          f"any K/V, {others / 2**30:.2f} GiB for the HTTP process"
                          f"{' and a standby engine (--no-engine-standby drops it)' if standby_bytes else ''}; "
                          f"`draftwise memory --rss` has the breakdown)")
    target_budget = int(tokens * per_token.get("target", total_per_token))
    if requested is not None and requested < target_budget:
        target_budget = requested
        tokens = int(requested // per_token.get("target", total_per_token))
    return KVPlan(limit, int(fixed), total_per_token, target_budget, tokens, server, standby_bytes, heap_bytes)


def rss_bytes(pid: int) -> int:
    """A process's resident set (VmRSS), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class MemoryGuard:
    """Holds admission while the measured RSS (`measure()`: bytes; default this process plus the engine's,
    `pids()`) is above `hold_fraction` x `limit`; reads it at most every `interval_s` (admission asks per
    request)."""

    def __init__(self, limit: int, pids=None, measure=None, interval_s: float = 0.25,
                 hold_fraction: float = HOLD_FRACTION):
        self.limit, self.interval_s, self.hold_fraction = limit, interval_s, hold_fraction
        self.pids = pids  # () -> [pid]: whose RSS counts (None: this process; create_app adds the engine's)
        self._measure = measure or (lambda: sum(rss_bytes(p) for p in (self.pids() if self.pids else
                                                                          [os.getpid()])))
        self._last_t = float("-inf")
        self.last_rss = 0
        self.peak_rss = 0
        self.holds_count = 0  # admissions held (each request the check kept queued counts once per check)

    def rss(self) -> int:
        now = time.monotonic()
        if now - self._last_t >= self.interval_s:
            self._last_t = now
            self.last_rss = int(self._measure())
            self.peak_rss = max(self.peak_rss, self.last_rss)
        return self.last_rss

    def holds(self) -> bool:
        """Whether a new request must wait: the RSS is near the ceiling."""
        held = self.rss() > self.hold_fraction * self.limit
        self.holds_count += held
        return held

"""Kernel autotuner: time every linear implementation that runs here on a model's real projection shapes, choose
one step kernel (decode and verification) and one prefill kernel, and cache the choice per machine and shapes.

Owns: the timing procedure, the choice rule (`choose`, a pure function of a timing table so tests inject tables),
the JSON cache (${DRAFTWISE_CACHE_DIR:-~/.cache/draftwise}/kernels/autotune/<key>.json, keyed by the CPU's
flags, torch version, threads and the shapes; on a GPU by its name and compute capability) and the table printer.
The same procedure and rule serve a CUDA device (`device="cuda"`): the candidates are those whose `devices`
include it, each call timed with CUDA events after the L2 cache is overwritten. Knows nothing of checkpoints or
decoders: callers pass shapes (`decoder_shapes`, or `shapes_from_config` on any object with the usual config
fields).

Choice rule (documented contract):
  * step kernel: ONE kernel for every decode/verification width, so greedy speculative output equals plain
    decoding. Score = (cost(1) + cost(9)) / 2: cost(1) is a plain decode step, cost(9) a k = 8 verification,
    linearly interpolated between the measured 8 and 16 rows. Only implementations found row-exact for the step
    are eligible (`rows_exact`: every row's output bitwise the same as that row alone, at EVERY width 1..
    EXACT_STEP_ROWS — one sequence's k + 1 rows or a batch of up to 8 sequences of mixed widths — and every
    thread count 1..torch's threads the thread guard may choose, on every projection shape, the head included):
    a kernel that fails can change a greedy token when a verification or a batch differs from a plain step. If
    none is, every one is (and the plan says so: it is not row-exact).
  * prefill kernel: the lowest cost at the prefill chunk width (default 128 rows) among the implementations
    found row-exact at the prefill widths (EXACT_PREFILL_ROWS: a batched prefill of several prompts must equal
    each prompt's own prefill); if none is, every one is.
  Costs are the sum over the model's projections (count x per-call ms). Candidates within the measurement's
  noise of the fastest are tied (TIE_BAND, or the spread of the interleaved rounds where that is larger), and a
  tie goes to the fixed PREFERENCE order, so two quiet machines of the same kind choose the same plan. A projection
  an implementation cannot take (`supports` False: e.g. torch int4 and an LM head of N % 16 != 0) costs what the
  model built with it runs there instead, the dense implementation of its activation dtype (linear.dense_for),
  and that one's row-exactness counts too (table["fallback"] lists such projections).

Load-time tuning (`autotune(shapes, fast=True)`, what `weights="auto"` runs on a model's first load): only the
candidates that can plausibly win here (`load_candidates`: q4x8 when it builds, torch int4, dense bf16 only with
native bf16, dense fp32), rows 1, 9 and 128, 3 samples, the LM head timed on its first FAST_MAX_N rows. A few
seconds per model; the result is cached like any other (the key includes the candidates and rows).

One plan per machine, model, threads and torch at a time, and only a quiet one kept (`autotune`): tuning and the
cache write run under a file lock beside the cache entry (a second process waits for the first one's plan,
saying so, and uses it). Contention is measured before (threads.QUIET_WINDOW_S) and during the timing from /proc:
where other processes kept >= threads.PROVISIONAL_BUSY_CORES cores busy, the result is `provisional`: used,
cached, shown, and re-tuned by the next start that finds the machine quiet.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from draftwise.kernels.linear import LINEARS, STEP_MAX_TOKENS, available, dense_for, probe_device
from draftwise.kernels.probe import cuda_probe, cuda_seconds, flag_summary, format_probe
from draftwise.kernels.probe import probe as cpu_probe
from draftwise.kernels.threads import busy_meter, busy_now, is_busy
from draftwise.paths import default_cache_dir

STEP_ROWS = (1, 2, 4, 8, 16)
PREFILL_ROWS = 128
VERIFY_ROWS = 9  # k = 8 drafted tokens + 1
FLUSH_BYTES = 96 * 1024 * 1024  # read this much between timed calls so the weights come from memory, not cache
MAX_N = 32768  # wider projections (the LM head) are timed on their first MAX_N rows and scaled by N / MAX_N
FAST_ROWS = (1, VERIFY_ROWS)
FAST_SAMPLES = 3
FAST_MAX_N = 8192
CUDA_FLUSH_BYTES = 256 * 1024 * 1024  # > any GPU's L2 (H100/H200: 50-60 MB)
EXACT_STEP_ROWS = 8 * STEP_MAX_TOKENS  # step calls: 8 sequences (the engine's default batch) of <= 12 tokens
EXACT_PREFILL_ROWS = (1, 2, 3, 17, 64, 127, 128, 129, 256)  # prompt chunks, alone and batched
EXACT_MAX_N = FAST_MAX_N  # wider projections (the LM head) are checked on their first EXACT_MAX_N rows
EXACT_VECTORS = 7  # distinct activation rows, cycled through every checked width (prime: never block-aligned)
TIE_BAND = 0.05  # candidates within 5% of the fastest are tied (or within the rounds' spread, if larger)
PREFERENCE = ("q4x8", "int4", "bf16", "int8", "fp32", "int8_dynamic")  # ties: row-exact by construction, then bytes
LOCK_REPORT_S = 5.0  # while waiting for another process's tuning, say so this often
VERSION = 2  # of the table's contents (2: rows_exact over widths and threads, rounds, provisional)


def run_probe(device: str = "cpu") -> dict:
    """The probe of `device` (no bandwidth measurement: the autotuner times the kernels themselves)."""
    return cpu_probe(bandwidth=False) if device == "cpu" else cuda_probe(bandwidth=False)


@dataclass(frozen=True)
class ProjShape:
    name: str
    N: int  # output features
    K: int  # input features
    count: int  # how many such projections one forward runs (layers x per layer)


def decoder_shapes(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, layers: int,
                   vocab: int, lm_head: bool = True) -> list[ProjShape]:
    """The linear projections of a llama/qwen-style decoder forward, one entry per distinct (N, K)."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    raw = [("q_proj", q, hidden), ("k_proj", kv, hidden), ("v_proj", kv, hidden), ("o_proj", hidden, q),
           ("gate_proj", intermediate, hidden), ("up_proj", intermediate, hidden), ("down_proj", hidden, intermediate)]
    merged: dict[tuple[int, int], ProjShape] = {}
    for name, N, K in raw:
        old = merged.get((N, K))
        merged[(N, K)] = ProjShape(f"{old.name}+{name}" if old else name, N, K, (old.count if old else 0) + layers)
    out = list(merged.values())
    if lm_head:
        out.append(ProjShape("lm_head", vocab, hidden, 1))
    return out


def shapes_from_config(cfg) -> list[ProjShape]:
    """Any object with hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, num_layers, vocab_size."""
    return decoder_shapes(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.num_layers, cfg.vocab_size)


# ---- measuring -------------------------------------------------------------------------------------------

_flush_bufs: dict[str, torch.Tensor] = {}


def _flush_caches(device: str = "cpu") -> None:
    """Stream a buffer larger than any last-level cache (on a GPU: write one larger than its L2), evicting the
    weights of the previous call: a decode step reads every weight once per token, so a kernel's realistic cost
    is with its weights in memory."""
    if device not in _flush_bufs:
        size = FLUSH_BYTES if device == "cpu" else CUDA_FLUSH_BYTES
        _flush_bufs[device] = torch.ones(size // 4, dtype=torch.float32, device=device)  # [size / 4]
    if device == "cpu":
        _flush_bufs[device].sum()
    else:
        _flush_bufs[device].zero_()


def _time_calls(mod, x: torch.Tensor, samples: int, cold: bool, clock=time.perf_counter, warm_up: bool = True) -> float:
    """Fastest ms of one call over `samples` calls (after one warm-up), each after a cache flush when `cold`.
    The minimum, not the median: other jobs on a shared machine only ever make a call slower. `clock` may be
    time.thread_time with torch at 1 thread: CPU time of the calling thread, blind to time spent descheduled.
    On a GPU (x on it) CUDA events bracket the call on its stream: the device's time from its first kernel's
    start to its last one's end, the gaps between them included, not the host's wait for the result (a decode
    step queues its kernels ahead and pays that once per step, not per call)."""
    device = x.device.type
    with torch.inference_mode():
        if warm_up:
            mod(x)
        best = float("inf")
        for _ in range(samples):
            if cold:
                _flush_caches(device)
            if device != "cpu":
                best = min(best, cuda_seconds(lambda: mod(x)))
                continue
            t0 = clock()
            mod(x)
            best = min(best, clock() - t0)
    return best * 1e3


def exactness_threads() -> list[int]:
    """Every thread count the thread guard may run a forward with: 1 .. torch's current count."""
    return list(range(1, torch.get_num_threads() + 1))


def rows_exact(module, K: int, widths, threads=None, seed: int = 0, device: str = "cpu") -> str | None:
    """None when every row's output is bitwise the output of that row alone (1 thread), at every width in
    `widths` and every thread count in `threads` (default exactness_threads()); otherwise what differed, e.g.
    "row 32 of 33 at 2 threads". Rows cycle through EXACT_VECTORS random vectors, so one call checks every row of
    its width against a few single-row references, and a kernel whose rows share anything (a per-call scale, a
    split-K reduction, an M-blocked micro-kernel with a tail) differs somewhere."""
    threads = threads or exactness_threads()
    g = torch.Generator().manual_seed(seed)
    vectors = torch.randn(EXACT_VECTORS, K, generator=g).to(device)  # [P, K]
    widest = max(widths)
    x = vectors[torch.arange(widest) % EXACT_VECTORS]  # [widest, K]
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(threads[0])
            alone = torch.cat([module(vectors[i:i + 1].clone()) for i in range(EXACT_VECTORS)])  # [P, N]
            expect = alone[torch.arange(widest) % EXACT_VECTORS]  # [widest, N]
            for t in threads:
                torch.set_num_threads(t)
                for w in widths:
                    out = module(x[:w].clone())  # [w, N]
                    same = (out == expect[:w]).all(dim=1)
                    if not bool(same.all()):
                        row = int((~same).nonzero()[0])
                        return f"row {row} of {w} at {t} thread{'s' if t > 1 else ''}"
    finally:
        torch.set_num_threads(before)
    return None


def load_candidates(p: dict) -> list[str]:
    """The implementations worth timing on a model's first load here: q4x8 when it builds, torch int4, dense bf16
    only where bf16 is native (AVX-512 BF16 or AMX; emulated bf16 never wins), dense fp32. On a GPU every
    implementation that runs there (torch int4, torch int8 where the build has its CUDA kernel, dense bf16 and
    fp32)."""
    if probe_device(p) != "cpu":
        return available(p)
    flags = p.get("flags", {})
    native_bf16 = bool(flags.get("avx512_bf16") or flags.get("amx_bf16") or flags.get("bf16"))
    names = ["q4x8", "int4"] + (["bf16"] if native_bf16 else []) + ["fp32"]
    return [n for n in names if n in available(p)]


def measure(shapes: list[ProjShape], names: list[str] | None = None, rows: tuple[int, ...] = STEP_ROWS,
            prefill_rows: int = PREFILL_ROWS, samples: int = 7, cold: bool = True, progress: bool = True,
            seed: int = 0, registry: dict | None = None, clock=time.perf_counter, max_n: int = MAX_N,
            prefill_samples: int = 3, device: str = "cpu", exact_threads: list[int] | None = None) -> dict:
    """Time each implementation on each shape for each row count, in `samples` interleaved rounds (every
    candidate once per round, so a burst of load spoils a round for all of them, not one candidate), and check
    each one's rows (`rows_exact`, step and prefill widths, stopping at the first failure). Returns a JSON-able
    table: {"rows": [...], "ms": {impl: {rows: total ms over the model's projections, fastest round}},
    "per_shape": {impl: {shape: {rows: ms per call}}}, "round_step_ms": {impl: [step score of each round]},
    "spread": {impl: (slowest - fastest round) / fastest}, "row_exact": {impl: {"step": bool, "prefill": bool,
    "why": {kind: first failure}}}, "shapes": [...]}. `registry` (name -> LinearImpl class, default LINEARS)
    lets benchmarks and tests add variants; `clock` see _time_calls; `device` where weights and activations
    live; `exact_threads` the thread counts of the exactness check (default: 1..torch's)."""
    from tqdm import tqdm

    p = run_probe(device)
    registry = registry or LINEARS
    names = [n for n in (names or available(p)) if n in registry]
    all_rows = sorted(set(rows) | ({prefill_rows} if prefill_rows else set()))
    gen = torch.Generator().manual_seed(seed)
    per_shape: dict[str, dict[str, dict[int, float]]] = {n: {} for n in names}
    rounds: dict[str, dict[str, dict[int, list[float]]]] = {n: {} for n in names}
    exact = {n: {"step": True, "prefill": True, "why": {}} for n in names}
    fallback: dict[str, list[str]] = {}
    step_widths = range(1, EXACT_STEP_ROWS + 1)
    # a GPU's result does not depend on the host's thread count
    threads = exact_threads or (exactness_threads() if device == "cpu" else [torch.get_num_threads()])
    bar = tqdm(total=len(names) * len(shapes), desc="timing kernels", unit="shape", disable=not progress,
               file=sys.stderr, leave=False)
    for shape in shapes:
        n_eff = min(shape.N, max_n)
        weight = (torch.randn(n_eff, shape.K, generator=gen) / shape.K ** 0.5).to(device)  # [N', K]
        xs = {r: torch.randn(r, shape.K, generator=gen).to(device) for r in all_rows}  # x [r, K]
        mods = {}
        for name in names:
            bar.set_postfix_str(f"{name} {shape.name}")
            cls = registry[name]
            if not cls.supports(shape.N, shape.K) or not cls.supports(n_eff, shape.K):
                cls = LINEARS[dense_for(cls.dtype)]  # what a model built with `name` runs here instead
                fallback.setdefault(name, []).append(shape.name)
            mods[name] = cls(weight)
            # every shape: a library may pick its GEMM algorithm by N and K too
            checked = mods[name] if n_eff <= EXACT_MAX_N else cls(weight[:EXACT_MAX_N])
            for kind, widths in (("step", step_widths), ("prefill", EXACT_PREFILL_ROWS)):
                if exact[name][kind]:
                    why = rows_exact(checked, shape.K, widths, threads, seed, device)
                    if why is not None:
                        exact[name][kind] = False
                        exact[name]["why"][kind] = f"{shape.name}: {why}"
            del checked
            bar.update(1)
        scale = shape.N / n_eff
        for name in names:
            rounds[name][shape.name] = {r: [] for r in all_rows}
        for i in range(samples):
            for name in names:
                for r in all_rows:
                    if r > 16 and i >= prefill_samples:  # prefill widths are compute-bound: a few rounds suffice
                        continue
                    t = _time_calls(mods[name], xs[r], 1, cold, clock, warm_up=i == 0)
                    rounds[name][shape.name][r].append(t * scale)
        for name in names:
            per_shape[name][shape.name] = {r: min(v) for r, v in rounds[name][shape.name].items()}
        del mods
    bar.close()
    ms = {name: {r: sum(per_shape[name][s.name][r] * s.count for s in shapes) for r in all_rows} for name in names}
    round_step = {}
    for name in names:
        every_round = [r for r in rows if r <= 16 or prefill_samples >= samples]
        per_round = [{r: sum(rounds[name][s.name][r][i] * s.count for s in shapes) for r in every_round}
                     for i in range(samples)]
        round_step[name] = [step_score(c) for c in per_round]
    spread = {n: (max(v) - min(v)) / min(v) if min(v) > 0 else 0.0 for n, v in round_step.items()}
    return {"rows": all_rows, "prefill_rows": prefill_rows, "ms": ms, "per_shape": per_shape,
            "round_step_ms": round_step, "spread": spread, "row_exact": exact, "fallback": fallback,
            "shapes": [asdict(s) for s in shapes], "cold": cold, "device": device, "exact_threads": threads,
            "version": VERSION}


# ---- choosing (pure) -------------------------------------------------------------------------------------

def cost_at(curve: dict, rows: int) -> float:
    """ms at `rows`, linearly interpolated between measured row counts (clamped at the ends)."""
    pts = sorted((int(r), float(v)) for r, v in curve.items())
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, v0), (r1, v1) in itertools.pairwise(pts):
        if rows <= r1:
            return v0 + (v1 - v0) * (rows - r0) / (r1 - r0)
    return pts[-1][1]


def step_score(curve: dict, verify_rows: int = VERIFY_ROWS) -> float:
    """(cost(1) + cost(verify_rows)) / 2: a plain decode step and a k = 8 verification, weighted alike."""
    return (cost_at(curve, 1) + cost_at(curve, verify_rows)) / 2


def fastest(scores: dict[str, float], eligible: list[str], band: float) -> tuple[str, list[str]]:
    """The first of PREFERENCE (then registry order) among the eligible candidates within `band` of the fastest,
    and that tied set: a difference inside the measurement's noise is no reason to differ from a machine that
    timed it the other way round."""
    best = min(scores[n] for n in eligible)
    tied = [n for n in eligible if scores[n] <= best * (1 + band)]
    order = list(dict.fromkeys([*PREFERENCE, *LINEARS]))
    return min(tied, key=lambda n: (order.index(n) if n in order else len(order), n)), tied


def choose(table: dict, verify_rows: int = VERIFY_ROWS) -> dict:
    """The step and prefill kernels for a timing table (see the module docstring for the rule)."""
    ms = table["ms"]
    if not ms:
        raise ValueError("empty timing table: no implementation could run every shape")
    order = [n for n in LINEARS if n in ms] + [n for n in ms if n not in LINEARS]
    exact = table.get("row_exact", {})
    step_score_ms = {n: step_score(ms[n], verify_rows) for n in order}
    step_eligible = [n for n in order if exact.get(n, {}).get("step")] or order
    prefill_eligible = [n for n in order if exact.get(n, {}).get("prefill")] or order
    spreads = [v for n, v in table.get("spread", {}).items() if n in step_eligible]
    band = max(TIE_BAND, statistics.median(spreads)) if spreads else TIE_BAND
    step, step_tied = fastest(step_score_ms, step_eligible, band)
    prefill_rows = int(table.get("prefill_rows") or max(int(r) for r in table["rows"]))
    prefill_cost = {n: cost_at(ms[n], prefill_rows) for n in order}
    prefill, prefill_tied = fastest(prefill_cost, prefill_eligible, band)
    return {
        "step": step,
        "prefill": prefill,
        "step_score_ms": step_score_ms,
        "step_eligible": step_eligible,
        "prefill_eligible": prefill_eligible,
        "tie_band": band,
        "step_tied": step_tied,
        "prefill_tied": prefill_tied,
        "row_exact": bool(exact.get(step, {}).get("step") and exact.get(prefill, {}).get("prefill")),
        "verify_rows": verify_rows,
        "verify_over_decode": {n: cost_at(ms[n], verify_rows) / cost_at(ms[n], 1) for n in order},
        "prefill_rows": prefill_rows,
        "prefill_ms": prefill_cost,
    }


# ---- cache -----------------------------------------------------------------------------------------------

def cache_key(p: dict, shapes: list[ProjShape], mode: str = "full") -> str:
    flags = sorted(k for k, v in p.get("flags", {}).items() if v)
    what = {"flags": flags, "cpu": p.get("cpu"), "torch": p.get("torch_version"),
            "threads": p.get("torch_threads"), "shapes": [asdict(s) for s in shapes]}
    if probe_device(p) != "cpu":  # CPU keys stay as they were
        what.update(device=probe_device(p), gpu=p.get("gpu"), capability=p.get("capability"))
    blob = json.dumps(what, sort_keys=True) + f"v{VERSION}"
    if mode != "full":  # a differently trimmed measurement is another table (full keys stay as they were)
        blob += mode
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_path(p: dict, shapes: list[ProjShape], mode: str = "full") -> Path:
    return Path(default_cache_dir()) / "kernels" / "autotune" / f"{cache_key(p, shapes, mode)}.json"


def fast_measure_kw(p: dict) -> dict:
    """measure() arguments of the load-time tuning (see the module docstring)."""
    return {"names": load_candidates(p), "rows": FAST_ROWS, "samples": FAST_SAMPLES, "max_n": FAST_MAX_N,
            "prefill_samples": 1}


@contextlib.contextmanager
def tuning_lock(path: Path, progress: bool = True):
    """Hold `path`.lock (one tuner per cache entry, across processes); while another process holds it, wait,
    saying every LOCK_REPORT_S who holds it. The OS drops the lock when its holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_suffix(".lock")
    with open(lock, "a+") as f:
        t0, said = time.monotonic(), 0.0
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                if progress and waited - said >= LOCK_REPORT_S:
                    f.seek(0)
                    holder = f.read().strip() or "another process"
                    print(f"draftwise: waiting {waited:.0f}s for {holder} tuning kernels for these shapes "
                          f"({lock})", file=sys.stderr, flush=True)
                    said = waited
                time.sleep(0.1)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path) -> dict | None:
    try:
        result = json.loads(path.read_text())
        result["table"]["ms"] = {n: {int(r): v for r, v in c.items()} for n, c in result["table"]["ms"].items()}
        return {**result, "cached": True}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or a damaged entry: measure again


def autotune(shapes: list[ProjShape], refresh: bool = False, progress: bool = True, fast: bool = False,
             device: str = "cpu", **measure_kw) -> dict:
    """The cached result for these shapes on this machine (`device`: its CPU, or its CUDA device), measuring (and
    caching) it first if needed, under the entry's lock; a `provisional` entry is measured again when this start
    finds the machine quiet. `fast`: the trimmed load-time tuning; `refresh`: measure again regardless. Returns
    {"key", "probe", "table", "choice", "busy_before" / "busy_cores" (other processes' busy cores before and
    while it was timed), "provisional", "measured_at" (UTC), "cached" (read from the cache)}."""
    p = run_probe(device)
    if fast:
        measure_kw = {**fast_measure_kw(p), **measure_kw}
    mode = "full" if not fast else json.dumps({k: measure_kw[k] for k in sorted(measure_kw)}, default=str)
    path = cache_path(p, shapes, mode)
    if not refresh:
        cached = _read(path)
        if cached is not None and not cached.get("provisional"):
            return cached  # the common case: no lock, no waiting (entries are replaced atomically)
    with tuning_lock(path, progress):
        cached = None if refresh else _read(path)  # what a process we waited for wrote
        if cached is not None and not cached.get("provisional"):
            return cached
        cpu = device == "cpu"  # a GPU's timings are the device's own (CUDA events): the host's load is not theirs
        before = busy_now() if cpu else None
        if cached is not None and is_busy(before):
            return cached  # still busy: keep using the provisional plan; a quiet start re-tunes it
        others = busy_meter()
        table = measure(shapes, progress=progress, device=device, **measure_kw)
        during = others() if cpu else None
        result = {"key": path.stem, "probe": p, "table": table, "choice": choose(table), "busy_before": before,
                  "busy_cores": during, "provisional": is_busy(before) or is_busy(during),
                  "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(json.dumps(result, indent=1))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return {**result, "cached": False}


# ---- printing --------------------------------------------------------------------------------------------

def format_table(table: dict, choice: dict | None = None, p: dict | None = None) -> str:
    """ms per forward's projections by rows for each implementation, the ratio vs 1 row, and the choice."""
    rows = [int(r) for r in table["rows"]]
    ms = table["ms"]
    exact = table.get("row_exact", {})
    w = max([len(n) for n in ms] + [10])
    head = f"{'kernel':<{w}} " + " ".join(f"{'M=' + str(r):>8}" for r in rows) + f" {'M=9/M=1':>8} {'rows-exact':>10}"
    lines = []
    if p is not None and probe_device(p) != "cpu":
        lines.append(format_probe(p))
    elif p is not None:
        lines.append(f"flags: {flag_summary(p)}; torch {p.get('torch_version')}, {p.get('torch_threads')} threads")
    lines += [head, "-" * len(head)]
    for n, c in ms.items():
        ratio = cost_at(c, VERIFY_ROWS) / cost_at(c, 1)
        mark = ("  <- step" if choice and choice["step"] == n else "") + (
            "  <- prefill" if choice and choice["prefill"] == n else "")
        lines.append(f"{n:<{w}} " + " ".join(f"{c[r]:8.2f}" for r in rows) +
                     f" {ratio:8.2f} {_exact_mark(exact.get(n, {})):>10}{mark}")
    lines.append("ratios vs M=1:")
    for n, c in ms.items():
        lines.append(f"{n:<{w}} " + " ".join(f"{c[r] / c[rows[0]]:8.2f}" for r in rows))
    for n, e in exact.items():
        for kind, why in (e.get("why") or {}).items():
            lines.append(f"{n}: not row-exact at the {kind} widths ({why})")
    if choice:
        tied = [n for n in choice.get("step_tied", []) if n != choice["step"]]
        if tied:
            lines.append(f"tied with the step kernel within {choice['tie_band']:.0%} (the fixed preference order "
                         f"decides): {', '.join(tied)}")
        lines.append(f"step kernel: {choice['step']} (score (cost(1) + cost({choice['verify_rows']})) / 2 = "
                     f"{choice['step_score_ms'][choice['step']]:.2f} ms); prefill kernel: {choice['prefill']} "
                     f"({choice['prefill_ms'][choice['prefill']]:.2f} ms at {choice['prefill_rows']} rows)")
    return "\n".join(lines)


def _exact_mark(e: dict) -> str:
    """"yes", "no", or which of the step / prefill widths the rows held at."""
    if e.get("step") and e.get("prefill"):
        return "yes"
    return "step" if e.get("step") else "prefill" if e.get("prefill") else "no"

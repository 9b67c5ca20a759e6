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
    linearly interpolated between the measured 8 and 16 rows. Only implementations whose rows were found
    bitwise independent of the other rows in the call, on every projection shape, are eligible (a row-dependent
    kernel can change a greedy token when the verification batch differs from a plain step); if none is, every
    one is.
  * prefill kernel: the lowest cost at the prefill chunk width (default 128 rows) among the row-exact
    implementations too (a batched prefill of several prompts must equal each prompt's own prefill); if none
    is, every one is.
  Costs are the sum over the model's projections (count x per-call ms), ties broken by LINEARS order. A projection
  an implementation cannot take (`supports` False: e.g. torch int4 and an LM head of N % 16 != 0) costs what the
  model built with it runs there instead, the dense implementation of its activation dtype (linear.dense_for),
  and that one's row-exactness counts too (table["fallback"] lists such projections).

Load-time tuning (`autotune(shapes, fast=True)`, what `weights="auto"` runs on a model's first load): only the
candidates that can plausibly win here (`load_candidates`: q4x8 when it builds, torch int4, dense bf16 only with
native bf16, dense fp32), rows 1, 9 and 128, 3 samples, the LM head timed on its first FAST_MAX_N rows. A few
seconds per model; the result is cached like any other (the key includes the candidates and rows).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftwise.kernels.linear import LINEARS, available, dense_for, probe_device
from draftwise.kernels.probe import cuda_probe, cuda_seconds, flag_summary, format_probe
from draftwise.kernels.probe import probe as cpu_probe
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


def row_independent(module, K: int, seed: int = 0, device: str = "cpu") -> bool:
    """Is row 0's output bitwise the same alone, among 9 rows and among 16 rows (the others random)?"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, K, generator=g).to(device)  # [16, K]
    with torch.inference_mode():
        alone = module(x[:1].clone())
        return all(torch.equal(alone[0], module(x[:m].clone())[0]) for m in (2, 9, 16))


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
            prefill_samples: int = 3, device: str = "cpu") -> dict:
    """Time each implementation on each shape for each row count. Returns a JSON-able table:
    {"rows": [...], "ms": {impl: {rows: total ms over the model's projections}}, "per_shape": {impl: {shape:
    {rows: ms per call}}}, "row_independent": {impl: bool}, "shapes": [...]}. `registry` (name -> LinearImpl
    class, default LINEARS) lets benchmarks add variants such as a forced ISA path; `clock` see _time_calls;
    `device` where the weights and activations live ("cpu" or "cuda")."""
    from tqdm import tqdm

    p = run_probe(device)
    registry = registry or LINEARS
    names = [n for n in (names or available(p)) if n in registry]
    all_rows = sorted(set(rows) | ({prefill_rows} if prefill_rows else set()))
    gen = torch.Generator().manual_seed(seed)
    per_shape: dict[str, dict[str, dict[int, float]]] = {n: {} for n in names}
    indep: dict[str, bool] = {}
    fallback: dict[str, list[str]] = {}
    bar = tqdm(total=len(names) * len(shapes), desc="timing kernels", unit="shape", disable=not progress,
               file=sys.stderr, leave=False)
    for shape in shapes:
        n_eff = min(shape.N, max_n)
        weight = (torch.randn(n_eff, shape.K, generator=gen) / shape.K ** 0.5).to(device)  # [N', K]
        xs = {r: torch.randn(r, shape.K, generator=gen).to(device) for r in all_rows}  # x [r, K]
        for name in names:
            bar.set_postfix_str(f"{name} {shape.name}")
            cls = registry[name]
            if not cls.supports(shape.N, shape.K) or not cls.supports(n_eff, shape.K):
                cls = LINEARS[dense_for(cls.dtype)]  # what a model built with `name` runs here instead
                fallback.setdefault(name, []).append(shape.name)
            mod = cls(weight)
            if indep.get(name, True):  # every shape: a GPU library may pick its GEMM kernel by N and K too
                indep[name] = row_independent(mod, shape.K, device=device)
            scale = shape.N / n_eff
            # prefill widths are compute-bound: a few calls are enough there
            per_shape[name][shape.name] = {
                r: _time_calls(mod, xs[r], samples if r <= 16 else prefill_samples, cold, clock, warm_up=i == 0) * scale
                for i, r in enumerate(all_rows)}
            del mod
            bar.update(1)
    bar.close()
    ms = {name: {r: sum(per_shape[name][s.name][r] * s.count for s in shapes) for r in all_rows} for name in names}
    return {"rows": all_rows, "prefill_rows": prefill_rows, "ms": ms, "per_shape": per_shape,
            "row_independent": indep, "fallback": fallback, "shapes": [asdict(s) for s in shapes], "cold": cold,
            "device": device}


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


def choose(table: dict, verify_rows: int = VERIFY_ROWS) -> dict:
    """The step and prefill kernels for a timing table (see the module docstring for the rule)."""
    ms = table["ms"]
    if not ms:
        raise ValueError("empty timing table: no implementation could run every shape")
    order = [n for n in LINEARS if n in ms] + [n for n in ms if n not in LINEARS]
    indep = table.get("row_independent", {})
    step_score = {n: (cost_at(ms[n], 1) + cost_at(ms[n], verify_rows)) / 2 for n in order}
    eligible = [n for n in order if indep.get(n, False)] or order
    step = min(eligible, key=lambda n: (step_score[n], order.index(n)))
    prefill_rows = int(table.get("prefill_rows") or max(int(r) for r in table["rows"]))
    prefill_cost = {n: cost_at(ms[n], prefill_rows) for n in order}
    prefill = min(eligible, key=lambda n: (prefill_cost[n], order.index(n)))
    return {
        "step": step,
        "prefill": prefill,
        "step_score_ms": step_score,
        "step_eligible": eligible,
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
    blob = json.dumps(what, sort_keys=True)
    if mode != "full":  # a differently trimmed measurement is another table (full keys stay as they were)
        blob += mode
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_path(p: dict, shapes: list[ProjShape], mode: str = "full") -> Path:
    return Path(default_cache_dir()) / "kernels" / "autotune" / f"{cache_key(p, shapes, mode)}.json"


def fast_measure_kw(p: dict) -> dict:
    """measure() arguments of the load-time tuning (see the module docstring)."""
    return {"names": load_candidates(p), "rows": FAST_ROWS, "samples": FAST_SAMPLES, "max_n": FAST_MAX_N,
            "prefill_samples": 1}


def busy_meter():
    """Start measuring how many cores OTHER processes keep busy; the returned function gives the mean since the
    start (None where /proc cannot say). A timing taken while they did is slower than this machine is."""
    from draftwise.kernels.threads import clock_ticks, others_busy, our_cpus, read_proc

    cpus = our_cpus()
    t0, first = time.monotonic(), read_proc(cpus)

    def others() -> float | None:
        last, dt = read_proc(cpus), time.monotonic() - t0
        if first is None or last is None or dt <= 0:
            return None
        return round(others_busy(first, last, dt, clock_ticks()), 2)

    return others


def autotune(shapes: list[ProjShape], refresh: bool = False, progress: bool = True, fast: bool = False,
             device: str = "cpu", **measure_kw) -> dict:
    """The cached result for these shapes on this machine (`device`: its CPU, or its CUDA device), measuring (and
    caching) it first if needed. `fast`: the trimmed load-time tuning. Returns {"key", "probe", "table", "choice",
    "busy_cores" (other processes' busy cores while it was timed), "cached" (read from the cache)}."""
    p = run_probe(device)
    if fast:
        measure_kw = {**fast_measure_kw(p), **measure_kw}
    mode = "full" if not fast else json.dumps({k: measure_kw[k] for k in sorted(measure_kw)}, default=str)
    path = cache_path(p, shapes, mode)
    if path.exists() and not refresh:
        try:
            result = json.loads(path.read_text())
            result["table"]["ms"] = {n: {int(r): v for r, v in c.items()} for n, c in result["table"]["ms"].items()}
            return {**result, "cached": True}
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry: measure again
    others = busy_meter()
    table = measure(shapes, progress=progress, device=device, **measure_kw)
    result = {"key": path.stem, "probe": p, "table": table, "choice": choose(table), "busy_cores": others()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(result, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return result


# ---- printing --------------------------------------------------------------------------------------------

def format_table(table: dict, choice: dict | None = None, p: dict | None = None) -> str:
    """ms per forward's projections by rows for each implementation, the ratio vs 1 row, and the choice."""
    rows = [int(r) for r in table["rows"]]
    ms = table["ms"]
    indep = table.get("row_independent", {})
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
                     f" {ratio:8.2f} {('yes' if indep.get(n) else 'no'):>10}{mark}")
    lines.append("ratios vs M=1:")
    for n, c in ms.items():
        lines.append(f"{n:<{w}} " + " ".join(f"{c[r] / c[rows[0]]:8.2f}" for r in rows))
    if choice:
        lines.append(f"step kernel: {choice['step']} (score (cost(1) + cost({choice['verify_rows']})) / 2 = "
                     f"{choice['step_score_ms'][choice['step']]:.2f} ms); prefill kernel: {choice['prefill']} "
                     f"({choice['prefill_ms'][choice['prefill']]:.2f} ms at {choice['prefill_rows']} rows)")
    return "\n".join(lines)

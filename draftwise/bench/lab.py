"""The benchmark, end to end: plan → run (journaled) → analyze → quality → verdicts → report files.

Owns the order of those steps and the options that reach each one; the CLI builds a client and BenchOptions,
tests pass a fake client. Knows nothing of argparse or of how a client produces its timings.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftwise.bench import analyze as analyze_mod
from draftwise.bench import quality as quality_mod
from draftwise.bench import report as report_mod
from draftwise.bench import runner
from draftwise.bench.clients import Condition
from draftwise.bench.verdict import across_engines, decide
from draftwise.bench.workloads import Workload, select
from draftwise.config import ConfigError


@dataclass
class BenchOptions:
    workloads: list[Workload]
    conditions: list[Condition]
    out_dir: Path
    warmup: int = 5
    requests: int = 30
    concurrency: list[int] | None = None
    sampling: runner.Sampling = field(default_factory=runner.Sampling)
    watts: float | None = None
    price_per_kwh: float | None = None
    fresh: bool = False
    progress: bool = True
    plots: bool = True
    humaneval: bool = True
    humaneval_timeout_s: float = 5.0


# grammar+X: the grammar's forced tokens first, then X fills the rest of k (structured outputs)
METHODS = ("ngram", "draft_model", "grammar", "grammar+ngram", "grammar+draft_model", "suffix", "suffix-chain")


def conditions_from(methods: list[str], k_values: list[int | str], draft: str | None,
                    engine: str | None = None, draft_weights: list[str] | None = None) -> list[Condition]:
    """methods × k (× the draft's plans, for a method with a draft model, when `draft_weights` names more than
    one), with `none` once (k = 0) and first: the baseline every other condition is paired with.
    `engine`: None for draftwise's own, "vllm" for vLLM's (ids `vllm:...`, paired with `vllm:none`)."""
    conds = [Condition("none", 0, engine=engine)] if "none" in methods else []
    for m in methods:
        if m == "none":
            continue
        if m not in METHODS:
            raise ConfigError(f"--methods: unknown method {m!r} ({', '.join(('none',) + METHODS)})")
        plans = draft_weights if "draft_model" in m and draft_weights and len(draft_weights) > 1 else [None]
        conds += [Condition(m, k, draft if "draft_model" in m else None, engine=engine, draft_weights=w)
                  for k in k_values for w in plans]
    if not conds:
        raise ConfigError("--methods selects no condition")
    return conds


def run_bench(client, opts: BenchOptions) -> dict:
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = runner.build_plan(opts.workloads, opts.conditions, opts.warmup, opts.requests, opts.concurrency)
    if getattr(client, "condition_major", False):
        plan = condition_major(plan)
    protocol = runner.protocol_dict(opts.workloads, opts.conditions, opts.warmup, opts.requests, opts.concurrency,
                                    opts.sampling, target=getattr(client, "identity", lambda: {})())
    key = runner.check_protocol(out, protocol, opts.fresh)
    wl = {w.name: w for w in opts.workloads}
    try:
        records = runner.run(client, plan, wl, opts.sampling, out, opts.progress, protocol_key=key)
    finally:
        if hasattr(client, "close"):
            client.close()  # a vLLM server stops here
    analysis = analyze_mod.analyze(records, opts.watts, opts.price_per_kwh, seed=opts.sampling.seed)
    quality = quality_by_segment(records, opts)
    verdicts = {seg: decide(a["speedups"], quality.get(seg, {}).get("identical")) for seg, a in analysis.items()}
    for seg, a in analysis.items():
        cross = across_engines(a["speedups"], a.get("across") or {})
        if cross:
            verdicts[seg] = dict(verdicts[seg], across=cross, text=verdicts[seg]["text"] + " | " + cross["text"])
    planned = {runner.segment_id(w.name, g, c): len(items) for w in opts.workloads
               for c in (opts.concurrency or list(w.concurrency)) for g, items in select(w, opts.requests).items()}
    devs = report_mod.deviations(opts.warmup, opts.requests, planned, asdict(opts.sampling))
    if any(c.engine for c in opts.conditions):
        devs.append("each vLLM condition ran on its own server, one condition after another (not interleaved "
                    "batch by batch): machine drift between them is not spread evenly")
    from draftwise.kernels.probe import probe

    manifest = {"versions": report_mod.versions(), "hardware": {**report_mod.hardware(), "probe": probe()},
                "client": client.manifest(),
                "sampling": asdict(opts.sampling), "seeds": {"base": opts.sampling.seed,
                                                           "per_item": "base + crc32(item_id)",
                                                           "bootstrap": opts.sampling.seed},
                "workloads": {w.name: {"source": w.source, "max_tokens": w.max_tokens,
                                       "concurrency": opts.concurrency or list(w.concurrency)} for w in opts.workloads},
                "energy": {"watts": opts.watts, "price_per_kwh": opts.price_per_kwh}}
    rep = report_mod.build(analysis, verdicts, quality, manifest, protocol, devs)
    report_mod.write(rep, out, opts.plots)
    return rep


def condition_major(plan: list) -> list:
    """The plan with draftwise's batches first (interleaved, as planned) and then each other engine's condition's
    batches together, in the sweep's order: one vLLM server per condition, started once."""
    order: dict[str, int] = {}
    for b in plan:
        if b.condition.engine:
            order.setdefault(b.condition.id, len(order) + 1)
    return sorted(plan, key=lambda b: order.get(b.condition.id, 0))


def quality_by_segment(records: list[dict], opts: BenchOptions) -> dict:
    out: dict[str, dict] = {}
    segs = dict.fromkeys(r["segment"] for r in records if r["phase"] == "measured")
    for seg in segs:
        rs = [r for r in records if r["segment"] == seg]
        q = {}
        if opts.sampling.temperature == 0:
            q["identical"] = quality_mod.identical_share(rs)
        if opts.humaneval and any(r.get("task_id") for r in rs):
            q["pass_at_1"] = quality_mod.humaneval_pass_at_1(rs, opts.humaneval_timeout_s)
        constraints = {it.item_id: it.structured_outputs for w in opts.workloads for it in w.items
                       if it.structured_outputs and any(r["workload"] == w.name for r in rs)}
        if constraints:
            q["validity"] = quality_mod.validity(rs, constraints)
        out[seg] = q
    return out

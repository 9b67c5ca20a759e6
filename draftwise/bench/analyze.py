"""Analysis: journal records → per-segment, per-condition figures and paired speedups vs `none`
(a vLLM condition, `vllm:...`, vs `vllm:none`: each engine against its own plain decoding), and, where a segment
holds more than one engine, every other engine's conditions paired against draftwise's `none` too (`across`).

Owns the aggregation (docs/ARCHITECTURE.md, metric definitions): median and p95 of TTFT, E2E, TPOT and per-request
tok/s over measured requests; aggregate tok/s = all output tokens / the condition's wall time (sum of its
batches' walls); peak memory; speculation counters summed (per request when the client attributes them,
else per batch from the server's /metrics); speedup vs `none` paired per item with a bootstrap 95% CI.
A segment is one workload group at one concurrency. Knows nothing of how records were produced.
"""
from __future__ import annotations

from draftwise.bench import energy as energy_mod
from draftwise.bench import stats

BASELINE = "none"
METRICS = ("ttft_s", "e2e_s", "tpot_s", "tok_s")


def measured(records: list[dict]) -> list[dict]:
    return [r for r in records if r["phase"] == "measured"]


def engine_of(condition: str) -> str:
    """The engine a condition ran on: `draftwise` for bare names, else the prefix (`vllm:ngram-k4` -> `vllm`)."""
    engine, _, _ = condition.rpartition(":")
    return engine or "draftwise"


def baseline_of(condition: str) -> str:
    """The plain condition a condition is paired with: `none`, or its own engine's (`vllm:ngram-k4` -> `vllm:none`)."""
    engine, sep, _ = condition.rpartition(":")
    return f"{engine}{sep}{BASELINE}"


def analyze(records: list[dict], watts: float | None = None, price_per_kwh: float | None = None,
            seed: int = 0) -> dict:
    """{segment: {"conditions": {cond: figures}, "speedups": {cond: paired speedup}}}."""
    segs: dict[str, dict[str, list[dict]]] = {}
    for r in measured(records):
        segs.setdefault(r["segment"], {}).setdefault(r["condition"], []).append(r)
    out = {}
    for seg, by_cond in segs.items():
        conds = {c: condition_figures(rs, watts, price_per_kwh) for c, rs in by_cond.items()}
        speedups = {}
        for c, rs in by_cond.items():
            if baseline_of(c) in by_cond and c != baseline_of(c):
                base = by_cond[baseline_of(c)]
                speedups[c] = {"tok_s": stats.paired_speedup(_per_item(base, "tok_s"), _per_item(rs, "tok_s"), seed),
                               "e2e": stats.paired_speedup(_per_item(rs, "e2e_s"), _per_item(base, "e2e_s"), seed)}
        across = {}
        if len({engine_of(c) for c in by_cond}) > 1 and BASELINE in by_cond:
            ref = _per_item(by_cond[BASELINE], "tok_s")
            across = {c: stats.paired_speedup(ref, _per_item(rs, "tok_s"), seed)
                      for c, rs in by_cond.items() if engine_of(c) != "draftwise"}
        samples = {c: {m: [r.get(m) for r in rs if not r.get("error") and r.get(m) is not None] for m in ("e2e_s", "tok_s")}
                   for c, rs in by_cond.items()}
        out[seg] = {"conditions": conds, "speedups": speedups, "samples": samples, "across": across,
                    "concurrency": by_cond[next(iter(by_cond))][0]["concurrency"]}
    return out


def _per_item(recs: list[dict], metric: str) -> dict[str, float]:
    return {r["item_id"]: r[metric] for r in recs if not r.get("error") and r.get(metric)}


def condition_figures(recs: list[dict], watts=None, price_per_kwh=None) -> dict:
    ok = [r for r in recs if not r.get("error")]
    walls = {r["batch"]: r["batch_wall_s"] for r in recs}
    wall = sum(walls.values())
    tokens = sum(r["num_output_tokens"] for r in ok)
    fig = {m: stats.summarize([r.get(m) for r in ok]) for m in METRICS}
    fig.update(n=len(recs), errors=len(recs) - len(ok), output_tokens=tokens, wall_s=wall,
               aggregate_tok_s=tokens / wall if wall else None,
               tokens_estimated=any(r.get("tokens_estimated") for r in ok),
               spec=spec_totals(ok), memory=peak_memory(recs),
               energy=energy_mod.energy(watts, wall, len(ok), tokens, price_per_kwh))
    return fig


def spec_totals(recs: list[dict]) -> dict | None:
    """Sum the counters: per-request `spec` when present, else each batch's `batch_spec` once."""
    parts = [r["spec"] for r in recs if r.get("spec")]
    if not parts:
        seen = {}
        for r in recs:
            if r.get("batch_spec") is not None:
                seen[r["batch"]] = r["batch_spec"]
        parts = list(seen.values())
    if not parts:
        return None
    width = max(len(p.get("accepted_per_position") or []) for p in parts)
    per_pos = [0] * width
    for p in parts:
        for i, a in enumerate(p.get("accepted_per_position") or []):
            per_pos[i] += a
    total = {k: sum(int(p.get(k, 0)) for p in parts) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                                 "num_forced_tokens", "num_accepted_forced_tokens")}
    out = stats.spec_summary(total["num_drafts"], total["num_draft_tokens"], total["num_accepted_tokens"], per_pos)
    # structured outputs: the grammar's forced tokens, and the share of output tokens that were accepted forced ones
    n_out = sum(r.get("num_output_tokens") or 0 for r in recs if r.get("spec"))
    out.update(num_forced_tokens=total["num_forced_tokens"], num_accepted_forced_tokens=total["num_accepted_forced_tokens"],
               forced_share=total["num_accepted_forced_tokens"] / n_out if n_out else None,
               mask_time_s=sum(float(p.get("mask_time_s") or 0.0) for p in parts))
    return out


def peak_memory(recs: list[dict]) -> dict:
    out: dict[str, float] = {}
    for r in recs:
        for k, v in (r.get("memory") or {}).items():
            if isinstance(v, (int, float)):
                out[k] = max(v, out.get(k, 0))
        if r.get("server_rss_bytes"):
            out["server_rss_bytes"] = max(r["server_rss_bytes"], out.get("server_rss_bytes", 0))
    return out

"""What `draftwise tune` decides after sweeping methods × num_speculative_tokens (× the draft's plans, given
`--draft-weights auto,faithful`) on a workload: a conservative winner.

Owns the choice rule: per condition, the per-prompt paired tok/s speedups vs `none`; score = median − MAD
(a winner must win on a typical prompt, not through a few lucky ones); the winner is the best score above
1.0 whose bootstrap CI also excludes 1.0, else plain decoding; the winner as our `--speculative-config` and
as a `vllm serve ... --speculative-config '...'` line (hub ids from the catalog; the keys through bench/vllm.py's
translation table).
Where the sweep ran several concurrency levels, `pays_up_to_concurrency`: the same rule per level (the winner's
per-prompt speedups pooled over the segments of that level), the highest level up to which every level pays;
the recommendation carries it (tune.json, and the printed configuration).
The sweep itself is an ordinary journaled bench run (lab.py); the `tune` command lives in bench/cli.py.
Knows nothing of models.
"""
from __future__ import annotations

import json

from draftwise.bench import stats
from draftwise.config import ConfigError


def choose(report: dict) -> dict:
    """Pool every segment's per-prompt speedups by condition and pick the conservative winner."""
    pooled: dict[str, list[float]] = {}
    ci: dict[str, tuple] = {}
    for seg in report["segments"].values():
        for cond, sp in seg["speedups"].items():
            pooled.setdefault(cond, []).extend(sp["tok_s"]["per_prompt"].values())
    scores = {}
    for cond, ratios in pooled.items():
        scores[cond] = {"score": stats.conservative_score(ratios), "median": stats.median(ratios),
                        "mad": stats.mad(ratios), "n": len(ratios)}
        ci[cond] = stats.bootstrap_ci(ratios)
        scores[cond]["ci_low"], scores[cond]["ci_high"] = ci[cond]
    ok = {c: s for c, s in scores.items() if s["score"] is not None and s["score"] > 1.0 and (s["ci_low"] or 0) > 1.0}
    winner = max(ok, key=lambda c: ok[c]["score"]) if ok else "none"
    return {"winner": winner, "scores": scores}


def pays_up_to_concurrency(report: dict, condition: str) -> int | None:
    """The highest concurrency up to which `condition` wins at every level measured (median - MAD > 1 and the
    bootstrap CI above 1.0, as `choose`); None where it does not pay at the lowest level (or nothing was paired)."""
    from draftwise.bench.verdict import split_segment

    by_level: dict[int, list[float]] = {}
    for name, seg in report["segments"].items():
        level = split_segment(name)[1]
        sp = seg["speedups"].get(condition)
        if level is not None and sp:
            by_level.setdefault(level, []).extend(sp["tok_s"]["per_prompt"].values())
    best = None
    for level in sorted(by_level):
        ratios = by_level[level]
        score, (low, _) = stats.conservative_score(ratios), stats.bootstrap_ci(ratios)
        if score is None or score <= 1.0 or (low or 0) <= 1.0:
            break
        best = level
    return best


def spec_config_for(cond: dict | None) -> dict | None:
    """cond: the Condition dict from protocol.json."""
    if not cond or cond["method"] == "none":
        return None
    from draftwise.bench.clients import Condition

    return Condition(cond["method"], cond["k"], cond.get("draft"),  # grammar+X: X in "then"
                     draft_weights=cond.get("draft_weights")).spec_config()


def hub_id(name: str | None) -> str | None:
    from draftwise.models.catalog import CATALOG

    return CATALOG[name].hub_id if name in CATALOG else name


def vllm_line(target: str, spec_config: dict | None) -> str:
    """The winner as a `vllm serve` hint for a draftwise tune: hub ids, our keys through the one translation table
    (bench/vllm.py); what vLLM has no equivalent for becomes a comment. `tune --engine vllm` prints instead the
    command its winning server ran."""
    from draftwise.bench.vllm import to_vllm

    line = f"vllm serve {hub_id(target)}"
    try:
        s = to_vllm(spec_config, hub_id)
    except ConfigError as e:
        return f"{line}  # {e}"
    return line + (f" --speculative-config '{json.dumps(s)}'" if s else "")

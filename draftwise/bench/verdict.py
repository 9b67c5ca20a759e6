"""The verdict: one sentence per segment from the paired speedups' confidence intervals.

Owns the decision rule (docs/ARCHITECTURE.md: a verdict needs a CI that excludes 1.0×):
  - some condition's 95% CI of the paired tok/s speedup lies wholly above 1 → "speculate with X", X being the
    one with the highest lower bound (the conservative pick, not the highest point estimate);
  - every condition's CI lies wholly below 1 → "don't speculate";
  - otherwise → "no measurable difference".
Greedy outputs that differ from `none` are attached as a caveat. Across concurrency levels (one segment per
level), `pays_up_to` says up to which concurrency the verdicts say speculate, every level below included. Where several engines ran, `across` names the
fastest engine and configuration by the same conservative rule over tok/s paired against draftwise's plain decoding
(each engine's own verdict above says whether speculation pays on that engine; this one says which engine to run).
Knows nothing of records or formats.
"""
from __future__ import annotations

MIN_PAIRS = 3
RELIABLE_PAIRS = 10  # below this the percentile bootstrap undercovers (Efron & Tibshirani 1993, ch. 13)


def decide(speedups: dict[str, dict], identical: dict[str, dict] | None = None) -> dict:
    """speedups: {condition: analyze's {"tok_s": paired_speedup, ...}} for one segment."""
    s = {c: v["tok_s"] for c, v in speedups.items() if v["tok_s"]["n"] >= MIN_PAIRS and v["tok_s"]["ci_low"]}
    if not s:
        return {"decision": "not enough data", "text": f"not enough paired requests (need >= {MIN_PAIRS} per condition)"}
    above = {c: v for c, v in s.items() if v["ci_low"] > 1.0}
    if above:
        best = max(above, key=lambda c: above[c]["ci_low"])
        v = above[best]
        out = {"decision": "speculate", "condition": best,
               "text": f"speculate with {best}: {v['speedup']:.2f}x tok/s (95% CI {v['ci_low']:.2f}-{v['ci_high']:.2f})"}
    elif all(v["ci_high"] < 1.0 for v in s.values()):
        best = max(s, key=lambda c: s[c]["speedup"])
        v = s[best]
        out = {"decision": "don't", "condition": best,
               "text": f"don't speculate: even the best, {best}, is slower at {v['speedup']:.2f}x "
                       f"(95% CI {v['ci_low']:.2f}-{v['ci_high']:.2f})"}
    else:  # the condition named is one whose CI holds 1.0 (the best of those): a faster one may lie wholly below 1
        holds = {c: v for c, v in s.items() if v["ci_high"] >= 1.0}
        best = max(holds, key=lambda c: holds[c]["speedup"])
        v = s[best]
        out = {"decision": "no measurable difference", "condition": best,
               "text": f"no measurable difference: best {best} at {v['speedup']:.2f}x, 95% CI "
                       f"{v['ci_low']:.2f}-{v['ci_high']:.2f} includes 1.0x"}
    n = s[out["condition"]]["n"]
    if n < RELIABLE_PAIRS:
        out["text"] += f" [only {n} paired prompts: a bootstrap interval this small is indicative, not reliable]"
    q = (identical or {}).get(out.get("condition"))
    if q and q.get("share") is not None and q["share"] < 1.0:
        from draftwise.bench.analyze import baseline_of

        out["caveat"] = f"{q['n'] - q['identical']} of {q['n']} greedy outputs differ from {baseline_of(out['condition'])}"
        out["text"] += f" (caveat: {out['caveat']})"
    return out


def across_engines(speedups: dict[str, dict], across: dict[str, dict]) -> dict | None:
    """speedups: draftwise's conditions vs `none`; across: other engines' conditions vs `none` (paired tok/s).

    The pick is the highest CI lower bound, `none` itself counting as exactly 1.0x; every other engine's best
    condition is quoted beside it so the user sees the gap."""
    if not across:
        return None
    s = {c: v["tok_s"] for c, v in speedups.items() if v["tok_s"]["n"] >= MIN_PAIRS and v["tok_s"]["ci_low"]}
    s.update({c: v for c, v in across.items() if v["n"] >= MIN_PAIRS and v["ci_low"]})
    if not s:
        return None
    from draftwise.bench.analyze import BASELINE, engine_of

    lows = {c: v["ci_low"] for c, v in s.items()}
    lows.setdefault(BASELINE, 1.0)
    best = max(lows, key=lows.get)

    def quote(c: str) -> str:
        if c == BASELINE:
            return f"{c} (draftwise plain, 1.00x)"
        v = s[c]
        return f"{c} at {v['speedup']:.2f}x draftwise plain (95% CI {v['ci_low']:.2f}-{v['ci_high']:.2f})"

    others = {}
    for c in lows:
        e = engine_of(c)
        if e != engine_of(best) and (e not in others or lows[c] > lows[others[e]]):
            others[e] = c
    text = f"across engines, run {quote(best)}"
    if others:
        text += "; best of " + ", ".join(f"{e}: {quote(c)}" for e, c in sorted(others.items()))
    return {"condition": best, "engine": engine_of(best), "text": text}


def split_segment(segment: str) -> tuple[str, int | None]:
    """("code/repeated", 4) from "code/repeated@c4" (runner.segment_id); (segment, None) without a level."""
    name, at, level = segment.rpartition("@c")
    return (name, int(level)) if at and level.isdigit() else (segment, None)


def pays_up_to(levels: dict[int, dict | None]) -> int | None:
    """levels: concurrency -> that segment's verdict. The highest concurrency up to which every level's verdict
    is "speculate" (None: not even the lowest)."""
    best = None
    for c in sorted(levels):
        if (levels[c] or {}).get("decision") != "speculate":
            break
        best = c
    return best

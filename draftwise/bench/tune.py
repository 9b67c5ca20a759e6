"""`draftwise tune`: sweep methods × num_speculative_tokens on a workload and name a conservative winner.

Owns the choice rule: per condition, the per-prompt paired tok/s speedups vs `none`; score = median − MAD
(a winner must win on a typical prompt, not through a few lucky ones); the winner is the best score above
1.0 whose bootstrap CI also excludes 1.0, else plain decoding. Prints it as our `--speculative-config` and
as a `vllm serve ... --speculative-config '...'` line (vLLM's JSON keys; hub ids from the catalog).
The sweep itself is an ordinary journaled bench run (lab.py). Knows nothing of models.
"""
from __future__ import annotations

import json
from pathlib import Path

from draftwise.bench import stats


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


def spec_config_for(cond: dict | None) -> dict | None:
    """cond: the Condition dict from protocol.json."""
    if not cond or cond["method"] == "none":
        return None
    d = {"method": cond["method"], "num_speculative_tokens": cond["k"]}
    if cond["method"] == "draft_model":
        d["model"] = cond["draft"]
    return d


def hub_id(name: str | None) -> str | None:
    from draftwise.models.catalog import CATALOG

    return CATALOG[name].hub_id if name in CATALOG else name


def vllm_line(target: str, spec: dict | None) -> str:
    line = f"vllm serve {hub_id(target)}"
    if spec:
        s = dict(spec)
        if s.get("method") == "ngram":
            s.setdefault("prompt_lookup_max", 3)
            s.setdefault("prompt_lookup_min", 1)
        if "model" in s:
            s["model"] = hub_id(s["model"])
        line += f" --speculative-config '{json.dumps(s)}'"
    return line


def cmd_tune(args) -> int:
    from draftwise.bench import report as report_mod
    from draftwise.bench.cli import _ints, make_client, options_from_args
    from draftwise.bench.lab import conditions_from, run_bench

    conditions = conditions_from(["none"] + [m.strip() for m in args.methods.split(",") if m.strip() != "none"],
                                 _ints(args.num_speculative_tokens), args.draft)
    rep = run_bench(make_client(args, conditions), options_from_args(args, conditions))
    print(report_mod.text_table(rep))
    pick = choose(rep)
    by_id = {c.id: c for c in conditions}
    for cond, s in sorted(pick["scores"].items(), key=lambda kv: -(kv[1]["score"] or 0)):
        print(f"{cond:18s} median {s['median']:.3f}  MAD {s['mad']:.3f}  median-MAD {s['score']:.3f}  "
              f"95% CI {s['ci_low']:.2f}-{s['ci_high']:.2f}  n={s['n']}")
    w = by_id.get(pick["winner"])
    spec = spec_config_for(w.__dict__ if w else None)
    if spec:
        print(f"winner: {pick['winner']}")
        print(f"draftwise serve --model {args.model} --speculative-config '{json.dumps(spec)}'")
    else:
        print("winner: none — no condition beats plain decoding on a typical prompt; serve without speculation")
        print(f"draftwise serve --model {args.model}")
    print(vllm_line(args.model, spec))
    (Path(args.out) / "tune.json").write_text(json.dumps({**pick, "speculative_config": spec}, indent=1))
    print(json.dumps({"winner": pick["winner"], "speculative_config": spec, "vllm": vllm_line(args.model, spec)}))
    return 0


def register(sub, add_bench_args) -> None:
    p = sub.add_parser("tune", help="sweep methods x num_speculative_tokens; print the winner (also as vLLM)")
    add_bench_args(p)
    p.set_defaults(func=cmd_tune, methods="ngram,draft_model", num_speculative_tokens="1,2,3,4,5,6,8",
                   out="tune-out")

"""What `draftwise tune` decides after sweeping methods × num_speculative_tokens on a workload: a conservative winner.

Owns the choice rule: per condition, the per-prompt paired tok/s speedups vs `none`; score = median − MAD
(a winner must win on a typical prompt, not through a few lucky ones); the winner is the best score above
1.0 whose bootstrap CI also excludes 1.0, else plain decoding; the winner as our `--speculative-config` and
as a `vllm serve ... --speculative-config '...'` line (vLLM's JSON keys; hub ids from the catalog; method suffix with
vLLM's four suffix_decoding_* keys written out, our own suffix keys left out).
The sweep itself is an ordinary journaled bench run (lab.py); the `tune` command lives in bench/cli.py.
Knows nothing of models.
"""
from __future__ import annotations

import json

from draftwise.bench import stats
from draftwise.config import SpecConfig

# vLLM's suffix keys (its SpeculativeConfig), written out with our values (vLLM's defaults unless the config set them)
VLLM_SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")


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
    from draftwise.bench.clients import Condition

    return Condition(cond["method"], cond["k"], cond.get("draft")).spec_config()  # grammar+X: X in "then"


def hub_id(name: str | None) -> str | None:
    from draftwise.models.catalog import CATALOG

    return CATALOG[name].hub_id if name in CATALOG else name


def vllm_line(target: str, spec_config: dict | None) -> str:
    line = f"vllm serve {hub_id(target)}"
    if spec_config:
        s = dict(spec_config)
        if s.get("method") == "ngram":
            s.setdefault("prompt_lookup_max", 3)
            s.setdefault("prompt_lookup_min", 1)
        if "model" in s:
            s["model"] = hub_id(s["model"])
        if s.get("method") == "suffix":
            if s.pop("suffix_tree", True) is False:
                return line + "  # vLLM's suffix method always proposes trees: no chain-only equivalent"
            s.pop("suffix_cache_max_bytes", None)
            for key in VLLM_SUFFIX_KEYS:
                s.setdefault(key, getattr(SpecConfig(), key))
            if s.get("num_speculative_tokens") == "auto":  # vLLM's suffix sizes each step itself, up to this
                s["num_speculative_tokens"] = SpecConfig(method="suffix", num_speculative_tokens="auto").k_max
        if s.get("num_speculative_tokens") == "auto":  # draftwise's cost-model policy; vLLM takes a fixed k
            return line + "  # vLLM has no adaptive k: use the best fixed-k condition of the table instead"
        line += f" --speculative-config '{json.dumps(s)}'"
    return line

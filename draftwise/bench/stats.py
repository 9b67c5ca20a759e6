"""Statistics for the benchmark: pure functions on lists of floats, small enough to check by hand.

Owns the definitions the report uses: median, p95 (linear interpolation between closest ranks, numpy's
default, "type 7" in Hyndman & Fan 1996), MAD (unscaled median absolute deviation), the paired per-prompt
speedup (geometric mean of per-prompt ratios) with a percentile-bootstrap 95% interval over prompts
(Efron & Tibshirani 1993, ch. 13), and the speculation summary (acceptance rate = accepted / draft tokens,
mean acceptance length = 1 + accepted / drafts, as vLLM and Spec-Bench define them). Knows no records or files.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


def _clean(xs: Sequence[float | None]) -> np.ndarray:
    return np.asarray([x for x in xs if x is not None and math.isfinite(x)], dtype=np.float64)


def median(xs: Sequence[float | None]) -> float | None:
    a = _clean(xs)
    return float(np.median(a)) if a.size else None


def percentile(xs: Sequence[float | None], q: float) -> float | None:
    a = _clean(xs)
    return float(np.percentile(a, q)) if a.size else None


def p95(xs: Sequence[float | None]) -> float | None:
    return percentile(xs, 95)


def mad(xs: Sequence[float | None]) -> float | None:
    """Median absolute deviation from the median, unscaled: MAD([1, 2, 3, 4, 100]) = 1."""
    a = _clean(xs)
    if not a.size:
        return None
    return float(np.median(np.abs(a - np.median(a))))


def summarize(xs: Sequence[float | None]) -> dict:
    a = _clean(xs)
    return {"n": int(a.size), "median": median(a), "p95": p95(a), "mean": float(a.mean()) if a.size else None}


def geomean(xs: Sequence[float]) -> float | None:
    a = _clean(xs)
    a = a[a > 0]
    return float(np.exp(np.log(a).mean())) if a.size else None


def paired_ratios(baseline: dict[str, float], treatment: dict[str, float]) -> dict[str, float]:
    """treatment / baseline for each key present in both with positive values (paired on the same prompt)."""
    out = {}
    for key, b in baseline.items():
        t = treatment.get(key)
        if b is not None and t is not None and b > 0 and t > 0:
            out[key] = t / b
    return out


def bootstrap_ci(ratios: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, level: float = 0.95,
                 seed: int = 0) -> tuple[float | None, float | None]:
    """Percentile bootstrap interval of the geometric mean of paired ratios, resampling prompts."""
    logs = np.log(_clean(ratios))
    if logs.size == 0:
        return None, None
    if logs.size == 1:
        v = float(np.exp(logs[0]))
        return v, v
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, logs.size, size=(resamples, logs.size))
    means = logs[idx].mean(axis=1)
    lo, hi = np.percentile(means, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(np.exp(lo)), float(np.exp(hi))


def paired_speedup(baseline: dict[str, float], treatment: dict[str, float], seed: int = 0) -> dict:
    """Speedup of treatment over baseline on the prompts both ran: point estimate, 95% CI, median, MAD."""
    r = paired_ratios(baseline, treatment)
    vals = list(r.values())
    lo, hi = bootstrap_ci(vals, seed=seed)
    return {"n": len(vals), "speedup": geomean(vals), "ci_low": lo, "ci_high": hi,
            "median": median(vals), "mad": mad(vals), "per_prompt": r}


def conservative_score(ratios: Sequence[float]) -> float | None:
    """median − MAD of per-prompt speedups: the tuner's winner must win on a typical prompt, not on average."""
    m, d = median(ratios), mad(ratios)
    return None if m is None else m - d


def spec_summary(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                 accepted_per_position: Sequence[int] = ()) -> dict:
    """vLLM's spec-decode metrics, one vocabulary (docs/ARCHITECTURE.md): rate, mean acceptance length (tokens per
    drafted step), by position; and the mean draft size (guesses verified per drafted step: a tree's nodes)."""
    rate = num_accepted_tokens / num_draft_tokens if num_draft_tokens else None
    mal = 1 + num_accepted_tokens / num_drafts if num_drafts else None
    size = num_draft_tokens / num_drafts if num_drafts else None
    by_pos = [a / num_drafts for a in accepted_per_position] if num_drafts else []
    return {"num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens,
            "num_accepted_tokens": num_accepted_tokens, "accepted_per_position": list(accepted_per_position),
            "acceptance_rate": rate, "mean_acceptance_length": mal, "mean_draft_size": size,
            "acceptance_by_position": by_pos}

"""Bench statistics against hand-computed values: median, p95, MAD, geometric mean, paired speedup and its
bootstrap interval, the spec-decode summary, TPOT and energy."""
import pytest

from draftwise.bench import energy, stats
from draftwise.bench.runner import tpot
from draftwise.bench.verdict import decide


def test_median_p95_mad_by_hand():
    xs = [1, 2, 3, 4, 100]
    assert stats.median(xs) == 3
    # p95 by linear interpolation between closest ranks: rank 0.95 * (5 - 1) = 3.8 → 4 + 0.8 * (100 - 4)
    assert stats.p95(xs) == pytest.approx(80.8)
    assert stats.mad(xs) == 1  # |x - 3| = 2, 1, 0, 1, 97 → median 1
    assert stats.median([4, 1, 3, 2]) == 2.5
    assert stats.p95(list(range(1, 21))) == pytest.approx(19.05)  # rank 18.05 → 19 + 0.05
    assert stats.median([]) is None and stats.mad([None]) is None
    assert stats.summarize([2.0, None, 4.0]) == {"n": 2, "median": 3.0, "p95": 3.9, "mean": 3.0}


def test_paired_speedup_geometric_mean():
    base = {"a": 10.0, "b": 10.0, "c": 20.0, "d": 5.0}
    treat = {"a": 20.0, "b": 5.0, "c": 20.0, "e": 1.0}  # d and e unpaired → dropped
    r = stats.paired_ratios(base, treat)
    assert r == {"a": 2.0, "b": 0.5, "c": 1.0}
    s = stats.paired_speedup(base, treat)
    assert s["n"] == 3 and s["speedup"] == pytest.approx(1.0)  # (2 * 0.5 * 1) ** (1/3)
    assert s["median"] == 1.0 and s["mad"] == 0.5
    assert s["ci_low"] <= 1.0 <= s["ci_high"]


def test_bootstrap_ci_properties():
    assert stats.bootstrap_ci([1.5] * 10) == pytest.approx((1.5, 1.5))
    assert stats.bootstrap_ci([2.0]) == (2.0, 2.0)
    assert stats.bootstrap_ci([]) == (None, None)
    ratios = [1.1, 1.2, 1.15, 1.3, 1.05, 1.25, 1.18, 1.22]
    lo, hi = stats.bootstrap_ci(ratios, seed=3)
    g = stats.geomean(ratios)
    assert lo < g < hi and lo > 1.0 and hi <= max(ratios) and lo >= min(ratios)
    assert stats.bootstrap_ci(ratios, seed=3) == (lo, hi)  # seeded: reproducible
    # two points 1 and 4: every resample mean of logs lies in [0, log 4]; the 2.5/97.5% bounds hit the extremes
    lo2, hi2 = stats.bootstrap_ci([1.0, 4.0] * 1, resamples=4000)
    assert lo2 == pytest.approx(1.0) and hi2 == pytest.approx(4.0)


def test_conservative_score():
    assert stats.conservative_score([1.0, 1.2, 1.4, 1.6, 5.0]) == pytest.approx(1.4 - 0.2)


def test_spec_summary_vllm_definitions():
    s = stats.spec_summary(num_drafts=4, num_draft_tokens=16, num_accepted_tokens=6, accepted_per_position=[3, 2, 1, 0])
    assert s["acceptance_rate"] == 6 / 16
    assert s["mean_acceptance_length"] == 1 + 6 / 4
    assert s["acceptance_by_position"] == [0.75, 0.5, 0.25, 0.0]
    assert stats.spec_summary(0, 0, 0)["acceptance_rate"] is None


def test_tpot_and_energy():
    assert tpot(2.0, 0.5, 16) == pytest.approx(0.1)
    assert tpot(2.0, 0.5, 1) is None
    e = energy.energy(watts=100, wall_s=36, num_requests=4, num_output_tokens=2000, price_per_kwh=0.5)
    assert e["joules"] == 3600 and e["joules_per_request"] == 900 and e["joules_per_1k_tokens"] == 1800
    assert e["cost_per_request"] == pytest.approx(0.001 * 0.5 / 4)  # 3600 J = 1 Wh = 0.001 kWh
    assert e["cost_per_1k_tokens"] == pytest.approx(0.001 * 0.5 / 2)
    assert energy.energy(None, 10, 1, 1) is None


def _sp(lo, mid, hi, n=10):
    return {"tok_s": {"n": n, "speedup": mid, "ci_low": lo, "ci_high": hi}}


def test_verdict_rules():
    v = decide({"ngram-k2": _sp(1.05, 1.2, 1.3), "ngram-k4": _sp(1.1, 1.15, 1.2), "draft-k4": _sp(0.8, 0.9, 0.95)})
    assert v["decision"] == "speculate" and v["condition"] == "ngram-k4"  # highest lower bound, not highest point
    assert decide({"a": _sp(0.7, 0.8, 0.9), "b": _sp(0.5, 0.6, 0.99)})["decision"] == "don't"
    assert decide({"a": _sp(0.9, 1.05, 1.2), "b": _sp(0.5, 0.6, 0.7)})["decision"] == "no measurable difference"
    # the CI it quotes as holding 1.0 does: the faster "a" lies wholly below 1, "b" holds it
    v = decide({"a": _sp(0.88, 0.92, 0.97), "b": _sp(0.7, 0.9, 1.1)})
    assert v["decision"] == "no measurable difference" and v["condition"] == "b" and "0.70-1.10 includes" in v["text"]
    assert decide({"a": _sp(1.0, 1.0, 1.0, n=1)})["decision"] == "not enough data"
    v = decide({"a": _sp(1.1, 1.2, 1.3)}, {"a": {"n": 10, "identical": 9, "share": 0.9}})
    assert "1 of 10 greedy outputs differ" in v["text"]
    assert v["condition"] == "a"

"""Concurrency levels in one table (bench) and up to which level speculation pays (bench's verdicts, tune's rule),
on hand-built reports: no models, no timing."""
from draftwise.bench import report, tune, verdict


def _seg(agg: dict[str, float], per_prompt: dict[str, list[float]], decision: str) -> dict:
    return {"conditions": {c: {"aggregate_tok_s": a} for c, a in agg.items()},
            "speedups": {c: {"tok_s": {"per_prompt": dict(enumerate(v)), "speedup": sum(v) / len(v)}}
                         for c, v in per_prompt.items()},
            "verdict": {"decision": decision, "text": f"{decision} (planted)"}}


GAINS = [1.3, 1.25, 1.35, 1.3, 1.28, 1.32, 1.3, 1.27, 1.31, 1.29, 1.3, 1.33]
LOSSES = [0.8, 0.85, 0.82, 0.79, 0.81, 0.83, 0.8, 0.84, 0.82, 0.8, 0.81, 0.83]
REPORT = {"segments": {
    "code/repeated@c1": _seg({"none": 20.0, "ngram-auto": 26.0}, {"ngram-auto": GAINS}, "speculate"),
    "code/repeated@c2": _seg({"none": 35.0, "ngram-auto": 42.0}, {"ngram-auto": GAINS}, "speculate"),
    "code/repeated@c4": _seg({"none": 45.0, "ngram-auto": 38.0}, {"ngram-auto": LOSSES}, "don't"),
    "code/repeated@c8": _seg({"none": 50.0, "ngram-auto": 52.0}, {"ngram-auto": GAINS}, "speculate"),
    "chat@c1": _seg({"none": 20.0, "ngram-auto": 22.0}, {"ngram-auto": [1.12] * 12}, "speculate"),
}}


def test_pays_up_to_stops_at_the_first_level_that_does_not():
    levels = {c: REPORT["segments"][f"code/repeated@c{c}"]["verdict"] for c in (1, 2, 4, 8)}
    assert verdict.pays_up_to(levels) == 2  # c=8 pays again, but c=4 between does not
    assert verdict.pays_up_to({1: {"decision": "don't"}, 2: {"decision": "speculate"}}) is None
    assert verdict.split_segment("code/repeated@c4") == ("code/repeated", 4)
    assert verdict.split_segment("chat") == ("chat", None)


def test_one_table_per_workload_with_a_column_per_level():
    tables = report.concurrency_rows(REPORT)
    assert list(tables) == ["code/repeated by concurrency (aggregate tok/s over plain's; paired per-request speedup)"]
    rows = next(iter(tables.values()))
    assert rows[0] == ["condition", "c=1: agg x (req x)", "c=2: agg x (req x)", "c=4: agg x (req x)",
                       "c=8: agg x (req x)"]
    assert rows[1][0] == "none" and rows[1][3] == "45.0 tok/s"
    assert rows[2][0] == "ngram-auto" and rows[2][1].startswith("1.30x") and rows[2][3].startswith("0.84x")
    assert [r[0] for r in rows[3:7]] == ["verdict c=1", "verdict c=2", "verdict c=4", "verdict c=8"]
    assert rows[-1] == ["speculation pays", "up to concurrency 2"]
    assert report._upto(rows) == 2


def test_tune_says_up_to_which_concurrency_the_winner_pays():
    assert tune.pays_up_to_concurrency(REPORT, "ngram-auto") == 2  # chat@c1 pooled into c=1; c=4 loses
    assert tune.pays_up_to_concurrency(REPORT, "draft_model-auto") is None
    flat = _seg({"none": 20.0, "ngram-auto": 20.0}, {"ngram-auto": [1.0] * 12}, "no measurable difference")
    assert tune.pays_up_to_concurrency({"segments": {"chat@c1": flat, "chat@c2": flat}}, "ngram-auto") is None


def test_levels_that_pay_above_a_losing_first_level_are_named():
    segs = {f"code/repeated@c{c}": REPORT["segments"][f"code/repeated@c{c}"] for c in (2, 4, 8)}
    segs["code/repeated@c1"] = _seg({"none": 20.0, "ngram-auto": 19.0}, {"ngram-auto": LOSSES}, "don't")
    rows = next(iter(report.concurrency_rows({"segments": segs}).values()))
    assert rows[-1] == ["speculation pays", "not at concurrency 1 (only at c=2, c=8)"]
    assert report._upto(rows) is None
    losing = {k: _seg({"none": 20.0, "ngram-auto": 19.0}, {"ngram-auto": LOSSES}, "don't") for k in segs}
    assert next(iter(report.concurrency_rows({"segments": losing}).values()))[-1] == [
        "speculation pays", "at no measured concurrency"]

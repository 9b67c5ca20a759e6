"""The verdicts: each engine's own (speculate or not) and the cross-engine pick (which engine and configuration)."""
from draftwise.bench import analyze
from draftwise.bench.verdict import across_engines, decide


def _records(cond: str, tok_s: list[float]) -> list[dict]:
    return [{"phase": "measured", "segment": "chat@c1", "condition": cond, "item_id": f"p{i}", "tok_s": t,
             "e2e_s": 64 / t, "ttft_s": 0.1, "tpot_s": 1 / t, "num_output_tokens": 64, "batch": f"{cond}-{i}",
             "batch_wall_s": 64 / t, "concurrency": 1} for i, t in enumerate(tok_s)]


def _segment(conds: dict[str, list[float]]) -> dict:
    recs = [r for c, ts in conds.items() for r in _records(c, ts)]
    return analyze.analyze(recs)["chat@c1"]


def test_engine_of_names_the_engine():
    assert analyze.engine_of("ngram-k4") == "draftwise"
    assert analyze.engine_of("vllm:ngram-k4") == "vllm"
    assert analyze.baseline_of("vllm:ngram-k4") == "vllm:none"


def test_across_picks_the_fastest_engine_not_the_biggest_own_speedup():
    # vLLM's suffix doubles vLLM's plain, but draftwise's n-gram is faster in absolute tok/s
    n = 12
    seg = _segment({"none": [16.0 + 0.1 * i for i in range(n)], "ngram-k4": [24.0 + 0.1 * i for i in range(n)],
                    "vllm:none": [6.0 + 0.05 * i for i in range(n)], "vllm:suffix-k4": [12.0 + 0.1 * i for i in range(n)]})
    own = decide(seg["speedups"])
    assert own["condition"] == "vllm:suffix-k4"  # each engine against its own plain: vLLM's suffix gains most
    cross = across_engines(seg["speedups"], seg["across"])
    assert cross["condition"] == "ngram-k4" and cross["engine"] == "draftwise"
    assert "vllm: vllm:suffix-k4" in cross["text"]
    assert seg["across"]["vllm:suffix-k4"]["speedup"] < 1.0


def test_across_can_pick_the_other_engine_and_keeps_plain_as_a_candidate():
    n = 12
    seg = _segment({"none": [10.0 + 0.1 * i for i in range(n)], "ngram-k4": [8.0 + 0.1 * i for i in range(n)],
                    "vllm:none": [20.0 + 0.1 * i for i in range(n)]})
    cross = across_engines(seg["speedups"], seg["across"])
    assert cross["condition"] == "vllm:none"
    assert "draftwise: none (draftwise plain, 1.00x)" in cross["text"]


def test_no_cross_verdict_for_one_engine():
    seg = _segment({"none": [10.0] * 5, "ngram-k4": [12.0] * 5})
    assert seg["across"] == {}
    assert across_engines(seg["speedups"], seg["across"]) is None

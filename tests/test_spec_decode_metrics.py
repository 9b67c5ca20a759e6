"""/metrics shows the k histogram and the batch's one decision per step (issue 44), fed from the engine's SpecStats
as the server's runner feeds them (ServerMetrics.sync); and the engine records them on a tiny model."""
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from draftwise.sampling import SamplingParams
from draftwise.server.metrics import ServerMetrics
from draftwise.spec_decode.stats import SpecStats
from tests.harness import PROMPTS, metric, tiny_llm


def _scrape(metrics: ServerMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name"))] = s.value
    return out


def _status(stats: SpecStats):
    return SimpleNamespace(running=1, waiting=0, free_slots=3, spec_stats=stats, prefix_cache=None)


def test_the_k_histogram_and_the_decisions_reach_metrics_by_what_they_gained():
    m, stats = ServerMetrics("tiny", 4, k_max=4), SpecStats()
    stats.record(0, 0)
    stats.record(3, 2)
    stats.record_decision(1, 2)
    m.sync(_status(stats))
    stats.record(0, 0)
    stats.record_decision(0, 1)
    stats.record_decision(1, 2)
    m.sync(_status(stats))
    m.sync(_status(stats))  # nothing moved: nothing counted twice
    got = _scrape(m)
    assert metric(got, "draftwise:spec_decode_k_steps_total", k="0") == 2
    assert metric(got, "draftwise:spec_decode_k_steps_total", k="3") == 1
    assert metric(got, "draftwise:spec_decode_batch_decisions_total", speculating="1", batch="2") == 2
    assert metric(got, "draftwise:spec_decode_batch_decisions_total", speculating="0", batch="1") == 1


def test_the_engine_records_one_decision_per_decode_step():
    """Every decode step adds one decision (rows that guessed of the rows stepped) and one k per row."""
    llm = tiny_llm({"method": "ngram", "num_speculative_tokens": "auto"}, max_num_seqs=4, k_max=8)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    st = llm.status().spec_stats
    rows = sum(batch * n for (_, batch), n in st.decisions.items())
    decode_rows = sum(st.k_histogram.values()) - sum(1 for _ in PROMPTS)  # a prefill's first k is no decode step
    assert st.decisions and all(0 <= s <= b <= 4 for s, b in st.decisions)
    assert decode_rows <= rows <= sum(st.k_histogram.values())

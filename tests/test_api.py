"""api.LLM as the one place an engine is assembled: from_parts, set_speculation (proposers built once, k checked
against the engine's look-ahead), run-until-done, and greedy outputs unchanged by switching arms."""
import pytest

from draftwise.api import LLM
from draftwise.config import ConfigError
from draftwise.sampling import SamplingParams
from tests.harness import MODEL, PROMPTS, noisy_draft, tiny_decoder, tiny_tokenizer, VOCAB


def counting_llm(**kw):
    loads = []
    tok = tiny_tokenizer()

    def load_draft(name, dtype, weights):
        loads.append((name, dtype, weights))
        return noisy_draft(), tok, {"name": name}

    return LLM.from_parts(tiny_decoder("qwen2", 0, VOCAB), tok, name=MODEL, load_draft=load_draft, **kw), loads


def test_switching_speculation_keeps_greedy_output_and_builds_each_proposer_once():
    llm, loads = counting_llm(max_num_seqs=2, max_model_len=128, max_lookahead=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    arms = [None, {"method": "ngram", "num_speculative_tokens": 3},
            {"method": "draft_model", "model": "d", "num_speculative_tokens": 4},
            {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}]
    texts = {}
    for _ in range(2):
        for arm in arms:
            llm.set_speculation(arm)
            outs = llm.generate(PROMPTS, params)
            texts.setdefault(str(arm), [o.outputs[0].token_ids for o in outs])
            assert [o.outputs[0].token_ids for o in outs] == texts[str(arm)]
            assert (outs[0].spec is None) == (arm is None)
    assert all(texts[str(arm)] == texts[str(arms[0])] for arm in arms)
    # the draft was loaded once: arms that differ only in k share it, and returning arms reuse it
    assert loads == [("d", "float32", None)]
    assert llm.draft_info == {"name": "d"}


def test_k_beyond_the_lookahead_is_refused_and_nothing_changes():
    llm, _ = counting_llm(max_lookahead=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="look-ahead of 2"):
        llm.set_speculation({"method": "ngram", "num_speculative_tokens": 3})
    assert llm.spec_config.num_speculative_tokens == 2 and llm.engine.k_policy.max_k == 2
    with pytest.raises(ConfigError, match="look-ahead of 0"):
        counting_llm()[0].set_speculation({"method": "ngram", "num_speculative_tokens": 1})


def test_run_finishes_every_request_and_reports_each_once():
    llm, _ = counting_llm(max_num_seqs=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    reqs = [llm.new_request(p, SamplingParams(max_tokens=8, ignore_eos=True))[0] for p in PROMPTS]
    finished = []
    llm.run(reqs, on_finished=finished.append)
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in reqs)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 8 for r in reqs)
    assert not llm.engine.has_unfinished() and llm.engine.num_free_slots == 2

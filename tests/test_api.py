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
    llm, loads = counting_llm(max_num_seqs=2, max_model_len=128, k_max=4)
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


def test_the_old_k_max_keyword_still_works_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="use k_max"):
        llm, _ = counting_llm(**{"max_lookahead": 3})
    assert llm.engine.k_max == 3
    with pytest.raises(TypeError, match="both"):
        counting_llm(k_max=3, **{"max_lookahead": 3})
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        counting_llm(bogus=3)


def test_k_beyond_k_max_is_refused_and_nothing_changes():
    llm, _ = counting_llm(k_max=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="look-ahead of 2"):
        llm.set_speculation({"method": "ngram", "num_speculative_tokens": 3})
    assert llm.spec_config.num_speculative_tokens == 2 and llm.engine.k_policy.k_max == 2
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


def test_prompt_ids_beyond_a_smaller_drafts_vocabulary_are_a_config_error():
    """Issue 11, item 2: a draft with fewer embedding rows than the target; `prompt: [id]` beyond them is refused
    up front (the server's 400), not an exception inside engine.step that fails every in-flight request."""
    spec_config = {"method": "draft_model", "model": "small", "num_speculative_tokens": 3}
    llm = LLM.from_parts(tiny_decoder("qwen2", 0, VOCAB), tiny_tokenizer(), name=MODEL, speculative_config=spec_config,
                         load_draft=lambda name, dtype, weights: (tiny_decoder("qwen2", 1, 48), None, {}))
    with pytest.raises(ConfigError, match="prompt token id 50 .*embeds only ids 0..47"):
        llm.new_request([3, 50], SamplingParams(max_tokens=4))
    with pytest.raises(ConfigError, match="prompt token id 63 "):
        llm.generate({"prompt_token_ids": [63]}, SamplingParams(max_tokens=4))
    outs = llm.generate([[3, 4, 5]], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=0))
    assert outs[0].outputs[0].finish_reason == "length" and max(outs[0].outputs[0].token_ids) < 48
    llm.set_speculation(None)  # plain decoding: the whole target vocabulary again
    assert llm.generate([[50]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].finish_reason == "length"


def test_generate_surfaces_a_failed_request_as_finish_reason_error(monkeypatch):
    """Issue 11, item 8: a request whose step keeps failing ends with finish_reason "error" and the message;
    generate does not raise and the other requests of the batch finish normally."""
    llm, _ = counting_llm(max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    forward = llm.model.forward
    bad_len = len(llm.tokenizer.encode(PROMPTS[2]))

    def flaky(token_ids, positions, cache, slots, **kw):
        if "logit_index" in kw and token_ids.shape[1] == bad_len:
            raise RuntimeError("injected: CUDA out of memory")
        return forward(token_ids, positions, cache, slots, **kw)

    monkeypatch.setattr(llm.model, "forward", flaky)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons == ["length", "length", "error", "length"]
    assert outs[2].error == "RuntimeError: injected: CUDA out of memory" and outs[0].error is None
    assert not llm.engine.has_unfinished() and llm.engine.num_free_slots == 4

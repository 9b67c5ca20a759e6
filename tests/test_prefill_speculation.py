"""Guesses verified inside the prefill forward (Engine.speculate_in_prefill).

Where every row is exact (a row-exact KernelPlan: q4x8 for every width and the row-exact attention op), a
prompt's rows are bitwise the rows a decode step computes, so the proposer's first guesses ride along with the
prompt and are verified from the same forward. Invariants: the first step of a request already verifies guesses
(the grammar's forced start is emitted with the first token); greedy output equals plain decoding token for token
(json_schema, regex, choice × ngram, draft_model, grammar+ngram, grammar+draft_model, several k; batched prompts of
different lengths; prompts cached to different depths); sampling keeps the masked target distribution; it is off
where rows are not exact. Tiny random models in q4x8; no timing asserts.
"""
from __future__ import annotations

import pytest

from draftwise.api import LLM
from draftwise.sampling import SamplingParams
from tests.harness import json_llm, one_torch_thread  # noqa: F401 (a fixture)
from tests.test_structured_engine import CONSTRAINTS, METHODS, PROMPTS, _check_valid
from tests.test_structured_engine import test_sampling_keeps_the_masked_target_distribution as sampling_check
from tests.tiny_models import tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm():
    return json_llm(k_max=8, max_num_seqs=4, q4x8=True)


def test_on_only_where_every_row_is_exact(llm):
    from draftwise.kernels import attention

    assert llm.engine.speculate_in_prefill == attention.available()
    if not attention.available():
        pytest.skip("the row-exact attention op is not built here")
    plain_rows = json_llm(k_max=8)  # dense float32: a row's result may depend on the call's shape
    assert not plain_rows.engine.speculate_in_prefill
    from draftwise.kernels.plan import resolve_plan
    from draftwise.models import quant

    mixed, q4 = tiny_decoder("qwen2", 0, 64), tiny_decoder("qwen2", 0, 64)
    quant.build_linears(mixed, resolve_plan("q4x8+bf16", "auto", None))
    quant.build_linears(q4, resolve_plan("q4x8", "auto", None))
    assert not LLM.from_parts(mixed, plain_rows.tokenizer).engine.speculate_in_prefill
    assert LLM.from_parts(q4, plain_rows.tokenizer).engine.speculate_in_prefill


def test_the_first_step_verifies_the_grammars_forced_start(llm):
    if not llm.engine.speculate_in_prefill:
        pytest.skip("rows are not exact here")
    so = CONSTRAINTS["json_schema"]  # `{"name":` is forced before any model choice
    llm.set_speculation({"method": "grammar", "num_speculative_tokens": 6})
    req, _ = llm.new_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so))
    llm.engine.add_request(req)
    out = llm.engine.step()[0]  # the prefill's output (the same step() then decodes it once more)
    assert out.request is req
    assert out.k >= 1 and out.num_accepted == out.k  # forced guesses: all kept
    assert len(out.new_token_ids) == out.num_accepted + 1  # + the target's own token after them
    assert llm.tokenizer.decode(out.new_token_ids).startswith('{"name":')
    while llm.engine.has_unfinished():
        llm.engine.step()
    _check_valid("json_schema", llm.tokenizer.decode(req.output_ids))


def _run(llm, so, spec_config=None, prompts=PROMPTS, max_tokens=48):
    llm.set_speculation(spec_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
    return llm.generate(list(prompts), params)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "grammar+ngram", "grammar+draft_model"])
@pytest.mark.parametrize("constraint", ["json_schema", "layout", "regex", "choice"])
def test_greedy_equals_plain_with_guesses_verified_in_the_prefill(llm, constraint, method):
    so = CONSTRAINTS[constraint]
    plain = _run(llm, so)
    for k in (1, 3, 8):
        outs = _run(llm, so, dict(METHODS[method], num_speculative_tokens=k))
        for p, s in zip(plain, outs):
            assert s.outputs[0].token_ids == p.outputs[0].token_ids, (constraint, method, k, s.outputs[0].text)
            assert s.outputs[0].finish_reason == p.outputs[0].finish_reason


def test_greedy_equals_plain_unconstrained_with_prompts_cached_to_different_depths(llm):
    """No grammar; the second batch shares prefixes of different lengths with the first (prefix cache hits),
    so each row's guesses start at a different position of the padded prefill."""
    first = ["the cat sat on the mat and the cat sat", "a b c a b c a b", '{"name": "Ada", "age": 36}']
    second = [first[0] + " on the", "a b c", first[2] + ' {"name": "Ada"']
    outs = {}
    for spec_config in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}):
        outs[spec_config is None] = [[o.outputs[0].token_ids for o in _run(llm, None, spec_config, batch, max_tokens=16)]
                              for batch in (first, second)]
    assert outs[True] == outs[False]


def test_sampling_keeps_the_masked_target_distribution_with_guesses_in_the_prefill(monkeypatch):
    """The chi-square check of test_structured_engine, its grammar + draft model case, with q4x8 models (so the
    prefill verifies the first draft: the draft's q rows meet the prefill's rows)."""
    import tests.test_structured_engine as structured

    def q4x8_llm(spec_config=None, **kw):
        llm = json_llm(spec_config, q4x8=True, **kw)
        if not llm.engine.speculate_in_prefill:
            pytest.skip("rows are not exact here")
        return llm

    monkeypatch.setattr(structured, "json_llm", q4x8_llm)
    sampling_check({"method": "grammar", "num_speculative_tokens": 3,
                    "then": {"method": "draft_model", "model": "noisy-draft"}})

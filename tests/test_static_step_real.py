"""Integration: the static step over the packaged models as api.load_model builds them (the plan's kernels, our
attention op) gives the engine's greedy tokens: the 0.5B plain and with device-side n-gram guesses, the 1.5B
with the 0.5B drafting through its own static step. Short: 3 prompts x 16 tokens."""
from __future__ import annotations

import pytest

from draftwise import LLM, SamplingParams
from draftwise.models.static_step import StaticStep
from draftwise.spec_decode.static_spec import StaticSpecDecoder
from tests.conftest import require_packaged

pytestmark = pytest.mark.integration

PROMPTS = ["def quicksort(xs):", "The quick brown fox jumps over the lazy dog. The quick brown fox",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n"]
TOKENS = 16
CAPACITY = 128


def engine_outputs(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    return [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs]


def test_small_model_plain_and_ngram_equal_the_engine():
    name = "qwen2.5-coder-0.5b-instruct"
    require_packaged(name)
    llm = LLM(name, max_num_seqs=3, max_model_len=256)
    prompts, want = engine_outputs(llm)
    for method in (None, "ngram"):
        runner = StaticSpecDecoder(StaticStep(llm.model, 3, CAPACITY), (), method, 4)
        assert runner.generate(prompts, TOKENS) == want, method


def test_default_pair_draft_model_equals_the_engine():
    target, draft = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
    require_packaged(target)
    require_packaged(draft)
    from draftwise.api import load_model

    llm = LLM(target, max_num_seqs=3, max_model_len=256)
    prompts, want = engine_outputs(llm)
    draft_model = load_model(draft)[0]
    runner = StaticSpecDecoder(StaticStep(llm.model, 3, CAPACITY), (), "draft_model", 3,
                               draft=StaticStep(draft_model, 3, CAPACITY))
    assert runner.generate(prompts, TOKENS) == want
    assert runner.num_accepted > 0

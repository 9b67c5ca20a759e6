"""Integration: with the packaged 1.5B target, greedy decoding with suffix speculation (token trees of up to 1, 4 and
16 nodes, four prompts batched, each run twice so the second run also guesses from the first run's outputs) equals
plain greedy decoding token for token, and trees with branches were verified."""
from __future__ import annotations

import pytest

from draftwise import LLM, SamplingParams
from tests.conftest import require_packaged

pytestmark = pytest.mark.integration

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    '{"tool": "read_file", "arguments": {"path": "src/a.py", "start": 1, "end": 40}}\n'
    '{"tool": "read_file", "arguments": {"path": "src/b.py", "start": 1, "end": 40}}\n{"tool": ',
    "SELECT name, region FROM customers WHERE region = 'EU';\nSELECT name, region FROM customers WHERE region =",
    "The capital of France is",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def target_plain():
    require_packaged("qwen2.5-coder-1.5b-instruct")
    from draftwise.equivalence import run_engine

    llm = LLM("qwen2.5-coder-1.5b-instruct", dtype="float32", max_num_seqs=4, max_model_len=256, k_max=16)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    return llm, prompts, run_engine(llm, None, prompts, [GREEDY] * len(prompts))


@pytest.mark.parametrize("k", [1, 4, 16])
def test_suffix_trees_greedy_equal_plain(target_plain, k):
    from draftwise.equivalence import run_engine

    llm, prompts, plain = target_plain
    config = {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_min_token_prob": 0.0}
    for _ in range(2):
        assert run_engine(llm, config, prompts, [GREEDY] * len(prompts)) == plain
    stats = llm.engine.stats
    assert stats.num_accepted_tokens > 0
    if k > 1:
        assert stats.num_draft_tokens > stats.num_drafts  # more than one node per step: trees or long chains

"""api.LLM's switch to the static step (use_static_step: on by default on CUDA only): an eligible batch (greedy,
plain or n-gram) gives the engine's outputs, finish reasons and counts; anything else still runs through the
engine; on the CPU the switch is off unless asked for."""
from __future__ import annotations

import pytest

from draftwise.sampling import SamplingParams
from tests.harness import PROMPTS, one_torch_thread, tiny_llm  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def outputs(llm, params):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": "auto"}])
def test_static_switch_gives_the_engine_outputs(spec):
    llm = tiny_llm(spec)
    assert llm._static is None  # the CPU path is the engine's unless asked
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = outputs(llm, greedy)
    stop = ref[0][0][4]
    stopping = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    ref_stop = outputs(llm, stopping)
    assert llm.use_static_step()
    runner_calls = []
    original = llm._static_runner
    llm._static_runner = lambda reqs: runner_calls.append(r := original(reqs)) or r
    assert outputs(llm, greedy) == ref
    assert outputs(llm, stopping) == ref_stop
    assert all(r is not None for r in runner_calls)
    if spec and spec["num_speculative_tokens"] != "auto":  # (auto may choose plain steps on this box's timing)
        out = llm.generate(PROMPTS[:1], greedy)[0]
        assert out.spec["num_drafts"] > 0


def test_ineligible_requests_run_through_the_engine():
    llm = tiny_llm()
    sampled = SamplingParams(temperature=0.8, max_tokens=12, seed=3, ignore_eos=True)
    ref = outputs(llm, sampled)
    llm.use_static_step()
    assert llm._static_runner([llm.new_request(PROMPTS[0], sampled)[0]]) is None
    assert outputs(llm, sampled) == ref

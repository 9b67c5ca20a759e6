"""Mixed k per row through the real engine (tiny random models): greedy speculative output equals plain decoding at
batch sizes 1..8 whatever k each row gets (0 included), and a draft model runs forwards over the rows that guess
only: a step whose batch decision is k = 0 everywhere runs no draft forward (counted), and an auto policy whose
planted cost grid says guessing loses keeps every step plain, draft forwards and target widths as plain decoding's.
Counts, no timing asserts."""
from __future__ import annotations

import random

import pytest

from draftwise.kernels.step_cost import StepCost
from draftwise.sampling import SamplingParams
from draftwise.spec_decode import draft_model
from draftwise.spec_decode.adaptive import AdaptiveK
from tests.harness import one_torch_thread, tiny_llm  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS8 = ["w1 w2 w3 w1 w2 w3 w1 w2", "w9 w8 w7", "w5 w5 w5 w5 w6 w5 w5 w5 w5", "w10 w20 w30 w40 w10 w20",
            "w3 w4 w3 w4 w3", "w11 w12 w13 w14 w15 w11 w12", "w7", "w2 w2 w8 w2 w2 w8 w2"]
DRAFT = {"method": "draft_model", "model": "noisy-draft", "num_speculative_tokens": 6}


class ScriptedK:
    """A k policy drawing each row's k in 0..its cap at random (0 as often as any other), seeded."""

    def __init__(self, k_max: int, seed: int):
        self.k_max, self.rng, self.decisions = k_max, random.Random(seed), []

    def choose(self, req) -> int:
        return self.choose_batch([req], [self.k_max])[0]

    def choose_batch(self, reqs, caps) -> list[int]:
        ks = [self.rng.randint(0, min(c, self.k_max)) if c > 0 else 0 for c in caps]
        if self.rng.random() < 0.2:
            ks = [0] * len(caps)  # a whole batch plain now and then
        self.decisions.append(ks)
        return ks

    def observe(self, req, k, num_accepted):
        pass

    def end(self, req):
        pass


@pytest.fixture
def draft_forwards(monkeypatch):
    """Every draft forward's slots, and every propose call's (slots, k per row)."""
    log = {"forwards": [], "proposes": []}
    forward, propose = draft_model.DraftModelProposer._forward, draft_model.DraftModelProposer.propose

    def counted_forward(self, slots, new_tokens):
        log["forwards"].append(list(slots))
        return forward(self, slots, new_tokens)

    def counted_propose(self, slots, k_per_seq, after=None):
        log["proposes"].append((list(slots), list(k_per_seq), len(log["forwards"])))
        return propose(self, slots, k_per_seq, after)

    monkeypatch.setattr(draft_model.DraftModelProposer, "_forward", counted_forward)
    monkeypatch.setattr(draft_model.DraftModelProposer, "propose", counted_propose)
    return log


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_mixed_k_per_row_equals_plain_at_every_batch_size(method, draft_forwards):
    llm = tiny_llm(max_num_seqs=8, k_max=6)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    spec = DRAFT if method == "draft_model" else {"method": "ngram", "num_speculative_tokens": 6}
    for batch in range(1, 9):
        prompts = PROMPTS8[:batch]
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.set_speculation(spec)
        policy = ScriptedK(6, seed=batch)
        llm.engine.set_speculation(llm.engine.proposer, policy)
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == plain, (method, batch)
        mixed = [ks for ks in policy.decisions if len(ks) > 1 and 0 in ks and any(ks)]
        assert batch == 1 or mixed  # not vacuous: steps where some rows guess and others do not
        llm.set_speculation(None)
    if method == "draft_model":
        calls = draft_forwards["proposes"]
        assert calls
        ends = [n for _, _, n in calls[1:]] + [len(draft_forwards["forwards"])]
        for (slots, ks, start), end in zip(calls, ends):
            guessing = {s for s, k in zip(slots, ks) if k > 0}
            for fed in draft_forwards["forwards"][start:end]:
                assert set(fed) <= guessing, (slots, ks, fed)  # no forward over a row that does not guess
            if not guessing:
                assert end == start  # a batch decision of k = 0 everywhere: no draft forward at all


def _losing_grids():
    """Planted grids where guessing loses at any acceptance: every extra verified token costs 20 plain steps."""
    target = StepCost({(b, w): 0.05 * b * (1 + 20 * (w - 1)) for b in (1, 2, 4, 8) for w in (1, 2, 4, 8, 16)})
    draft = StepCost({(b, w): 0.01 * b * w for b in (1, 2, 4, 8) for w in (1, 2, 4, 8, 16)})
    return target, draft


def test_an_auto_policy_whose_grid_says_guessing_loses_runs_plain_steps_only(draft_forwards):
    """Rows that never guess: the batch decision is k = 0 at every step, probes included, so a draft model runs no
    forward at all (its catch-up is lazy: it reads the context only when asked to guess) and every target step is
    one token wide, as plain decoding's; the output is plain's."""
    llm = tiny_llm(max_num_seqs=4, k_max=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS8[:4], params)]
    llm.set_speculation(DRAFT)
    target, draft = _losing_grids()
    policy = AdaptiveK(6, target, draft)
    policy.engine_alpha = 1.0  # the best acceptance there is: the grid alone says no
    llm.engine.set_speculation(llm.engine.proposer, policy)
    widths = []
    observe = policy.observe_step
    policy.observe_step = lambda batch, width, *rest: (widths.append(width), observe(batch, width, *rest))
    outs = llm.generate(PROMPTS8[:4], params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert draft_forwards["forwards"] == []
    assert all(not any(ks) for _, ks, _ in draft_forwards["proposes"])
    assert widths and set(widths) == {1}
    assert set(policy.k_histogram) == {0} and sum(policy.k_histogram.values()) >= 4 * 39

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
    """Every draft forward's slots and tokens fed per row, and every propose call's (slots, k per row, forwards
    before it)."""
    log = {"forwards": [], "fed": [], "proposes": []}
    forward, propose = draft_model.DraftModelProposer._forward, draft_model.DraftModelProposer.propose

    def counted_forward(self, slots, new_tokens):
        log["forwards"].append(list(slots))
        log["fed"].append([len(t) for t in new_tokens])
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
        assert draft_forwards["proposes"]
        assert _draft_work_only_where_guessing(draft_forwards) == []


def _draft_work_only_where_guessing(log) -> list:
    """The draft forwards that ran over a row not guessing in their propose call (a batch decision of k = 0
    everywhere: any forward at all), as (slots, k per row, forward's slots); [] when a plain row cost no draft work."""
    calls = log["proposes"]
    ends = [n for _, _, n in calls[1:]] + [len(log["forwards"])]
    bad = []
    for (slots, ks, start), end in zip(calls, ends):
        guessing = {s for s, k in zip(slots, ks) if k > 0}
        bad += [(slots, ks, fed) for fed in log["forwards"][start:end] if not set(fed) <= guessing]
    return bad


class LateGuesser:
    """The request of prompt PROMPTS8[0] decodes plainly for `plain_steps` steps, then guesses `k` every step; every other row
    stays plain throughout (a policy that starts one row late, as AdaptiveK does once a row's guessing pays)."""

    def __init__(self, k_max: int, plain_steps: int, k: int):
        self.k_max, self.plain_steps, self.k, self.steps = k_max, plain_steps, k, 0

    def choose(self, req) -> int:
        return 0  # the prefill's first guesses: none

    def choose_batch(self, reqs, caps) -> list[int]:
        late = [r.prompt_text == PROMPTS8[0] for r in reqs]
        if any(late):
            self.steps += 1
        return [min(self.k, c) if is_late and self.steps > self.plain_steps else 0 for is_late, c in zip(late, caps)]

    def observe(self, req, k, num_accepted):
        pass

    def end(self, req):
        pass


def _eager(propose):
    """A planted eager draft: after each propose it also reads every plain row's new context (its catch-up done
    every step, as a draft that mirrors the target would), so its guesses are the same, its work is not."""
    def eager_propose(self, slots, k_per_seq, after=None):
        drafts = propose(self, slots, k_per_seq, after)
        plain = [s for s, k in zip(slots, k_per_seq) if k == 0 and len(self.tokens[s]) > self.seen[s]]
        if plain:
            self._catch_up(plain, {s: [] for s in plain})
        return drafts
    return eager_propose


def _recording(propose, seen: list):
    """propose, each guessing row's guesses appended to `seen`."""
    def recorded(self, slots, k_per_seq, after=None):
        drafts = propose(self, slots, k_per_seq, after)
        seen.extend(d.token_ids.tolist() for d in drafts if d.num_tokens)
        return drafts
    return recorded


def test_a_lazily_caught_up_draft_guesses_what_an_eager_one_does_and_plain_rows_cost_it_nothing(
        draft_forwards, monkeypatch):
    """A row that decoded plainly for 12 steps starts guessing: the draft reads its prompt and those 12 tokens in
    one catch-up forward right then (lazy), its guesses equal those of a draft that read every token as it came
    (eager), the greedy output is plain decoding's, and the rows that never guess cost the draft no forward at all.
    The planted eager draft gives the same output and guesses and fails the no-work check."""
    llm = tiny_llm(max_num_seqs=4, k_max=6)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = PROMPTS8[:4]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    guesses = {}
    counted = draft_model.DraftModelProposer.propose
    for variant in ("lazy", "eager"):
        monkeypatch.setattr(draft_model.DraftModelProposer, "propose", counted if variant == "lazy" else _eager(counted))
        draft_forwards["forwards"].clear(), draft_forwards["fed"].clear(), draft_forwards["proposes"].clear()
        llm.set_speculation(DRAFT)
        llm.engine.set_speculation(llm.engine.proposer, LateGuesser(6, plain_steps=12, k=3))
        seen = []
        monkeypatch.setattr(draft_model.DraftModelProposer, "propose",
                            _recording(draft_model.DraftModelProposer.propose, seen))
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == plain, variant
        guesses[variant] = seen
        for cache in llm.prefix_caches().values():  # the next variant's draft reads its prompts from scratch
            for o in outs:
                cache.forget(o.prompt_token_ids)
        bad = _draft_work_only_where_guessing(draft_forwards)
        if variant == "lazy":
            assert bad == []
            # only the late row is ever read, and its first forward reads its prompt and 12 plain steps' at once
            assert all(len(f) == 1 for f in draft_forwards["forwards"])
            assert len({f[0] for f in draft_forwards["forwards"]}) == 1
            assert draft_forwards["fed"][0][0] >= len(outs[0].prompt_token_ids) + 12
        else:
            assert bad, "the planted eager draft's plain-row forwards must be caught"
        llm.set_speculation(None)
    assert guesses["lazy"] == guesses["eager"] and len(guesses["lazy"]) >= 5


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

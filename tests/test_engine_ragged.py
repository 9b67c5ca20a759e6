"""Ragged verification (engine.py `_verify_forward`): a decode step's forward computes each sequence's own 1 + k
tokens, not B x the widest row's width, and keeps every row exact: a row's logits are bitwise those of plain steps
at its positions, whatever the batch and the other rows' widths. Greedy speculation equals plain decoding at batch
sizes 1..8 with a different k per row (0 included); a planted padding-to-widest step fails the cost test; an engine
whose policy keeps every row plain runs plain decoding's forwards, call for call."""
from __future__ import annotations

import random

import pytest
import torch

from draftwise.engine import Engine, Request
from draftwise.sampling import SamplingParams
from draftwise.spec_decode.draft_model import DraftModelProposer
from draftwise.spec_decode.ngram import NgramProposer
from draftwise.spec_decode.adaptive import AdaptiveK
from draftwise.spec_decode.proposer import Draft, NoProposer
from draftwise.spec_decode.suffix import SuffixProposer
from tests.harness import engine_run, row_exact
from tests.tiny_models import tiny_decoder

MAX_LEN = 96
VOCAB = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 6, 5, 5, 5, 5], [10, 20, 30, 40, 50, 60, 10, 20],
           [3, 1, 3, 1, 3, 1], [7], [2, 4, 6, 8, 2, 4, 6, 8, 2, 4], [11, 12, 13, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


class MixedK:
    """A planted k policy: row i of step s guesses (3 i + s) mod (k_max + 1) tokens, so every step mixes widths and
    rows that do not guess (k = 0) sit beside rows that guess k_max."""

    def __init__(self, k_max: int):
        self.k_max, self.steps = k_max, 0

    def choose_batch(self, reqs, caps) -> list[int]:
        self.steps += 1
        return [min(c, (3 * i + self.steps) % (self.k_max + 1)) for i, c in enumerate(caps)]

    def observe(self, req, k: int, num_accepted: int) -> None:
        pass

    def end(self, req) -> None:
        pass


@pytest.fixture(scope="module")
def target():
    return tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def exact_target():
    return row_exact(tiny_decoder("llama", seed=1, vocab_size=VOCAB))


@pytest.fixture(scope="module")
def noisy_draft():
    draft = tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return draft


def run(target, proposer, k, prompts, k_policy=None):
    return engine_run(target, proposer, k, prompts, GREEDY, len(prompts), MAX_LEN, k_policy=k_policy)


@pytest.mark.parametrize("batch", range(1, 9))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_ragged_speculation_equals_plain_at_every_batch_size(target, noisy_draft, batch, method):
    prompts = PROMPTS[:batch]
    plain, _, _ = run(target, NoProposer(), 0, prompts)
    k = 5
    proposer = (NgramProposer(1, 3) if method == "ngram" else
                DraftModelProposer(noisy_draft, num_slots=batch, capacity=MAX_LEN + 16, target_vocab_size=VOCAB))
    outs, eng, _ = run(target, proposer, k, prompts, k_policy=MixedK(k))
    assert outs == plain
    assert eng.stats.num_drafts > 0


def step_inputs(eng: Engine, reqs, ks, rng) -> list[Draft]:
    """Planted chain drafts of ks[i] random guesses (what a proposer would hand the forward)."""
    return [Draft(torch.tensor([rng.randrange(1, VOCAB) for _ in range(k)], dtype=torch.int64)) for k in ks]


def prefilled(model, prompts, k_max=8):
    eng = Engine(model, NoProposer(), k_max, len(prompts), MAX_LEN, eos_token_ids=(0,))
    reqs = [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    eng.step()  # every prompt prefilled: each slot has its pending token
    return eng, reqs


@pytest.mark.parametrize("stack", [False, True])
def test_a_ragged_rows_bits_are_plain_steps_whatever_the_batch(exact_target, stack):
    """Each sequence's verified rows in a ragged batch (k = 0..8 mixed) are bitwise its plain single steps, and
    bitwise the same rows verified in a batch of its own: independent of the batch and the other rows' widths."""
    model = exact_target
    model.stack = stack
    if stack and model._stack_weights(1) is None:
        pytest.skip("the one-call layer loop does not run here")
    rng = random.Random(7)
    eng, reqs = prefilled(model, PROMPTS)
    ks = [0, 8, 3, 0, 1, 5, 0, 2]
    drafts = step_inputs(eng, reqs, ks, rng)
    base = [eng.cache.lengths[r.slot] for r in reqs]
    batch_logits = eng._verify_forward(reqs, drafts)
    for b, (r, d) in enumerate(zip(reqs, drafts)):
        assert batch_logits[b].shape == (1 + d.num_tokens, VOCAB)
        eng.cache.truncate(r.slot, base[b])
        alone = eng._verify_forward([r], [d])[0]
        assert torch.equal(alone, batch_logits[b]), b
        eng.cache.truncate(r.slot, base[b])
        ids = [eng._pending[r.slot], *d.token_ids.tolist()]
        for j, tok in enumerate(ids):  # plain steps, one token at a time
            step = model(torch.tensor([[tok]]), torch.tensor([[base[b] + j]]), eng.cache, torch.tensor([r.slot]),
                         num_tokens=[1])
            assert torch.equal(batch_logits[b][j], step[0, 0]), (b, j)
    del model.stack  # the class default again


def forward_tokens(eng: Engine, reqs, drafts, monkeypatch) -> int:
    """Tokens the target forward was given by one verification (padding included)."""
    given = []
    original = eng.target.forward

    def counting(token_ids, *args, **kwargs):  # token_ids [B, T]
        given.append(token_ids.numel())
        return original(token_ids, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(eng.target, "forward", counting)
        eng._verify_forward(reqs, drafts)
    return sum(given)


def check_cost(eng: Engine, reqs, drafts, monkeypatch) -> None:
    """The cost test: a verification computes each row's own tokens (1 + k), no more."""
    tokens = forward_tokens(eng, reqs, drafts, monkeypatch)
    own = sum(1 + d.num_tokens for d in drafts)
    assert tokens == own, f"the forward was given {tokens} tokens for rows of {own}"


def test_a_row_that_does_not_guess_costs_one_token(target, monkeypatch):
    eng, reqs = prefilled(target, PROMPTS[:4])
    drafts = step_inputs(eng, reqs, [0, 7, 0, 0], random.Random(1))
    check_cost(eng, reqs, drafts, monkeypatch)  # 1 + 8 + 1 + 1 = 11 tokens, not 4 x 8 = 32


def test_a_planted_padding_to_the_widest_step_fails_the_cost_test(target, monkeypatch):
    eng, reqs = prefilled(target, PROMPTS[:4])
    drafts = step_inputs(eng, reqs, [0, 7, 0, 0], random.Random(1))
    monkeypatch.setattr(eng, "_verify_forward", eng._padded_verify_forward)  # every row at the widest's width
    with pytest.raises(AssertionError, match="given 32 tokens for rows of 11"):
        check_cost(eng, reqs, drafts, monkeypatch)


def test_a_whole_ragged_decode_step_costs_its_rows_tokens(target, noisy_draft, monkeypatch):
    """Through Engine.step with the planted mixed k: every decode forward is given sum(1 + k) tokens."""
    given, widths = [], []
    original = target.forward

    def counting(token_ids, *args, **kwargs):  # token_ids [B, T]
        if token_ids.shape[1] == 1:  # decode / verification (ragged: a token a row); these prompts are wider
            given.append(token_ids.shape[0])
        return original(token_ids, *args, **kwargs)

    proposer = DraftModelProposer(noisy_draft, num_slots=4, capacity=MAX_LEN + 16, target_vocab_size=VOCAB)
    propose = proposer.propose

    def recording(slots, k_per_seq, *args, **kwargs):
        drafts = propose(slots, k_per_seq, *args, **kwargs)
        widths.append([1 + d.num_tokens for d in drafts])
        return drafts

    monkeypatch.setattr(target, "forward", counting)
    monkeypatch.setattr(proposer, "propose", recording)
    run(target, proposer, 6, PROMPTS[:4], k_policy=MixedK(6))
    assert given == [sum(w) for w in widths]
    assert any(1 in w and max(w) > 2 for w in widths)  # rows that do not guess beside rows that do


def _forwards(target, proposer, k, k_policy, monkeypatch) -> list[tuple]:
    """Every target forward of a run over PROMPTS[:4]: its token ids, positions, slots, num_tokens and which other
    arguments it was given (a tree's, logit_index, ...)."""
    calls = []
    original = target.forward

    def recording(token_ids, positions, cache, slots, **kwargs):
        calls.append((token_ids.tolist(), positions.tolist(), slots.tolist(), kwargs.get("num_tokens"),
                      sorted(kwargs)))
        return original(token_ids, positions, cache, slots, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(target, "forward", recording)
        run(target, proposer, k, PROMPTS[:4], k_policy=k_policy)
    return calls


def _never_pays(k: int) -> AdaptiveK:
    """An auto policy over a grid on which any guess costs 1000x a plain step: it decides every step and keeps every
    row plain (no probe either: none would pay at any acceptance)."""
    return AdaptiveK(k, {w: 0.01 if w == 1 else 10.0 for w in range(1, k + 2)},
                     {j: 10.0 for j in range(k + 1)})


class _EmptyTrees(SuffixProposer):
    """Planted: a proposer whose plain rows hand the engine an empty token tree (parents = ()) instead of an empty
    chain, which sends the whole step down the padded tree path."""

    def propose(self, slots, k_per_seq, after=None):
        return [Draft(d.token_ids, d.probs, parents=d.parents if d.num_tokens else ()) for d in
                super().propose(slots, k_per_seq, after)]


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
def test_speculation_that_does_not_guess_runs_plain_decodings_forwards(target, noisy_draft, method, monkeypatch):
    """Speculation configured but unused costs what plain decoding costs: under an auto policy that keeps every row
    plain, the target's forwards are plain decoding's, call for call (the same tokens, positions, slots and
    arguments: a ragged step of one token a row, no padded or tree path), and so is the output."""
    k = 6
    plain = _forwards(target, NoProposer(), k, None, monkeypatch)
    proposer = {"draft": lambda: DraftModelProposer(noisy_draft, num_slots=4, capacity=MAX_LEN + 16,
                                                    target_vocab_size=VOCAB),
                "ngram": lambda: NgramProposer(1, 3), "suffix": lambda: SuffixProposer()}[method]()
    policy = _never_pays(k)
    assert _forwards(target, proposer, k, policy, monkeypatch) == plain
    assert policy.k_histogram.get(0, 0) > 0 and set(policy.k_histogram) == {0}  # it decided, every step plain


def test_a_planted_empty_tree_at_k_0_fails_the_plain_forwards_test(target, monkeypatch):
    k = 6
    plain = _forwards(target, NoProposer(), k, None, monkeypatch)
    assert _forwards(target, _EmptyTrees(), k, _never_pays(k), monkeypatch) != plain

"""A draft model that stops guessing on its own confidence (`draft_p_min`, spec_decode/draft_model.py
min_guess_prob): greedy speculative output equals plain output at every threshold, and the stop really shortens
drafts; each returned guess but the last has the draft's probability >= the threshold; sampling keeps the target's
distribution (exact chi-square on a table model, where a planted proposer that turns a low-confidence guess into
its argmax while reporting q must fail); the k policy's calibration times full-length guesses; bad values are
ConfigErrors. Tiny random models only, no timing asserts; about 10 s.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.config import DRAFT_P_MIN, ConfigError, parse_spec_config
from draftwise.sampling import SamplingParams, process_logits, sample
from draftwise.spec_decode.verify import rejection_verify
from tests.harness import PROMPTS, one_torch_thread, tiny_llm  # noqa: F401 (a fixture)
from tests.test_spec_decode_draft_vocab import _pvalue

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _spec(p_min, k=4):
    return {"method": "draft_model", "model": "noisy-draft", "num_speculative_tokens": k, "draft_p_min": p_min}


def test_greedy_equals_plain_at_every_threshold_and_the_stop_shortens_drafts():
    llm = tiny_llm(k_max=6)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    drafted = {}
    for p_min in (0.0, 0.04, 0.3, 0.999):
        for k in (1, 4):
            llm.set_speculation(_spec(p_min, k))
            assert llm.proposer.min_guess_prob == p_min
            outs = llm.generate(PROMPTS, params)
            assert [o.outputs[0].token_ids for o in outs] == plain, (p_min, k)
            drafted[(p_min, k)] = sum(o.spec["num_draft_tokens"] for o in outs)
    assert drafted[(0.999, 4)] < drafted[(0.0, 4)]  # not vacuous: the tiny draft is rarely that sure
    assert drafted[(0.999, 1)] == drafted[(0.0, 1)]  # one guess is always made: the stop comes after it


# the tiny random draft is unsure everywhere (top probabilities 0.03-0.05 over 64 ids): thresholds inside that range
@pytest.mark.parametrize("temperature,p_min", [(0.0, 0.04), (1.0, 0.02)])
def test_every_guess_but_the_last_is_at_least_the_threshold(temperature, p_min):
    """The draft's own probability of each guess (greedy: its row's top; sampled: q of the drawn id), computed
    here from the draft model's logits, is >= p_min for every guess but the last of a draft shorter than k."""
    from draftwise.equivalence import next_logits

    k = 6
    llm = tiny_llm(k_max=k)
    llm.set_speculation(_spec(p_min, k))
    proposer = llm.proposer
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=temperature, max_tokens=8)
    context = [5, 6, 7, 8]
    proposer.begin(0, context, params, gen)
    lengths = set()
    for step in range(12):
        d = proposer.propose([0], [k])[0]
        guesses = d.token_ids.tolist()
        lengths.add(len(guesses))
        for i, tok in enumerate(guesses):
            probs = torch.softmax(next_logits(proposer.model, [context + guesses[:i]])[0].float(), -1)
            conf = float(probs.max()) if temperature == 0.0 else float(d.probs[i, tok])
            if i < len(guesses) - 1:
                assert conf >= p_min, (step, i, conf)
            elif len(guesses) < k:
                assert conf < p_min, (step, i, conf)  # it stopped because this guess was unsure
        accepted = len(guesses) // 2
        emitted = (guesses[accepted] + 1) % 60 + 1
        proposer.accept(0, accepted, emitted)
        context = context + guesses[:accepted] + [emitted]
    assert len(lengths) > 1  # not vacuous: some drafts stop early, some do not


def test_the_policys_draft_costs_come_from_the_drafts_own_forwards():
    """The auto policy costs guesses by the draft's step-cost grid (its forwards timed directly, at every batch
    size), so a draft that stops early on its own confidence cannot make guessing k look cheaper at load."""
    llm = tiny_llm(k_max=8)
    llm.set_speculation(_spec(0.999, "auto"))
    policy = llm.engine.k_policy
    assert llm.proposer.min_guess_prob == 0.999
    assert policy.draft_grid is llm.step_cost(llm.proposer.model, "last")
    assert policy.draft_time([4]) > policy.draft_time([1]) > 0  # one draft forward per guess


def test_the_default_and_bad_values():
    assert parse_spec_config(_spec(None)).draft_p_min is None
    llm = tiny_llm(k_max=4)
    llm.set_speculation({"method": "draft_model", "model": "d", "num_speculative_tokens": 2})
    assert llm.proposer.min_guess_prob == DRAFT_P_MIN
    for bad in (1.0, -0.1, "0.5", True):
        with pytest.raises(ConfigError, match="draft_p_min"):
            parse_spec_config(_spec(bad))
    with pytest.raises(ConfigError, match="draft_p_min"):
        parse_spec_config({"method": "ngram", "num_speculative_tokens": 2, "draft_p_min": 0.5})


# --------------------------------------------------------------------------- sampling keeps p

VOCAB, PROMPT, NUM_TOKENS, K, P_MIN = 6, (3, 5), 3, 3, 0.3
NUM_SAMPLES, NUM_SAMPLES_BROKEN = 60_000, 20_000


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits [prev2, prev1, V] (the draft: the target plus noise)."""
    g = torch.Generator().manual_seed(99)
    target = 1.5 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)
    return target, target + 0.8 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)


def _simulate(broken: bool, num_samples: int, seed: int) -> tuple[np.ndarray, float]:
    """Speculative sampling at temperature 1; each row guesses up to K tokens and stops after a guess whose q is
    below P_MIN (as DraftModelProposer). `broken`: that unsure guess is replaced by the draft's argmax while q is
    reported unchanged (planted). Returns the counts of the first NUM_TOKENS tokens and the mean draft length."""
    target, draft = _tables()
    q = process_logits(draft, 1.0)  # [prev2, prev1, V]
    draft_gen, verify_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    sequences = [list(PROMPT) for _ in range(num_samples)]
    lengths = []
    active = list(range(num_samples))
    while active:
        for i in active:
            s = sequences[i]
            context, ids, told = s[-2:], [], []
            for _ in range(K):
                row = q[context[0], context[1]]  # [V]
                tok = int(sample(row[None], draft_gen)[0])
                unsure = float(row[tok]) < P_MIN
                if unsure and broken:
                    tok = int(row.argmax())
                ids.append(tok)
                told.append(row)
                context = [context[1], tok]
                if unsure:
                    break
            lengths.append(len(ids))
            full = s[-2:] + ids
            logits = torch.stack([target[full[j], full[j + 1]] for j in range(len(ids) + 1)])  # [k + 1, V]
            s.extend(rejection_verify(torch.tensor(ids), torch.stack(told), logits, 1.0, 0, 1.0, verify_gen).token_ids)
        active = [i for i in active if len(sequences[i]) < len(PROMPT) + NUM_TOKENS]
    outcomes = np.array([s[len(PROMPT): len(PROMPT) + NUM_TOKENS] for s in sequences])
    counts = np.bincount((outcomes * VOCAB ** np.arange(NUM_TOKENS - 1, -1, -1)).sum(1), minlength=VOCAB**NUM_TOKENS)
    return counts, float(np.mean(lengths))


def _exact() -> np.ndarray:
    probs = process_logits(_tables()[0], 1.0).double()
    a, b = PROMPT
    return (probs[a, b][:, None, None] * probs[b][:, :, None] * probs).reshape(-1).numpy()


def test_a_confidence_stop_keeps_the_target_distribution():
    counts, mean_len = _simulate(False, NUM_SAMPLES, seed=21)
    assert 1.2 < mean_len < K - 0.2  # not vacuous: drafts stop early and also run to K
    assert _pvalue(counts, _exact()) > 0.01


def test_the_distribution_test_rejects_an_argmax_swapped_unsure_guess():
    counts, _ = _simulate(True, NUM_SAMPLES_BROKEN, seed=22)
    assert _pvalue(counts, _exact()) < 1e-6

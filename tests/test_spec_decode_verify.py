"""Invariants of spec_decode/verify.py: greedy verification cases, seeded determinism, and the centrepiece — speculative
sampling reproduces the target's exactly enumerated distribution (chi-square), while deliberately broken
verifiers fail the same test. With penalties on (sampling.adjust_logits), the same holds for the penalised
target, and a mutant that penalises every row from the history before the guesses fails.

The "models" are explicit tables: next-token logits are a function of the last two tokens, so the target's
distribution over the first NUM_TOKENS generated tokens can be enumerated exactly. The simulation batches
what an engine batches (draft sampling and the target forward over all proposals) and calls the real
`rejection_verify` once per sequence per round, as the engine does.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftwise.sampling import SamplingParams, adjust_logits, process_logits, sample
from draftwise.spec_decode.verify import VerifyResult, greedy_verify, rejection_verify, verify
from tests.harness import one_torch_thread  # noqa: F401 (a fixture)

VOCAB = 8
PROMPT = (3, 5)
NUM_TOKENS = 3  # outcomes are the first 3 generated tokens: VOCAB**3 = 512 cells
K = 2  # num_speculative_tokens: rounds end in a correction or a bonus, and sequences need 1-3 rounds
# 50k samples for either draft. Power at 50k (chi-square at p < 0.01, up to ~260 cells): 9 runs in 10 fail a
# verifier whose every outcome is off by 4% of its probability (total variation 2%); the broken verifiers below are
# off by far more and fail at 10k by hundreds of sigma
NUM_SAMPLES = {"model": 50_000, "point_mass": 50_000}
NUM_SAMPLES_BROKEN = 10_000  # the broken verifiers fail by hundreds of sigma; fewer samples keep the file fast

CASES = {  # (temperature, top_k, top_p[, min_p])
    "temperature_1.0": (1.0, 0, 1.0),
    "temperature_0.7_top_p_0.9": (0.7, 0, 0.9),
    "top_k_5": (1.0, 5, 1.0),
    "min_p_0.15": (1.0, 0, 1.0, 0.15),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logit tables indexed [prev2, prev1] -> [VOCAB]; the draft is a noisy target."""
    g = torch.Generator().manual_seed(1234)
    target = 1.5 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)  # [prev2, prev1, vocab_size]
    draft = target + 0.6 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)  # [prev2, prev1, vocab_size]
    return target, draft


def _exact_distribution(target: torch.Tensor, params: tuple[float, int, float]) -> np.ndarray:
    """P(t1, t2, t3) of plain sampling from the processed target, flattened to [VOCAB**3]."""
    probs = process_logits(target, *params).double()  # [prev2, prev1, vocab_size]
    a, b = PROMPT
    p1 = probs[a, b]  # [t1]
    p2 = probs[b]  # [t1, t2]
    p3 = probs  # [t1, t2, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [t1, t2, t3]
    return joint.reshape(-1).numpy()


def _simulate(verify_fn, params, draft_kind: str, num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Run speculative decoding `num_samples` times.

    Returns counts of the first NUM_TOKENS tokens [VOCAB**NUM_TOKENS] and of num_accepted per call [K + 1].
    """
    temperature, top_k, top_p, *min_p = params
    target, draft = _tables()
    draft_probs_table = process_logits(draft, *params)  # [prev2, prev1, vocab_size]
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)
    sequences = [list(PROMPT) for _ in range(num_samples)]
    active = list(range(num_samples))
    accepted_counts = np.zeros(K + 1, dtype=np.int64)
    while active:
        # batched drafting: K tokens per active sequence, from the draft's processed q (or a fixed guess)
        prompt = torch.tensor([sequences[i][-2:] for i in active])  # [B, 2]
        context = prompt
        draft_ids, draft_probs = [], []
        for _ in range(K):
            if draft_kind == "model":
                q = draft_probs_table[context[:, 0], context[:, 1]]  # [B, vocab_size]
                draft_probs.append(q)
                token = sample(q, draft_gen)  # [B]
            else:  # n-gram-like: a deterministic guess, verified as a point mass
                token = draft[context[:, 0], context[:, 1]].argmax(-1)  # [B]
            draft_ids.append(token)
            context = torch.stack([context[:, 1], token], dim=1)
        draft_ids = torch.stack(draft_ids, dim=1)  # [B, K]
        batch_probs = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, K, vocab_size]
        # batched "target forward" over [context, *draft]: row j predicts the token after position j
        ids = torch.cat([prompt, draft_ids], dim=1)  # [B, K + 2]
        target_logits = target[ids[:, :-1], ids[:, 1:]]  # [B, K + 1, vocab_size]
        # unbind: per-sequence views in one call, cheaper than indexing row by row
        rows = zip(draft_ids.unbind(0), target_logits.unbind(0))
        probs_rows = [None] * len(active) if batch_probs is None else batch_probs.unbind(0)
        for i, (draft_row, logits_row), probs_row in zip(active, rows, probs_rows):
            result = verify_fn(draft_row, probs_row, logits_row, temperature, top_k, top_p, verify_gen, *min_p)
            sequences[i].extend(result.token_ids)
            accepted_counts[result.num_accepted] += 1
        active = [i for i in active if len(sequences[i]) < len(PROMPT) + NUM_TOKENS]
    outcomes = np.array([s[len(PROMPT): len(PROMPT) + NUM_TOKENS] for s in sequences])  # [N, NUM_TOKENS]
    codes = (outcomes * VOCAB ** np.arange(NUM_TOKENS - 1, -1, -1)).sum(1)
    return np.bincount(codes, minlength=VOCAB**NUM_TOKENS), accepted_counts


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float, int]:
    """(statistic, p-value, cells) of counts against probs; cells with expected count < 5 are pooled."""
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return float("inf"), 0.0, 0  # an impossible sequence was produced
    expected = probs * n
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    if small.any():
        pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
        if pooled_exp >= 5:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
        else:  # too little mass to stand alone: fold into the smallest regular cell
            j = int(np.argmin(exp))
            obs[j] += pooled_obs
            exp[j] += pooled_exp
    exp = np.array(exp) * (n / np.sum(exp))  # exact sums for scipy (probs sum to 1 up to float error)
    result = chisquare(np.array(obs), exp)
    return float(result.statistic), float(result.pvalue), len(obs)


# --------------------------------------------------------------------------- the distribution test


@pytest.mark.parametrize("draft_kind", ["model", "point_mass"])
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(case, draft_kind):
    params = CASES[case]
    seed = 100 * list(CASES).index(case) + (0 if draft_kind == "model" else 50)
    counts, accepted_counts = _simulate(rejection_verify, params, draft_kind, NUM_SAMPLES[draft_kind], seed)
    # not vacuous: rejections at each position and full acceptances (bonus tokens) all happen often
    assert (accepted_counts / accepted_counts.sum() > 0.05).all(), accepted_counts
    statistic, pvalue, cells = _chi_square(counts, _exact_distribution(_tables()[0], params))
    print(f"{case} {draft_kind}: chi2 {statistic:.1f} over {cells} cells, p = {pvalue:.4g}")
    assert pvalue > 0.01


def _accept_everything(draft_ids, draft_probs, target_logits, temperature, top_k, top_p, generator):
    """Broken on purpose: keeps every draft token, then a bonus from p."""
    p = process_logits(target_logits, temperature, top_k, top_p)  # [k + 1, vocab_size]
    k = draft_ids.shape[0]
    return VerifyResult(k, draft_ids.tolist() + [int(sample(p[k:], generator).item())])


def _correct_from_p(draft_ids, draft_probs, target_logits, temperature, top_k, top_p, generator):
    """Broken on purpose: the right acceptance test, but the correction is drawn from p, not max(0, p - q)."""
    p = process_logits(target_logits, temperature, top_k, top_p)  # [k + 1, vocab_size]
    k = draft_ids.shape[0]
    u = torch.rand(k, generator=generator)
    positions = torch.arange(k)
    accepted = (u * draft_probs[positions, draft_ids] < p[positions, draft_ids]).tolist()
    n = next((i for i, ok in enumerate(accepted) if not ok), k)
    return VerifyResult(n, draft_ids[:n].tolist() + [int(sample(p[n : n + 1], generator).item())])


@pytest.mark.parametrize("broken", [_accept_everything, _correct_from_p], ids=lambda f: f.__name__)
def test_distribution_test_rejects_broken_verifier(broken):
    params = CASES["temperature_1.0"]
    counts, _ = _simulate(broken, params, "model", NUM_SAMPLES_BROKEN, seed=7)
    statistic, pvalue, cells = _chi_square(counts, _exact_distribution(_tables()[0], params))
    print(f"{broken.__name__}: chi2 {statistic:.1f} over {cells} cells, p = {pvalue:.4g}")
    assert pvalue < 1e-6


# --------------------------------------------------------------------------- greedy


def _logits_with_argmax(argmax_ids: list[int], vocab: int = 10) -> torch.Tensor:  # [len, vocab]
    logits = torch.randn(len(argmax_ids), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax_ids)), torch.tensor(argmax_ids)] = 10.0
    return logits


def test_greedy_all_accepted_emits_bonus():
    result = greedy_verify(torch.tensor([4, 1, 7]), _logits_with_argmax([4, 1, 7, 2]))
    assert result == VerifyResult(3, [4, 1, 7, 2])


def test_greedy_first_mismatch_emits_target_token():
    result = greedy_verify(torch.tensor([4, 3, 7]), _logits_with_argmax([4, 1, 7, 2]))
    assert result == VerifyResult(1, [4, 1])  # position 2 matches, but only the prefix counts


def test_greedy_mismatch_at_first_position():
    assert greedy_verify(torch.tensor([5, 1]), _logits_with_argmax([4, 1, 2])) == VerifyResult(0, [4])


def test_greedy_k0_is_plain_decoding():
    result = greedy_verify(torch.zeros(0, dtype=torch.int64), _logits_with_argmax([6]))
    assert result == VerifyResult(0, [6])


def test_verify_dispatches_on_temperature():
    draft, logits = torch.tensor([4, 3]), _logits_with_argmax([4, 1, 2])
    greedy = SamplingParams(temperature=0.0)
    assert verify(draft, None, logits, greedy, None) == greedy_verify(draft, logits)
    sampled = verify(draft, None, logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert len(sampled.token_ids) == sampled.num_accepted + 1


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        greedy_verify(torch.tensor([1, 2]), torch.randn(2, 10))
    with pytest.raises(ValueError):
        rejection_verify(torch.tensor([1]), torch.rand(2, 10), torch.randn(2, 10), 1.0, 0, 1.0, None)


# --------------------------------------------------------------------------- rejection sampling edge cases


def test_rejection_k0_samples_from_target():
    logits = torch.full((1, 10), -30.0)
    logits[0, 3] = 30.0  # p is (numerically) a point mass on 3
    result = rejection_verify(torch.zeros(0, dtype=torch.int64), None, logits, 1.0, 0, 1.0, None)
    assert result == VerifyResult(0, [3])


def test_rejection_identical_draft_is_always_accepted():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 10, generator=g)  # [k + 1, vocab_size]
    q = process_logits(logits[:3], 0.8, 4, 0.95)  # [k, vocab_size] the draft *is* the target
    for _ in range(200):
        draft = sample(q, g)
        assert rejection_verify(draft, q, logits, 0.8, 4, 0.95, g).num_accepted == 3


def test_rejection_token_outside_target_top_k_is_always_rejected():
    g = torch.Generator().manual_seed(4)
    logits = torch.arange(10.0).repeat(2, 1)  # [2, 10] top-2 = {8, 9}
    for probs in (None, torch.full((1, 10), 0.1)):
        for _ in range(100):
            result = rejection_verify(torch.tensor([0]), probs, logits, 1.0, 2, 1.0, g)
            assert result.num_accepted == 0 and result.token_ids[0] in (8, 9)


def test_rejection_point_mass_correction_excludes_the_draft_token():
    g = torch.Generator().manual_seed(5)
    logits = torch.zeros(2, 10)  # uniform target
    logits[0, 2] = 1.0
    for _ in range(300):
        result = rejection_verify(torch.tensor([2]), None, logits, 1.0, 0, 1.0, g)
        assert result.num_accepted == 1 or result.token_ids[0] != 2


def test_rejection_degenerate_residual_falls_back_to_target():
    # an unnormalised q >= p everywhere leaves max(0, p - q) with no mass; the correction must still be valid
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 10, generator=g)
    p = process_logits(logits, 1.0, 3, 1.0)  # [2, 10] support of size 3
    draft = torch.tensor([int(p[0].argmax())])
    support = set(torch.nonzero(p[0]).flatten().tolist())
    rejected = 0
    for _ in range(200):
        result = rejection_verify(draft, 2.0 * p[:1], logits, 1.0, 3, 1.0, g)
        if result.num_accepted == 0:
            rejected += 1
            assert result.token_ids[0] in support
    assert rejected > 0


# --------------------------------------------------------------------------- determinism


def _verify_sequence(seed: int) -> list[VerifyResult]:
    data_gen = torch.Generator().manual_seed(11)  # fixed inputs; only the verifier's generator varies
    generator = torch.Generator().manual_seed(seed)
    results = []
    for step in range(50):
        k = step % 5
        logits = torch.randn(k + 1, 16, generator=data_gen)
        q = process_logits(torch.randn(k, 16, generator=data_gen), 0.9, 0, 0.95)
        draft = sample(q, data_gen) if k else torch.zeros(0, dtype=torch.int64)
        params = SamplingParams(temperature=0.9, top_p=0.95)
        results.append(verify(draft, q if step % 2 else None, logits, params, generator))
    return results


def test_seeded_determinism():
    assert _verify_sequence(seed=42) == _verify_sequence(seed=42)
    assert _verify_sequence(seed=42) != _verify_sequence(seed=43)


# --------------------------------------------------------------------------- penalties (history-dependent p)
PENALTIES = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.8,
                           logit_bias={1: 1.5})
NUM_SAMPLES_PENALTY = 20_000  # per-sequence transforms (the history differs): slower than the batched simulation


def _penalized(rows: torch.Tensor, history: list[int], guesses: list[int]) -> torch.Tensor:  # [n, V] -> [n, V]
    return adjust_logits(rows, PENALTIES, list(PROMPT), history, guesses)


def _pre_guess(rows: torch.Tensor, history: list[int], guesses: list[int]) -> torch.Tensor:
    """Broken on purpose: every row penalised from the history before the guesses (guesses 1..i ignored)."""
    return torch.cat([adjust_logits(rows[i: i + 1], PENALTIES, list(PROMPT), history, []) for i in range(len(rows))])


def _exact_penalized() -> np.ndarray:
    """P(t1, t2, t3) of plain sampling from the penalised target (each step from its own history)."""
    target = _tables()[0]
    joint = np.zeros((VOCAB,) * NUM_TOKENS)

    def probs(prev2, prev1, history):
        return process_logits(_penalized(target[prev2, prev1][None], history, []), 1.0)[0].double().numpy()

    a, b = PROMPT
    p1 = probs(a, b, [])
    for t1 in range(VOCAB):
        p2 = probs(b, t1, [t1])
        for t2 in range(VOCAB):
            joint[t1, t2] = p1[t1] * p2[t2] * probs(t1, t2, [t1, t2])
    return joint.reshape(-1)


def _simulate_penalized(transform, num_samples: int, seed: int) -> np.ndarray:
    """Speculative sampling one sequence at a time: the draft's q and the target's rows both transformed
    (`transform`), the draft's along its own guesses; returns counts of the first NUM_TOKENS tokens."""
    target, draft = _tables()
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(VOCAB**NUM_TOKENS, dtype=np.int64)
    memo: dict = {}  # histories are few: each transformed q and row set is computed once

    for _ in range(num_samples):
        seq = list(PROMPT)
        while len(seq) < len(PROMPT) + NUM_TOKENS:
            history = seq[len(PROMPT):]
            guesses, qs = [], []
            for _ in range(K):
                ctx = (seq + guesses)[-2:]
                key = ("q", *ctx, *history, -1, *guesses)
                if key not in memo:
                    memo[key] = process_logits(_penalized(draft[ctx[0], ctx[1]][None], history + guesses, []), 1.0)
                q = memo[key]  # [1, V]
                qs.append(q[0])
                guesses.append(int(sample(q, gen)[0]))
            ids = seq[-2:] + guesses
            key = ("p", *ids, *history)
            if key not in memo:
                memo[key] = transform(torch.stack([target[ids[j], ids[j + 1]] for j in range(K + 1)]), history, guesses)
            rows = memo[key]  # [K + 1, V]
            result = rejection_verify(torch.tensor(guesses), torch.stack(qs), rows, 1.0, 0, 1.0, gen)
            seq.extend(result.token_ids)
        t = seq[len(PROMPT): len(PROMPT) + NUM_TOKENS]
        counts[(t[0] * VOCAB + t[1]) * VOCAB + t[2]] += 1
    return counts


@pytest.mark.parametrize("transform,passes", [(_penalized, True), (_pre_guess, False)],
                         ids=["per_row_history", "mutant_pre_guess_history"])
def test_penalised_sampling_matches_the_penalised_target(transform, passes):
    exact = _exact_penalized()
    assert np.abs(exact - _exact_distribution(_tables()[0], (1.0, 0, 1.0))).sum() > 0.3  # penalties matter
    counts = _simulate_penalized(transform, NUM_SAMPLES_PENALTY if passes else NUM_SAMPLES_BROKEN, seed=11)
    statistic, pvalue, cells = _chi_square(counts, exact)
    print(f"penalties {transform.__name__}: chi2 {statistic:.1f} over {cells} cells, p = {pvalue:.4g}")
    assert (pvalue > 0.01) if passes else (pvalue < 1e-6)

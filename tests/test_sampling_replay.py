"""Position-addressed randomness (sampling.PositionalGenerator, spec_decode/verify.py) and the engine's side of a
replay (server/engine_host._resume): a request resumed from its prompt plus the tokens it already emitted finishes
with exactly the tokens of the undisturbed run — greedy, seeded sampled, with penalties and min_tokens, under a
grammar and a stop string — and a seeded request's output is the same whatever k an n-gram proposer guesses with
(or none). Planted faults the same checks must catch: a sampler whose replay draws new numbers (a sequential
generator), and a position-addressed stream that ignores the position (chi-square). Unseeded sampling through the
position-addressed draws stays a correct sample of the target (chi-square over many seeds, point-mass and
draft-model drafts). Tiny models from tests/harness.py; in process, no server."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftwise import engine as engine_mod
from draftwise.sampling import PositionalGenerator, SamplingParams, process_logits, sample
from draftwise.server.engine_host import _resume
from draftwise.spec_decode.verify import rejection_verify
from tests.harness import PROMPTS, one_torch_thread, tiny_llm  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CUTS = (1, 5, 23)  # where the engine "dies": tokens the client already has
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
    "greedy_penalties": SamplingParams(temperature=0, max_tokens=48, min_tokens=30, repetition_penalty=1.3,
                                       presence_penalty=0.4),
    "seeded": SamplingParams(temperature=0.9, max_tokens=48, seed=5, ignore_eos=True),
    "seeded_top_p_penalties": SamplingParams(temperature=1.0, top_p=0.9, max_tokens=48, seed=123,
                                             frequency_penalty=0.7, ignore_eos=True),
}


def _llm(k: int | None):
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k}
    return tiny_llm(spec, max_model_len=256)


def _run(llm, prompt: str, params: SamplingParams, emitted: list[int] | None = None) -> list[int]:
    """One request to the end; `emitted`: resumed from them as the server's replay does (engine_host._resume)."""
    req, _ = llm.new_request(prompt, params)
    if emitted:
        _resume(req, emitted)
    llm.run([req])
    return list(req.output_ids)


def _replay_mismatches(llm, prompts, params) -> list[str]:
    """Each prompt undisturbed, then resumed at each cut: what differs (empty: every replay matches)."""
    bad = []
    for p in prompts:
        full = _run(llm, p, params)
        for cut in CUTS:
            if cut >= len(full):
                continue
            again = _run(llm, p, params, full[:cut])
            if again != full:
                bad.append(f"{p!r} resumed at {cut}: differs from position "
                           f"{next(i for i, (a, b) in enumerate(zip(again + [None] * 99, full)) if a != b)}")
    return bad


@pytest.mark.parametrize("case", list(PARAMS))
def test_a_resumed_request_finishes_with_the_undisturbed_tokens(case):
    assert _replay_mismatches(_llm(3), PROMPTS, PARAMS[case]) == []


def test_seeded_output_does_not_depend_on_k():
    params = PARAMS["seeded_top_p_penalties"]
    outs = {k: [_run(_llm(k), p, params) for p in PROMPTS] for k in (None, 1, 3, 5)}
    assert outs[1] == outs[None] and outs[3] == outs[None] and outs[5] == outs[None]


def _sequential_generator(seed, fallback_seed, device="cpu"):
    """Planted fault: a generator that draws in sequence (a replay starts its stream over: new numbers)."""
    return torch.Generator(device=device).manual_seed(seed if seed is not None else fallback_seed)


def test_a_sampler_whose_replay_draws_new_numbers_is_caught(monkeypatch):
    monkeypatch.setattr(engine_mod, "make_generator", _sequential_generator)
    assert _replay_mismatches(_llm(3), PROMPTS, PARAMS["seeded"])  # the same check now reports differences


def test_a_replay_past_a_stop_string_or_max_tokens_is_refused():
    from draftwise.config import ConfigError

    llm = _llm(3)
    full = _run(llm, PROMPTS[0], PARAMS["greedy"])
    text = llm.tokenizer.decode(full[:6])
    req, _ = llm.new_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=48, stop=[text.split()[2]]))
    with pytest.raises(ConfigError, match="stop string"):
        _resume(req, full[:6])
    req, _ = llm.new_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))
    with pytest.raises(ConfigError, match="max_tokens"):
        _resume(req, full[:6])


# ---- the position-addressed draws are a correct sample (chi-square over independent seeds) -----------------------
VOCAB, PROMPT, NUM_TOKENS, K = 8, (3, 5), 3, 2
NUM_SEEDS = 20_000


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits indexed [prev2, prev1] -> [VOCAB]; the draft is a noisy target."""
    g = torch.Generator().manual_seed(1234)
    target = 1.5 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)  # [prev2, prev1, vocab_size]
    return target, target + 0.6 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)


def _exact(target: torch.Tensor) -> np.ndarray:
    probs = process_logits(target, 1.0).double()  # [prev2, prev1, vocab_size]
    a, b = PROMPT
    return (probs[a, b][:, None, None] * probs[b][:, :, None] * probs).reshape(-1).numpy()


class _PositionIgnored(PositionalGenerator):
    """Planted fault: the same numbers at every position."""

    def uniforms(self, position, purpose, n=1):
        return super().uniforms(0, purpose, n)


def _simulate(draft_kind: str, generator_cls=PositionalGenerator) -> np.ndarray:
    """One sequence per seed, verified with position-addressed draws; counts of the first NUM_TOKENS tokens."""
    target, draft = _tables()
    q_table = process_logits(draft, 1.0)  # [prev2, prev1, vocab_size]
    counts = np.zeros(VOCAB**NUM_TOKENS, dtype=np.int64)
    for seed in range(NUM_SEEDS):
        gen = generator_cls(seed)
        seq = list(PROMPT)
        while len(seq) < len(PROMPT) + NUM_TOKENS:
            ctx, guesses, qs = seq[-2:], [], []
            for _ in range(K):
                c = (ctx + guesses)[-2:]
                if draft_kind == "model":
                    qs.append(q_table[c[0], c[1]])
                    guesses.append(int(sample(qs[-1][None], gen)[0]))
                else:
                    guesses.append(int(draft[c[0], c[1]].argmax()))
            ids = ctx + guesses
            rows = torch.stack([target[ids[j], ids[j + 1]] for j in range(K + 1)])  # [K + 1, V]
            res = rejection_verify(torch.tensor(guesses), torch.stack(qs) if qs else None, rows, 1.0, 0, 1.0, gen,
                                   position=len(seq) - len(PROMPT))
            seq.extend(res.token_ids)
        t = seq[len(PROMPT): len(PROMPT) + NUM_TOKENS]
        counts[(t[0] * VOCAB + t[1]) * VOCAB + t[2]] += 1
    return counts


def _pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    if counts[probs == 0].sum():
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("draft_kind,generator_cls,passes", [
    ("point_mass", PositionalGenerator, True), ("model", PositionalGenerator, True),
    ("point_mass", _PositionIgnored, False)], ids=["point_mass", "draft_model", "mutant_position_ignored"])
def test_position_addressed_sampling_matches_the_target(draft_kind, generator_cls, passes):
    p = _pvalue(_simulate(draft_kind, generator_cls), _exact(_tables()[0]))
    print(f"{draft_kind} {generator_cls.__name__}: p = {p:.4g}")
    assert (p > 0.01) if passes else (p < 1e-6)

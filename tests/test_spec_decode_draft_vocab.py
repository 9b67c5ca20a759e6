"""A draft whose head scores only the first `draft_vocab_size` ids plus the EOS ids (FR-Spec;
spec_decode/draft_model.py TrimmedHead): greedy speculative output equals plain output whatever the size; sampling
keeps the target's distribution (exact chi-square on a table model) and fails when q is not zeroed outside the kept
ids; the trimmed head's logits on the kept ids equal the full head's (bitwise for q4x8); bad values are
ConfigErrors naming draft_vocab_size. Tiny random models only; no timing asserts.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from torch import nn

from draftwise.config import ConfigError, parse_spec_config
from draftwise.kernels import q4x8
from draftwise.kernels.linear import DenseBF16, DenseF32, Q4x8Linear, derived_split, make_linear
from draftwise.kernels.plan import resolve_plan
from draftwise.models import quant
from draftwise.sampling import SamplingParams, process_logits, sample
from draftwise.spec_decode.draft_model import DraftModelProposer, TrimmedHead, kept_ids
from draftwise.spec_decode.verify import rejection_verify
from tests.harness import PROMPTS, json_llm, noisy_draft, one_torch_thread, tiny_llm  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_EOS = 63  # tests/harness.py tiny_tokenizer: the last of 64 ids


def _q4x8_or_skip():
    try:
        q4x8.load()
    except q4x8.KernelBuildError as e:
        pytest.skip(f"q4x8 kernel unavailable: {e}")


def _spec_config(n, k=4, **kw):
    return {"method": "draft_model", "model": "noisy-draft", "num_speculative_tokens": k, "draft_vocab_size": n, **kw}


# --------------------------------------------------------------------------- (a) greedy == plain


@pytest.mark.parametrize("draft_format", ["dense", "q4x8"])
def test_greedy_trimmed_draft_equals_plain(draft_format):
    llm = tiny_llm(k_max=6)
    if draft_format == "q4x8":
        _q4x8_or_skip()
        tok = llm.tokenizer

        def load(name, dtype, weights):
            d = noisy_draft()
            quant.build_linears(d, resolve_plan("q4x8", "auto", None))
            return d, tok, {"name": name}

        llm._load_draft = load
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    emitted = {t for ids in plain for t in ids}
    sizes = [64, 48, 16, 8, 1]
    assert min(sizes[1:]) <= min(emitted)  # not vacuous: some sizes leave out every id the target emits
    for n in sizes:
        for k in (1, 4):
            llm.set_speculation(_spec_config(n, k))
            head = llm.proposer.head
            assert (head is None) == (n == 64)
            if head is not None:
                assert TINY_EOS in head.rest_ids.tolist() or n > TINY_EOS
            outs = llm.generate(PROMPTS, params)
            assert [o.outputs[0].token_ids for o in outs] == plain, (draft_format, n, k)
            if n == 1:
                assert sum(o.spec["num_accepted_tokens"] for o in outs) == 0  # id 0 / EOS are never the argmax


def test_greedy_constrained_trimmed_draft_equals_plain():
    """Under a grammar the trimmed head may admit no allowed id: the draft then stops guessing (no error)."""
    llm = json_llm(k_max=6)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs={"json": schema, "disable_any_whitespace": True})
    prompts = ['{"name": "Ada", "age": 36} user', "user positive"]
    llm.set_speculation(None)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for n in (200, 40, 8):
        for spec_config in (_spec_config(n), {"method": "grammar", "num_speculative_tokens": 4,
                                "then": {"method": "draft_model", "model": "noisy-draft", "draft_vocab_size": n}}):
            llm.set_speculation(spec_config)
            outs = llm.generate(prompts, params)
            assert [o.outputs[0].token_ids for o in outs] == plain, (n, spec_config)


def test_sampled_guesses_stay_in_the_kept_ids():
    llm = tiny_llm(k_max=6)
    llm.set_speculation(_spec_config(12))
    proposer = llm.proposer
    kept = set(proposer.head.rest_ids.tolist()) | set(range(12))
    gen = torch.Generator().manual_seed(3)
    proposer.begin(0, [5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=8), gen)
    for _ in range(20):
        draft = proposer.propose([0], [4])[0]
        assert set(draft.token_ids.tolist()) <= kept
        outside = torch.ones(draft.probs.shape[-1], dtype=torch.bool)
        outside[sorted(kept)] = False
        assert draft.probs[:, outside].sum() == 0  # q is 0 off the kept ids ...
        assert torch.allclose(draft.probs.sum(-1), torch.ones(len(draft.token_ids)))  # ... and sums to 1 on them
        proposer.accept(0, 1, 5)


# --------------------------------------------------------------------------- (b) sampling keeps p

VOCAB = 8
KEPT_PREFIX, EOS = 5, 7  # kept ids: 0..4 and 7; 5 and 6 only ever come from the target
PROMPT = (3, 5)
NUM_TOKENS = 3  # outcomes: the first 3 generated tokens, VOCAB**3 = 512 cells
K = 2
NUM_SAMPLES, NUM_SAMPLES_BROKEN = 60_000, 20_000


def _tables() -> tuple[torch.Tensor, torch.Tensor, nn.Linear]:
    """Target logits [prev2, prev1, V], the draft's hidden states [prev2, prev1, V] and its (full) head."""
    g = torch.Generator().manual_seed(4321)
    target = 1.5 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)
    hidden = target + 0.6 * torch.randn(VOCAB, VOCAB, VOCAB, generator=g)
    head = nn.Linear(VOCAB, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(VOCAB))  # the full head gives the noisy target back
    return target, hidden, head


def _simulate(zero_outside: bool, num_samples: int, seed: int) -> np.ndarray:
    """Speculative sampling at temperature 1 with a trimmed draft; counts of the first NUM_TOKENS tokens.
    Guesses are always drawn from the trimmed head's q; `zero_outside=False` hands the verifier the full head's q
    instead (broken on purpose: not the distribution the guesses came from)."""
    target, hidden, head = _tables()
    trimmed = TrimmedHead(head, VOCAB, kept_ids(KEPT_PREFIX, VOCAB, [EOS]))
    with torch.no_grad():
        q_kept = process_logits(trimmed(hidden), 1.0)  # [prev2, prev1, V], 0 at 5 and 6
        q_full = process_logits(head(hidden), 1.0)
    q_told = q_kept if zero_outside else q_full
    draft_gen, verify_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    sequences = [list(PROMPT) for _ in range(num_samples)]
    active = list(range(num_samples))
    while active:
        prompt = torch.tensor([sequences[i][-2:] for i in active])  # [B, 2]
        context, ids, told = prompt, [], []
        for _ in range(K):
            token = sample(q_kept[context[:, 0], context[:, 1]], draft_gen)  # [B]
            ids.append(token)
            told.append(q_told[context[:, 0], context[:, 1]])  # [B, V]
            context = torch.stack([context[:, 1], token], dim=1)
        draft_ids = torch.stack(ids, dim=1)  # [B, K]
        draft_probs = torch.stack(told, dim=1)  # [B, K, V]
        full = torch.cat([prompt, draft_ids], dim=1)  # [B, K + 2]
        logits = target[full[:, :-1], full[:, 1:]]  # [B, K + 1, V]
        for i, d, q, lg in zip(active, draft_ids.unbind(0), draft_probs.unbind(0), logits.unbind(0)):
            sequences[i].extend(rejection_verify(d, q, lg, 1.0, 0, 1.0, verify_gen).token_ids)
        active = [i for i in active if len(sequences[i]) < len(PROMPT) + NUM_TOKENS]
    outcomes = np.array([s[len(PROMPT): len(PROMPT) + NUM_TOKENS] for s in sequences])  # [N, NUM_TOKENS]
    return np.bincount((outcomes * VOCAB ** np.arange(NUM_TOKENS - 1, -1, -1)).sum(1), minlength=VOCAB**NUM_TOKENS)


def _exact_distribution() -> np.ndarray:  # P(t1, t2, t3) of plain sampling from the target [VOCAB**3]
    probs = process_logits(_tables()[0], 1.0).double()  # [prev2, prev1, V]
    a, b = PROMPT
    return (probs[a, b][:, None, None] * probs[b][:, :, None] * probs).reshape(-1).numpy()


def _pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of counts against probs; cells expecting fewer than 5 are pooled into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    obs.append(counts[~big].sum())
    exp.append(expected[~big].sum())
    exp = np.array(exp) * (n / np.sum(exp))
    return float(chisquare(np.array(obs), exp).pvalue)


def test_trimmed_draft_keeps_target_distribution():
    counts = _simulate(zero_outside=True, num_samples=NUM_SAMPLES, seed=11)
    first = counts.reshape(VOCAB, VOCAB, VOCAB).sum((1, 2))
    assert first[[5, 6]].sum() > 0.05 * NUM_SAMPLES  # not vacuous: ids the draft never proposes are emitted
    assert _pvalue(counts, _exact_distribution()) > 0.01


def test_distribution_test_rejects_q_not_zeroed_outside_the_kept_ids():
    counts = _simulate(zero_outside=False, num_samples=NUM_SAMPLES_BROKEN, seed=12)
    assert _pvalue(counts, _exact_distribution()) < 1e-6


# --------------------------------------------------------------------------- (c) trimmed head == full head


def _q4x8_head(V: int, H: int, bias: bool) -> Q4x8Linear:
    g = torch.Generator().manual_seed(5)
    return Q4x8Linear(torch.randn(V, H, generator=g), torch.randn(V, generator=g) if bias else None)


@pytest.mark.parametrize("n", [16, 40, 160, 199])
@pytest.mark.parametrize("bias", [False, True])
def test_q4x8_trimmed_head_is_bitwise_the_full_head(n, bias):
    _q4x8_or_skip()
    V, H = 200, 64
    head = _q4x8_head(V, H, bias)
    ids = kept_ids(n, V, [197, 150, 3])
    trimmed = TrimmedHead(head, V, ids)
    assert trimmed.first.packed.data_ptr() == head.packed.data_ptr()  # the prefix is a view: no copy
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(6))
    full, got = head(x), trimmed(x)  # [3, 5, V]
    assert torch.equal(got[..., ids], full[..., ids])
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[..., outside]).all()
    assert trimmed.rows_read == n + (16 if n <= 150 else 0) + (16 if n <= 197 else 0)  # prefix + EOS blocks


def test_q4x8_trimmed_head_inside_a_split_linear():
    _q4x8_or_skip()
    V, H = 200, 64
    split = derived_split(_q4x8_head(V, H, False), "fp32", None)
    ids = kept_ids(48, V, [190])
    trimmed = TrimmedHead(split, V, ids)
    for T in (1, 20):  # the step half (q4x8, bitwise) and the prefill half (dense rows)
        x = torch.randn(2, T, H, generator=torch.Generator().manual_seed(T))
        full, got = split(x), trimmed(x)
        if T == 1:
            assert torch.equal(got[..., ids], full[..., ids])
        else:
            torch.testing.assert_close(got[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "fp32", "bf16", "int8", "int4"])
def test_dense_trimmed_head_matches_the_full_head(kind):
    V, H = (112 if kind == "int4" else 100), 32
    g = torch.Generator().manual_seed(8)
    w, b = torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    if kind == "linear":
        head = nn.Linear(H, V)
        with torch.no_grad():
            head.weight.copy_(w)
            head.bias.copy_(b)
    elif kind == "fp32":
        head = DenseF32(w, b)
    elif kind == "bf16":
        head = DenseBF16(w, b)
    else:  # int8 gathers its rows; int4's packed layout has none: the whole head, then the kept ids
        head = make_linear(kind, w, b)
    ids = kept_ids(30, V, [99, 64])
    trimmed = TrimmedHead(head, V, ids)
    x = torch.randn(4, H, generator=g)
    full, got = head(x).detach(), trimmed(x).detach()
    tol = 1e-5 if kind in ("linear", "fp32") else 2e-2
    torch.testing.assert_close(got[..., ids], full[..., ids], rtol=tol, atol=tol)
    assert trimmed.rows_read == (V if kind == "int4" else 32)


def test_kept_ids_add_eos_once_and_in_order():
    assert kept_ids(4, 10, [9, 2, 9, 7, 12]).tolist() == [0, 1, 2, 3, 7, 9]  # 2 already kept, 12 beyond the vocab
    assert kept_ids(10, 10, [9]).tolist() == list(range(10))


def test_full_size_is_todays_head():
    draft = noisy_draft()
    proposer = DraftModelProposer(draft, 1, 64, 64, draft_vocab_size=64, eos_token_ids=(TINY_EOS,))
    assert proposer.head is None
    proposer = DraftModelProposer(draft, 1, 64, 64, draft_vocab_size=None)
    assert proposer.head is None


# --------------------------------------------------------------------------- (d) config errors


@pytest.mark.parametrize("bad", [0, -3, 1.5, "32768", True, [16]])
def test_bad_draft_vocab_size_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        parse_spec_config(_spec_config(bad))
    with pytest.raises(ConfigError, match="draft_vocab_size"):  # inside the grammar method's `then` too
        parse_spec_config({"method": "grammar", "num_speculative_tokens": 4,
                           "then": {"method": "draft_model", "model": "d", "draft_vocab_size": bad}})


def test_draft_vocab_size_parses_and_only_applies_to_draft_model():
    assert parse_spec_config(_spec_config(32768)).draft_vocab_size == 32768
    assert parse_spec_config(_spec_config(None)).draft_vocab_size is None
    then = parse_spec_config({"method": "grammar", "num_speculative_tokens": 4,
                              "then": {"method": "draft_model", "model": "d", "draft_vocab_size": 16}}).then
    assert then.draft_vocab_size == 16
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        parse_spec_config({"method": "ngram", "num_speculative_tokens": 4, "draft_vocab_size": 16})


def test_draft_vocab_size_beyond_the_drafts_vocabulary_is_a_config_error():
    llm = tiny_llm(k_max=6)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        llm.set_speculation(_spec_config(65))

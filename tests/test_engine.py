"""Engine invariants on tiny random models: speculative greedy output equals plain greedy output token for
token (n-gram and draft-model proposers, k = 1..8, several prompts batched), seeded sampling reproduces,
and stats add up."""
import pytest
import torch

from draftwise.config import ConfigError, ContextLengthError
from draftwise.engine import Engine, Request
from draftwise.sampling import SamplingParams
from draftwise.spec_decode.adaptive import FixedK
from draftwise.spec_decode.draft_model import DraftModelProposer
from draftwise.spec_decode.ngram import NgramProposer, lookup
from draftwise.spec_decode.proposer import NoProposer
from tests.harness import engine_run
from tests.tiny_models import tiny_decoder

import numpy as np

MAX_LEN = 96


@pytest.fixture(scope="module")
def target():
    return tiny_decoder("qwen2", seed=0, vocab_size=64)


@pytest.fixture(scope="module")
def drafts(target):
    exact = tiny_decoder("qwen2", seed=0, vocab_size=64)  # same weights: every guess accepted
    noisy = tiny_decoder("qwen2", seed=0, vocab_size=64)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    other = tiny_decoder("llama", seed=7, vocab_size=64, num_layers=1)  # unrelated small model
    return {"exact": exact, "noisy": noisy, "other": other}


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 6, 5, 5, 5, 5], [10, 20, 30, 40, 50, 60, 10, 20]]


def run_engine(target, proposer, k, prompts=PROMPTS, params=None, max_num_seqs=4, k_policy=None):
    params = params or SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return engine_run(target, proposer, k, prompts, params, max_num_seqs, MAX_LEN, k_policy=k_policy)


def plain(target, **kw):
    return run_engine(target, NoProposer(), 0, **kw)[0]


def draft_proposer(model):
    return DraftModelProposer(model, num_slots=4, capacity=MAX_LEN + 16, target_vocab_size=64)


@pytest.mark.parametrize("k", range(1, 9))
def test_ngram_greedy_equals_plain(target, k):
    outs, eng, _ = run_engine(target, NgramProposer(1, 3), k)
    assert outs == plain(target)
    assert eng.stats.num_drafts > 0


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("which", ["exact", "noisy", "other"])
def test_draft_model_greedy_equals_plain(target, drafts, k, which):
    outs, eng, _ = run_engine(target, draft_proposer(drafts[which]), k)
    assert outs == plain(target)
    s = eng.stats
    assert s.num_draft_tokens >= s.num_accepted_tokens
    if which == "exact":  # every guess accepted: exercises the "draft never saw its last guess" path
        assert s.num_accepted_tokens == s.num_draft_tokens


def test_queueing_beyond_max_num_seqs(target, drafts):
    outs, _, _ = run_engine(target, draft_proposer(drafts["noisy"]), 3, max_num_seqs=2)
    assert outs == plain(target)


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_seeded_sampling_reproduces(target, drafts, method):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=123, ignore_eos=True)

    def once():
        prop = {"none": NoProposer(), "ngram": NgramProposer(1, 3), "draft": draft_proposer(drafts["noisy"])}[method]
        return run_engine(target, prop, 0 if method == "none" else 4, params=params)[0]

    a, b = once(), once()
    assert a == b
    assert any(len(set(o)) > 1 for o in a)


def test_stop_conditions_and_context_error(target):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = plain(target)[0]
    stop_tok = ref[5]
    outs, _, reqs = run_engine(target, NgramProposer(1, 3), 4, prompts=[PROMPTS[0]],
                               params=SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok]))
    assert outs[0] == ref[: ref.index(stop_tok) + 1] and reqs[0].finish_reason == "stop"
    eng = Engine(target, NoProposer(), 0, 1, MAX_LEN, eos_token_ids=())
    with pytest.raises(ContextLengthError, match="90 tokens.*exceeds the context length of 96"):
        eng.add_request(Request("x", [1] * 90, SamplingParams(max_tokens=10)))
    assert run_engine(target, NoProposer(), 0, params=params)[2][0].finish_reason == "length"


def test_ngram_lookup_prefers_longest_latest_match():
    toks = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], dtype=np.int64)
    assert lookup(toks, 1, 3, 2) == [7, 8]  # "2 3" last seen before "7 8"
    assert lookup(np.array([4, 5, 6]), 1, 3, 3) == []
    assert lookup(np.array([4, 5, 4]), 1, 3, 3) == [5, 4]


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4+dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equivalence_holds_for_quantized_weights(fmt, dtype):
    from draftwise.kernels.plan import resolve_plan
    from draftwise.models.quant import build_linears

    target = tiny_decoder("qwen2", seed=0, vocab_size=64, dtype=dtype)
    draft = tiny_decoder("qwen2", seed=0, vocab_size=64, dtype=dtype)
    plan = resolve_plan(fmt, "bfloat16" if dtype == torch.bfloat16 else "float32", None)
    assert build_linears(target, plan) > 0 and build_linears(draft, plan) > 0
    ref = plain(target)
    for proposer, k in ((NgramProposer(1, 3), 4), (draft_proposer(draft), 3)):
        assert run_engine(target, proposer, k)[0] == ref


def _lively(noise: float = 0.0):
    """The tiny target with its weights scaled up, so greedy output varies (the default init repeats one token,
    which hides bugs that put the wrong token at a position); noise > 0: a draft that sometimes disagrees."""
    model = tiny_decoder("qwen2", seed=0, vocab_size=64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(16).add_(noise * torch.randn_like(p))
    return model


def test_adaptive_k_stays_exact():
    from draftwise.spec_decode.adaptive import AdaptiveK

    target = _lively()
    torch.manual_seed(1)
    proposer = draft_proposer(_lively(noise=0.3))
    policy = AdaptiveK.calibrate(target, 6, proposer, max_batch=4)
    assert policy.draft_time([6]) >= policy.draft_time([1]) > 0 and policy.catch_up_cost >= 0
    outs, _, _ = run_engine(target, proposer, 6, k_policy=policy)
    assert outs == plain(target)
    assert sum(policy.k_histogram.values()) > 0



def test_an_aborted_request_does_not_move_the_typical_length(target):
    """The engine tells the policy why a request ended: one aborted mid-way leaves the typical output length (which
    a draft's catch-up is spread over) where the finished one put it."""
    from draftwise.spec_decode.adaptive import AdaptiveK

    policy = AdaptiveK(4, {w: 0.01 for w in range(1, 6)})
    eng = Engine(target, NgramProposer(1, 3), 4, 2, MAX_LEN, eos_token_ids=(0,), k_policy=policy)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    done, cut = Request("done", PROMPTS[0], params), Request("cut", PROMPTS[1], params)
    for r in (done, cut):
        eng.add_request(r)
    eng.step()
    eng.step()
    eng.abort("cut")
    while eng.has_unfinished():
        eng.step()
    assert cut.finish_reason == "abort" and 0 < len(cut.output_ids) < 24
    assert done.finish_reason == "length" and policy.typical_length == 24
    assert policy.remaining(Request("next", PROMPTS[2], params, output_ids=[5] * 4)) == 20

class _RandomK:
    """k drawn per step from 0..k_max, runs of plain steps included: the draft must catch up after them."""

    def __init__(self, k_max: int, seed: int):
        self.k_max, self.rng, self.chosen = k_max, np.random.default_rng(seed), []

    def choose(self, req) -> int:
        self.chosen.append(int(self.rng.choice([0, 0, 0, *range(1, self.k_max + 1)])))
        return self.chosen[-1]

    def observe(self, req, k, num_accepted):
        pass

    def end(self, req):
        pass


class _MixedBatchK:
    """One decision per step for the whole batch (choose_batch): a different k per row, 0 included, drawn afresh
    each step; records every step's ks."""

    def __init__(self, k_max: int, seed: int):
        self.k_max, self.rng, self.steps = k_max, np.random.default_rng(seed), []

    def choose(self, req) -> int:  # the prefill's first guesses (a batch of one)
        return int(self.rng.integers(0, self.k_max + 1))

    def choose_batch(self, reqs, caps):
        ks = [int(self.rng.choice([0, *range(1, self.k_max + 1)])) for _ in reqs]
        self.steps.append(ks)
        return ks

    def observe(self, req, k, num_accepted):
        pass

    def end(self, req):
        pass


LONG_PROMPTS = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [11, 12, 11, 12, 11], [40, 41, 42]]


@pytest.mark.parametrize("method", ["ngram", "noisy"])
def test_greedy_with_mixed_k_per_row_equals_plain_at_every_batch_size(method):
    """Batch sizes 1..8, each step's rows guessing different k (0 included, the batch padded to the widest):
    greedy output is plain decoding's, token for token (row-exact: a row's bits never depend on its batch)."""
    target = _lively()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = run_engine(target, NoProposer(), 0, prompts=LONG_PROMPTS, params=params, max_num_seqs=8)[0]
    for batch in range(1, 9):
        torch.manual_seed(1)
        proposer = (NgramProposer(1, 3) if method == "ngram"
                    else DraftModelProposer(_lively(0.3), num_slots=batch, capacity=MAX_LEN + 16, target_vocab_size=64))
        policy = _MixedBatchK(6, seed=batch)
        outs, eng, _ = run_engine(target, proposer, 6, prompts=LONG_PROMPTS[:batch], params=params,
                                  max_num_seqs=batch, k_policy=policy)
        assert outs == ref[:batch], f"batch {batch}"
        mixed = [ks for ks in policy.steps if len(ks) > 1 and 0 in ks and any(ks)]
        assert batch == 1 or mixed, f"batch {batch}: no step mixed plain and guessing rows"
        assert sum(eng.stats.decisions.values()) == len(policy.steps)


@pytest.mark.parametrize("method", ["ngram", "noisy", "exact"])
def test_any_sequence_of_k_stays_exact(method):
    """Greedy output is the same whatever k each step takes, plain steps (k = 0) in between included."""
    target = _lively()
    ref = plain(target)
    assert all(len(set(o)) > 5 for o in ref)
    torch.manual_seed(1)
    proposer = NgramProposer(1, 3) if method == "ngram" else draft_proposer(_lively(0.3 if method == "noisy" else 0))
    policy = _RandomK(6, seed=3)
    outs, eng, _ = run_engine(target, proposer, 6, k_policy=policy)
    assert outs == ref
    assert eng.stats.num_accepted_tokens > 0
    assert policy.chosen.count(0) > 5 and len(set(policy.chosen)) == 7


def test_guesses_discarded_after_a_stop_are_not_counted_as_accepted(target, drafts):
    """Draft == target: every guess is accepted. A stop string completing at output token i (the on_token
    callback, as TextStream reports it) inside the accepted run discards the rest of the run; the stats and the
    step output count only the emitted guesses."""
    ref = plain(target)[0]
    i = 5
    seen = []

    def stop_at_i(token_id: int) -> bool:
        seen.append(token_id)
        return len(seen) == i + 1

    eng = Engine(target, draft_proposer(drafts["exact"]), 8, 1, MAX_LEN, eos_token_ids=())
    req = Request("s", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24), on_token=stop_at_i)
    eng.add_request(req)
    outputs = []
    while eng.has_unfinished():
        outputs.extend(eng.step())
    assert req.output_ids == ref[: i + 1] and req.finish_reason == "stop"
    # prefill emitted ref[0]; one step guessed ref[1..8], all accepted, and stopped at ref[i]
    assert req.spec_stats.num_draft_tokens == 8 and req.spec_stats.num_accepted_tokens == i
    assert eng.stats.num_accepted_tokens == i
    assert [(o.k, o.num_accepted, len(o.new_token_ids)) for o in outputs] == [(0, 0, 1), (8, i, i)]


# ---- a draft with fewer embedding rows than the target ---------------------------------
SHARED = 48  # the small draft embeds ids 0..47; the target has 64 rows
SHARED_PROMPTS = [[t % SHARED for t in p] for p in PROMPTS]


class FavourIds(torch.nn.Module):
    """The target with its logits for ids >= `start` (the rows the draft cannot embed) boosted, so an unmasked
    engine would pick them."""

    def __init__(self, inner, start: int, boost: float = 20.0):
        super().__init__()
        self.inner, self.start, self.boost = inner, start, boost
        self.config, self.dtype, self.device = inner.config, inner.dtype, inner.device

    @torch.inference_mode()
    def forward(self, *args, **kwargs):
        logits = self.inner(*args, **kwargs).clone()
        logits[..., self.start:] += self.boost
        return logits


def small_vocab_proposer():
    return draft_proposer(tiny_decoder("qwen2", seed=3, vocab_size=SHARED))


@pytest.mark.parametrize("favour_padded", [False, True])
def test_sampling_is_masked_to_the_vocabulary_a_smaller_draft_shares(target, favour_padded):
    """Greedy speculative == greedy plain under the same mask (the draft proposer with k = 0), and no emitted id,
    greedy or sampled, is one the draft cannot embed — even when the target's logits favour those ids."""
    tgt = FavourIds(target, SHARED) if favour_padded else target
    speculative, _, reqs = run_engine(tgt, small_vocab_proposer(), 3, prompts=SHARED_PROMPTS)
    masked_plain, _, _ = run_engine(tgt, small_vocab_proposer(), 3, prompts=SHARED_PROMPTS, k_policy=FixedK(0))
    assert speculative == masked_plain
    assert all(r.finish_reason == "length" for r in reqs)
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    outs, _, reqs = run_engine(tgt, small_vocab_proposer(), 3, prompts=SHARED_PROMPTS, params=sampled)
    assert all(r.finish_reason == "length" for r in reqs)
    ids = [t for o in speculative + outs for t in o]
    assert max(ids) < SHARED
    if not favour_padded:  # without the boost the mask changes nothing: plain unmasked decoding agrees
        assert speculative == plain(target, prompts=SHARED_PROMPTS)
    assert small_vocab_proposer().vocab_limit == SHARED


def test_prompt_ids_a_smaller_draft_cannot_embed_are_refused(target):
    eng = Engine(target, small_vocab_proposer(), 3, 2, MAX_LEN, eos_token_ids=(0,))
    with pytest.raises(ConfigError, match="prompt token id 50 "):
        eng.add_request(Request("r", [1, 2, 50], SamplingParams(max_tokens=4)))
    assert not eng.has_unfinished()
    for proposer in (NoProposer(), NgramProposer(1, 3)):
        assert proposer.vocab_limit is None
        Engine(target, proposer, 3, 2, MAX_LEN, eos_token_ids=(0,)).add_request(Request("r", [50], SamplingParams()))


# ---- a failing step fails only the request(s) it can be pinned on ----------------------
def inject_failures(target, monkeypatch, when):
    """Make the target's forward raise MemoryError whenever `when(token_ids, is_prefill)` is true."""
    forward = target.forward

    def flaky(token_ids, positions, cache, slots, **kw):
        if when(token_ids, "logit_index" in kw):
            raise MemoryError("injected: out of memory")
        return forward(token_ids, positions, cache, slots, **kw)

    monkeypatch.setattr(target, "forward", flaky)


def test_a_failing_prefill_fails_only_the_prompt_that_caused_it(target, monkeypatch):
    ref = plain(target)
    long_prompt = list(range(1, 41))
    inject_failures(target, monkeypatch, lambda ids, prefill: prefill and ids.shape[1] >= len(long_prompt))
    outs, eng, reqs = run_engine(target, NgramProposer(1, 3), 3, prompts=PROMPTS + [long_prompt], max_num_seqs=5)
    assert reqs[-1].finish_reason == "error" and "MemoryError: injected" in reqs[-1].error
    assert outs[:-1] == ref and all(r.finish_reason == "length" and r.error is None for r in reqs[:-1])
    assert not eng.has_unfinished() and eng.num_free_slots == 5


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_failing_decode_step_is_retried_once_exactly(target, drafts, monkeypatch, method):
    """One decode forward fails: the step is rolled back (target cache, draft cache, generators) and retried,
    so the seeded sampled output is exactly that of a run without the failure."""
    params = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=11)
    make = (lambda: NgramProposer(1, 3)) if method == "ngram" else (lambda: draft_proposer(drafts["noisy"]))
    ref, _, _ = run_engine(target, make(), 3, params=params)
    decode_calls = []

    def third_decode_forward(token_ids, prefill):
        if not prefill:
            decode_calls.append(token_ids.shape)
        return not prefill and len(decode_calls) == 3

    inject_failures(target, monkeypatch, third_decode_forward)
    outs, _, reqs = run_engine(target, make(), 3, params=params)
    assert len(decode_calls) > 3 and decode_calls[2] == decode_calls[3]  # failed mid-run, then the same step again
    assert outs == ref and all(r.finish_reason == "length" for r in reqs)


def test_a_decode_step_failing_twice_fails_its_requests_and_the_engine_goes_on(target, drafts, monkeypatch):
    eng = Engine(target, draft_proposer(drafts["noisy"]), 3, 4, MAX_LEN, eos_token_ids=(0,))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    inject_failures(target, monkeypatch, lambda ids, prefill: not prefill)
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()  # never raises
    assert all(r.finish_reason == "error" and "MemoryError" in r.error and len(r.output_ids) == 1 for r in reqs)
    assert eng.num_free_slots == 4
    monkeypatch.undo()
    again = Request("again", PROMPTS[0], params)
    eng.add_request(again)
    while eng.has_unfinished():
        eng.step()
    assert again.output_ids == plain(target)[0]

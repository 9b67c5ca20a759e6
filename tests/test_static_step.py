"""The static step (models/static_step.py) and device-side speculation (spec_decode/static_spec.py) on tiny
random models: with our row-exact attention op its rows are bitwise Decoder.forward's; with row-exact linears
a row's logits do not depend on the bucket it ran in (SDPA over the slot's whole capacity included;
bitwise where torch's CPU SDPA is itself bucket-free, to 1e-5 where its GEMMs' blocking is not); greedy
output equals today's engine token for token (plain, n-gram k 1..8, a draft model, the suffix proposer on the
host; 1..8 sequences of mixed widths); the tensor n-gram lookup is spec_decode/ngram.py's; rejection
sampling keeps the target's distribution (chi-square)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.models.static_step import StaticStep
from draftwise.sampling import SamplingParams
from draftwise.spec_decode.ngram import lookup
from draftwise.spec_decode.proposer import NoProposer
from draftwise.spec_decode.static_spec import StaticSpecDecoder, ngram_lookup, rejection_accept
from draftwise.spec_decode.suffix import SuffixProposer
from draftwise.kv_cache import KVCache
from tests.harness import engine_run, one_torch_thread, row_exact  # noqa: F401 (fixture)
from tests.tiny_models import tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
CAPACITY = 128
MAX_TOKENS = 24
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 6, 5, 5, 5, 5], [10, 20, 30, 40, 50, 60, 10, 20],
           [7, 7, 8, 7, 7, 8, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [11], [2, 4, 2, 4, 2]]


@pytest.fixture(scope="module")
def target():
    return tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def plain_outputs(target):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return engine_run(target, NoProposer(), 0, PROMPTS, params, max_num_seqs=8, max_len=96, eos=())[0]


def static_outputs(decoder, prompts, method=None, k=4, slots=8, attention=None, draft=None, proposer=None):
    step = StaticStep(decoder, slots, CAPACITY, attention)
    draft_step = StaticStep(draft, slots, CAPACITY, attention) if draft is not None else None
    runner = StaticSpecDecoder(step, (), method, k, draft=draft_step, proposer=proposer)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return runner.generate(prompts, MAX_TOKENS, params), runner


def test_op_rows_are_bitwise_decoder_forward_rows():
    model = row_exact(tiny_decoder("qwen2", seed=0, vocab_size=VOCAB))
    cfg = model.config
    ids = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(3))
    cache = KVCache(len(cfg.layer_types), 1, cfg.num_kv_heads, 64, cfg.head_dim, model.dtype)
    ref = model(ids, torch.arange(13)[None], cache, torch.tensor([0]), num_tokens=[13])[0]  # [13, V]
    for width, batch in ((1, 1), (2, 2), (4, 8), (16, 4)):
        step = StaticStep(model, 8, 64, "op")
        rows = []
        for start in range(0, 13, width):
            tok = torch.zeros(batch, width, dtype=torch.int64)
            chunk = ids[0, start : start + width]
            tok[0, : chunk.numel()] = chunk
            pos = torch.arange(width)[None].repeat(batch, 1)
            pos[0] += start
            slots = torch.tensor([5] + [step.scratch_slot] * (batch - 1))
            rows.append(step(tok, pos, slots)[0, : chunk.numel()])
        assert torch.equal(torch.cat(rows), ref), (width, batch)


def test_sdpa_rows_do_not_depend_on_the_bucket_with_row_exact_linears():
    model = row_exact(tiny_decoder("qwen2", seed=0, vocab_size=VOCAB))
    model.use_fused_glue(False)
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(4))
    results = {}
    for width, batch in ((1, 1), (2, 2), (4, 8), (8, 4), (16, 1)):
        step = StaticStep(model, 8, 64, "sdpa")
        rows = []
        for start in range(0, 16, width):
            tok = torch.randint(0, VOCAB, (batch, width))  # other sequences: random ids in other slots
            tok[0] = ids[start : start + width]
            pos = torch.arange(width)[None].repeat(batch, 1) + start
            rows.append(step(tok, pos, torch.arange(batch))[0])
        results[(width, batch)] = torch.cat(rows)
    base = results[(1, 1)]
    bitwise = _torch_sdpa_rows_are_bucket_free()
    for key, rows in results.items():
        torch.testing.assert_close(rows, base, rtol=1e-5, atol=1e-5, msg=str(key))
        if bitwise:  # torch's own SDPA keeps a row's bits whatever the bucket here: so must the step around it
            assert torch.equal(rows, base), key


def _torch_sdpa_rows_are_bucket_free() -> bool:
    """Whether torch's CPU SDPA on this machine gives a query row the same bits at every query width and batch
    (its GEMMs' blocking decides: on a Sapphire Rapids class CPU it does, on Zen 4 rows differ by ~2e-7). Where
    it does not, the step's rows can only be compared to a tolerance: the static step is the GPU's path."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(8, 4, 16, 16, generator=g), torch.randn(8, 2, 64, 16, generator=g), torch.randn(8, 2, 64, 16, generator=g)
    key_pos = torch.arange(64)

    def rows(width, batch):
        out = []
        for start in range(0, 16, width):
            mask = key_pos <= (torch.arange(width)[None].repeat(batch, 1) + start)[:, None, :, None]
            out.append(torch.nn.functional.scaled_dot_product_attention(
                q[:batch, :, start : start + width], k[:batch], v[:batch], attn_mask=mask, enable_gqa=True)[0])
        return torch.cat(out, 1)

    base = rows(1, 1)
    return all(torch.equal(rows(w, b), base) for w, b in ((2, 2), (4, 8), (8, 4), (16, 1)))


def test_plain_equals_engine(target, plain_outputs):
    outs, runner = static_outputs(target, PROMPTS)
    assert outs == plain_outputs
    steps = max(len(o) for o in outs) - 1
    assert runner.host_reads == steps  # one host read per step (all 8 sequences in one bucket)


@pytest.mark.parametrize("k", range(1, 9))
def test_ngram_equals_engine(target, plain_outputs, k):
    outs, runner = static_outputs(target, PROMPTS, "ngram", k)
    assert outs == plain_outputs
    assert runner.num_accepted > 0 and runner.host_reads < max(len(o) for o in outs) - 1


@pytest.mark.parametrize("count, slots", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 2)])
def test_ngram_batches_of_mixed_widths(target, plain_outputs, count, slots):
    """1..8 sequences (fewer slots than prompts: admission as slots free up), guesses of differing lengths,
    k capped per sequence near max_tokens: every row equals the engine's."""
    outs, _ = static_outputs(target, PROMPTS[:count], "ngram", 5, slots=slots)
    assert outs == plain_outputs[:count]


@pytest.mark.parametrize("k", [1, 3, 7])
def test_draft_model_equals_engine(target, plain_outputs, k):
    noisy = tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in noisy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    outs, runner = static_outputs(target, PROMPTS, "draft_model", k, draft=noisy)
    assert outs == plain_outputs
    assert runner.num_accepted > 0


def test_suffix_on_the_host_equals_engine(target, plain_outputs):
    outs, runner = static_outputs(target, PROMPTS + PROMPTS[:2], "host", 6, proposer=SuffixProposer())
    assert outs == plain_outputs + plain_outputs[:2]
    assert runner.num_accepted > 0


def test_sdpa_path_equals_engine_tokens(plain_outputs):
    """The torch-only path (what a GPU runs) gives the engine's tokens here: its logits differ from our C++ ops'
    in the last bits only (a different attention summation), which no argmax of these prompts depends on."""
    model = tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)
    model.use_fused_glue(False)
    outs, _ = static_outputs(model, PROMPTS, "ngram", 4, attention="sdpa")
    assert outs == plain_outputs


def test_ngram_lookup_equals_the_host_lookup():
    rng = np.random.default_rng(0)
    for _ in range(40):
        B, C = 4, 40
        hist = rng.integers(0, 4, size=(B, C))  # a 4-token alphabet: many matches of every n
        lengths = rng.integers(1, C, size=B)
        k = int(rng.integers(1, 9))
        guesses, n = ngram_lookup(torch.tensor(hist), torch.tensor(lengths), k, 1, 3)
        for b in range(B):
            want = lookup(hist[b, : lengths[b]], 1, 3, k)
            assert guesses[b, : n[b]].tolist() == want


def test_rejection_accept_keeps_the_target_distribution():
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(0)
    N, V = 40000, 5
    p = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    q = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    P = p.expand(N, 2, V)
    Q = q.expand(N, 1, V)
    guesses = torch.multinomial(q, N, replacement=True, generator=g)[:, None]  # x ~ q
    uniforms = torch.rand(N, 1, generator=g)
    noise = torch.empty(N, 2, V).exponential_(generator=g)
    emitted, tokens = rejection_accept(P, Q, guesses, torch.ones(N, dtype=torch.int64), uniforms, noise)
    first = tokens[:, 0]
    counts = torch.bincount(first, minlength=V).double()
    assert chisquare(counts.numpy(), (p * N).double().numpy()).pvalue > 1e-3
    # p == q: every guess accepted; a point-mass draft of p's mode: accepted with probability p(x)
    emitted, _ = rejection_accept(P, P[:, :1], guesses, torch.ones(N, dtype=torch.int64), uniforms, noise)
    assert bool((emitted == 2).all())
    mode = torch.ones(N, 1, dtype=torch.int64)
    emitted, _ = rejection_accept(P, None, mode, torch.ones(N, dtype=torch.int64), uniforms, noise)
    assert abs((emitted == 2).double().mean().item() - 0.4) < 0.02


def test_k_auto_falls_back_to_plain_when_guesses_fail(target, plain_outputs):
    """A draft that is never right (an unrelated model): k auto drops to plain steps once it has seen that,
    and the output stays the engine's."""
    other = tiny_decoder("llama", seed=7, vocab_size=VOCAB, num_layers=1)
    step = StaticStep(target, 8, CAPACITY)
    runner = StaticSpecDecoder(step, (), "draft_model", "auto", draft=StaticStep(other, 8, CAPACITY))
    runner.calibrate(batches=(8,), rounds=1)
    assert set(runner.costs[8]) == {1, 2, 4, 8, 16} and min(runner.costs[8].values()) > 0
    runner.costs = {b: {w: 1.0 + 0.05 * w for w in (1, 2, 4, 8, 16)} for b in (1, 2, 4, 8)}  # not this box's timing
    runner.acceptance = 0.0
    assert runner.choose_k(8) == 0
    runner.acceptance = 0.9
    assert runner.choose_k(8) == 15
    runner.acceptance = 0.5
    assert runner.generate(PROMPTS, MAX_TOKENS) == plain_outputs
    assert runner.num_guessed > 0 and runner.acceptance < 0.5

"""Paged K/V (draftwise/kv_cache.py): blocks are taken as a sequence grows and return on truncate / free; a reserve
is all or nothing; the decoder over blocks scattered through a pool is bitwise the contiguous layout (one block per
slot), fused C++ layer loop and torch reference alike; the engine with a pool of a few blocks admits by claims and
gives every request the output an unconstrained pool gives (plain, n-gram, draft model); the budget's parsing.
Tiny models; no timing asserts."""
from __future__ import annotations

import pytest
import torch

from draftwise import cli_args
from draftwise.config import ConfigError, ContextLengthError, parse_kv_cache_memory
from draftwise.engine import Engine, Request
from draftwise.kv_cache import CacheFull, KVCache, blocks_for, draft_pool_blocks, pool_blocks
from draftwise.sampling import SamplingParams
from draftwise.spec_decode.draft_model import DraftModelProposer
from draftwise.spec_decode.ngram import NgramProposer
from draftwise.spec_decode.proposer import NoProposer
from tests.harness import one_torch_thread  # noqa: F401 (a fixture)
from tests.tiny_models import tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_blocks_follow_the_length_and_return_on_truncate_and_free():
    cache = KVCache(2, 3, 2, 100, 8, torch.float32)  # blocks of 16; 7 per slot at most, 21 in the pool
    assert (cache.block_size, cache.blocks_per_slot, cache.num_blocks, cache.num_free_blocks) == (16, 7, 21, 21)
    cache.reserve([0, 2], [17, 1])  # 2 blocks and 1
    cache.extend([0, 2], [17, 1])
    assert [len(h) for h in cache.held] == [2, 0, 1] and cache.num_free_blocks == 18
    assert cache.table(torch.tensor([0, 2])).tolist() == [cache.held[0], cache.held[2] + [cache.null_block]]
    cache.reserve([0], [17])  # already held: nothing taken
    assert cache.num_free_blocks == 18
    cache.truncate(0, 16)  # position 16 was the second block's only one
    assert len(cache.held[0]) == 1 and cache.num_free_blocks == 19 and cache.lengths[0] == 16
    cache.truncate(0, 15)  # within the block: kept
    assert len(cache.held[0]) == 1
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(0, 16)
    with pytest.raises(ValueError, match="reserve first"):
        cache.extend([1], [1])
    cache.free(2)
    cache.free(0)
    assert cache.num_free_blocks == 21 and cache.held == [[], [], []] and cache.lengths == [0, 0, 0]
    assert (cache.tables == cache.null_block).all()
    with pytest.raises(ValueError, match="capacity"):
        cache.reserve([1], [101])
    with pytest.raises(ValueError, match="multiple of 16"):
        KVCache(1, 1, 1, 100, 8, torch.float32, block_size=24)
    assert KVCache(1, 2, 1, 100, 8, torch.float32, block_size=128).block_size == 100  # one block per slot


def test_a_reserve_takes_all_or_nothing_and_blocks_come_back_zeroed():
    cache = KVCache(1, 2, 1, 64, 4, torch.float32, num_blocks=3)
    cache.reserve([0], [32])
    with pytest.raises(CacheFull, match="needs 3 more blocks"):
        cache.reserve([0, 1], [48, 17])  # 1 + 2 blocks, 1 free: nothing taken
    assert cache.num_free_blocks == 1 and len(cache.held[1]) == 0
    cache.keys[0].fill_(float("nan"))  # stale garbage anywhere
    cache.free(0)
    cache.reserve([1], [40])
    assert not cache.keys[0][cache.held[1]].isnan().any()  # a taken block is zeroed


def scattered(cache: KVCache) -> KVCache:
    """Interleave the free list, so consecutive blocks of a slot lie apart and out of order in the pool."""
    cache._free = cache._free[::2] + cache._free[1::2]
    return cache


def forwards(model, cache: KVCache) -> list[torch.Tensor]:
    """A ragged batch of two (prompts of 37 and 13 tokens padded to 37), one decode step, a verification of 9 and
    4 (padded to 9), a rollback over a block boundary and a step again: the logits, then every written position's
    K/V of both slots."""
    c = model.config
    slots = torch.tensor([0, 1])
    ids = torch.randint(0, c.vocab_size, (2, 50), generator=torch.Generator().manual_seed(3))
    lens = torch.tensor([37, 13])[:, None]
    out = [model(ids[:, :37], torch.arange(37)[None].expand(2, 37), cache, slots, num_tokens=[37, 13]),
           model(ids[:, 37:38], lens, cache, slots, num_tokens=[1, 1]),
           model(ids[:, 38:47], lens + 1 + torch.arange(9)[None], cache, slots, num_tokens=[9, 4])]
    cache.truncate(0, 30)  # 47 -> 30: the third block goes
    cache.truncate(1, 15)
    out.append(model(ids[:, 47:49], torch.tensor([[30, 31], [15, 16]]), cache, slots, num_tokens=[2, 2]))
    held = [cache.gather(s, cache.lengths[s]) for s in (0, 1)]
    return out + [t for keys, values in held for t in keys + values]


@pytest.mark.parametrize("kind", ["q4x8", "torch"])
def test_paged_decoder_is_bitwise_the_contiguous_layout(kind):
    """Every logit and every stored K/V of a ragged batch with decode, verification and a rollback: blocks of 16
    (and 32) scattered through the pool == one block per slot, on the C++ layer loop (q4x8) and the torch path."""
    if kind == "q4x8":
        from tests.test_kernels_stack import q4x8_model
        model = q4x8_model("qwen2")
    else:
        model = tiny_decoder("qwen2", 0, 64)
    c = model.config
    make = lambda bs: KVCache(c.num_layers, 2, c.num_kv_heads, 64, c.head_dim, model.dtype, block_size=bs)  # noqa
    contiguous = forwards(model, make(64))
    for bs in (16, 32):
        paged = forwards(model, scattered(make(bs)))
        assert len(paged) == len(contiguous)
        for i, (a, b) in enumerate(zip(contiguous, paged)):
            assert torch.equal(a, b), (kind, bs, i)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 6, 5, 5, 5, 5], [10, 20, 30, 40, 50, 60, 10, 20],
           [3, 1, 3, 1, 3, 1]]


def run(target, proposer, k, blocks):
    eng = Engine(target, proposer, k, 4, 96, eos_token_ids=(0,), kv_cache_blocks=blocks)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()
        assert sum(len(eng.cache.held[r.slot]) for r in eng.running) == eng.cache.num_blocks - eng.cache.num_free_blocks
    assert eng.cache.num_free_blocks == eng.cache.num_blocks  # every block back
    return [r.output_ids for r in reqs], sum(r.num_preemptions for r in reqs)


@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_a_small_pool_preempts_and_changes_no_token(method):
    """A pool of a few blocks (two requests' worth at full length; four are admitted on their prompts): when it
    runs out the youngest request is preempted, prefilled again later from its prompt and output, and every
    request's output equals the unconstrained run's (plain, n-gram, draft model with its own pool)."""
    from tests.test_kernels_stack import q4x8_model

    target = q4x8_model("qwen2")  # row-exact: a re-prefilled context is bitwise the K/V it had
    k = 0 if method == "plain" else 4

    def proposer(blocks):
        if method == "plain":
            return NoProposer()
        if method == "ngram":
            return NgramProposer(1, 3)
        pool = None if blocks is None else draft_pool_blocks(blocks, 4, 96 + 16)
        return DraftModelProposer(q4x8_model("qwen2", seed=1), 4, 96 + 16, 64, num_blocks=pool)

    free, preempted_free = run(target, proposer(None), k, None)
    claim = blocks_for(9 + 24 + k + 1)  # the longest prompt's
    small, preempted = run(target, proposer(2 * claim), k, 2 * claim)
    assert small == free
    assert preempted_free == 0 and preempted > 0


def test_a_request_larger_than_the_pool_is_refused():
    target = tiny_decoder("qwen2", seed=0, vocab_size=64)
    eng = Engine(target, NoProposer(), 0, 2, 96, eos_token_ids=(0,), kv_cache_blocks=2)
    eng.add_request(Request("fits", [1, 2, 3], SamplingParams(max_tokens=20)))  # 24 positions: 2 blocks
    with pytest.raises(ContextLengthError, match="K/V blocks"):
        eng.add_request(Request("big", [1, 2, 3], SamplingParams(max_tokens=40)))


def test_budget_parsing_and_pool_size():
    assert parse_kv_cache_memory("2GiB") == 2 * 2**30 and parse_kv_cache_memory("512MB") == 512 * 10**6
    assert parse_kv_cache_memory(None) == 4 * 2**30 and parse_kv_cache_memory(0.25) == 0.25
    assert parse_kv_cache_memory("0.5") == 0.5 and parse_kv_cache_memory(1000) == 1000
    assert parse_kv_cache_memory("8G") == 8 * 2**30 == cli_args.kv_cache_memory_value("8G")  # one reader, a bare G binary
    for bad in ("lots", "1.5", "0", "2XB"):
        with pytest.raises(ConfigError):
            parse_kv_cache_memory(bad)
    per_token = 57344  # the 1.5B target's float32 K/V per position (28 layers x 2 x 2 heads x 128 x 4 bytes)
    assert pool_blocks(2**30, per_token, 8, 4101) == 2**30 // (per_token * 16) == 1170
    assert pool_blocks(2**40, per_token, 8, 4101) == 8 * 257  # never more than every slot at full context
    assert 1 <= pool_blocks(0.01, per_token, 8, 32769)  # a fraction of available RAM


def test_a_long_prompt_prefilled_in_chunks_changes_no_token(monkeypatch):
    """Prompts longer than the prefill chunk (and the draft's catch-up chunk) go in several forwards, each with
    activations of one chunk: on a row-exact (q4x8) target the outputs are those of one forward per prompt."""
    from draftwise import engine as engine_mod
    from draftwise.spec_decode import draft_model
    from tests.test_kernels_stack import q4x8_model

    target, draft = q4x8_model("qwen2"), q4x8_model("qwen2", seed=1)
    prompts = [[(7 * i + j) % 60 + 1 for j in range(n)] for i, n in enumerate((41, 5, 23))]

    def outputs():
        eng = Engine(target, DraftModelProposer(draft, 3, 96 + 16, 64), 3, 3, 96, eos_token_ids=(0,))
        reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
                for i, p in enumerate(prompts)]
        for r in reqs:
            eng.add_request(r)
        calls = []
        real = target.forward
        with monkeypatch.context() as m:
            m.setattr(target, "forward", lambda ids, *a, **k: calls.append(ids.shape[1]) or real(ids, *a, **k))
            while eng.has_unfinished():
                eng.step()
        return [r.output_ids for r in reqs], max(calls)

    whole, widest = outputs()
    assert widest >= 41
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK_TOKENS", 8)
    monkeypatch.setattr(draft_model, "CATCH_UP_CHUNK_TOKENS", 8)
    chunked, widest = outputs()
    assert chunked == whole and widest <= 8 + 3 + 1  # a chunk, or the last one with the first guesses


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_bfloat16_kv_speculative_greedy_equals_plain(method):
    """--kv-cache-dtype bfloat16 on a row-exact (q4x8) tiny target: speculation and plain decoding read the same
    K/V bits, so greedy outputs are equal; the LLM resolves the dtype and sizes the pool with it."""
    from tests.harness import tiny_tokenizer
    from tests.test_kernels_stack import q4x8_model
    from draftwise.api import LLM

    target, tok = q4x8_model("qwen2"), tiny_tokenizer()
    spec = {"method": "ngram", "num_speculative_tokens": 3} if method == "ngram" else \
        {"method": "draft_model", "model": "d", "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name, config in (("plain", None), ("spec", spec)):
        llm = LLM.from_parts(target, tok, speculative_config=config, max_model_len=128, kv_cache_dtype="bfloat16",
                             load_draft=lambda n, d, w: (q4x8_model("qwen2", seed=1), tok, {"name": n}))
        assert llm.engine.cache.keys[0].dtype == torch.bfloat16
        if name == "spec" and method == "draft":
            assert llm.proposer.cache.keys[0].dtype == torch.bfloat16
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
    assert outs["spec"] == outs["plain"]
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM.from_parts(target, tok, kv_cache_dtype="int8")

"""Prefix cache (draftwise/prefix_cache.py and the engine's use of it).

Invariants: the longest shared prefix is found at token granularity and never the whole prompt; a loaded prefix maps
the stored blocks (no copy) and reads bitwise the stored K/V, and a write into its partial block copies it, leaving
the entry's bits unchanged; the byte budget holds (least recently used go first); the pool reclaims blocks only the
cache holds before it runs out; a prompt prefilled after a cached
prefix gives bitwise the logits and K/V of the prompt prefilled whole (row-exact q4x8 + attention op), so greedy
outputs with the cache on equal outputs with it off — alone, batched with prompts cached to different depths,
with speculation, and when the batch has to be split because padding after a long prefix would not fit.
Tiny random models; no timing asserts.
"""
from __future__ import annotations

import httpx
import pytest
import torch

from draftwise.api import LLM
from draftwise.config import EngineConfig
from draftwise.kv_cache import KVCache
from draftwise.prefix_cache import PrefixCache
from draftwise.sampling import SamplingParams
from tests.harness import MODEL, VOCAB, Server, metric, noisy_draft, one_torch_thread, tiny_tokenizer  # noqa: F401
from tests.tiny_models import tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS, HEADS, DIM = 2, 2, 4
BLOCK = 16
BLOCK_BYTES = LAYERS * 2 * HEADS * DIM * 4 * BLOCK  # K and V, every layer, float32, 16 positions


def filled_cache(slots: int = 4, capacity: int = 48) -> KVCache:
    """Blocks of 16 (3 per slot), every slot's blocks taken and filled with random K/V."""
    cache = KVCache(LAYERS, slots, HEADS, capacity, DIM, torch.float32)
    cache.reserve(list(range(slots)), [capacity] * slots)
    cache.extend(list(range(slots)), [capacity] * slots)
    g = torch.Generator().manual_seed(0)
    for t in cache.keys + cache.values:
        t[: cache.num_blocks].copy_(torch.randn(t[: cache.num_blocks].shape, generator=g))
    return cache


def stored(pc: PrefixCache, cache: KVCache, ids: list[int], slot: int = 0) -> None:
    cache.lengths[slot] = len(ids)
    pc.store(ids, cache, slot)


def test_match_is_the_longest_shared_prefix_but_never_the_whole_prompt():
    cache, pc = filled_cache(), PrefixCache()
    assert pc.match([1, 2, 3]) == (None, 0)
    stored(pc, cache, [1, 2, 3, 4, 5])
    stored(pc, cache, [1, 2, 9, 9], slot=1)
    assert pc.match([1, 2, 3, 4, 7])[1] == 4
    assert pc.match([1, 2, 9, 5])[1] == 3
    assert pc.match([1, 2, 3, 4, 5])[1] == 4  # the same prompt again: its last token is still computed
    assert pc.match([1])[1] == 0 and pc.match([8, 1, 2])[1] == 0


def test_load_shares_the_stored_blocks_and_a_write_copies_only_the_partial_one():
    """The entry's blocks outlive their slot (retained, not copied); a loaded slot maps the same blocks, reads the
    stored K/V bitwise, and its first write into the shared partial block copies it: the entry's bits stay."""
    cache, pc = filled_cache(), PrefixCache()
    prompt = list(range(1, 21))  # 20 tokens: a whole block and 4 positions of the next
    stored(pc, cache, prompt, slot=0)
    entry_blocks = cache.held[0][:2]
    reference = cache.gather(0, 20)
    cache.free(0)  # the slot goes to someone else, who writes everything it gets
    cache.free(1)
    cache.reserve([0], [48])
    assert not set(cache.held[0]) & set(entry_blocks)  # retained blocks are never handed out
    for t in cache.keys + cache.values:
        t[cache.held[0]] = 7.0
    entry, n = pc.match(prompt[:18] + [60, 61])
    pc.load(entry, n, cache, slot=1)
    assert n == 18 and cache.lengths[1] == 18 and cache.held[1] == entry_blocks  # mapped, not copied
    assert [cache.refs[b] for b in entry_blocks] == [2, 2]
    for x, y in zip(cache.gather(1, 18), [[t[:, :18] for t in ts] for ts in reference]):
        assert all(torch.equal(a, b) for a, b in zip(x, y))
    copies = cache.num_copies
    cache.reserve([1], [19])  # position 18 lies in the shared partial block: copied first
    assert cache.num_copies == copies + 1 and cache.held[1][0] == entry_blocks[0] and cache.held[1][1] != entry_blocks[1]
    for t in cache.keys + cache.values:
        t[cache.held[1][1]] = -1.0  # the slot's own copy, written over
    cache.extend([1], [19])
    cache.free(2)
    pc.load(*pc.match(prompt + [1]), cache, slot=2)
    for x, y in zip(cache.gather(2, 19), [[t[:, :19] for t in ts] for ts in reference]):
        assert all(torch.equal(a, b) for a, b in zip(x, y))  # the entry's bits unchanged by the other's write


def test_covered_prompts_are_not_stored_twice_and_extensions_replace_entries():
    cache, pc = filled_cache(), PrefixCache()
    stored(pc, cache, [1, 2, 3, 4])
    stored(pc, cache, [1, 2, 3])  # already covered
    assert len(pc) == 1 and pc.nbytes == BLOCK_BYTES and pc.num_blocks == 1
    stored(pc, cache, list(range(1, 21)))  # extends the entry: it replaces it
    assert len(pc) == 1 and pc.nbytes == 2 * BLOCK_BYTES
    assert pc.match(list(range(1, 22)))[1] == 20
    stored(pc, cache, list(range(1, 17)) + [9, 9], slot=1)  # another slot's blocks: two more retained
    assert len(pc) == 2 and pc.num_blocks == 4


def test_budget_evicts_least_recently_used_first():
    cache, pc = filled_cache(slots=5), PrefixCache(max_bytes=2 * BLOCK_BYTES)
    stored(pc, cache, [1, 1, 1, 1])
    stored(pc, cache, [2, 2, 2, 2], slot=1)
    cache.free(2)
    pc.load(*pc.match([1, 1, 1, 1, 1]), cache, slot=2)  # [1...] used again: [2...] is now the oldest
    stored(pc, cache, [3, 3, 3, 3], slot=3)
    assert pc.nbytes <= pc.max_bytes and len(pc) == 2
    assert pc.match([2, 2, 2, 2, 2])[1] == 0 and pc.match([1, 1, 1, 1, 1])[1] == 4
    stored(pc, cache, list(range(40)), slot=4)  # larger than the whole budget: not kept, nothing evicted for it
    assert len(pc) == 2 and pc.match(list(range(40)) + [0])[1] == 0


def test_the_pool_reclaims_cached_blocks_before_it_reports_full():
    """Blocks only the cache holds count as available and are given back (least recently used entry first)
    when a reserve needs them; blocks a slot also holds are never freed by that."""
    cache, pc = filled_cache(slots=3), PrefixCache()
    stored(pc, cache, list(range(1, 33)), slot=0)  # 2 blocks
    stored(pc, cache, [5] * 16, slot=1)  # 1 block
    cache.free(0), cache.free(1), cache.free(2)
    pc.load(*pc.match([5] * 17), cache, slot=1)  # block of [5...] also held by slot 1 now
    assert cache.num_free_blocks == 9 - 3 and pc.reclaimable() == 2 and cache.num_available_blocks == 8
    cache.reserve([0], [48])  # 3 blocks: free ones, nothing reclaimed
    cache.reserve([2], [48])  # the last 3 free ones
    assert len(pc) == 2 and cache.num_free_blocks == 0
    cache.reserve([1], [48])  # 2 more: the least recently used entry ([1..32], cache-only) lets go of its 2
    assert pc.match(list(range(1, 34)))[1] == 0 and pc.match([5] * 17)[1] == 16 and cache.num_free_blocks == 0
    cache.free(2)
    cache.truncate(1, 8)  # slot 1 keeps the shared block (refs 2): 5 free
    cache.reserve([2], [48])  # 2 free left; slot 1's next write needs a copy of its shared block and 2 more ...
    cache.reserve([1], [48])  # ... so the entry goes first, and the block, now slot 1's alone, is not copied
    assert len(pc) == 0 and cache.num_free_blocks == 0 and cache.num_copies == 0


def test_whole_blocks_are_found_by_chained_hash_and_a_collision_changes_no_match(monkeypatch):
    """Entries are indexed by the chained hash of each whole block; a planted hash that collides for every block
    (each chain position hashes alike) must still give the same matches: tokens decide, the hash only narrows."""
    prompts = [list(range(1, 41)), list(range(1, 17)) + [99] * 10, [7] * 40, [7] * 16 + list(range(1, 17)) + [3]]
    queries = [list(range(1, 45)), list(range(1, 17)) + [99] * 3, [7] * 33, [7] * 16 + list(range(1, 20)), [5] * 20]

    def matches():
        cache, pc = filled_cache(slots=4), PrefixCache()
        for slot, p in enumerate(prompts):
            stored(pc, cache, p, slot)
        return [pc.match(q)[1] for q in queries], pc

    honest, pc = matches()
    assert honest == [40, 18, 32, 32, 0]
    # chains of 2, 1, 2 and 2 whole blocks; the first two prompts share their first block, the last two theirs
    assert sorted(map(len, pc._by_hash.values())) == [1, 1, 1, 2, 2]
    monkeypatch.setattr(PrefixCache, "_chain", lambda self, ids: list(range(len(ids) // BLOCK)))
    colliding, _ = matches()
    assert colliding == honest


def test_reclaim_keeps_entries_that_free_nothing():
    """An older entry whose blocks a running slot holds costs no memory: the pool under pressure drops a newer
    entry that frees a block instead."""
    cache, pc = filled_cache(slots=3), PrefixCache()
    stored(pc, cache, list(range(1, 17)), slot=0)  # slot 0 keeps holding this block
    stored(pc, cache, [2] * 16, slot=1)
    cache.free(1), cache.free(2)  # 5 free; [2...]'s block only the cache holds
    cache.reserve([2], [48])
    cache.reserve([1], [48])  # 3 needed, 2 free: one entry must go
    assert pc.match(list(range(1, 18)))[1] == 16 and pc.match([2] * 17)[1] == 0


def test_forget_drops_the_prompt_and_its_extensions_only():
    cache, pc = filled_cache(), PrefixCache()
    stored(pc, cache, [1, 2, 8])
    stored(pc, cache, [1, 2, 3, 4, 5], slot=1)
    stored(pc, cache, [7, 8, 9], slot=2)
    pc.forget([1, 2, 3])
    assert len(pc) == 2  # [1, 2, 3, 4, 5] went
    assert pc.match([1, 2, 3, 4, 5, 6])[1] == 2  # what [1, 2, 3] shares with another prompt stays
    assert pc.match([7, 8, 9, 1])[1] == 3
    pc.count(10, 4)
    assert (pc.queries, pc.hits) == (10, 4)


# ---- with a model ---------------------------------------------------------------------------------------

def q4x8_decoder():
    from draftwise.kernels import attention, q4x8
    from draftwise.kernels.plan import resolve_plan
    from draftwise.models import quant

    try:
        q4x8.load()
    except q4x8.KernelBuildError as e:
        pytest.skip(f"q4x8 cannot be built here: {e}")
    assert attention.available()
    model = tiny_decoder("qwen2", 0, VOCAB)
    quant.build_linears(model, resolve_plan("q4x8", "auto", None))
    return model


def test_prefill_after_a_cached_prefix_is_bitwise_the_whole_prefill():
    model = q4x8_decoder()
    c = model.config
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    for cut in (1, 7, 16, 17, 39):
        whole = KVCache(c.num_layers, 1, c.num_kv_heads, 48, c.head_dim, model.dtype)
        parts = KVCache(c.num_layers, 1, c.num_kv_heads, 48, c.head_dim, model.dtype)
        slot = torch.tensor([0])
        a = model(ids, torch.arange(40)[None], whole, slot, last_only=True, num_tokens=[40])
        model(ids[:, :cut], torch.arange(cut)[None], parts, slot, last_only=True, num_tokens=[cut])
        b = model(ids[:, cut:], torch.arange(cut, 40)[None], parts, slot, last_only=True, num_tokens=[40 - cut])
        assert torch.equal(a, b), cut
        for x, y in zip(whole.gather(0, 40), parts.gather(0, 40)):  # keys, values
            assert all(torch.equal(a, b) for a, b in zip(x, y)), cut


def q4x8_draft():
    """The harness's noisy copy of the target (agrees often, not always), in q4x8."""
    from draftwise.kernels.plan import resolve_plan
    from draftwise.models import quant

    draft = noisy_draft()
    quant.build_linears(draft, resolve_plan("q4x8", "auto", None))
    return draft


def q4x8_llm(enable: bool | None, spec_config=None, max_model_len: int = 256, max_num_seqs: int = 4) -> LLM:
    tok = tiny_tokenizer()
    return LLM.from_parts(q4x8_decoder(), tok, name=MODEL, speculative_config=spec_config,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          enable_prefix_caching=enable,
                          load_draft=lambda name, dtype, weights: (q4x8_draft(), tok, {"name": name}))


SYSTEM = [3] + list(range(10, 30))  # a shared "system prompt" of 21 tokens
FIRST = [SYSTEM + [40, 41, 42], SYSTEM + [43, 44], [50, 51, 52, 53, 54, 55]]
SECOND = [SYSTEM + [40, 41, 42, 45], SYSTEM[:12] + [46, 47], [56, 57, 58], SYSTEM + [43, 44]]


DRAFT = {"method": "draft_model", "model": "noisy", "num_speculative_tokens": 3}


@pytest.mark.parametrize("spec_config", [None, {"method": "ngram", "num_speculative_tokens": 3}, DRAFT],
                         ids=["plain", "ngram", "draft_model"])
def test_greedy_outputs_are_the_same_with_and_without_the_cache(spec_config):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for enable in (False, True):
        llm = q4x8_llm(enable, spec_config)
        first = llm.generate([{"prompt_token_ids": p} for p in FIRST], params)
        second = llm.generate([{"prompt_token_ids": p} for p in SECOND], params)  # one batch, different depths
        outs[enable] = [o.outputs[0].token_ids for o in first + second]
        cached = [o.num_cached_tokens for o in first + second]
    assert outs[True] == outs[False]
    # FIRST: the 2nd prompt shares SYSTEM with the 1st only if that was stored first — same batch: nothing cached
    assert cached[:3] == [0, 0, 0]
    assert cached[3:] == [24, 12, 0, 22]  # all of FIRST[0]; SYSTEM[:12]; nothing; FIRST[1] but its last token


def test_the_next_turn_reuses_the_previous_prompt_and_output():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs, cached = {}, None
    for enable in (False, True):
        llm = q4x8_llm(enable, {"method": "ngram", "num_speculative_tokens": 3})
        first = llm.generate([{"prompt_token_ids": SYSTEM}], params)[0]
        turn = SYSTEM + first.outputs[0].token_ids + [60, 61]
        second = llm.generate([{"prompt_token_ids": turn}], params)[0]
        outs[enable] = (first.outputs[0].token_ids, second.outputs[0].token_ids)
        cached = second.num_cached_tokens
    assert outs[True] == outs[False]
    assert cached == len(SYSTEM) + 6 - 1  # all but the last output token were in the cache when it finished


def test_the_draft_model_keeps_its_own_cache_and_sampled_tokens_do_not_move():
    """A sampled request's tokens depend on the draft's q: with the draft's prefix cache (exact, like the target's)
    the same seed gives the same tokens as without any cache."""
    params = SamplingParams(temperature=0.8, max_tokens=10, seed=7, ignore_eos=True)
    outs = {}
    for enable in (False, True):
        llm = q4x8_llm(enable, DRAFT)
        llm.generate([{"prompt_token_ids": p} for p in FIRST], params)
        res = llm.generate([{"prompt_token_ids": p} for p in SECOND], params)
        outs[enable] = [o.outputs[0].token_ids for o in res]
        draft_cache = llm.proposer.prefix_cache
        assert (draft_cache is not None) == enable
        assert list(llm.prefix_caches()) == (["target", "draft noisy"] if enable else [])
    assert outs[True] == outs[False]
    assert draft_cache.hits > 0 and draft_cache.queries == sum(map(len, FIRST + SECOND))


def test_a_batch_that_would_overflow_the_cache_is_prefilled_prompt_by_prompt():
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long = list(range(4, 60))  # 56 tokens; capacity is 64 + 0 + 1: 55 cached + 20 padded rows would not fit
    other = list(range(60, 63)) * 7
    outs = {}
    for enable in (False, True):
        llm = q4x8_llm(enable, max_model_len=64)
        llm.generate([{"prompt_token_ids": long}], params)
        res = llm.generate([{"prompt_token_ids": p} for p in (long, other)], params)
        outs[enable] = [o.outputs[0].token_ids for o in res]
        if enable:
            assert [o.num_cached_tokens for o in res] == [55, 0]
    assert outs[True] == outs[False]


def test_on_by_default_only_where_it_changes_no_token():
    from draftwise.kernels import attention

    llm = q4x8_llm(None, DRAFT)  # the draft's plan is q4x8 too: it gets one by default, as the target does
    assert (llm.engine.prefix_cache is not None) == (llm.proposer.prefix_cache is not None) == attention.available()

    from draftwise.kernels.plan import resolve_plan

    dense = tiny_decoder("qwen2", 0, VOCAB).plan  # plain nn.Linear layers: dense fp32, not row-exact
    q4, mixed = resolve_plan("q4x8", "auto", None), resolve_plan("q4x8+bf16", "auto", None)
    auto = LLM._prefix_cache(EngineConfig(model="m"), q4)
    assert (auto is not None) == attention.available()
    assert LLM._prefix_cache(EngineConfig(model="m"), mixed) is None
    assert LLM._prefix_cache(EngineConfig(model="m"), dense) is None
    assert LLM._prefix_cache(EngineConfig(model="m", enable_prefix_caching=True), dense) is not None
    assert LLM._prefix_cache(EngineConfig(model="m", enable_prefix_caching=False), q4) is None


def test_server_reports_cached_tokens_in_usage_and_metrics():
    from draftwise.server.app import create_app

    with Server(create_app(q4x8_llm(True), MODEL)) as server:
        c = server.client()
        prompt = " ".join(f"w{i}" for i in range(1, 30))
        first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        again = c.completions.create(model=MODEL, prompt=prompt + " w40", max_tokens=3, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == 29
        m = server.metrics()
        assert metric(m, "draftwise:prefix_cache_queries_total") == 29 + 30
        assert metric(m, "draftwise:prefix_cache_hits_total") == 29
        assert httpx.get(server.url + "/health").status_code == 200


def test_the_bench_runs_every_request_as_new_to_the_caches():
    """The same prompt runs under every condition of a bench: its own earlier run must not shorten its prefill
    (only what it shares with other prompts may)."""
    from draftwise.bench.clients import Call, InProcessClient

    llm = q4x8_llm(True, DRAFT)
    client = InProcessClient(llm)
    prompt = " ".join(f"w{i}" for i in range(1, 20))
    for _ in range(2):
        client._run_calls([Call(prompt=prompt, messages=None, max_tokens=4)])
    caches = llm.prefix_caches()
    assert set(caches) == {"target", "draft noisy"}
    assert all(c.queries == 2 * 19 and c.hits == 0 for c in caches.values())
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))  # outside the bench: reused
    assert caches["target"].hits == 18

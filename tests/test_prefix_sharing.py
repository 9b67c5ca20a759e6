"""Prefix sharing through the engine (engine.py + prefix_cache.py + kv_cache.py's refcounted blocks).

Invariants: greedy outputs with the prefix cache on equal outputs with it off (plain, n-gram, suffix trees, a draft
model with its own pool and prefix cache; a pool of a few blocks that preempts while blocks are shared; prompts
prefilled in chunks); after every step each block's reference count is exactly its holders (slots mapping it,
the prefix cache retaining it), free blocks are exactly those nobody holds, and after all requests finish the free
blocks are the pool less what the cache alone holds; a shared 2k-token system prompt costs its blocks once, however
many requests use it; n samples of one prompt map the same prompt blocks. Tiny row-exact (q4x8) models; no timing.
"""
from __future__ import annotations

from collections import Counter

import pytest

from draftwise.engine import Engine, Request
from draftwise.kv_cache import KVCache, blocks_for, draft_pool_blocks
from draftwise.prefix_cache import PrefixCache
from draftwise.sampling import SamplingParams
from draftwise.spec_decode.draft_model import DraftModelProposer
from draftwise.spec_decode.ngram import NgramProposer
from draftwise.spec_decode.proposer import NoProposer
from draftwise.spec_decode.suffix import SuffixProposer
from tests.harness import one_torch_thread  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LEN = 160  # max_model_len
SYSTEM = [(5 * j) % 60 + 2 for j in range(37)]  # a shared "system prompt": two whole blocks and 5 positions
PROMPTS = [SYSTEM + [61, 62, 63], SYSTEM + [40, 41], SYSTEM[:20] + [7, 7, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1],
           SYSTEM + [61, 62, 63, 50]]


@pytest.fixture(scope="module")
def models():
    from tests.test_kernels_stack import q4x8_model

    return q4x8_model("qwen2"), q4x8_model("qwen2", seed=1)


def audit(cache: KVCache, pc: PrefixCache | None) -> None:
    """Every block's count is its holders; the free list is exactly the blocks nobody holds."""
    holders = Counter(b for held in cache.held for b in held)
    if pc is not None:
        holders.update(pc._holds.keys())
    assert [cache.refs[b] for b in range(cache.num_blocks)] == [holders[b] for b in range(cache.num_blocks)]
    assert sorted(cache._free) == [b for b in range(cache.num_blocks) if not holders[b]]


def audit_all(eng: Engine) -> None:
    audit(eng.cache, eng.prefix_cache)
    if isinstance(eng.proposer, DraftModelProposer):
        audit(eng.proposer.cache, eng.proposer.prefix_cache)


def proposer_for(method: str, draft, blocks: int | None, prefix: bool, k: int):
    if method == "plain":
        return NoProposer()
    if method == "ngram":
        return NgramProposer(1, 3)
    if method == "suffix":
        return SuffixProposer()
    pool = None if blocks is None else draft_pool_blocks(blocks, 4, LEN + 16)
    return DraftModelProposer(draft, k, LEN + 16, 64, prefix_cache=PrefixCache() if prefix else None,
                              num_blocks=pool)


def run(models, method: str, prefix: bool, blocks: int | None = None, max_tokens: int = 20):
    """The first prompt alone for one step (its prefill stores it), then the rest joining; invariants audited
    after every step. -> (outputs, engine)"""
    target, draft = models
    k = 0 if method == "plain" else 4
    eng = Engine(target, proposer_for(method, draft, blocks, prefix, k), k, 4, LEN, eos_token_ids=(0,),
                 prefix_cache=PrefixCache() if prefix else None, kv_cache_blocks=blocks)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    eng.add_request(reqs[0])
    eng.step()
    for r in reqs[1:]:
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()
        audit_all(eng)
    for cache, pc in [(eng.cache, eng.prefix_cache)] + ([(eng.proposer.cache, eng.proposer.prefix_cache)]
                                                        if method == "draft" else []):
        # nothing leaks: what is not free is what the cache alone holds (its reclaimable blocks)
        held = pc.reclaimable() if pc is not None else 0
        assert cache.num_free_blocks == cache.num_blocks - held
        assert held == (pc.num_blocks if pc is not None else 0)
    return [r.output_ids for r in reqs], eng, reqs


@pytest.mark.parametrize("method", ["plain", "ngram", "suffix", "draft"])
def test_sharing_changes_no_token_and_leaks_no_block(models, method):
    off, _, _ = run(models, method, False)
    on, eng, reqs = run(models, method, True)
    assert on == off
    assert [r.num_cached_tokens for r in reqs][1:] == [37, 20, 0, 40]  # SYSTEM, SYSTEM[:20], -, PROMPTS[0]
    assert eng.cache.num_copies > 0  # the partial block of a shared prefix was copied on its first write


@pytest.mark.parametrize("method", ["plain", "draft"])
def test_a_small_pool_preempts_while_blocks_are_shared_and_changes_no_token(models, method):
    off, _, _ = run(models, method, False)
    claim = blocks_for(len(PROMPTS[4]) + 20 + 4 + 1)  # the longest prompt's: 5 blocks
    on, eng, reqs = run(models, method, True, blocks=claim + 1)
    assert on == off
    assert sum(r.num_preemptions for r in reqs) > 0


def test_chunked_prefill_after_a_shared_prefix_changes_no_token(models, monkeypatch):
    from draftwise import engine as engine_mod
    from draftwise.spec_decode import draft_model

    off, _, _ = run(models, "draft", False)
    monkeypatch.setattr(engine_mod, "PREFILL_CHUNK_TOKENS", 8)
    monkeypatch.setattr(draft_model, "CATCH_UP_CHUNK_TOKENS", 8)
    on, _, reqs = run(models, "draft", True)
    assert on == off and reqs[1].num_cached_tokens == 37


def test_a_shared_2k_system_prompt_costs_its_blocks_once(models):
    """Four requests on one 2,048-token system prompt (+ a few tokens each) hold its 128 blocks once: the pool's
    blocks in use (not free, not reclaimable from the prefix cache) are those plus each request's own tail (its copy
    of the shared partial block), against four copies without sharing."""
    target, _ = models
    system = [(7 * j) % 60 + 2 for j in range(2048)]
    used = {}
    for prefix in (False, True):
        eng = Engine(target, NoProposer(), 0, 4, 2200, eos_token_ids=(0,),
                     prefix_cache=PrefixCache() if prefix else None)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        reqs = [Request(f"r{i}", system + [61, 62, i + 1], params) for i in range(4)]
        eng.add_request(reqs[0])
        eng.step()  # its prefill; the others then find the system prompt cached
        for r in reqs[1:]:
            eng.add_request(r)
        while len(eng.running) < 4:  # without sharing, one 2k prefill a step (the prefill token budget)
            eng.step()
        used[prefix] = eng.cache.num_blocks - eng.cache.num_available_blocks  # what the cache alone holds is free
        audit(eng.cache, eng.prefix_cache)
        while eng.has_unfinished():
            eng.step()
    own = blocks_for(2048 + 3 + 8) - 2048 // 16  # each request's tail blocks (a copy of the partial one included)
    assert used[False] == 4 * blocks_for(2048 + 3 + 1)
    assert used[True] == 2048 // 16 + 4 * own
    assert [r.num_cached_tokens for r in reqs] == [0, 2050, 2050, 2050]


def test_n_samples_of_one_prompt_map_the_same_prompt_blocks(models):
    target, _ = models
    eng = Engine(target, NoProposer(), 0, 4, LEN, eos_token_ids=(0,), prefix_cache=PrefixCache())
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)
    reqs = [Request(f"s{i}", PROMPTS[0], params) for i in range(3)]
    for r in reqs:
        eng.add_request(r)
    while len(eng.running) < 3:
        eng.step()
    whole = len(PROMPTS[0]) // 16
    first = [eng.cache.held[r.slot][:whole] for r in reqs]
    assert first[0] == first[1] == first[2]  # the prompt's whole blocks, once
    assert [r.num_cached_tokens for r in reqs] == [0, 39, 39]
    audit(eng.cache, eng.prefix_cache)


def test_the_server_moves_requests_into_the_engine_only_while_blocks_are_free():
    """server/runner.py's admission hook: a free slot is not enough; the available blocks the engine reported with its
    last step (free, or held only by the prefix cache) must exceed what the prompts sent and not yet answered need."""
    from types import SimpleNamespace

    from draftwise.server.engine_host import EngineThread
    from draftwise.server.runner import EngineRunner
    from tests.test_prefix_cache import q4x8_llm

    llm = q4x8_llm(True)
    runner = EngineRunner(EngineThread(llm), metrics=None)  # not started: the hook only
    free = llm.engine.cache.num_available_blocks
    assert runner._engine_has_room()  # no step yet: nothing known of the pool
    runner._kv_blocks = (free, 16)
    assert runner._engine_has_room()  # nothing in the engine: always room (it preempts within its pool)
    big = SimpleNamespace(request=SimpleNamespace(prompt_ids=[5] * (16 * free), output_ids=[]))
    runner._sinks["big"] = big
    assert not runner._engine_has_room()
    big.request.prompt_ids = [5] * (16 * (free - 1))
    assert runner._engine_has_room()
    big.request.prompt_ids = [5] * (16 * free)
    big.request.output_ids = [7]  # answering: its blocks are in the snapshot's count already
    assert runner._engine_has_room()
    runner._sinks.update({f"r{i}": big for i in range(llm.max_num_seqs - 1)})
    assert not runner._engine_has_room()  # every slot taken


def test_abort_returns_its_references(models):
    target, _ = models
    eng = Engine(target, NoProposer(), 0, 4, LEN, eos_token_ids=(0,), prefix_cache=PrefixCache())
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reqs = [Request(f"a{i}", p, params) for i, p in enumerate(PROMPTS[:2])]
    eng.add_request(reqs[0])
    eng.step()
    eng.add_request(reqs[1])
    eng.step()
    eng.step()
    assert reqs[1].num_cached_tokens == 37 and len(eng.running) == 2
    for r in reqs:
        eng.abort(r.request_id)
        audit(eng.cache, eng.prefix_cache)
    assert eng.cache.num_free_blocks == eng.cache.num_blocks - eng.prefix_cache.reclaimable()
    assert eng.prefix_cache.reclaimable() == eng.prefix_cache.num_blocks  # only prompts stored at prefill remain

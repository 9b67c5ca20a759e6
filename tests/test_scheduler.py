"""The scheduler (draftwise/scheduler.py) on planted requests and a K/V pool of a few blocks, no model: admission
respects the prompt-token budget, the free slots and the free blocks (a request alone always starts), preemption
takes the youngest first and queues it first, a claim beyond the pool is refused, and under any sequence of
admissions, preemptions and finishes no request is lost or held twice and every slot and block comes back."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from draftwise.config import ContextLengthError
from draftwise.kv_cache import KVCache
from draftwise.scheduler import Scheduler

BLOCK = 16


@dataclass(eq=False)
class Planted:
    name: str
    prompt_ids: list[int]
    max_tokens: int = 8
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    num_preemptions: int = 0

    @property
    def params(self):
        return SimpleNamespace(max_tokens=self.max_tokens)

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def pool(num_blocks: int, slots: int = 4, capacity: int = 256) -> KVCache:
    return KVCache(1, slots, 1, capacity, 4, torch.float32, num_blocks=num_blocks, block_size=BLOCK)


def scheduler(num_blocks: int = 64, slots: int = 4, budget: int = 1024, k_max: int = 3) -> Scheduler:
    return Scheduler(pool(num_blocks, slots), None, slots, max_model_len=200, k_max=k_max,
                     prefill_tokens_per_step=budget)


def prefill(s: Scheduler, reqs) -> None:
    """What the engine's prefill does to the pool: each admitted context's K/V written."""
    for r in reqs:
        n = len(r.context_ids)
        s.cache.reserve([r.slot], [n])
        s.cache.extend([r.slot], [n])


def req(name: str, n: int, max_tokens: int = 8) -> Planted:
    return Planted(name, list(range(1, n + 1)), max_tokens)


def test_admission_stops_at_the_prompt_token_budget_but_one_request_always_starts():
    s = scheduler(budget=100)
    a, b, c = req("a", 60), req("b", 30), req("c", 20)
    for r in (a, b, c):
        s.add(r)
    assert s.schedule() == [a, b]  # 90 of 100 tokens; c's 20 would pass the budget
    assert s.waiting == [c] and s.running == [a, b]
    big = scheduler(budget=100)
    huge, small = req("huge", 150), req("small", 5)
    big.add(huge)
    big.add(small)
    assert big.schedule() == [huge]  # over the budget alone: admitted, nothing after it
    assert big.schedule() == [small]


def test_admission_stops_at_the_free_slots():
    s = scheduler(slots=2)
    reqs = [req(f"r{i}", 4) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert s.schedule() == reqs[:2] and sorted(r.slot for r in reqs[:2]) == [0, 1]
    assert s.schedule() == [] and s.waiting == [reqs[2]]


def test_admission_keeps_the_blocks_running_requests_need_for_their_next_step():
    # 10 blocks; a request of 40 tokens and k_max 3 needs blocks_for(44) = 3 and a look-ahead later
    s = scheduler(num_blocks=10, k_max=3)
    first = req("first", 40)
    s.add(first)
    assert s.schedule() == [first]
    prefill(s, [first])  # holds 3 blocks; its next step needs none more (44 <= 48)
    assert s.admittable_blocks() == 7
    second, third = req("second", 62), req("third", 62)  # blocks_for(62 + 4) = 5 each
    s.add(second)
    s.add(third)
    assert s.schedule() == [second]  # 5 of 7; third's 5 do not fit in the 2 left
    prefill(s, [second])  # holds blocks_for(62) = 4; its look-ahead (66 positions) takes one more
    assert s.admittable_blocks() == 10 - 3 - 4 - 1
    assert s.schedule() == [] and s.waiting == [third]


def test_a_request_alone_starts_even_when_short_of_blocks_and_a_claim_beyond_the_pool_is_refused():
    s = scheduler(num_blocks=4, k_max=3)
    with pytest.raises(ContextLengthError, match="K/V blocks"):
        s.add(req("too long", 60, max_tokens=8))  # claim: blocks_for(60 + 8 + 4) = 5 > 4
    assert s.waiting == []
    fits = req("fits", 40, max_tokens=8)  # claim blocks_for(52) = 4
    s.add(fits)
    s.cache.reserve([3], [3 * BLOCK])  # planted: another holder of 3 blocks, so `fits` is short of room
    assert s.admittable_blocks() == 1
    assert s.schedule() == [fits]  # nothing runs: it starts anyway (preemption or the pool's return makes room)


def test_preemption_takes_the_youngest_first_and_queues_it_first():
    s = scheduler()
    reqs = [req(f"r{i}", 20) for i in range(3)]
    for r in reqs:
        s.add(r)
    later = req("later", 20)
    assert s.schedule() == reqs
    prefill(s, reqs)
    s.add(later)
    free_before = s.cache.num_free_blocks
    victim = s.preemption_victim()
    assert victim is reqs[2]  # the youngest running request
    slot = victim.slot
    s.preempt(victim)
    assert victim.slot is None and victim.num_preemptions == 1 and slot in s.free_slots
    assert s.running == reqs[:2] and s.waiting == [victim, later]  # ahead of what waited before it
    assert s.cache.num_free_blocks == free_before + 2 and s.cache.lengths[slot] == 0
    assert s.preemption_victim() is reqs[1]
    assert s.schedule() == [victim, later]  # re-admitted first, its context (prompt + output) prefilled again


def test_a_preempted_requests_context_stays_in_the_prefix_cache():
    from draftwise.prefix_cache import PrefixCache
    cache = pool(64)
    pc = PrefixCache()
    s = Scheduler(cache, pc, 4, max_model_len=200, k_max=3)
    r = req("r", 40)
    s.add(r)
    s.schedule()
    prefill(s, [r])
    r.output_ids = [7, 7]  # emitted, the last one pending (not in the cache)
    s.preempt(r)
    entry, cached = pc.match(r.context_ids)
    assert cached == 40  # every token the slot held, kept (evictable) for its re-admission
    assert s.admission_cost(r)[0] == len(r.context_ids) - 40


@pytest.mark.parametrize("seed", range(6))
def test_no_request_is_lost_or_held_twice(seed):
    """Random adds, schedules, preemptions and finishes: each request is in exactly one place (waiting, running,
    finished), running slots are distinct and with the free ones make up every slot, and at the end every block
    and slot is back."""
    rng = random.Random(seed)
    s = scheduler(num_blocks=24, slots=3, budget=64, k_max=2)
    reqs, finished = [], []
    for step in range(300):
        op = rng.random()
        if op < 0.3 and len(reqs) < 40:
            r = req(f"r{len(reqs)}", rng.randrange(1, 70), max_tokens=rng.randrange(1, 40))
            s.add(r)
            reqs.append(r)
        elif op < 0.6:
            prefill(s, s.schedule())
        elif op < 0.75 and s.running:
            s.preempt(s.preemption_victim())
        elif s.running:
            r = rng.choice(s.running)
            if rng.random() < 0.5:  # a decode step's token, then done or not
                r.output_ids.append(1)
            s.finish(r, keep=False)
            finished.append(r)
        places = [id(r) for r in s.waiting] + [id(r) for r in s.running] + [id(r) for r in finished]
        assert sorted(places) == sorted(id(r) for r in reqs), step  # each request exactly once
        held = [r.slot for r in s.running]
        assert len(set(held)) == len(held) and None not in held
        assert sorted(held + s.free_slots) == list(range(3))
        assert all(r.slot is None for r in s.waiting)
    while s.waiting or s.running:
        prefill(s, s.schedule())
        for r in list(s.running):
            s.finish(r, keep=False)
            finished.append(r)
    assert sorted(id(r) for r in finished) == sorted(id(r) for r in reqs)
    assert s.cache.num_free_blocks == s.cache.num_blocks and sorted(s.free_slots) == [0, 1, 2]

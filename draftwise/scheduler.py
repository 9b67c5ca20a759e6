"""The scheduler: which requests hold a slot of the K/V cache, which wait, and who gives blocks back when the pool
runs out (as vLLM keeps its scheduler apart from the model runner).

It owns the waiting queue, the running list (admission order: the youngest last), the free slots and the block
budget: a request's claim (the most blocks it may ever hold), the blocks a running request's next step may take, and
admission under a prompt-token budget per step while the pool has room for each admitted context and a look-ahead.
Admission is optimistic, as vLLM's: when a step later finds the pool short, the youngest running request is
preempted (its slot and blocks returned, its context kept in the prefix cache, itself at the head of the queue, to
be prefilled again from prompt + output when re-admitted).

It does not know models, proposers, logits or sampling: a request is what `Schedulable` names, and the engine
(engine.py) prefills what `schedule()` admits, decodes what runs, and tells the scheduler when a request finishes or
must be preempted (after letting go of its own per-slot state).
"""
from __future__ import annotations

from typing import Protocol, Sequence

from draftwise.config import ContextLengthError
from draftwise.kv_cache import KVCache, blocks_for
from draftwise.prefix_cache import PrefixCache

PREFILL_TOKENS_PER_STEP = 1024  # prompt tokens admitted per step (at least one request always)


class Schedulable(Protocol):
    """What the scheduler reads of a request (engine.Request is one)."""
    prompt_ids: list[int]
    output_ids: list[int]
    params: object  # .max_tokens
    slot: int | None
    num_preemptions: int

    @property
    def context_ids(self) -> list[int]: ...


class Scheduler:
    def __init__(self, cache: KVCache, prefix_cache: PrefixCache | None, max_num_seqs: int, max_model_len: int,
                 k_max: int, prefill_tokens_per_step: int = PREFILL_TOKENS_PER_STEP):
        self.cache = cache  # the target's paged K/V: its blocks are the budget
        self.prefix_cache = prefix_cache  # blocks only it holds count as available (reclaimed before a preemption)
        self.max_model_len = max_model_len
        self.k_max = k_max  # a verification's look-ahead: k_max + 1 positions past a sequence's length
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.waiting: list[Schedulable] = []
        self.running: list[Schedulable] = []  # in admission order: the youngest last (the first preempted)
        self.free_slots = list(range(max_num_seqs))[::-1]

    # ---- the block budget ------------------------------------------------------------------------
    def claim(self, req: Schedulable) -> int:
        """K/V blocks `req` may hold at most: its prompt and max_tokens (within the context) plus one
        verification's look-ahead. A request whose claim exceeds the pool is refused (`add`); any other one
        finishes, alone if it must (preemption gives it the others' blocks)."""
        tokens = min(len(req.prompt_ids) + req.params.max_tokens, self.max_model_len) + self.k_max + 1
        return blocks_for(tokens, self.cache.block_size)

    def admittable_blocks(self) -> int:
        """Available blocks (free, and those only the prefix cache holds) less what the running requests' next
        steps may take (a verification's look-ahead each)."""
        ahead = sum(self.cache.blocks_needed(r.slot, self.cache.lengths[r.slot] + self.k_max + 1)
                    for r in self.running if r.slot is not None)
        return self.cache.num_available_blocks - ahead

    def admission_cost(self, req: Schedulable) -> tuple[int, int]:
        """(tokens its prefill computes, blocks it takes from the available ones) if `req` is admitted now: its
        context less the cached prefix; blocks for its context and a look-ahead, less the whole blocks of its
        cached prefix that running sequences hold anyway (shared, and not counted as available)."""
        n = len(req.context_ids)
        need = blocks_for(n + self.k_max + 1, self.cache.block_size)
        if self.prefix_cache is None:
            return n, need
        entry, cached = self.prefix_cache.match(req.context_ids)
        whole = self.prefix_cache.blocks(entry, cached)[: cached // self.cache.block_size]
        return n - cached, need - sum(self.cache.refs[b] > 1 for b in whole)

    # ---- the queue -------------------------------------------------------------------------------
    def add(self, req: Schedulable) -> None:
        """Queue `req` (last); refused (ContextLengthError) when its claim exceeds the whole pool."""
        if self.claim(req) > self.cache.num_blocks:
            raise ContextLengthError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) needs "
                f"{self.claim(req)} K/V blocks of {self.cache.block_size} tokens, the pool holds "
                f"{self.cache.num_blocks} (--kv-cache-memory)")
        self.waiting.append(req)

    def schedule(self) -> list[Schedulable]:
        """Admit waiting requests in queue order into free slots, up to the step's prompt-token budget (so running
        sequences keep decoding meanwhile) and while the pool has room for each one's context and a look-ahead;
        each admitted request gets a slot and joins `running` (last). At least one request is always admitted
        when nothing runs and a slot is free. Returns the admitted, in order."""
        admit: list[Schedulable] = []
        budget = self.prefill_tokens_per_step
        room = self.admittable_blocks() if self.waiting else 0
        while self.waiting and len(admit) < len(self.free_slots):
            head = self.waiting[0]
            n, need = self.admission_cost(head)  # a cached prefix is neither computed nor held twice
            if admit and n > budget:
                break
            if need > room and (admit or self.running):
                break  # the K/V pool is short: wait until blocks come back (alone, a request always starts)
            room -= need
            if self.prefix_cache is not None and any(a.prompt_ids == head.prompt_ids for a in admit):
                break  # the same prompt again (n > 1 samples): next step, its K/V from the prefix cache
            admit.append(self.waiting.pop(0))
            budget -= n
        for r in admit:
            r.slot = self.free_slots.pop()
            self.running.append(r)
        return admit

    def remove_waiting(self, reqs: Sequence[Schedulable]) -> None:
        for r in reqs:
            self.waiting.remove(r)

    # ---- giving blocks back --------------------------------------------------------------------
    def preemption_victim(self) -> Schedulable:
        """Whom the pool running out preempts: the youngest running request."""
        return self.running[-1]

    def preempt(self, r: Schedulable) -> None:
        """r gives back its slot and blocks (what its cache holds stays in the prefix cache, evictable, for its
        re-admission) and waits at the head of the queue; re-admitted, its prompt and output so far are prefilled
        again. The engine lets go of its own per-slot state first."""
        self.running.remove(r)
        self._release(r, keep=True)
        r.slot = None
        r.num_preemptions += 1
        self.waiting.insert(0, r)

    def finish(self, r: Schedulable, keep: bool) -> None:
        """r is done: it leaves `running` and gives back its slot and blocks; with `keep` (a request that ended
        normally) the prefix cache keeps what its cache holds (the next turn of a chat starts with it)."""
        if r in self.running:
            self.running.remove(r)
        if r.slot is not None:
            self._release(r, keep)

    def _release(self, r: Schedulable, keep: bool) -> None:
        if keep and self.prefix_cache is not None:  # all the slot holds: the context but the last token emitted
            self.prefix_cache.store(r.context_ids[: self.cache.lengths[r.slot]], self.cache, r.slot)
        self.cache.free(r.slot)
        self.free_slots.append(r.slot)

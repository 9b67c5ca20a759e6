"""Fair admission per API key: whether a new request may queue, and which queued request takes the next free slot.

Owns the per-key queues (bounded: `max_queued_per_key`), the per-key cap on requests decoding at once
(`max_running_per_key`), the order requests leave the queues (round-robin over the keys that have a request
waiting and room to run one, so a key that floods the server waits for its own turn and takes nobody else's),
the Retry-After a refused key is told (from its own queue: the keys ahead of it in the round and the measured
time a request holds a slot), and the per-key counts /metrics shows (queued, admitted, rejected). When the server's
whole queue is full, a request from a key with a shorter queue pushes out the newest request of the longest queue
(longest-queue drop), so a full server still takes turns. A key refused again before its Retry-After has passed
has that refusal held back for the rest of the wait (early_retry_hold_s; at most 1 s), so clients that ignore
Retry-After cannot keep the server busy with refusals.

A key is whatever the caller names it by (the runner: guard.cache_scope of the Authorization header; requests
without a key share one). Knows no HTTP, asyncio or engine: the runner calls it under its own lock, and items
are opaque.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

EARLY_RETRY_HOLD_MAX_S = 1.0  # the longest a refusal of a key that came back early is held before it is sent
SERVICE_EWMA = 0.2  # weight of the newest request's slot time in the running mean
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60


@dataclass
class KeyState:
    queue: deque = field(default_factory=deque)  # items waiting for a slot, oldest first
    running: int = 0  # items holding a slot
    admitted: int = 0  # items that got a slot, ever
    rejected: int = 0  # requests refused (429), ever, including longest-queue drops
    last_queued: int = 0  # the admission's sequence number of this key's newest queued item
    retry_at: float = 0.0  # clock time the key's last refusal told it to come back at


@dataclass
class Refusal:
    """Why a request was not queued: the message and the Retry-After (s) to send with the 429."""

    message: str
    retry_after_s: int


class FairAdmission:
    """Round-robin over per-key queues. `slots`: requests the engine decodes at once; `max_waiting`: requests queued
    over all keys; `max_queued_per_key` / `max_running_per_key`: one key's caps."""

    def __init__(self, slots: int, max_waiting: int | None, max_queued_per_key: int | None = None,
                 max_running_per_key: int | None = None, clock=time.monotonic):
        for name, v in (("max_queued_per_key", max_queued_per_key), ("max_running_per_key", max_running_per_key)):
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.slots, self.max_waiting = slots, max_waiting
        self.max_queued_per_key = max_queued_per_key
        self.max_running_per_key = max_running_per_key
        # round-robin order, least recently served first (a new key before every key served already)
        self.keys: OrderedDict[str, KeyState] = OrderedDict()
        self.queued = 0  # items in all queues
        self.running = 0  # items holding a slot, all keys
        self._seq = 0  # items ever queued (KeyState.last_queued)
        self.clock = clock
        self.service_s = 1.0  # running mean of the time a request holds a slot (s); 1 s until one finishes

    def _state(self, key: str) -> KeyState:
        st = self.keys.get(key)
        if st is None:  # never served: first in the round
            st = self.keys[key] = KeyState()
            self.keys.move_to_end(key, last=False)
        return st

    def _active_keys(self) -> int:
        return sum(1 for st in self.keys.values() if st.queue)

    def retry_after(self, key: str) -> int:
        """Seconds until `key` likely has room again: its queue's head must wait for every other key with work
        queued (one request each, round-robin) on `slots` slots; each takes service_s."""
        st = self.keys.get(key)
        ahead = max(1, self._active_keys() - (1 if st and st.queue else 0))
        wait = ahead * self.service_s / max(1, self.slots)
        return int(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(wait))))

    def check(self, key: str) -> Refusal | None:
        """Would a request from `key` be refused now? A refusal is counted against the key."""
        st = self._state(key)
        refusal = self._refusal(st, key)
        if refusal is not None:
            self._rejected(st, refusal)
        return refusal

    def _rejected(self, st: KeyState, refusal: Refusal) -> None:
        st.rejected += 1
        now = self.clock()
        if now >= st.retry_at:  # not while it is early: retrying early does not move the time it was given
            st.retry_at = now + refusal.retry_after_s

    def early_retry_hold_s(self, key: str) -> float:
        """How long to hold a refusal of `key` before sending it: the time left of the Retry-After it was given
        (at most EARLY_RETRY_HOLD_MAX_S), 0 when it came back in time. A client that ignores Retry-After then
        costs the server one idle wait per request instead of a busy loop of refusals."""
        st = self.keys.get(key)
        return 0.0 if st is None else max(0.0, min(EARLY_RETRY_HOLD_MAX_S, st.retry_at - self.clock()))

    def _refusal(self, st: KeyState, key: str) -> Refusal | None:
        # queued items that a free slot takes at once do not count as waiting (the runner moves them)
        free = max(0, self.slots - self.running)
        key_free = free if self.max_running_per_key is None else min(free, self.max_running_per_key - st.running)
        if self.max_queued_per_key is not None and len(st.queue) - max(0, key_free) >= self.max_queued_per_key:
            return Refusal(f"this API key has {len(st.queue)} requests queued, the most one key may queue",
                           self.retry_after(key))
        if self.max_waiting is not None and self.queued - free >= self.max_waiting and self._longest(st) is None:
            return Refusal(f"the server is busy ({self.queued} requests queued, the most it takes)",
                           self.retry_after(key))
        return None

    def _longest(self, st: KeyState) -> KeyState | None:
        """The key state with the longest queue (of those, the one that queued last: a request that has waited
        longest is not the one pushed out), if it is longer than `st`'s (else None: nothing to push out)."""
        longest = max((s for s in self.keys.values() if s.queue), key=lambda s: (len(s.queue), s.last_queued),
                      default=None)
        return longest if longest is not None and len(longest.queue) > len(st.queue) else None

    def offer(self, key: str, item) -> tuple[Refusal | None, object | None]:
        """Queue `item` for `key`, or refuse it (counted). Returns (refusal, dropped): `dropped` is (the item a
        longest-queue drop pushed out to make room, its Refusal: the caller tells it 429), None otherwise."""
        st = self._state(key)
        refusal = self._refusal(st, key)
        if refusal is not None:
            self._rejected(st, refusal)
            return refusal, None
        dropped = None
        if self.max_waiting is not None and self.queued - max(0, self.slots - self.running) >= self.max_waiting:
            longest = self._longest(st)
            longest_key = next(k for k, s in self.keys.items() if s is longest)
            item_out = longest.queue.pop()  # the newest of the longest queue
            longest.rejected += 1
            self.queued -= 1
            dropped = (item_out, Refusal(f"the server's queue is full and this API key has the most requests "
                                         f"queued ({len(longest.queue) + 1}); its newest made room for another "
                                         f"key's", self.retry_after(longest_key)))
        st.queue.append(item)
        self.queued += 1
        self._seq += 1
        st.last_queued = self._seq
        return None, dropped

    def pop(self) -> tuple[str, object] | None:
        """The next item for a free slot: the first key in round-robin order with an item queued and room to run
        one more; that key then goes to the back of the round. None when no key may start anything."""
        for key, st in self.keys.items():
            if st.queue and (self.max_running_per_key is None or st.running < self.max_running_per_key):
                item = st.queue.popleft()
                self.queued -= 1
                st.running += 1
                self.running += 1
                st.admitted += 1
                self.keys.move_to_end(key)
                return key, item
        return None

    def remove_where(self, match) -> object | None:
        """Take out the queued item for which `match(item)` is true (its request was aborted before it got a
        slot) and return it; None when no queued item matches."""
        for st in self.keys.values():
            at = next((i for i, x in enumerate(st.queue) if match(x)), None)
            if at is not None:
                item = st.queue[at]
                del st.queue[at]
                self.queued -= 1
                return item
        return None

    def finished(self, key: str, slot_s: float | None = None) -> None:
        """A running item of `key` left its slot after `slot_s` seconds (None: not a measure, e.g. an error)."""
        st = self.keys.get(key)
        if st is not None and st.running > 0:
            st.running -= 1
            self.running -= 1
        if slot_s is not None and slot_s > 0:
            self.service_s += SERVICE_EWMA * (slot_s - self.service_s)

    def drain_all(self) -> list:
        """Every queued item, taken out (the engine stopped or the server gives up on them)."""
        items = []
        for st in self.keys.values():
            items.extend(st.queue)
            st.queue.clear()
        self.queued = 0
        return items

    def counts(self) -> dict[str, tuple[int, int, int]]:
        """key -> (queued, admitted, rejected), for /metrics."""
        return {k: (len(s.queue), s.admitted, s.rejected) for k, s in self.keys.items()}


def fair_shares(completions: list[tuple[str, frozenset]]) -> dict[str, tuple[int, float]]:
    """key -> (completions, fair share) from a log of completions, each (the key served, the keys that had work
    queued or running then): each completion is owed equally to the keys with work at that moment."""
    got: dict[str, int] = {}
    owed: dict[str, float] = {}
    for key, active in completions:
        got[key] = got.get(key, 0) + 1
        for k in active:
            owed[k] = owed.get(k, 0.0) + 1.0 / len(active)
    return {k: (got.get(k, 0), owed.get(k, 0.0)) for k in set(got) | set(owed)}

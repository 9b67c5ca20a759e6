"""Fair admission per API key (server/admission.py, runner.py): the round-robin order, the per-key caps, Retry-After
from the key's queue, longest-queue drop, and /metrics per hashed key.

The fairness check is a simulation of the flood (2 keys that honour Retry-After, 40 that retry at once, 2 slots):
each well-behaved key must get within 20% of an equal share of the completions among keys with work queued. A
planted first-come-first-served admission (one global queue, 429 when full) must fail that same check.
"""
from __future__ import annotations

import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from draftwise.server.admission import FairAdmission, Refusal, fair_shares
from draftwise.server.app import create_app
from draftwise.server.guard import cache_scope
from draftwise.server.metrics import key_label
from tests.harness import MODEL, Server, metric, one_torch_thread, tiny_llm  # noqa: F401
from tests.test_server_hardening import GOOD, StepGate, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SLOTS, GOOD_KEYS, FLOOD_KEYS = 2, ("good-a", "good-b"), tuple(f"flood-{i}" for i in range(40))


class PlantedFCFS:
    """First come, first served: one global queue of `max_waiting`, 429 when it is full, whoever asks. The
    admission the issue measured (well-behaved clients got 1 of 54 completions)."""

    def __init__(self, slots: int, max_waiting: int):
        self.slots, self.max_waiting = slots, max_waiting
        self.queue: deque = deque()

    def offer(self, key, item):
        if len(self.queue) >= self.max_waiting:
            return Refusal("busy", 1), None
        self.queue.append((key, item))
        return None, None

    def pop(self):
        return self.queue.popleft() if self.queue else None

    def finished(self, key, slot_s=None):
        pass


FLOOD_CONNECTIONS = 3  # requests each flooding key keeps trying to have in flight


def simulate(admission, ticks: int = 600, seed: int = 0) -> list[tuple[str, frozenset]]:
    """The flood in discrete ticks: a request holds a slot for 3 ticks; every flooding key sends, every tick, while
    it has fewer than FLOOD_CONNECTIONS requests in flight, 429s notwithstanding; a well-behaved key keeps one
    request in flight and, after a 429, waits its Retry-After (1 tick per second). The senders' order is shuffled
    each tick. Returns the completion log for fair_shares: the key served, and the keys with work then (a request
    queued or running, or one held back by a Retry-After)."""
    rng = random.Random(seed)
    in_flight: dict[str, int] = {}  # key -> requests queued or running
    running: list[list] = []  # [ticks left, key]
    not_before = {k: 0 for k in GOOD_KEYS}
    log = []
    for t in range(ticks):
        for r in running:
            r[0] -= 1
        for r in [r for r in running if r[0] <= 0]:
            running.remove(r)
            key = r[1]
            # a well-behaved key always has work: a request in flight, or one its Retry-After holds back
            log.append((key, frozenset(k for k, n in in_flight.items() if n) | frozenset(GOOD_KEYS)))
            in_flight[key] -= 1
            admission.finished(key, 3.0)
        while len(running) < SLOTS:
            nxt = admission.pop()
            if nxt is None:
                break
            running.append([3, nxt[0]])
        senders = [k for k in FLOOD_KEYS for _ in range(FLOOD_CONNECTIONS)]
        senders += [k for k in GOOD_KEYS if not in_flight.get(k) and t >= not_before[k]]
        rng.shuffle(senders)
        for key in senders:
            if key in FLOOD_KEYS and in_flight.get(key, 0) >= FLOOD_CONNECTIONS:
                continue
            refusal, dropped = admission.offer(key, key)  # the item: its key
            if dropped is not None:  # a longest-queue drop: that key's newest request got its 429
                in_flight[dropped[0]] -= 1
            if refusal is not None:
                if key in GOOD_KEYS:
                    not_before[key] = t + refusal.retry_after_s
                continue
            in_flight[key] = in_flight.get(key, 0) + 1
    return log


def unfair_keys(log, keys=GOOD_KEYS, tolerance: float = 0.2) -> dict:
    """The keys whose completions are not within `tolerance` of their fair share: key -> (got, owed)."""
    shares = fair_shares(log)
    return {k: shares.get(k, (0, 0.0)) for k in keys
            if not abs(shares.get(k, (0, 0.0))[0] - shares.get(k, (0, 0.0))[1]) <= tolerance * shares[k][1]}


def test_round_robin_gives_well_behaved_keys_their_share():
    log = simulate(FairAdmission(SLOTS, max_waiting=64, max_queued_per_key=1))
    assert len(log) > 300
    assert unfair_keys(log) == {}
    # and the share is not vacuous: each well-behaved key had work for nearly every completion (1/42 of them)
    assert all(fair_shares(log)[k][1] > 0.9 * len(log) / 42 for k in GOOD_KEYS)


def test_planted_first_come_first_served_fails_the_fairness_check():
    log = simulate(PlantedFCFS(SLOTS, max_waiting=64))
    assert len(log) > 300
    assert set(unfair_keys(log)) == set(GOOD_KEYS)


def fill_slots(adm: FairAdmission) -> None:
    """Every slot taken by key "busy" (a request queued while a slot is free is not waiting: it starts at once)."""
    for i in range(adm.slots):
        adm.offer("busy", i)
        assert adm.pop() == ("busy", i)


def test_a_request_a_free_slot_takes_at_once_is_not_counted_as_waiting():
    adm = FairAdmission(slots=1, max_waiting=1, max_queued_per_key=1)
    assert adm.offer("a", "a1") == (None, None)  # the slot is free: a1 is not waiting
    assert adm.offer("a", "a2") == (None, None)  # so a2 is the key's one waiting request
    assert adm.pop() == ("a", "a1")
    assert adm.offer("a", "a3")[0] is not None  # the slot is taken: the key's cap
    refusal, dropped = adm.offer("b", "b1")  # the server's queue is full, a's is the longer: a2 makes room
    assert refusal is None and dropped[0] == "a2"


def test_per_key_queue_cap_and_retry_after_from_the_keys_queue():
    adm = FairAdmission(slots=2, max_waiting=100, max_queued_per_key=2)
    fill_slots(adm)
    for key in ("a", "b", "c"):
        for _ in range(2):
            assert adm.offer(key, object()) == (None, None)
    refusal, _ = adm.offer("a", object())
    assert refusal is not None and "queued" in refusal.message
    # a's head waits for b's and c's turn on 2 slots at 1 s each (the default until one finishes): 1 s
    assert refusal.retry_after_s == 1
    adm.finished("x", 10.0)  # a request held a slot 10 s: the mean moves towards it
    assert adm.service_s == pytest.approx(1.0 + 0.2 * 9.0)
    assert adm.retry_after("a") == 3  # ceil(2 keys ahead * 2.8 s / 2 slots)
    assert adm.counts()["a"] == (2, 0, 1)
    assert adm.counts()["busy"] == (0, 2, 0)


def test_round_robin_order_and_running_cap():
    adm = FairAdmission(slots=4, max_waiting=None, max_running_per_key=1)
    for item in ("a1", "a2", "a3"):
        adm.offer("a", item)
    adm.offer("b", "b1")
    assert adm.pop() == ("b", "b1")  # a key never served goes first
    assert adm.pop() == ("a", "a1")
    assert adm.pop() is None  # b has nothing queued, a one running: its cap
    adm.finished("a")
    assert adm.pop() == ("a", "a2")


def test_longest_queue_drop_makes_room_for_a_shorter_queue():
    adm = FairAdmission(slots=1, max_waiting=3)
    fill_slots(adm)
    for item in ("f1", "f2", "f3"):
        adm.offer("flood", item)
    refusal, dropped = adm.offer("good", "g1")
    assert refusal is None and dropped[0] == "f3" and dropped[1].retry_after_s >= 1
    # the flooder itself cannot push out its own requests: the queue is full and it has the longest
    refusal, dropped = adm.offer("flood", "f4")
    assert refusal is not None and dropped is None
    assert adm.counts()["flood"] == (2, 0, 2) and adm.queued == 3
    assert adm.remove_where(lambda x: x == "g1") == "g1" and adm.queued == 2


def test_bad_caps_are_refused():
    with pytest.raises(ValueError, match="max_queued_per_key"):
        FairAdmission(2, 8, max_queued_per_key=0)


# ---- through the server ------------------------------------------------------------------------------------------
def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_a_full_key_gets_429_while_another_key_is_served_and_metrics_hash_keys():
    llm = tiny_llm(max_num_seqs=1, max_model_len=256)
    app = create_app(llm, MODEL, max_waiting=8, max_queued_per_key=1)
    started = []  # the engine's requests in the order they got the slot, by cache scope (one per key)
    add = llm.add_request
    llm.add_request = lambda req: (started.append(req.cache_scope), add(req))[1]
    with Server(app) as s, ThreadPoolExecutor(3) as pool:
        gate = StepGate(llm.engine, blocked=True)
        try:
            runner = s.app.state.runner
            def post(key):
                r = httpx.post(s.url + "/v1/completions", json=GOOD, headers=bearer(key), timeout=60)
                return r

            pending = [pool.submit(post, "flooder-secret")]  # it takes the slot (the gate holds its first step)
            wait_until(lambda: len(started) == 1)
            pending.append(pool.submit(post, "flooder-secret"))  # it queues: the key's one queued request
            wait_until(lambda: runner.in_flight == 2)
            refused = post("flooder-secret")
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            other = pool.submit(post, "polite-secret")  # its own queue is empty: it queues
            wait_until(lambda: runner.in_flight == 3)
            text = httpx.get(s.url + "/metrics").text
            assert "flooder-secret" not in text and "polite-secret" not in text
            m = s.metrics()
            flood, polite = (key_label(cache_scope(f"Bearer {k}")) for k in ("flooder-secret", "polite-secret"))
            assert metric(m, "draftwise:key_queue_depth", key=flood) == 1
            assert metric(m, "draftwise:key_queue_depth", key=polite) == 1
            assert metric(m, "draftwise:key_rejected_total", key=flood) == 1
            assert metric(m, "draftwise:key_rejected_total", key=polite) == 0
        finally:
            gate.restore()
        assert [p.result().status_code for p in pending + [other]] == [200, 200, 200]
        # round-robin: the polite key's request went before the flooder's second one (its turn came first)
        flood_scope, polite_scope = (cache_scope(f"Bearer {k}") for k in ("flooder-secret", "polite-secret"))
        assert started == [flood_scope, polite_scope, flood_scope]
        m = s.metrics()
        assert metric(m, "draftwise:key_admitted_total", key=polite) == 1
        assert metric(m, "draftwise:key_admitted_total", key=flood) == 2


def test_a_key_back_before_its_retry_after_has_its_refusal_held():
    now = [100.0]
    adm = FairAdmission(slots=1, max_waiting=None, max_queued_per_key=1, clock=lambda: now[0])
    fill_slots(adm)
    adm.offer("a", "a1")
    assert adm.early_retry_hold_s("a") == 0.0  # never refused
    refusal = adm.check("a")
    assert refusal is not None and adm.early_retry_hold_s("a") == 1.0  # told to wait 1 s
    now[0] += 0.4
    assert adm.check("a") is not None  # early again: refused, and the time it was given does not move
    assert adm.early_retry_hold_s("a") == pytest.approx(0.6)
    now[0] += 0.6
    assert adm.early_retry_hold_s("a") == 0.0  # back in time: answered at once
    assert adm.early_retry_hold_s("b") == 0.0  # another key owes nothing

"""How many tokens to guess: a fixed k, or a cost model that picks k per step to maximise tokens per second.

Cost model (in the spirit of Leviathan et al. 2023, §3.4, with measured rather than assumed costs):
with per-position conditional acceptance a_1..a_k, the expected tokens from one step is
E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i, and its time is verify(k+1) + draft_per_token * k. We pick the k in
0..max_k with the highest E(k)/time(k); k = 0 is plain decoding, chosen whenever guessing cannot pay.
verify(width) is timed at start-up (one target forward per width) and refined online from measured steps
(median of the last few, kept monotone in width); the proposer's cost for k guesses is timed at start-up
through the Proposer protocol on a scratch slot, in the steady state (one unseen token) — online draft timings
mix in catch-up prefills after plain steps, which would make guessing look dearer than it is. Acceptance by
position is learned online (per request, falling back to engine-wide counts, with a mild prior).
Knows nothing of models' internals or the proposer's type.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Protocol

import torch

from draftwise.kv_cache import KVCache

WINDOW = 15  # cost measurements kept (per verification width, and for the draft); the median is used
PRIOR_ACCEPT = (1.0, 1.0)  # Beta(1, 1) pseudo-counts for each position's acceptance
MARGIN = 1.1  # guess only when the model predicts >= 10% more tokens/s than plain decoding (estimates are noisy)
EXPLORE_EVERY = 16  # steps between forced speculative steps while plain decoding wins (acceptance can change)


class KPolicy(Protocol):
    """How the engine asks for k each step and reports back what happened."""

    max_k: int  # the most guesses this policy ever asks for (the engine checks it against its look-ahead cap)

    def choose(self, req) -> int:
        """Guesses to ask the proposer for on this request's next step (0 = a plain step)."""

    def observe(self, req, k: int, num_accepted: int) -> None:
        """The request's step guessed k tokens and the target kept the first num_accepted."""

    def observe_step(self, width: int, num_draft_tokens: int, draft_s: float, verify_s: float) -> None:
        """One engine step: verification width (1 + longest draft), guesses in the batch, and its two timings."""

    def end(self, req) -> None:
        """The request finished; forget it."""


class FixedK:
    def __init__(self, k: int):
        self.max_k = k

    def choose(self, req) -> int:
        return self.max_k

    def observe(self, req, k: int, num_accepted: int) -> None:
        pass

    def observe_step(self, width: int, num_draft_tokens: int, draft_s: float, verify_s: float) -> None:
        pass

    def end(self, req) -> None:
        pass


class AdaptiveK:
    def __init__(self, max_k: int, verify_cost: dict[int, float], draft_cost: dict[int, float] | None = None):
        self.max_k = max_k
        self._verify_times = {w: deque([t], maxlen=WINDOW) for w, t in verify_cost.items()}
        self.verify_cost = _monotone(verify_cost)  # width -> seconds per step (median of recent steps)
        self.draft_cost = _monotone(draft_cost or {k: 0.0 for k in range(max_k + 1)})  # k -> seconds to guess k
        self.global_counts = [[0, 0] for _ in range(max_k)]  # per position: [reached, accepted]
        self.req_counts: dict[str, list[list[int]]] = {}
        self.k_histogram: dict[int, int] = {}
        self._since_spec: dict[str, int] = {}

    @classmethod
    def calibrate(cls, target, max_k: int, proposer=None, repeats: int = 5) -> "AdaptiveK":
        """Time one target forward at each verification width 1..max_k+1 on a scratch cache, and the proposer."""
        c = target.config
        scratch = KVCache(c.num_layers, 1, c.num_kv_heads, 64 + max_k + 1, c.head_dim, target.dtype, target.device)
        slot = torch.tensor([0], device=target.device)
        target(torch.zeros(1, 32, dtype=torch.int64, device=target.device),
               torch.arange(32, device=target.device)[None], scratch, slot)
        costs = {}
        for width in range(1, max_k + 2):
            times = []
            for _ in range(repeats + 1):
                scratch.truncate(0, 32)
                ids = torch.zeros(1, width, dtype=torch.int64, device=target.device)
                t0 = time.perf_counter()
                target(ids, 32 + torch.arange(width, device=target.device)[None], scratch, slot)
                times.append(time.perf_counter() - t0)
            costs[width] = statistics.median(times[1:])
        return cls(max_k, costs, _time_proposer(proposer, max_k, repeats) if proposer is not None else None)

    # ---- policy -------------------------------------------------------------------------------
    def acceptance(self, req) -> list[float]:
        counts = self.req_counts.get(req.request_id)
        out = []
        for i in range(self.max_k):
            reached, accepted = self.global_counts[i]
            a0, b0 = PRIOR_ACCEPT
            # the request's own history counts double: acceptance is workload- and prompt-specific
            if counts:
                reached, accepted = reached + 2 * counts[i][0], accepted + 2 * counts[i][1]
            out.append((accepted + a0) / (reached + a0 + b0))
        return out

    def expected_rate(self, k: int, acceptance: list[float]) -> float:
        """Expected tokens per second of one step that guesses k tokens."""
        tokens, run = 1.0, 1.0
        for a in acceptance[:k]:
            run *= a
            tokens += run
        return tokens / (self.verify_cost[k + 1] + self.draft_cost[k])

    def choose(self, req) -> int:
        acc = self.acceptance(req)
        rates = [self.expected_rate(k, acc) for k in range(self.max_k + 1)]
        best = max(range(1, self.max_k + 1), key=rates.__getitem__) if self.max_k else 0
        if rates[best] < MARGIN * rates[0]:
            best = 0
        if best == 0:
            since = self._since_spec.get(req.request_id, 0) + 1
            self._since_spec[req.request_id] = since
            if since >= EXPLORE_EVERY:
                best = min(2, self.max_k)  # a cheap probe keeps the acceptance estimate alive
        if best:
            self._since_spec[req.request_id] = 0
        self.k_histogram[best] = self.k_histogram.get(best, 0) + 1
        return best

    def observe(self, req, k: int, num_accepted: int) -> None:
        counts = self.req_counts.setdefault(req.request_id, [[0, 0] for _ in range(self.max_k)])
        for i in range(min(k, num_accepted + 1)):  # positions reached: all accepted ones and the first rejected
            hit = int(i < num_accepted)
            counts[i][0] += 1
            counts[i][1] += hit
            self.global_counts[i][0] += 1
            self.global_counts[i][1] += hit

    def observe_step(self, width: int, num_draft_tokens: int, draft_s: float, verify_s: float) -> None:
        if width in self._verify_times:
            self._verify_times[width].append(verify_s)
            self.verify_cost = _monotone({w: statistics.median(t) for w, t in self._verify_times.items()})


    def end(self, req) -> None:
        self.req_counts.pop(req.request_id, None)
        self._since_spec.pop(req.request_id, None)


def _monotone(costs: dict[int, float]) -> dict[int, float]:
    """A wider verification never costs less than a narrower one: a timing that says so is noise."""
    out, running = {}, 0.0
    for w in sorted(costs):
        running = max(running, costs[w])
        out[w] = running
    return out


def _time_proposer(proposer, max_k: int, repeats: int) -> dict[int, float]:
    """Seconds for the proposer to guess k tokens, k = 0..max_k, timed through the protocol on scratch slot 0
    (before any request uses it) with every guess rejected, so each call has exactly one unseen token."""
    from draftwise.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    proposer.begin(0, list(range(1, 33)), greedy, None)
    proposer.propose([0], [1])  # the prompt prefill, not part of the steady state
    proposer.accept(0, 0, 1)
    costs = {0: 0.0}
    for k in range(1, max_k + 1):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            proposer.propose([0], [k])
            times.append(time.perf_counter() - t0)
            proposer.accept(0, 0, 1)
        costs[k] = statistics.median(times)
    proposer.end(0)
    return costs

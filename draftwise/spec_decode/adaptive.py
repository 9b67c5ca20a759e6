"""How many tokens to guess: a fixed k, or a cost model that picks k per step to maximise tokens per second.

Cost model (Leviathan et al. 2023, arXiv 2211.17192, §3.4, with measured costs): with α the chance that a
guess is accepted (their i.i.d. assumption; the 0.5B draft's measured acceptance is flat across positions),

    E(k)    = (1 − α^(k+1)) / (1 − α)                                 tokens one step yields (their eq. 1)
    time(k) = verify(k + 1) + draft(k) + catch_up · (behind − 1) · E(k) / remaining          (k ≥ 1)

and k = argmax E(k)/time(k) over 0..k_max (k = 0: a plain step, time(0) = verify(1)). Guessing starts when the
best k predicts MARGIN more tokens/s than plain and stops when it predicts less than plain (KEEP_MARGIN):
stopping is free, restarting is not. `behind`: context tokens the proposer has not read (1 in the steady
state; a request's prompt before its first guess; + 1 per plain step, for a draft model that reads only on
`propose`). Catching up is paid once, so it is spread over the steps left if each yields E(k) (remaining =
output tokens left).

Costs: the choice compares E/time across k at one moment, so only the costs' ratios matter, and only timings
taken together give ratios on a shared machine. `calibrate` times, in interleaved rounds, a target forward at
every width 1..k_max+1 after CONTEXT tokens, and through the Proposer protocol the proposer guessing k in the
steady state and after CATCH_UP unseen tokens; each cost keeps its fastest round (load only adds time, and a
burst spoils a round, not a width). Nothing is refined from step timings (per-width medians compared widths
timed minutes apart on a machine drifting ±30%, and a width never chosen kept its stale time); instead the
costs follow the load they were measured under: the policy reads other processes' busy cores every
LOAD_WINDOW_S (kernels/threads.BusyWindows), and when two windows in a row differ from the calibration's by
LOAD_CHANGE_CORES or more it times the target's widths again (RECHECK_ROUNDS rounds on calibrate's scratch cache;
the proposer's costs scaled by the 1-row forward's change), so a calibration taken under a burst leaves
speculation off (or on) only until the burst ends, and one taken quietly is re-checked when a neighbour arrives.

α is learned per request, older guesses decayed (DECAY per guess: a chat answer turns into code and back),
behind PRIOR_GUESSES pseudo-guesses at the engine's α, which each finished request moves ENGINE_MIX of the way
to its own: the last few requests set a new request's start, and no workload's long history outvotes a
request's own evidence. While plain decoding wins, a k = PROBE_K probe after EXPLORE_EVERY plain steps keeps
the estimate alive, the gap doubling after each probe (every probe pays the proposer's catch-up).
Knows nothing of models' internals or the proposer's type.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Protocol

import torch

from draftwise.kernels.threads import BusyWindows
from draftwise.kv_cache import KVCache, target_cache_capacity

ROUNDS = 5  # interleaved calibration rounds; every cost keeps its fastest
CONTEXT = 128  # context tokens before the timed target forwards (a typical request's; attention grows with it)
CATCH_UP = 16  # unseen tokens before the timed catch-up guess (a probe after EXPLORE_EVERY - 1 plain steps)
PRIOR_GUESSES = 4.0  # weight of the engine's α in a request's estimate, in guesses of the request's own
DECAY = 0.9  # per guess: how much of a request's older evidence is kept
ENGINE_MIX = 0.5  # a finished request's share in the engine's α (the last few requests count)
MARGIN = 1.1  # start guessing only when the model predicts >= 10% more tokens/s than plain decoding ...
KEEP_MARGIN = 1.0  # ... and stop when it predicts less than plain (stopping is free, restarting costs a catch-up)
EXPLORE_EVERY = 16  # plain steps before a probe (then 32, 64, ...: the gap doubles after each probe)
PROBE_K = 2  # guesses of a probe
LOAD_WINDOW_S = 2.0  # how often the policy reads other processes' busy cores
LOAD_CHANGE_CORES = 0.5  # a load this far from the calibration's, two windows in a row, re-times the costs
RECHECK_ROUNDS = 2  # rounds of the re-timing (a short stall of the engine, once per load change)


class KPolicy(Protocol):
    """How the engine asks for k each step and reports back what happened."""

    k_max: int  # the most guesses this policy ever asks for (the engine checks it against its look-ahead cap)

    def choose(self, req) -> int:
        """Guesses to ask the proposer for on this request's next step (0 = a plain step)."""

    def observe(self, req, k: int, num_accepted: int) -> None:
        """The request's step guessed k tokens (k >= 1) and the target kept the first num_accepted."""

    def end(self, req) -> None:
        """The request finished; forget it."""


class FixedK:
    def __init__(self, k: int):
        self.k_max = k

    def choose(self, req) -> int:
        return self.k_max

    def observe(self, req, k: int, num_accepted: int) -> None:
        pass

    def end(self, req) -> None:
        pass


class AdaptiveK:
    def __init__(self, k_max: int, verify_cost: dict[int, float], draft_cost: dict[int, float] | None = None,
                 catch_up_cost: float = 0.0, retime: Callable[[], dict[int, float]] | None = None,
                 windows: BusyWindows | None = None, calibrated_load: float | None = None):
        self.k_max = k_max
        self.retime = retime  # () -> width -> seconds: the target's forwards timed again (None: never re-checked)
        self.windows = windows  # other processes' busy cores per window (None: the load is not watched)
        self.calibrated_load = calibrated_load  # busy cores of the others while the costs were measured
        self.recalibrations = 0
        self._drift = 0  # windows in a row whose load differs from the calibration's
        self.verify_cost = _monotone(verify_cost)  # width -> seconds of one target forward
        self.draft_cost = _monotone(draft_cost or {k: 0.0 for k in range(k_max + 1)})  # k -> seconds to guess k
        self.catch_up_cost = catch_up_cost  # seconds per context token the proposer has not seen yet
        self.engine_alpha: float | None = None  # α of the last few finished requests; None before the first
        self.req_counts: dict[str, tuple[float, float]] = {}
        self.k_histogram: dict[int, int] = {}
        self._behind: dict[str, int] = {}  # request -> context tokens its proposer has not seen
        self._plain_run: dict[str, int] = {}  # request -> plain steps since its last guess
        self._probe_gap: dict[str, int] = {}

    @classmethod
    def calibrate(cls, target, k_max: int, proposer=None, rounds: int = ROUNDS) -> AdaptiveK:
        """Time a target forward at each verification width 1..k_max+1 after CONTEXT tokens (on a scratch cache,
        as the engine verifies: `num_tokens`), and the proposer (on its scratch slot 0, before any request)."""
        c, dev = target.config, target.device
        context = min(CONTEXT, c.max_position_embeddings - k_max - 1)
        capacity = target_cache_capacity(context, k_max)  # the engine's slot, at this context
        scratch = KVCache(c.num_layers, 1, c.num_kv_heads, capacity, c.head_dim, target.dtype, dev)
        slot = torch.tensor([0], device=dev)
        target(torch.zeros(1, context, dtype=torch.int64, device=dev), torch.arange(context, device=dev)[None],
               scratch, slot)

        def time_verify(width: int) -> float:
            scratch.truncate(0, context)
            ids = torch.zeros(1, width, dtype=torch.int64, device=dev)
            pos = context + torch.arange(width, device=dev)[None]
            return _timed(dev, target, ids, pos, scratch, slot, num_tokens=[width])

        timer = (lambda: _time_proposer(proposer, k_max, dev)) if proposer is not None else None
        windows = BusyWindows(window_s=LOAD_WINDOW_S) if dev.type == "cpu" else None
        return cls.from_timers(k_max, time_verify, timer, rounds, windows)

    @classmethod
    def from_timers(cls, k_max: int, time_verify: Callable[[int], float],
                    proposer: Callable[[], tuple[list[float], float]] | None, rounds: int = ROUNDS,
                    windows: BusyWindows | None = None) -> AdaptiveK:
        """`rounds` interleaved rounds of time_verify(width) for every width and proposer() -> (seconds to guess
        k = 1..k_max in the steady state, seconds to guess 1 after CATCH_UP unseen tokens); the fastest of each.
        `windows` (started before this call) gives the load they were measured under and then watches it."""
        widths = range(1, k_max + 2)

        def verify_costs(n: int, start: dict[int, float]) -> dict[int, float]:
            costs = dict(start)
            for _ in range(n):
                costs = {w: min(costs[w], time_verify(w)) for w in widths}
            return costs

        verify_cost = {w: float("inf") for w in widths}
        draft_cost, behind = {k: float("inf") for k in range(k_max + 1)}, float("inf")
        for _ in range(rounds):
            verify_cost = verify_costs(1, verify_cost)
            steady, late = proposer() if proposer is not None else ([0.0] * k_max, 0.0)
            for k, t in enumerate([0.0, *steady]):
                draft_cost[k] = min(draft_cost[k], t)
            behind = min(behind, late)
        catch_up = max(0.0, behind - draft_cost[1]) / (CATCH_UP - 1) if k_max else 0.0
        load = windows.sample(force=True) if windows is not None else None
        return cls(k_max, verify_cost, draft_cost, catch_up,
                   retime=lambda: verify_costs(RECHECK_ROUNDS, {w: float("inf") for w in widths}),
                   windows=windows, calibrated_load=load)

    def watch_load(self) -> bool:
        """Read the load once a window has passed; re-time the costs when it has moved LOAD_CHANGE_CORES from the
        calibration's for two windows in a row (one window is a blip). True when it re-timed."""
        if self.windows is None or self.retime is None:
            return False
        others = self.windows.sample()
        if others is None:
            return False
        if self.calibrated_load is None:
            self.calibrated_load = others
        if abs(others - self.calibrated_load) < LOAD_CHANGE_CORES:
            self._drift = 0
            return False
        self._drift += 1
        if self._drift < 2:
            return False
        fresh = _monotone(self.retime())
        scale = fresh[1] / self.verify_cost[1] if self.verify_cost[1] > 0 else 1.0
        print(f"draftwise: other processes keep ~{others:.1f} cores busy (calibrated at "
              f"~{self.calibrated_load:.1f}): speculation costs re-timed, a 1-token forward now "
              f"{fresh[1] * 1e3:.1f} ms (was {self.verify_cost[1] * 1e3:.1f})", file=sys.stderr, flush=True)
        self.verify_cost = fresh
        self.draft_cost = {k: v * scale for k, v in self.draft_cost.items()}  # a proposer slows down alike
        self.catch_up_cost *= scale
        self.calibrated_load, self._drift = others, 0
        self.recalibrations += 1
        return True

    # ---- policy -------------------------------------------------------------------------------
    def acceptance(self, req) -> float:
        """α for this request: its own decayed counts behind PRIOR_GUESSES pseudo-guesses at the engine's α
        (one at 0.5 before any request has finished)."""
        reached, accepted = self.req_counts.get(req.request_id, (0.0, 0.0))
        prior, weight = (0.5, 1.0) if self.engine_alpha is None else (self.engine_alpha, PRIOR_GUESSES)
        return (accepted + weight * prior) / (reached + weight)

    def expected_rate(self, k: int, alpha: float, behind: int = 1, remaining: int = 1 << 30) -> float:
        """E(k)/time(k): expected tokens per second of a step that guesses k tokens (module docstring)."""
        tokens = sum(alpha ** i for i in range(k + 1))  # E(k) = (1 - α^(k+1)) / (1 - α)
        catch_up = self.catch_up_cost * (behind - 1) * tokens / max(remaining, 1) if k else 0.0
        return tokens / (self.verify_cost[k + 1] + self.draft_cost[k] + catch_up)

    def choose(self, req) -> int:
        self.watch_load()
        rid = req.request_id
        behind = self._behind.get(rid, len(req.prompt_ids) + 1)
        remaining = req.params.max_tokens - len(req.output_ids)
        alpha = self.acceptance(req)
        rates = [self.expected_rate(k, alpha, behind, remaining) for k in range(self.k_max + 1)]
        best = max(range(self.k_max + 1), key=rates.__getitem__)
        guessing = self._plain_run.get(rid) == 0  # its last step guessed: stopping is free, restarting is not
        if rates[best] < (KEEP_MARGIN if guessing else MARGIN) * rates[0]:
            best = 0
        plain_run = self._plain_run.get(rid, 0) + 1 if best == 0 else 0
        gap = self._probe_gap.get(rid, EXPLORE_EVERY)
        if plain_run >= gap:  # a cheap probe keeps the acceptance estimate alive, less often each time
            best, plain_run, self._probe_gap[rid] = min(PROBE_K, self.k_max), 0, 2 * gap
        self._plain_run[rid] = plain_run
        self._behind[rid] = behind + 1 if best == 0 else behind  # observe() resets it once the proposer guessed
        self.k_histogram[best] = self.k_histogram.get(best, 0) + 1
        return best

    def observe(self, req, k: int, num_accepted: int) -> None:
        """Guesses reached: every accepted one and the first rejected; older evidence decays per guess."""
        self._behind[req.request_id] = 1
        reached = min(k, num_accepted + 1)
        own = self.req_counts.get(req.request_id, (0.0, 0.0))
        keep = DECAY ** reached
        self.req_counts[req.request_id] = (own[0] * keep + reached, own[1] * keep + num_accepted)

    def end(self, req) -> None:
        """The request's own α (its recent guesses) moves the engine's, the prior of the next requests."""
        reached, accepted = self.req_counts.get(req.request_id, (0.0, 0.0))
        if reached:
            mix = ENGINE_MIX if self.engine_alpha is not None else 1.0
            self.engine_alpha = (1 - mix) * (self.engine_alpha or 0.0) + mix * accepted / reached
        for d in (self.req_counts, self._behind, self._plain_run, self._probe_gap):
            d.pop(req.request_id, None)


def _monotone(costs: dict[int, float]) -> dict[int, float]:
    """Guessing more never costs less: a timing that says so is noise."""
    out, running = {}, 0.0
    for w in sorted(costs):
        running = max(running, costs[w])
        out[w] = running
    return out


def _timed(device, fn, *args, **kwargs) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _time_proposer(proposer, k_max: int, device) -> tuple[list[float], float]:
    """Seconds for the proposer to guess k = 1..k_max tokens in the steady state (every guess rejected, so each
    call has one unseen token), and to guess one after CATCH_UP unseen tokens (plain steps: asked for nothing,
    told each emitted token), through the protocol on scratch slot 0 (before any request uses it)."""
    from draftwise.sampling import SamplingParams

    # a proposer that stops on its own confidence (draft_model's min_guess_prob) guesses all k while it is timed
    stop = getattr(proposer, "min_guess_prob", None)
    if stop:
        proposer.min_guess_prob = 0.0
    try:
        return _time_proposer_guessing_k(proposer, k_max, device, SamplingParams(temperature=0.0))
    finally:
        if stop:
            proposer.min_guess_prob = stop


def _time_proposer_guessing_k(proposer, k_max: int, device, params) -> tuple[list[float], float]:
    proposer.begin(0, list(range(1, 33)), params, None)
    proposer.propose([0], [1])  # the prompt, not part of the steady state
    proposer.accept(0, 0, 1)
    steady = []
    for k in range(1, k_max + 1):
        steady.append(_timed(device, proposer.propose, [0], [k]))
        proposer.accept(0, 0, 1)
    for _ in range(CATCH_UP - 1):
        proposer.propose([0], [0])
        proposer.accept(0, 0, 1)
    late = _timed(device, proposer.propose, [0], [1])
    proposer.end(0)
    return steady, late

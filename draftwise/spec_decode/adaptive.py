"""How many tokens to guess: a fixed k, or a cost model that picks every row's k for the whole batch once per step,
to maximise the batch's tokens per second (0 = a plain row).

Cost model (Leviathan et al. 2023, arXiv 2211.17192, §3.4, per row, with measured batch costs): with α_i the chance
that row i's guess is accepted (their i.i.d. assumption; the 0.5B draft's measured acceptance is flat across
positions), a step in which row i guesses k_i tokens yields and costs

    E_i(k)  = (1 − α_i^(k+1)) / (1 − α_i)                       tokens row i emits (their eq. 1; E_i(0) = 1)
    time(k) = verify(B, w(k)) + draft(k) + Σ_i catch_up(behind_i − 1) · E_i(k_i) / remaining_i
    w(k)    = Σ_i (1 + k_i) / B                                    (ragged; a padded batch: 1 + max_i k_i)
    rate(k) = Σ_i E_i(k_i) / time(k)

verify(B, w): the target's step-cost grid (kernels/step_cost.py: B rows x w tokens, measured at load, corrected
online from the engine's own steps), at the point with as many tokens as the engine computes: its verification is
ragged (every row its own 1 + k_i tokens, Σ_i (1 + k_i) in all), B rows of a fractional width with exactly that
many tokens (the grid is piecewise-linear in width, and its load-time cells are B rows x w tokens each), the point
the engine's observe_step reports, so the grid is corrected where it is read. Rounded up to a whole width (as it was
before 2026-12-06's sixth session), the cell (B, 2) priced one row's guess among 8 rows as 8 more tokens, and, corrected
from such steps (nearly free: 9 tokens cost what 8 do), priced 8 rows guessing one each (16 tokens: 1.5-1.6x a
plain step on this machine's step records) as nearly free too: low-acceptance rows guessed at c = 4 and 8. Read
at any width, a cell never costs less than a narrower one at the same B (an online residual saying so is load
noise). A batch holding a token
tree is still padded to its widest row: `padded` (set by a caller whose proposer grows trees, and learned from the
steps: one reported wider than its ragged width) prices 1 + max_i k_i instead. A row that does not guess beside one
that does costs one token, not the widest row's width, so mixed k (a likely row guessing, an unlikely one plain)
can pay where one padded step would not. draft(k):
guess j is one draft forward over the B_j rows guessing >= j tokens, Σ_j draft_grid(B_j, 1), scaled online by the
measured proposing time, and the draft grid's own cells taught by it as the target's are (a step without catch-up:
its seconds shared among its forwards by their prices, each observed at (B_j, 1)), so a 4-row forward is priced
from 4-row steps, not from the scale 1-row steps set (a proposer without a model: what its lookups measure, per
guessing row, times the rows guessing: a step's lookups are one per row). The draft's costs also follow the
target grid's load factor (both models run on the same cores: when the target's steps take 3x what its grid was
timed at, so do the draft's forwards), so a batch that decoded plainly for a while, the draft idle, still prices a
restart's draft forwards and catch-up at today's load; the draft's own scale learns only how the two differ.
Catch-up (k_i >= 1 only): context
the proposer has not read (`behind`: the prompt before a request's first guess, + 1 per plain step, for a draft
model that reads only on `propose`), paid once, so spread over the steps left if each yields E (remaining = output
tokens still expected: max_tokens left, or fewer where finished requests of its kind have been ending sooner at a
stop or EOS; `remaining`). A request's kind (`length_kinds`) is what the engine knows of it on arrival that predicts
where it ends: its shape as its client set it (max_tokens' power-of-two bucket, stop strings and stop ids,
ignore_eos, whether a grammar constrains it) within its cache scope (the server: its API key), else that shape in
every scope; each kind keeps the last LENGTH_WINDOW lengths its requests finished with (at a stop, EOS or
max_tokens: an aborted or failed request says nothing of where it would have ended), used from LENGTH_SAMPLES of
them on, the engine's (every kind's finished requests) until then. A chat asking for 128 tokens that runs to them
no longer prices a code completion's catch-up, nor a code completion that stops after 20 tokens a chat's; prompts
that differ only in content (the bench's code/repeated and code/novel: one max_tokens, one stop list) share a kind.
remaining is robust to such a mix: the catch-up a token is C / remaining, and over where the request may end (the
kind's recent lengths L past its n tokens, equally likely) its expectation is C · E[1 / (L − n)], so remaining is
their harmonic mean, which the short answers dominate (the mean over requests of seconds a token, what a user's
TPOT averages, priced exactly); past every recent length, n more (Lindy: a request that has run n tokens is likely
to run about n more). Until 2026-12-07 (first session) an EWMA of the lengths: code/repeated's 137 tokens priced
the catch-up of code/novel answers that ended after 8-46 (0.91x plain at 4 server clients, one ~0.8 s step of the
draft reading four prompts).
catch_up(n): what a draft row's forward of 1 + n tokens costs beyond a width-1 forward (the draft reads them in
the forward that yields its first guess), from the draft grid's cells at B = 1, PROMPT_WIDTHS
included (StepCost.catch_up: a ~100-token catch-up runs the prompt kernels, a fraction of the per-token cost that
widths 1..16 extrapolate to), times the draft's load factor; a constant per token where the caller gives one.

The decision (`choose_batch`, once per step): for each K in 1..k_max and m in 1..B, the m rows likeliest to be
accepted guess min(K, their cap) and the others none; the best of these, then each row (least likely first) tried
at every other k, the others held, for up to SWEEPS sweeps while one improves. Guessing starts when the best predicts MARGIN more tokens/s than a plain step of
the batch and stops when it predicts less than plain (KEEP_MARGIN): stopping is free, restarting is not. The
shared-K pass adds rows in order, keeping Σ k_i (the ragged width) and the widest (the padded one) as it goes; in
the per-row sweeps a smaller k saves verification tokens (ragged) as well as draft forwards and catch-up, a larger
one rides along a padded widest row. Where an upper bound on every guessing mix's rate (for each total of guesses S,
the S largest guess gains over the cheapest step that holds S guesses: `_guessing_bound`) is no more than plain's,
the search is skipped, with the same decision: a batch of rows that cannot pay costs one bound a step, not the
search. A
narrow batch makes width nearly free; a wide batch makes every token dear: the grid decides, the same rule at every
load. Paired plain steps: a batch that keeps guessing runs plain steps rarely, so a plain step's price was the
load-time grid's shape times the load factor its guessing steps set, and one timing after a load does not give that
shape on a busy VM ((4, 2) / (4, 1) anywhere in 1.24-1.61): chat at c = 4 (2026-12-07, second session) priced plain
4-row steps at 44.7 ms against 37.5-39.4 measured and kept guessing at a predicted 1.08x that realized 0.88x. So every
PAIR_EVERY-th close guessing decision (predicting less than PAIR_MARGIN over plain: a clear win is not flipped by
a mispriced plain step) runs plain instead, its hysteresis kept; the plain cell learns its cost at the guessing
steps' load and, visited now and then, keeps it (step_cost FRESH_STEPS). The gap doubles up to PAIR_MAX while
paired steps cost within PAIR_TOL of their price and is PAIR_EVERY again when one does not. The engine asks
`choose_batch(reqs, caps)`; `choose(req)` is the same rule for a batch of one (the prefill's first guesses,
per-request callers).

α is learned per request, older guesses decayed (DECAY per guess: a chat answer turns into code and back),
behind a prior (`prior_for`): the other running requests' own decayed guesses pooled, behind PRIOR_GUESSES
pseudo-guesses at the engine's α, which each finished request moves ENGINE_MIX of the way to its own. The last few
requests set a new request's start only until the running ones show theirs: the engine's α moves only as requests
finish, so a batch of new requests (a new workload) priced every row at the previous workload's α (code/novel at
c = 8 opened with every row guessing at code/repeated's 0.76) for as long as each row's own few guesses took to
outweigh it; pooled, one step of the batch's guesses is the whole batch's evidence. No workload's long history
outvotes a request's own evidence. While plain decoding wins for a row, a k = PROBE_K probe after EXPLORE_EVERY plain steps
keeps its estimate from freezing, the gap doubling after each probe; a probe widens the whole padded step, so the
rows whose probe is at least half due probe in that same step. A probe pays what a guess pays (the padded width,
the draft's forwards and the proposer's whole catch-up: a draft model reads the prompt and every plain step's
token first), so a row is probed only where the same search, with its α raised to PROBE_ALPHA, would have it
guess: where the grid and its catch-up make guessing lose even at that acceptance, no probe can change the
decision and the row stays plain (a short answer whose draft never read its prompt never pays the prompt). A cold
engine (no finished request has guessed yet, so no acceptance to go by) probes where a guess accepted every time
would pay: its first probes are what every later request's prior is learned from.
Knows nothing of models' internals or the proposer's type.
"""
from __future__ import annotations

import heapq
import math
from typing import Protocol

from draftwise.kernels.step_cost import StepCost

PRIOR_GUESSES = 4.0  # weight of the engine's α in a request's estimate, in guesses of the request's own
DECAY = 0.9  # per guess: how much of a request's older evidence is kept
ENGINE_MIX = 0.5  # a finished request's share in the engine's α (the last few requests count)
MARGIN = 1.1  # start guessing only when the model predicts >= 10% more tokens/s than plain decoding ...
KEEP_MARGIN = 1.0  # ... and stop when it predicts less than plain (stopping is free, restarting costs a catch-up)
PAIR_EVERY = 8  # close guessing decisions before a paired plain step (the plain step's cost at the same load) ...
PAIR_MAX = 64  # ... the gap doubling up to this while paired steps take what the grid priced them at ...
PAIR_TOL = 0.05  # ... within this (further off: the gap is PAIR_EVERY again)
PAIR_MARGIN = 1.3  # a close decision: it predicts less than this over plain (a clear win needs no paired step)
EXPLORE_EVERY = 16  # plain steps before a probe (then 32, 64, ...: the gap doubles after each probe)
PROBE_K = 2  # guesses of a probe
SWEEPS = 2  # the search's per-row passes after the shared-K one (each row at every k, the others held)
PROBE_ALPHA = 0.9  # the acceptance a probe looks for: a row whose guessing would not pay even at it is not probed
COLD_PROBE_ALPHA = 1.0  # ... before the engine has any acceptance of its own (every guess accepted)
DRAFT_EWMA = 0.1  # per guessing step: the draft's scale (or a model-free proposer's seconds a row) toward the measured
DRAFT_RATIO_RANGE = (0.25, 4.0)  # one step's measured / predicted proposing time, as the draft's scale reads it
CATCH_UP_TOKENS = 128  # a typical prompt: `catch_up_cost` (seconds a token) is the catch-up of this many, per token
LENGTH_WINDOW = 8  # finished requests' output lengths kept per kind and for the engine (the last few: `remaining`)
LENGTH_SAMPLES = 3  # finished requests of a kind before its own lengths are used (the engine's until then)
LENGTH_KINDS = 256  # kinds whose typical lengths are kept (the least recently finished one is forgotten first)
FINISHED = ("stop", "length")  # the finish reasons whose output length is evidence (not "abort", not "error")


def forward_rows(k_per_seq: list[int]) -> list[int]:
    """The rows of each draft forward of a step: guess j is one forward over the rows guessing >= j tokens."""
    top = max(k_per_seq, default=0)
    at = [0] * (top + 1)  # rows guessing exactly k
    for k in k_per_seq:
        at[k] += 1
    rows, out = 0, [0] * top
    for j in range(top, 0, -1):  # rows guessing >= j: a running sum from the widest down
        rows += at[j]
        out[j - 1] = rows
    return out


def length_kinds(req) -> tuple:
    """The kinds a request's output length is learned under, narrowest first (module docstring): its shape as its
    client set it (max_tokens' power-of-two bucket, stop strings, stop ids, ignore_eos, constrained by a grammar)
    within its cache scope, then that shape in every scope. All of it is known when the request arrives."""
    p = req.params
    shape = (p.max_tokens.bit_length(), tuple(sorted(p.stop)), tuple(sorted(p.stop_token_ids)), p.ignore_eos,
             p.structured_outputs is not None)
    return ("scope", req.cache_scope, shape), ("shape", shape)


def ragged_width(guesses: list[int]) -> float:
    """The step-cost grid width of a ragged verification whose B rows guess these many tokens: its Σ(1 + k_i)
    tokens as B rows of Σ(1 + k_i) / B = 1 + Σ k_i / B tokens each, a fractional width (the grid is piecewise-linear
    in width, so this is the cost of exactly its tokens; what the engine reports to observe_step). Rounded up to a
    whole width, one row's guess in a batch of 8 was priced as 8 more tokens, and the cell learned from such
    steps priced 8 rows guessing one each as if they cost what one row's guess does."""
    return 1 + sum(guesses) / max(len(guesses), 1)


class KPolicy(Protocol):
    """How the engine asks for k each step and reports back what happened."""

    k_max: int  # the most guesses this policy ever asks for (the engine checks it against its look-ahead cap)

    def choose(self, req) -> int:
        """Guesses to ask the proposer for on this request's next step (0 = a plain step)."""

    def observe(self, req, k: int, num_accepted: int) -> None:
        """The request's step guessed k tokens (k >= 1) and the target kept the first num_accepted."""

    def end(self, req) -> None:
        """The request finished; forget it."""

    # optional (choose_batch / observe_step below fall back without them):
    # choose_batch(reqs, caps) -> [k per row], one decision for the whole step;
    # observe_step(batch, width, step_s, propose_s, k_per_seq): one decode step's own timing


def choose_batch(policy, reqs: list, caps: list[int]) -> list[int]:
    """Every row's k for this step: the policy's batch decision, else its per-request view; each within its cap
    (0: the row may not guess: opted out, or no room left)."""
    batch = getattr(policy, "choose_batch", None)
    if batch is not None:
        ks = batch(reqs, caps)
    else:
        ks = [policy.choose(r) if c > 0 else 0 for r, c in zip(reqs, caps)]
    return [max(0, min(k, c)) for k, c in zip(ks, caps)]


def observe_step(policy, batch: int, width: int, step_s: float, propose_s: float, k_per_seq: list[int]) -> None:
    """Hand a decode step's timing to a policy that learns from it (AdaptiveK's grids); others ignore it."""
    fn = getattr(policy, "observe_step", None)
    if fn is not None:
        fn(batch, width, step_s, propose_s, k_per_seq)


class FixedK:
    def __init__(self, k: int):
        self.k_max = k

    def choose(self, req) -> int:
        return self.k_max

    def choose_batch(self, reqs, caps) -> list[int]:
        return [min(self.k_max, c) for c in caps]

    def observe(self, req, k: int, num_accepted: int) -> None:
        pass

    def end(self, req) -> None:
        pass


class AdaptiveK:
    def __init__(self, k_max: int, verify_cost: StepCost | dict[int, float],
                 draft_cost: StepCost | dict[int, float] | None = None, catch_up_cost: float | None = None):
        """verify_cost: the target's grid (a width -> seconds dict: a batch-independent one); draft_cost: the
        draft model's grid (one forward of B rows), or k -> seconds to guess k (batch-independent), or None (a
        proposer without a model: its seconds are measured online); catch_up_cost: seconds per context token
        the proposer has not read (None: from the draft grid's B = 1 cells, StepCost.catch_up; 0 without one)."""
        self.k_max = k_max
        self.target = verify_cost if isinstance(verify_cost, StepCost) else StepCost.from_widths(verify_cost)
        self.draft_grid = draft_cost if isinstance(draft_cost, StepCost) else None
        self.draft_steps = None if draft_cost is None or self.draft_grid is not None else dict(draft_cost)
        # seconds per unseen context token at the load time's scale (a constant), or None: the draft grid's cells
        self._catch_up = catch_up_cost if catch_up_cost is not None or self.draft_grid is not None else 0.0
        self.padded = False  # the engine pads verification to the widest row (token trees); ragged otherwise
        self.draft_scale = 1.0  # measured / predicted proposing time of guessing steps, beyond the load factor (EWMA)
        self.propose_row_s = 0.0  # a model-free proposer's seconds per guessing row of a step (EWMA)
        self.engine_alpha: float | None = None  # α of the last few finished requests; None before the first
        self.req_counts: dict[str, tuple[float, float]] = {}
        self.k_histogram: dict[int, int] = {}
        self.last_decision: tuple[int, int] = (0, 0)  # (rows that guessed, rows) of the last batch decision
        self._guessing = False  # the last batch decision guessed: stopping is free, restarting is not
        self._since_pair = 0  # close guessing decisions since the last paired plain step
        self._pair_gap = PAIR_EVERY  # ... before the next
        self._pair_pending = False  # the last decision was a paired plain step: its observed cost moves the gap
        self.paired_steps = 0  # paired plain steps taken
        self._unseen = 0.0  # seconds (load time) of catch-up the last decision's guessing rows had the proposer do
        self._behind: dict[str, int] = {}  # request -> context tokens its proposer has not seen
        self._plain_run: dict[str, int] = {}  # request -> plain steps since its last guess
        self._probe_gap: dict[str, int] = {}
        self.lengths: list[int] = []  # output tokens of the last LENGTH_WINDOW finished requests, any kind
        self._kind_lengths: dict[tuple, list[int]] = {}  # length kind -> its last LENGTH_WINDOW finished lengths
        self._live = [0.0, 0.0]  # Σ over running requests of their own (decayed) guesses reached, accepted

    @classmethod
    def calibrate(cls, target, k_max: int, proposer=None, max_batch: int = 8, cache: bool = False) -> AdaptiveK:
        """A policy over `target`'s measured grid and, for a proposer with a draft model (`proposer.model`), the
        draft's (kernels/step_cost.load_or_measure; `cache`: the per-machine cache of loaded checkpoints). Where
        either grid is provisional (timed while other processes were busy, at another moment than the other), the
        draft's scale starts at their load ratio timed now, together (step_cost.load_now): the draft factor
        multiplies the draft's cells by the target's load factor, so a draft grid timed at 3x the target grid's load
        priced the draft 3x (2026-12-07, first session: a draft forward at 0.99x a 4-row target step against 0.23-0.35x
        measured, and no guessing step at all at c = 4, so the online scale, learned from guessing steps, never moved)."""
        from draftwise.kernels.step_cost import GRID_WIDTHS, load_or_measure

        draft = getattr(proposer, "model", None)
        policy = cls(k_max, load_or_measure(target, max_batch, GRID_WIDTHS, "all", cache=cache),
                     load_or_measure(draft, max_batch, GRID_WIDTHS, "last", cache=cache)  # + PROMPT_WIDTHS cells
                     if draft is not None else None)
        policy.align_draft(target, draft)
        return policy

    def align_draft(self, target, draft) -> None:
        """Where either grid is provisional, the draft's scale starts at the two models' load ratio timed now
        (calibrate's docstring); nothing is timed otherwise, or without a draft grid."""
        from draftwise.kernels.step_cost import load_now

        if draft is None or self.draft_grid is None or not (self.target.provisional or self.draft_grid.provisional):
            return
        ratios = [(load_now(draft, self.draft_grid, "last"), load_now(target, self.target, "all"))
                  for _ in range(2)]  # interleaved: a burst in one pass is the other's too
        self.draft_scale = min(d for d, _ in ratios) / min(t for _, t in ratios)

    @property
    def draft_factor(self) -> float:
        """What the draft's load-time costs are multiplied by now: its own scale times the target's load factor."""
        return self.draft_scale * self.target.scale

    def _catch_up_base(self, tokens: int) -> float:
        """Seconds to read `tokens` unseen context tokens at the load time's costs (module docstring: catch_up)."""
        if tokens <= 0:
            return 0.0
        if self._catch_up is None:
            return self.draft_grid.catch_up(tokens)
        return self._catch_up * tokens

    def catch_up_time(self, tokens: int) -> float:
        """Seconds for the proposer to read `tokens` context tokens it has not seen, now."""
        return self._catch_up_base(tokens) * self.draft_factor

    @property
    def catch_up_cost(self) -> float:
        """Seconds per context token the proposer has not read, now (a CATCH_UP_TOKENS catch-up's, per token)."""
        return self.catch_up_time(CATCH_UP_TOKENS) / CATCH_UP_TOKENS

    def verify_width(self, k_per_seq: list[int]) -> float:
        """The grid width a step with these guesses is priced at: the ragged width with exactly as many tokens
        (fractional), as observe_step records it; a padded engine's widest row."""
        if self.padded:
            return 1 + max(k_per_seq, default=0)
        return ragged_width(k_per_seq)

    def verify_cost(self, batch: int, width: int) -> float:
        """Seconds of a target step of `batch` rows x `width` tokens now (the live grid)."""
        return self.target.cost(batch, width)

    # ---- costs ---------------------------------------------------------------------------------------------
    def draft_time(self, k_per_seq: list[int]) -> float:
        """Seconds to propose k_per_seq: guess j is one draft forward over the rows guessing >= j tokens."""
        K = max(k_per_seq, default=0)
        if K == 0:
            return 0.0
        if self.draft_grid is not None:
            t = sum(self.draft_grid.cost(b, 1) for b in forward_rows(k_per_seq))
        elif self.draft_steps is not None:
            t = self.draft_steps.get(K, self.draft_steps[max(self.draft_steps)])
        else:  # a proposer without a model looks up each guessing row on its own
            return self.propose_row_s * sum(k > 0 for k in k_per_seq)
        return t * self.draft_factor

    def _lookup_row_s(self) -> float | None:
        """A proposer without a model: its seconds per guessing row (draft_time is that times the rows guessing,
        whatever their k); None where a draft grid or a k -> seconds curve prices the proposal."""
        return self.propose_row_s if self.draft_grid is None and self.draft_steps is None else None

    def batch_rate(self, k_per_seq: list[int], alphas: list[float], behind: list[int] | None = None,
                   remaining: list[int] | None = None) -> float:
        """rate(k): the batch's expected tokens per second when row i guesses k_per_seq[i] (module docstring)."""
        return self._rate_of(alphas, max(k_per_seq, default=0), behind, remaining)(k_per_seq)

    def expected_rate(self, k: int, alpha: float, behind: int = 1, remaining: int = 1 << 30) -> float:
        """E(k)/time(k) of one request alone (a batch of one)."""
        return self.batch_rate([k], [alpha], [behind], [remaining])

    def _rate_of(self, alphas: list[float], k_top: int, behind: list[int] | None, remaining: list[int] | None):
        """rate(ks) for ks up to k_top, over costs read once per decision (the grids' lookups are the slow part);
        its `.parts` (E table, verify by width, draft forward by rows or None, catch-up per row) for best_ks.
        verify[w] is the target's step of the n rows at whole width w, never less than at a narrower one (more
        tokens never cost less: an online residual that says so is load noise); a fractional width (ragged:
        1 + Σk/n) is read between its two whole widths (`_at`: exactly the grid's piecewise-linear value)."""
        n = len(alphas)
        e = [[_expected(a, k) for k in range(k_top + 1)] for a in alphas]  # E_i(k)
        verify = [0.0]
        for w in range(1, k_top + 2):  # by the priced width, non-decreasing
            verify.append(max(self.target.cost(n, w), verify[-1]))
        forward = ([0.0] + [self.draft_grid.cost(b, 1) * self.draft_factor for b in range(1, n + 1)]
                   if self.draft_grid is not None else None)  # one draft forward of b rows (none for 0)
        cu = ([self.catch_up_time(behind[i] - 1) / max(remaining[i], 1) for i in range(n)]
              if behind is not None else [0.0] * n)
        per_row = self._lookup_row_s()

        def rate(ks: list[int]) -> float:  # one pass over the rows: the search prices ~100 mixes a step at 8 rows
            tokens, catch_up, rows = 0.0, 0.0, 0
            for i, k in enumerate(ks):
                tokens += e[i][k]
                if k:
                    catch_up += cu[i] * e[i][k]
                    rows += 1
            w = _at(verify, self.verify_width(ks))
            if forward is not None:
                draft = sum(forward[b] for b in forward_rows(ks))
            elif per_row is not None:
                draft = per_row * rows
            else:
                draft = self.draft_time(ks)
            return tokens / (w + draft + catch_up)

        rate.parts = (e, verify, forward, cu)
        return rate

    # ---- the decision --------------------------------------------------------------------------------------
    def best_ks(self, alphas: list[float], caps: list[int], behind: list[int] | None = None,
                remaining: list[int] | None = None) -> tuple[list[int], float, float]:
        """(k per row, its rate, plain's rate): the search of the module docstring, without hysteresis or probes.
        The shared-K pass adds rows one at a time, updating the sums (no full re-evaluation per candidate): the
        tokens, the catch-up, the draft's forwards by depth, Σk (the ragged width 1 + Σk/n) and the widest row
        (the padded width 1 + widest); both widths are at most 1 + K, inside `verify`. Where `_guessing_bound` says
        no mix can beat plain, the search is skipped (the same decision)."""
        n = len(alphas)
        k_top = min(self.k_max, max(caps, default=0))
        rate = self._rate_of(alphas, k_top, behind, remaining)
        e, verify, forward, cu = rate.parts
        plain = rate([0] * n)
        best, best_rate = [0] * n, float("-inf")  # the best guessing candidate (plain's rate compared at the end)
        order = sorted((i for i in range(n) if caps[i] > 0), key=lambda i: -alphas[i])
        if not order:
            return best, plain, plain
        per_row = self._lookup_row_s()
        if _guessing_bound(order, caps, k_top, e, verify, forward, cu, self.draft_time, self.padded, plain,
                           per_row) <= plain:
            return best, plain, plain  # no mix can beat plain (the bound's docstring): the search would find none
        for K in range(1, k_top + 1):
            ks, rows_at = [0] * n, [0] * (K + 1)  # rows_at[j]: rows guessing >= j tokens
            tokens, catch_up, draft, widest, guessed, rows = float(n), 0.0, 0.0, 0, 0, 0
            for i in order:
                k = ks[i] = min(K, caps[i])
                tokens += e[i][k] - 1.0
                catch_up += cu[i] * e[i][k]
                widest = max(widest, k)
                guessed += k
                rows += 1
                if forward is not None:
                    for j in range(1, k + 1):
                        draft += forward[rows_at[j] + 1] - forward[rows_at[j]]
                        rows_at[j] += 1
                elif per_row is not None:
                    draft = per_row * rows
                else:
                    draft = self.draft_time(ks)
                width = 1 + widest if self.padded else 1 + guessed / n
                r = tokens / (_at(verify, width) + draft + catch_up)
                if r > best_rate:
                    best, best_rate = list(ks), r
        # ragged, the step's width follows Σk: one guess at a time to the row it adds the most tokens to (row i's
        # (k+1)-th guess adds α_i^(k+1)), each total priced (the allocation of Σk guesses that yields the most)
        if not self.padded:
            ks = [0] * n
            heap = [(-alphas[i], -alphas[i], -i) for i in order if min(k_top, caps[i]) > 0]  # negated: a max-heap
            heapq.heapify(heap)  # of (the next guess's gain α_i^(k_i + 1), α_i, i): the largest goes next
            while heap:
                _, neg_alpha, neg_i = heapq.heappop(heap)
                i = -neg_i
                ks[i] += 1
                if ks[i] < min(k_top, caps[i]):
                    heapq.heappush(heap, (-(alphas[i] ** (ks[i] + 1)), neg_alpha, neg_i))
                r = rate(ks)
                if r > best_rate:
                    best, best_rate = list(ks), r
        # then each row alone (least likely first) at every other k, the others held, while a sweep improves; from
        # the best guessing candidate even where it loses to plain (one row fewer and one more may win together)
        for _ in range(SWEEPS if any(best) else 0):
            improved = False
            for i in reversed(order):
                for k in {0, best[i] - 1, best[i] + 1}:  # plain, or one guess fewer or more
                    if not 0 <= k <= min(k_top, caps[i]) or k == best[i]:
                        continue
                    trial = list(best)
                    trial[i] = k
                    r = rate(trial)
                    if r > best_rate:
                        best, best_rate, improved = trial, r, True
            if not improved:
                break
        if best_rate <= plain:
            best = [0] * n
        return best, rate(best), plain

    def choose_batch(self, reqs: list, caps: list[int] | None = None, guessing: bool | None = None) -> list[int]:
        """Each row's k for this step (caps: each row's most, default k_max); `guessing`: whether the last step
        guessed, for the hysteresis (default: the last batch decision's)."""
        guessing = self._guessing if guessing is None else guessing
        caps = [self.k_max] * len(reqs) if caps is None else [min(c, self.k_max) for c in caps]
        rids = [r.request_id for r in reqs]
        behind = [self._behind.get(rid, len(r.prompt_ids) + 1) for rid, r in zip(rids, reqs)]
        # a request's first decision (its prefill's guesses) pays its prompt's catch-up in full: later steps may not guess
        remaining = [self.remaining(r) if rid in self._behind else 1 for rid, r in zip(rids, reqs)]
        alphas = [self.acceptance(r) for r in reqs]
        ks, rate, plain = self.best_ks(alphas, caps, behind, remaining)
        if any(ks) and rate < (KEEP_MARGIN if guessing else MARGIN) * plain:
            ks = [0] * len(reqs)
        paired = any(ks) and rate < PAIR_MARGIN * plain and self._pair_due()
        if paired:  # this step runs plain, so the plain cell is priced at today's load too (module docstring)
            ks = [0] * len(reqs)
        runs = [self._plain_run.get(rid, 0) + 1 if ks[i] == 0 else 0 for i, rid in enumerate(rids)]
        gaps = [self._probe_gap.get(rid, EXPLORE_EVERY) for rid in rids]
        # a probe widens the whole padded step: rows whose probe is at least half due take the same step; only rows
        # that would guess at PROBE_ALPHA (their catch-up charged) are worth the probe
        hopeful = self._worth_probing(alphas, caps, behind, remaining, runs, gaps)
        for i, rid in enumerate(rids):
            plain_run, gap = runs[i], gaps[i]
            if hopeful[i] and plain_run >= (gap + 1) // 2:  # keeps the estimate alive, less often each time
                ks[i], plain_run, self._probe_gap[rid] = min(PROBE_K, caps[i]), 0, 2 * gap
            self._plain_run[rid] = plain_run
            self._behind[rid] = behind[i] + 1 if ks[i] == 0 else behind[i]  # observe() resets it after a guess
            self.k_histogram[ks[i]] = self.k_histogram.get(ks[i], 0) + 1
        self._guessing = any(ks) or paired  # a paired plain step keeps the guessing margin
        self.last_decision = (sum(k > 0 for k in ks), len(ks))
        self._unseen = sum(self._catch_up_base(behind[i] - 1) for i in range(len(ks)) if ks[i])  # read first
        return ks

    def _pair_due(self) -> bool:
        """Called at each guessing decision whose gain is close (below PAIR_MARGIN): whether this one runs plain
        instead (the gap: PAIR_EVERY, doubling while paired steps confirm the price; PAIR_EVERY 0: never)."""
        self._since_pair += 1
        if not PAIR_EVERY or self._since_pair < self._pair_gap:
            return False
        self._since_pair, self._pair_pending = 0, True
        self.paired_steps += 1
        return True

    def _worth_probing(self, alphas: list[float], caps: list[int], behind: list[int], remaining: list[int],
                       runs: list[int], gaps: list[int]) -> list[bool]:
        """Per row: may it probe this step? None may unless some row's probe is due; then each row that would guess
        if every row's α were at least PROBE_ALPHA (COLD_PROBE_ALPHA before the engine has an α; the same search and
        start margin; widths, draft forwards and catch-up as they are), so a probe is never paid where no
        acceptance it looks for would make guessing pay."""
        n = len(alphas)
        if not any(runs[i] >= gaps[i] and caps[i] > 0 for i in range(n)):
            return [False] * n
        hope = PROBE_ALPHA if self.engine_alpha is not None else COLD_PROBE_ALPHA
        ks, rate, plain = self.best_ks([max(a, hope) for a in alphas], caps, behind, remaining)
        if rate < MARGIN * plain:
            return [False] * n
        return [k > 0 for k in ks]

    def remaining(self, req) -> int:
        """The output tokens a request is expected to produce still, which a catch-up is spread over (module
        docstring: `remaining`): over the recent finished lengths of its kind (`recent_lengths`) that it has not
        yet reached, the harmonic mean of what each would leave it, 1 / mean(1 / (L - n)): the catch-up per token is
        C / remaining, and its expectation over where the request may end is C · E[1 / (L - n)], which a short
        answer dominates (an arithmetic mean, or an EWMA, of lengths let a kind's long answers price the catch-up
        of its short ones). Past every recent length: as many as it has produced (Lindy: a request that has run n
        tokens is likely to run about n more). Max_tokens left where nothing finished yet; never more than it may."""
        n, left = len(req.output_ids), req.params.max_tokens - len(req.output_ids)
        lengths = self.recent_lengths(req)
        if not lengths:
            return max(left, 1)
        ahead = [length - n for length in lengths if length > n]
        expected = len(ahead) / sum(1.0 / a for a in ahead) if ahead else n
        return max(1, min(left, round(expected)))

    def recent_lengths(self, req) -> list[int]:
        """The output lengths requests like this one recently finished with: the narrowest of its kinds
        (`length_kinds`) with LENGTH_SAMPLES finished requests, else the engine's (empty before any finished)."""
        for kind in length_kinds(req):
            lengths = self._kind_lengths.get(kind, ())
            if len(lengths) >= LENGTH_SAMPLES:
                return list(lengths)
        return list(self.lengths)

    def expected_length(self, req) -> float | None:
        """A request like this one's typical output length: the harmonic mean of `recent_lengths` (what
        `remaining` spreads a catch-up over at the request's start); None before any request finished."""
        return _harmonic(self.recent_lengths(req))

    @property
    def typical_length(self) -> float | None:
        """The harmonic mean of the engine's last LENGTH_WINDOW finished output lengths (any kind)."""
        return _harmonic(self.lengths)

    def choose(self, req) -> int:
        """The batch rule for one request alone (a prefill's first guesses): the batch decision's state is kept."""
        held = self._guessing, self.last_decision, self._unseen
        k = self.choose_batch([req], guessing=self._plain_run.get(req.request_id) == 0)[0]
        self._guessing, self.last_decision, self._unseen = held
        return k

    # ---- learning ------------------------------------------------------------------------------------------
    def observe_step(self, batch: int, width: int, step_s: float, propose_s: float, k_per_seq: list[int]) -> None:
        """A decode step of `batch` rows verified at `width` in step_s seconds after proposing k_per_seq in
        propose_s: the target's grid follows it; a guessing step moves the draft's scale (or seconds). A guessing
        step of several rows reported wider than its ragged width was padded (a token tree in the batch): the
        following decisions price the widest row (`padded`) until a step is reported ragged again."""
        if self._pair_pending and not any(k_per_seq):  # a paired plain step: was the plain cell priced right?
            self._pair_pending = False
            off = abs(math.log(step_s / self.target.cost(batch, width))) if step_s > 0 else math.inf
            self._pair_gap = min(2 * self._pair_gap, PAIR_MAX) if off <= math.log1p(PAIR_TOL) else PAIR_EVERY
        self.target.observe(batch, width, step_s)
        if batch > 1 and any(k_per_seq) and len(k_per_seq) == batch:
            ragged = ragged_width(k_per_seq)
            if ragged != 1 + max(k_per_seq):
                self.padded = width > ragged
        if not any(k_per_seq) or not propose_s > 0:
            return
        if self.draft_grid is None and self.draft_steps is None:  # per guessing row: 8 rows' lookups cost 8 rows'
            per_row = propose_s / sum(k > 0 for k in k_per_seq)
            self.propose_row_s = (1 - DRAFT_EWMA) * self.propose_row_s + DRAFT_EWMA * per_row
            return
        predicted = (self.draft_time(k_per_seq) / self.draft_scale + self._unseen * self.target.scale)
        if predicted > 0:  # one step moves the scale by at most DRAFT_RATIO_RANGE (a prompt's catch-up is an outlier)
            ratio = min(max(propose_s / predicted, DRAFT_RATIO_RANGE[0]), DRAFT_RATIO_RANGE[1])
            self.draft_scale = math.exp((1 - DRAFT_EWMA) * math.log(self.draft_scale) + DRAFT_EWMA * math.log(ratio))
        if self.draft_grid is not None and self._unseen == 0:  # no catch-up in it: the step's forwards alone
            self._teach_draft_grid(k_per_seq, propose_s)

    def _teach_draft_grid(self, k_per_seq: list[int], propose_s: float) -> None:
        """The draft's grid learns the shape of its forwards by rows as the target's does (StepCost.observe): a
        step's proposing seconds shared among its forwards (guess j: the rows guessing >= j) by their prices, each
        seen at its (rows, 1) cell in the grid's own units (the draft factor divided out). One draft scale for every
        batch size priced a 4-row forward at 13.6 ms that took ~17 (chat at c = 4, its scale learned from 1- and
        2-row steps; 2026-12-07, third session)."""
        rows = forward_rows(k_per_seq)
        prices = [self.draft_grid.cost(b, 1) for b in rows]
        total, factor = sum(prices), self.draft_factor
        if not (total > 0 and factor > 0):
            return
        for b, price in zip(rows, prices):
            self.draft_grid.observe(b, 1, propose_s * price / total / factor)

    def acceptance(self, req) -> float:
        """α for this request: its own decayed counts behind the prior's pseudo-guesses (`prior_for`: the other
        running requests' evidence and the engine's α)."""
        reached, accepted = self.req_counts.get(req.request_id, (0.0, 0.0))
        prior, weight = self.prior_for(req)
        return (accepted + weight * prior) / (reached + weight)

    def prior_for(self, req) -> tuple[float, float]:
        """(α, weight in guesses) a request's own evidence is added to: the other running requests' own (decayed)
        guesses pooled, behind PRIOR_GUESSES pseudo-guesses at the engine's α (the last finished requests'), at
        weight PRIOR_GUESSES; before any request finished, one pseudo-guess at 0.5 behind the pool, weight 1.
        The requests running now are the workload now: the engine's α moves only as requests finish, so a
        code/novel batch after code/repeated requests started every row at the α code/repeated finished with."""
        reached, accepted = self.req_counts.get(req.request_id, (0.0, 0.0))
        live_reached, live_accepted = max(self._live[0] - reached, 0.0), max(self._live[1] - accepted, 0.0)
        alpha, weight = (0.5, 1.0) if self.engine_alpha is None else (self.engine_alpha, PRIOR_GUESSES)
        return (live_accepted + weight * alpha) / (live_reached + weight), weight

    def observe(self, req, k: int, num_accepted: int) -> None:
        """Guesses reached: every accepted one and the first rejected; older evidence decays per guess."""
        self._behind[req.request_id] = 1
        reached = min(k, num_accepted + 1)
        own = self.req_counts.get(req.request_id, (0.0, 0.0))
        keep = DECAY ** reached
        new = self.req_counts[req.request_id] = (own[0] * keep + reached, own[1] * keep + num_accepted)
        self._live = [self._live[0] + new[0] - own[0], self._live[1] + new[1] - own[1]]

    def end(self, req) -> None:
        """The request's own α (its recent guesses) moves the engine's, the prior of the next requests; where it
        finished (FINISHED: at a stop, EOS or max_tokens), its output length moves its kinds' typical lengths and
        the engine's (`remaining`)."""
        if req.finish_reason in FINISHED:
            self._learn_length(req)
        reached, accepted = self.req_counts.get(req.request_id, (0.0, 0.0))
        self._live = [self._live[0] - reached, self._live[1] - accepted]
        if self.req_counts.keys() <= {req.request_id}:
            self._live = [0.0, 0.0]  # no other running request has evidence: no float residue
        if reached:
            mix = ENGINE_MIX if self.engine_alpha is not None else 1.0
            self.engine_alpha = (1 - mix) * (self.engine_alpha or 0.0) + mix * accepted / reached
        for d in (self.req_counts, self._behind, self._plain_run, self._probe_gap):
            d.pop(req.request_id, None)

    def _learn_length(self, req) -> None:
        """A finished request's output length into the engine's recent lengths and each of its kinds' (the last
        LENGTH_WINDOW each); past LENGTH_KINDS kinds the least recently finished one is forgotten."""
        n = len(req.output_ids)
        self.lengths = (self.lengths + [n])[-LENGTH_WINDOW:]
        for kind in length_kinds(req):
            self._kind_lengths[kind] = (self._kind_lengths.pop(kind, []) + [n])[-LENGTH_WINDOW:]
        while len(self._kind_lengths) > LENGTH_KINDS:
            del self._kind_lengths[next(iter(self._kind_lengths))]


def _harmonic(lengths: list[int]) -> float | None:
    """1 / mean(1 / n) of output lengths (a zero-length output counted as 1); None for none."""
    return len(lengths) / sum(1.0 / max(n, 1) for n in lengths) if lengths else None


def _expected(alpha: float, k: int) -> float:
    """E(k) = (1 - α^(k+1)) / (1 - α): tokens a row emits when it guesses k (1 + the expected accepted)."""
    return k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _at(verify: list[float], width: float) -> float:
    """verify (by whole width) read at a fractional width: linear between the two whole widths around it."""
    w = int(width)
    t = width - w
    return verify[w] if t == 0 else verify[w] + t * (verify[w + 1] - verify[w])


def _guessing_bound(order: list[int], caps: list[int], k_top: int, e: list[list[float]], verify: list[float],
                    forward: list[float] | None, cu: list[float], draft_time, padded: bool = False,
                    enough: float = float("inf"), per_row: float | None = None) -> float:
    """An upper bound on the rate of every mix in which some row guesses (best_ks's parts), taken over the total
    guesses S = Σ k_i = 1, 2, ...: at most the S largest guess gains of any rows (E_i(k + 1) − E_i(k), whichever rows
    they belong to) over at least the cheapest step holding S guesses: verification at width 1 + S/n (padded: the
    widest row holds at least ceil(S/n)), the draft's forwards of such a step (at least ceil(S/n) of them, the first over
    at least the m rows that S guesses need, m from the largest caps; a proposer without a grid: its least proposal
    of m rows), and the m smallest first-guess catch-ups. Where it is no more than plain's rate the search cannot
    find a guessing mix that beats plain, so best_ks skips it with the same decision: a batch whose rows cannot pay
    costs one bound a step (O(n k log nk)), not the search. (The bound read one guess's verification against every
    row's longest guess before 2026-12-07's first session: at c = 4 chat the search ran every step, and with the
    probe check's second search cost ~0.7 ms a step on this machine, speculation configured but unused.) A relative
    slack of 1e-9 keeps summation order's rounding from ever skipping a mix that beats plain by less. Once some S's
    bound exceeds `enough` (plain's rate: the search will run) that bound is returned without reading further S."""
    n = len(e)
    gains = sorted((e[i][k + 1] - e[i][k] for i in order for k in range(min(k_top, caps[i]))), reverse=True)
    tops = sorted((min(k_top, caps[i]) for i in order), reverse=True)  # guesses the m likeliest-capped rows hold
    first = sorted(cu[i] * e[i][1] for i in order)  # each row's least catch-up if it guesses at all
    if forward is not None:  # the least draft forward over at least m rows (the step's first), and over any rows
        least_from = [0.0] * (n + 2)
        least_from[n + 1] = float("inf")
        for b in range(n, 0, -1):
            least_from[b] = min(forward[b], least_from[b + 1])
    else:
        least_rows: dict[int, float] = {}  # m -> the least proposal of m rows (read as S reaches m)
    best, tokens, catch_up, rows, held = 0.0, float(n), 0.0, 0, 0
    for s, gain in enumerate(gains, 1):
        tokens += gain
        while held < s:  # m: the fewest rows that hold s guesses
            held += tops[rows]
            catch_up += first[rows]
            rows += 1
        deepest = -(-s // n)  # the widest row guesses at least this many
        width = verify[1 + deepest] if padded else _at(verify, 1 + s / n)
        if forward is not None:
            draft = least_from[rows] + (deepest - 1) * least_from[1]
        else:
            if rows not in least_rows:  # a model-free proposer's (per_row given): the same for every k
                least_rows[rows] = (per_row * rows if per_row is not None else
                                    min(draft_time([k] * rows + [0] * (n - rows)) for k in range(1, k_top + 1)))
            draft = least_rows[rows]
        cost = width + draft + catch_up
        if cost <= 0:
            return float("inf")
        best = max(best, tokens / cost * (1 + 1e-9))
        if best > enough:
            break
    return best

"""Speculation statistics in the one vocabulary the engine, bench, server /metrics and reports share.

Owns the counters (docs/ARCHITECTURE.md, metric definitions): num_drafts, num_draft_tokens, num_accepted_tokens,
accepted_per_position, and the derived acceptance rate (accepted / draft tokens) and mean acceptance length
(1 + accepted / drafts, as vLLM and Spec-Bench define it); with structured outputs, the **forced** tokens (the
grammar's only continuation, anywhere in a draft) and their acceptance, counted apart, and the
seconds spent on grammar masks. It does not know what produced the drafts or
how they were verified; callers `record` one verified draft at a time and `merge` across requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters for verified drafts. A step that proposed k = 0 tokens is not a draft: it only appears in
    `k_histogram` (the adaptive policy turned speculation off), so the acceptance figures describe drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [max k] drafts whose token i was kept
    drafted_per_position: list[int] = field(default_factory=list)  # [max k] drafts that had a token i
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    k_histogram: dict[int, int] = field(default_factory=dict)  # k used -> steps
    num_forced_tokens: int = 0  # draft tokens the grammar forced (a subset of num_draft_tokens)
    num_accepted_forced_tokens: int = 0  # of those, accepted (a subset of num_accepted_tokens)
    mask_time_s: float = 0.0  # grammar masks for the target (structured outputs), plain steps included
    # engine-wide, per decode step: (rows that guessed, rows in the batch) -> steps (the batch's one decision)
    decisions: dict[tuple[int, int], int] = field(default_factory=dict)

    def record(self, k: int, num_accepted: int, *, draft_time_s: float = 0.0, verify_time_s: float = 0.0,
               forced: tuple[int, ...] = ()) -> None:
        """Count one step that proposed `k` tokens of which the first `num_accepted` were kept; the guesses at
        positions `forced` (0-based, distinct) were forced by the grammar."""
        if k < 0 or not 0 <= num_accepted <= k or len(set(forced)) != len(forced) or any(
                not 0 <= i < k for i in forced):
            raise ValueError(f"need 0 <= num_accepted <= k and distinct forced positions in 0..k-1, got k={k}, "
                             f"num_accepted={num_accepted}, forced={forced}")
        self.num_forced_tokens += len(forced)
        self.num_accepted_forced_tokens += sum(1 for i in forced if i < num_accepted)
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        self.draft_time_s += draft_time_s
        self.verify_time_s += verify_time_s
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        _grow(self.drafted_per_position, k)
        _grow(self.accepted_per_position, k)
        for i in range(k):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def record_decision(self, speculating: int, batch: int) -> None:
        """Count one decode step of `batch` rows of which `speculating` guessed."""
        self.decisions[(speculating, batch)] = self.decisions.get((speculating, batch), 0) + 1

    def add_times(self, draft_time_s: float, verify_time_s: float) -> None:
        """Charge seconds of proposing and of verification to these counters (a share of a batched step)."""
        self.draft_time_s += draft_time_s
        self.verify_time_s += verify_time_s

    def merge(self, other: SpecStats) -> SpecStats:
        """Add `other`'s counters into this one (in place); returns self so totals can be folded."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.drafted_per_position, other.drafted_per_position),
        ):
            _grow(mine, len(theirs))
            for i, count in enumerate(theirs):
                mine[i] += count
        self.draft_time_s += other.draft_time_s
        self.verify_time_s += other.verify_time_s
        self.num_forced_tokens += other.num_forced_tokens
        self.num_accepted_forced_tokens += other.num_accepted_forced_tokens
        self.mask_time_s += other.mask_time_s
        for k, count in other.k_histogram.items():
            self.k_histogram[k] = self.k_histogram.get(k, 0) + count
        for d, count in other.decisions.items():
            self.decisions[d] = self.decisions.get(d, 0) + count
        return self

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None before any draft."""
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verified draft: 1 (the correction or bonus) + accepted / drafts."""
        if self.num_drafts == 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def forced_acceptance_rate(self) -> float | None:
        """Accepted / proposed forced tokens; None before any (a target may prefer another tokenization)."""
        if self.num_forced_tokens == 0:
            return None
        return self.num_accepted_forced_tokens / self.num_forced_tokens

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """P(token i kept | the draft had a token i): the curve an adaptive k policy reads."""
        return [a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def to_dict(self) -> dict:
        """JSON-ready: plain numbers, string keys, derived rates included."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "k_histogram": {str(k): count for k, count in sorted(self.k_histogram.items())},
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "num_forced_tokens": self.num_forced_tokens,
            "num_accepted_forced_tokens": self.num_accepted_forced_tokens,
            "forced_acceptance_rate": self.forced_acceptance_rate,
            "mask_time_s": self.mask_time_s,
        }


def _grow(counts: list[int], length: int) -> None:
    if len(counts) < length:
        counts.extend([0] * (length - len(counts)))

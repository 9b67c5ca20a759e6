"""The Proposer protocol: what every proposer implements, the Draft it returns, and plain decoding's NoProposer.

A proposer guesses up to k next tokens for a sequence slot; the engine verifies them with the target. The
engine talks to every proposer through this protocol only (never isinstance-checks), so `none` — plain
decoding — is a proposer that never proposes. Modelled on llama.cpp's speculative "common" interface: `accept`
is the one explicit rollback call. Which proposer a method name builds lives in builders.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.sampling import SamplingParams


@dataclass
class Draft:
    token_ids: torch.Tensor  # [k] int64
    probs: torch.Tensor | None = None  # [k, target_vocab] processed draft distribution; None = point masses

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


EMPTY_DRAFT_IDS = torch.zeros(0, dtype=torch.int64)


class Proposer(Protocol):
    def begin(self, slot: int, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator) -> None:
        """A sequence starts in `slot` with these prompt ids."""

    def propose(self, slots: list[int], max_tokens: list[int]) -> list[Draft]:
        """Up to max_tokens[i] guesses for each slot (fewer, or none, is fine)."""

    def accept(self, slot: int, num_accepted: int, token_id: int) -> None:
        """The target kept the first `num_accepted` guesses of the last draft, then emitted `token_id`."""

    def end(self, slot: int) -> None:
        """The sequence in `slot` finished; forget it."""


class NoProposer:
    """Plain decoding through the same engine path: never proposes anything."""

    def begin(self, slot, prompt_ids, params, generator):
        pass

    def propose(self, slots, max_tokens):
        return [Draft(EMPTY_DRAFT_IDS) for _ in slots]

    def accept(self, slot, num_accepted, token_id):
        pass

    def end(self, slot):
        pass


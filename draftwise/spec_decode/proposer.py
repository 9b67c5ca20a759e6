"""The Proposer protocol: what every proposer implements, the Draft it returns, and plain decoding's NoProposer.

A proposer guesses up to k next tokens for a sequence slot; the engine verifies them with the target. The
engine talks to every proposer through this protocol only (never isinstance-checks), so `none` — plain
decoding — is a proposer that never proposes. Modelled on llama.cpp's speculative "common" interface: `accept`
is the one explicit rollback call. Which proposer a method name builds lives in builders.py.

Structured outputs: `begin` hands a proposer the request's grammar state (a structured.GrammarMatcher at the
start of the output, or None); a proposer that uses it keeps its own `copy()`, advances it along its guesses
and along what `accept` reports. `propose(..., after=...)` lets a proposer continue a draft another one began
(the grammar proposer's forced tokens): it guesses as if `after[i]` followed the context, returns only its own
guesses, and counts `accept`'s num_accepted over `after[i]` + its guesses.

Token trees: a proposer may return a Draft with `parents` (a tree of guesses, verified in one forward); `accept`
then also gets `path`, the chunk rows of the accepted guesses (a root-to-node path). `begin(..., scope=...)` names
whose earlier outputs a proposer that keeps them across requests (suffix.py) may guess this request from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.sampling import SamplingParams
from draftwise.structured.matcher import GrammarMatcher


@dataclass
class Draft:
    token_ids: torch.Tensor  # [k] int64
    probs: torch.Tensor | None = None  # [k, target_vocab] processed draft distribution; None = point masses
    forced: tuple[int, ...] = ()  # positions (ascending) of the guesses the grammar forced (point masses)
    # a token tree (spec_decode/tree.py): parents[i] is the chunk row of guess i's parent (0: the pending token);
    # None = a chain. Trees are verified greedily only (verify.py): a proposer gives sampled requests chains.
    parents: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_forced(self) -> int:
        return len(self.forced)


EMPTY_DRAFT_IDS = torch.zeros(0, dtype=torch.int64)


class Proposer(Protocol):
    # Token ids this proposer can take in: None = any id of the target's vocabulary. A draft model with fewer
    # embedding rows than the target declares its row count; the engine then refuses prompt ids >= it and masks
    # the target's sampling to ids < it (p, q and plain steps alike), so no such id ever reaches `accept`.
    vocab_limit: int | None

    def begin(self, slot: int, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator,
              grammar: GrammarMatcher | None = None, scope: str = "") -> None:
        """A sequence starts in `slot` with these prompt ids; `grammar`: its output constraint's state at the
        start of the output (copy it to use it; never advance the caller's object); `scope`: the request's cache
        scope (an API key's, or one shared by all; "" outside the server)."""

    def propose(self, slots: list[int], k_per_seq: list[int], after: list[list[int]] | None = None) -> list[Draft]:
        """Up to k_per_seq[i] guesses for each slot (fewer, or none, is fine), after the tokens `after[i]`
        (None: right after the context; see the module docstring). Idempotent between two `accept`s: the
        engine calls it again when a step failed and is retried (the same generators state)."""

    def accept(self, slot: int, num_accepted: int, token_id: int, path: tuple[int, ...] | None = None) -> None:
        """The target kept the first `num_accepted` guesses of the last draft (`after` tokens first), then
        emitted `token_id`; for a tree draft, `path` holds the chunk rows of the kept guesses."""

    def end(self, slot: int) -> None:
        """The sequence in `slot` finished; forget it."""


class NoProposer:
    """Plain decoding through the same engine path: never proposes anything."""

    vocab_limit = None

    def begin(self, slot, prompt_ids, params, generator, grammar=None, scope=""):
        pass

    def propose(self, slots, k_per_seq, after=None):
        return [Draft(EMPTY_DRAFT_IDS) for _ in slots]

    def accept(self, slot, num_accepted, token_id, path=None):
        pass

    def end(self, slot):
        pass


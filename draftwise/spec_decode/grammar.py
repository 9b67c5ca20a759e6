"""Grammar proposer: under structured outputs, guess the tokens the grammar forces — no model, always allowed.

Where the constraint admits exactly one continuation (`{"name": "` after `{` in compact JSON, the rest of an
enum value once its prefix is unique, a closing `"}`), those tokens are known without any model:
`GrammarMatcher.forced_tokens(k)` returns them (at most k). The proposer puts them at the front of the draft
as point masses (`Draft.num_forced` counts them) and lets another proposer (`then`: n-gram, a draft model, or
none) fill the rest of k from the context extended by them (`propose(..., after=forced)`). Without a grammar
it proposes only what `then` proposes. A target may still reject a forced token (it prefers another
tokenization of the same bytes): forced tokens are proposals, verified like any other.

Owns one grammar state per slot (a copy of the request's, advanced along what `accept` reports). Knows
nothing of the engine's scheduling, of models, or of how the other proposer guesses.
"""
from __future__ import annotations

import torch

from draftwise.spec_decode.proposer import Draft, NoProposer, Proposer
from draftwise.structured.matcher import GrammarError, GrammarMatcher


class GrammarProposer:
    def __init__(self, then: Proposer | None = None):
        self.then: Proposer = then if then is not None else NoProposer()
        self.vocab_limit = getattr(self.then, "vocab_limit", None)
        self.grammars: dict[int, GrammarMatcher] = {}  # per slot: the accepted output's grammar state
        self._last: dict[int, list[int]] = {}  # per slot: the last draft (forced tokens + then's guesses)

    def begin(self, slot, prompt_ids, params, generator, grammar=None):
        if grammar is not None:
            self.grammars[slot] = grammar.copy()
        self._last[slot] = []
        self.then.begin(slot, prompt_ids, params, generator, grammar)

    def propose(self, slots, max_tokens, after=None):
        befores = [list(a) for a in after] if after else [[] for _ in slots]
        owns = [self._forced(s, b, k) for s, b, k in zip(slots, befores, max_tokens)]
        rest = self.then.propose(slots, [k - len(o) for k, o in zip(max_tokens, owns)],
                                 after=[b + o for b, o in zip(befores, owns)])
        drafts = []
        for slot, before, own, d in zip(slots, befores, owns, rest):
            self._last[slot] = before + own + d.token_ids.tolist()
            ids = torch.cat([torch.tensor(own, dtype=torch.int64), d.token_ids])  # [num_forced + k_then]
            probs = d.probs
            if probs is not None and own:  # forced positions are point masses
                point = torch.zeros(len(own), probs.shape[1], dtype=probs.dtype, device=probs.device)
                point[torch.arange(len(own)), torch.tensor(own)] = 1.0
                probs = torch.cat([point, probs])  # [num_forced + k_then, V]
            drafts.append(Draft(ids, probs, num_forced=len(own) + d.num_forced))
        return drafts

    def _forced(self, slot: int, before: list[int], k: int) -> list[int]:
        """Up to k tokens the grammar forces after the accepted output + `before` (state left unchanged)."""
        m = self.grammars.get(slot)
        if m is None or k <= 0:
            return []
        n = m.advance_many(before)
        try:
            return m.forced_tokens(k) if n == len(before) else []
        finally:
            m.rollback(n)

    def accept(self, slot, num_accepted, token_id):
        m = self.grammars.get(slot)
        if m is not None:
            kept = self._last[slot][:num_accepted] + [token_id]
            if m.advance_many(kept) != len(kept):
                raise GrammarError(f"the grammar proposer's state refused the emitted tokens {kept}")
        self._last[slot] = []
        self.then.accept(slot, num_accepted, token_id)

    def end(self, slot):
        self.grammars.pop(slot, None)
        self._last.pop(slot, None)
        self.then.end(slot)

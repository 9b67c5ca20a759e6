"""Grammar proposer: under structured outputs, guess the tokens the grammar forces — no model, always allowed.

Where the constraint admits exactly one continuation (`{"name": "` after `{` in compact JSON, the rest of an
enum value once its prefix is unique, a closing `"}`, the next key of a schema whose keys come in order),
those tokens are known without any model: `GrammarMatcher.forced_tokens(k)` returns them (at most k). The
proposer puts them in the draft as point masses (`Draft.forced` holds their positions) and lets another
proposer (`then`: n-gram, a draft model, or none) continue from the context extended by them
(`propose(..., after=...)`); `then`'s guesses are kept up to the first one the grammar forbids, the tokens
forced after those follow, and `then` is asked again from there, until k guesses or nothing new (`propose`).
Between forced stretches it also proposes layout the target wrote before in the same place (`Layout`: tokens of
only whitespace and JSON punctuation, `{\n`, `  `, ` "`, `":`), so pretty-printed JSON's indentation and
separators are guessed too. Without a grammar it proposes only what `then` proposes. A target may still reject
a forced token (it prefers another tokenization of the same bytes): forced tokens are proposals, verified like
any other.

Owns one grammar state per slot (a copy of the request's, advanced along what `accept` reports) and the learned
layout. Knows nothing of the engine's scheduling, of models, or of how the other proposer guesses.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from draftwise.spec_decode.proposer import Draft, NoProposer, Proposer
from draftwise.structured.matcher import GrammarError, GrammarMatcher


class GrammarProposer:
    def __init__(self, then: Proposer | None = None):
        self.then: Proposer = then if then is not None else NoProposer()
        self.vocab_limit = getattr(self.then, "vocab_limit", None)
        self.grammars: dict[int, GrammarMatcher] = {}  # per slot: the accepted output's grammar state
        self._last: dict[int, list[int]] = {}  # per slot: the last draft (forced tokens + then's guesses)
        self._tail: dict[int, int | None] = {}  # per slot: the accepted output's last token (None: none yet)
        # layout the target wrote (tokens of only whitespace and JSON punctuation, so no request's content),
        # counted: the layout tokens it wrote right after a layout token, and where the grammar forced bytes whose
        # token the engine held back (`"` after a key, written as `":`). `layout` is learned across requests and
        # guides greedy requests only (their output cannot depend on proposals); a sampled request uses what its
        # own output taught (`_own`), so its seed alone decides its tokens, as without speculation.
        self.layout = Layout()
        self._own: dict[int, Layout] = {}
        self._greedy: dict[int, bool] = {}

    def begin(self, slot, prompt_ids, params, generator, grammar=None, scope=""):
        if grammar is not None:
            self.grammars[slot] = grammar.copy()
        self._last[slot] = []
        self._tail[slot] = None
        self._own[slot] = Layout()
        self._greedy[slot] = params.greedy
        self.then.begin(slot, prompt_ids, params, generator, grammar, scope)

    def propose(self, slots, k_per_seq, after=None):
        """Per slot: the forced tokens and learned layout, then `then`'s guesses up to the first one the grammar
        forbids, then the forced tokens and layout after those, then `then` again from there ... until k guesses
        or nothing new. Pretty-printed JSON alternates like this: layout (`",\n  "`), the schema's next key
        (forced), `":` (layout), a value (n-gram lookup in the prompt). `then` is asked again (for all such slots
        in one call, so a draft model still batches) only where forced tokens or layout extended the draft since
        its last answer: the same context would give the same guesses."""
        befores = [list(a) for a in after] if after else [[] for _ in slots]
        ids: list[list[int]] = [[] for _ in slots]
        rows: list[list] = [[] for _ in slots]  # per guess: its q row [V] from `then`, or None (a point mass)
        forced: list[list[int]] = [[] for _ in slots]
        seen: list[list[int] | None] = [None for _ in slots]  # the draft `then` last guessed after, + its guesses
        live = list(range(len(slots)))
        while live:
            ask = []
            for i in live:
                grew = False
                while len(ids[i]) < k_per_seq[i]:  # forced tokens and learned layout, as long as either adds
                    own = self._forced(slots[i], befores[i] + ids[i], k_per_seq[i] - len(ids[i]))
                    forced[i] += range(len(ids[i]), len(ids[i]) + len(own))
                    ids[i] += own
                    lay = self._layout(slots[i], befores[i] + ids[i], k_per_seq[i] - len(ids[i]))
                    ids[i] += lay
                    rows[i] += [None] * (len(own) + len(lay))
                    grew = grew or bool(own or lay)
                    if not lay:
                        break
                if len(ids[i]) < k_per_seq[i] and (seen[i] is None or grew):
                    ask.append(i)
            if not ask:
                break
            answers = self.then.propose([slots[i] for i in ask], [k_per_seq[i] - len(ids[i]) for i in ask],
                                        after=[befores[i] + ids[i] for i in ask])
            live = []
            for i, d in zip(ask, answers):
                guesses = d.token_ids.tolist()
                seen[i] = befores[i] + ids[i] + guesses
                valid = self._valid(slots[i], befores[i] + ids[i], guesses)
                forced[i] += (len(ids[i]) + j for j in d.forced if j < valid)
                ids[i] += guesses[:valid]
                rows[i] += [None] * valid if d.probs is None else list(d.probs[:valid])
                if valid and len(ids[i]) < k_per_seq[i]:
                    live.append(i)  # cut by the grammar or out of guesses: forced tokens may follow
        stale = [i for i in range(len(slots)) if seen[i] != befores[i] + ids[i]]
        if stale:  # not asked, its last guesses were cut, or forced tokens follow them: `accept` counts over ours
            self.then.propose([slots[i] for i in stale], [0] * len(stale), after=[befores[i] + ids[i] for i in stale])
        drafts = []
        for i, slot in enumerate(slots):
            self._last[slot] = befores[i] + ids[i]
            drafts.append(Draft(torch.tensor(ids[i], dtype=torch.int64), _probs(ids[i], rows[i]), tuple(forced[i])))
        return drafts

    @contextmanager
    def _after(self, slot: int, before: list[int]) -> Iterator[GrammarMatcher | None]:
        """The slot's grammar state advanced along `before` (the draft so far), rolled back on exit; None without
        a grammar or where `before` leaves it."""
        m = self.grammars.get(slot)
        n = 0 if m is None else m.advance_many(before)
        try:
            yield m if m is not None and n == len(before) else None
        finally:
            if m is not None:
                m.rollback(n)

    def _valid(self, slot: int, before: list[int], guesses: list[int]) -> int:
        """How many of `guesses` the grammar allows in a row after the accepted output + `before`."""
        if slot not in self.grammars or not guesses:
            return len(guesses)
        with self._after(slot, before) as m:
            if m is None:
                return 0
            v = m.advance_many(guesses)
            m.rollback(v)
            return v

    def _layout(self, slot: int, before: list[int], k: int) -> list[int]:
        """Up to k layout tokens the target wrote before in this grammar position, each allowed here, after the
        accepted output + `before`; stops where the grammar forces tokens again (the caller takes those)."""
        layout = self.layout if self._greedy.get(slot) else self._own.get(slot)
        if k <= 0 or not layout:
            return []
        with self._after(slot, before) as m:
            if m is None:
                return []
            out: list[int] = []
            last = before[-1] if before else self._tail.get(slot)
            while len(out) < k:
                held = m.held_back_bytes()
                counts = layout.at.get(held) if held else layout.next.get(last)
                # the most frequent one the grammar allows here
                t = next((t for t, _ in counts.most_common() if m.advance(t)), None) if counts else None
                if t is None:
                    break
                out.append(t)
                last = t
                if m.forced_tokens(1):
                    break
            m.rollback(len(out))
            return out

    def _learn(self, slot: int, m: GrammarMatcher, last: int | None, t: int) -> None:
        """Remember the layout token `t` the target wrote in `m`'s state (before advancing it) after `last`."""
        if t not in m.layout_ids:
            return
        held = m.held_back_bytes()
        for layout in (self.layout, self._own[slot]):
            if held:
                layout.at.setdefault(held, Counter())[t] += 1
            elif last in m.layout_ids:
                layout.next.setdefault(last, Counter())[t] += 1

    def _forced(self, slot: int, before: list[int], k: int) -> list[int]:
        """Up to k tokens the grammar forces after the accepted output + `before` (state left unchanged)."""
        if k <= 0:
            return []
        with self._after(slot, before) as m:
            return m.forced_tokens(k) if m is not None else []

    def accept(self, slot, num_accepted, token_id):
        m = self.grammars.get(slot)
        kept = self._last[slot][:num_accepted] + [token_id]
        if m is not None:
            last = self._tail.get(slot)
            for t in kept:
                self._learn(slot, m, last, t)
                if not m.advance(t):
                    raise GrammarError(f"the grammar proposer's state refused the emitted tokens {kept}")
                last = t
        self._tail[slot] = kept[-1]
        self._last[slot] = []
        self.then.accept(slot, num_accepted, token_id)

    def end(self, slot):
        self.grammars.pop(slot, None)
        self._last.pop(slot, None)
        self._tail.pop(slot, None)
        self._own.pop(slot, None)
        self._greedy.pop(slot, None)
        self.then.end(slot)


def _probs(ids: list[int], rows: list) -> torch.Tensor | None:  # -> [k, V] or None (all point masses)
    """A draft model's q rows with point masses at the forced (and n-gram) guesses; None when every guess is one."""
    ref = next((r for r in rows if r is not None), None)
    if ref is None:
        return None
    out = torch.zeros(len(ids), ref.shape[0], dtype=ref.dtype, device=ref.device)  # [k, V]
    for j, (t, r) in enumerate(zip(ids, rows)):
        if r is None:
            out[j, t] = 1.0
        else:
            out[j] = r
    return out


class Layout:
    """Counted layout tokens: `next[a][b]`: the target wrote layout token b right after layout token a;
    `at[bytes][b]`: it wrote b where the grammar forced `bytes` whose token the engine held back."""

    def __init__(self):
        self.next: dict[int, Counter[int]] = {}
        self.at: dict[bytes, Counter[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.next or self.at)

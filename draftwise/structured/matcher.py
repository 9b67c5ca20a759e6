"""Per-sequence grammar state: which token ids may come next, advancing, rolling back, forced tokens, and
the masks along a draft that speculative verification scores positions with.

Owns `GrammarMatcher` (a wrapper over one llguidance matcher with its own token history, so rollback,
EOS and forbidden tokens behave the same whatever the engine does internally) and `mask_logits`.
Rollback is ours, not llguidance's: each advanced token keeps a copy of the state before it (a deep copy is
microseconds and kilobytes for a JSON schema), so undoing n tokens restores exactly the state that was there; deeper than
the copies kept, the state is rebuilt from the start by advancing the kept tokens again. llguidance 1.9.1's own
`rollback` can leave a different state: on the structured bench's email-tool item, advancing `.com`, `",\n`,
`   `, rolling the three back and advancing `.com`, `"]\n` gave a state that allowed `"` (a new key without a
comma) and forbade `}`, unlike the same two tokens advanced without the detour — so greedy speculation differed
from plain decoding (tests/test_structured.py pins this sequence).
It does not know where the constraint came from (constraint.py / grammar.py), models, proposers or the
scheduler. Its cost per mask and per `allowed()` (the mask unpacked to a BoolTensor): docs/PERFORMANCE.md,
structured outputs.

Ids: the matcher knows the tokenizer's ids [0, vocab_size). Callers pass the model's row count to
`allowed`/`masks_along`; rows at or beyond the tokenizer's ids (embedding padding) are never allowed,
and neither are `[PAD<id>]` placeholder tokens. EOS ids are allowed exactly when the output so far is
complete (`is_accepting()`); after an EOS is advanced nothing more is allowed.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class GrammarError(RuntimeError):
    """The grammar engine failed mid-sequence (e.g. a parser resource limit); end the sequence."""


SNAPSHOTS = 32  # states kept for rollback (a verification rolls back at most k + 1 tokens); deeper: rebuilt


class GrammarMatcher:
    """The grammar state of one sequence. Not thread-safe; one per sequence (use `copy()` to branch)."""

    def __init__(self, ll_matcher, vocab_size: int, eos_token_ids: Sequence[int], never_allowed: torch.Tensor,
                 layout_ids: frozenset[int] = frozenset()):
        self._m = ll_matcher
        self._start = ll_matcher.deep_copy()  # the state before any token (never advanced: only copied)
        self.layout_ids = layout_ids  # tokens of only whitespace and JSON punctuation (the compiler's; shared)
        self.vocab_size = vocab_size  # the tokenizer's ids; the model may have more rows
        self.eos_token_ids = tuple(eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)
        self._never = never_allowed  # [P] int64
        self._never_set = frozenset(never_allowed.tolist())
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # [ceil(V_tok / 32)] bitmask
        self._keep, self._eos_bits = _static_bits(vocab_size, never_allowed, self.eos_token_ids)
        self._history: list[int] = []  # per advanced token: how many tokens the engine consumed (EOS: 0)
        self._tokens: list[int] = []  # the advanced token ids (to rebuild a state deeper than the snapshots)
        self._snapshots: list = []  # [<= SNAPSHOTS] the states before the last advanced tokens (never advanced)
        self._finished = False  # an EOS was advanced

    # -- state --------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens advanced and not rolled back (EOS included): the most `rollback` accepts."""
        return len(self._history)

    def is_accepting(self) -> bool:
        """The output so far is complete under the grammar, so EOS is allowed now."""
        return not self._finished and self._m.is_accepting()

    def is_finished(self) -> bool:
        """An EOS was advanced, or the grammar admits nothing more than EOS (a closed JSON value, a full
        choice): the engine should end the sequence (with EOS if it emits one)."""
        return self._finished or self._m.is_stopped()

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (microseconds)."""
        other = GrammarMatcher.__new__(GrammarMatcher)
        other.__dict__.update(self.__dict__)
        other._m = self._m.deep_copy()
        other._words = self._words.clone()
        other._history = list(self._history)
        other._tokens = list(self._tokens)
        other._snapshots = list(self._snapshots)  # shared safely: a snapshot is only ever deep-copied
        return other

    # -- masks --------------------------------------------------------------------------------------
    def bitmask(self) -> torch.Tensor:  # [ceil(vocab_size / 32)] int32, bit i of word w = id 32w + i
        """The raw allowed set over the tokenizer's ids (a view reused by the next call; clone to keep)."""
        if self._finished:
            self._words.zero_()
            return self._words
        self._m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())
        return self._words

    def allowed_into(self, out: torch.Tensor) -> torch.Tensor:  # out: [V] bool, written and returned
        """`allowed(len(out))` written into a caller's row (e.g. one row of a [k+1, V] buffer)."""
        words = self.bitmask().numpy()
        if not self._finished:
            np.bitwise_and(words, self._keep, out=words)  # placeholders and EOS off ...
            if self._m.is_accepting():
                np.bitwise_or(words, self._eos_bits, out=words)  # ... EOS on exactly when complete
        rows = out.shape[0]
        n = min(rows, self.vocab_size)
        dst = out.numpy()
        dst[:n] = np.unpackbits(words.view(np.uint8), bitorder="little", count=n).view(np.bool_)
        if rows > n:
            dst[n:] = False  # embedding rows beyond the tokenizer: never allowed
        return out

    def allowed(self, vocab_size: int) -> torch.Tensor:  # [vocab_size] bool
        """Which of the model's `vocab_size` output rows may come next. Ids >= the tokenizer's vocab and
        `[PAD<id>]` placeholders are False; EOS ids are True iff `is_accepting()`; all False once finished."""
        return self.allowed_into(torch.empty(vocab_size, dtype=torch.bool))

    # -- advancing ----------------------------------------------------------------------------------
    def advance(self, token_id: int) -> bool:
        """Consume one token. False (and the state unchanged) if the grammar forbids it here; EOS is
        accepted iff `is_accepting()`, and after it nothing is. Equivalent to `allowed(...)[token_id]`."""
        token_id = int(token_id)
        if self._finished:
            return False
        if token_id in self._eos:
            if not self._m.is_accepting():
                return False
            self._push(token_id, 0, self._m.deep_copy())  # EOS is ours: the engine's EOS handling differs by state
            self._finished = True
            return True
        if token_id < 0 or token_id >= self.vocab_size or token_id in self._never_set:
            return False
        before = self._m.deep_copy()
        if self._m.try_consume_tokens([token_id]) != 1:
            if self._m.is_error():
                raise GrammarError(self._m.get_error())
            self._m = before  # a refused token leaves the state as it was
            return False
        self._push(token_id, 1, before)
        return True

    def _push(self, token_id: int, consumed: int, before) -> None:
        self._history.append(consumed)
        self._tokens.append(token_id)
        self._snapshots.append(before)
        if len(self._snapshots) > SNAPSHOTS:
            del self._snapshots[0]

    def advance_many(self, token_ids: Sequence[int]) -> int:
        """Advance along `token_ids` until the first forbidden one; returns how many were consumed."""
        for i, t in enumerate(token_ids):
            if not self.advance(t):
                return i
        return len(token_ids)

    def rollback(self, n: int) -> None:
        """Undo the last `n` advanced tokens (0 <= n <= num_tokens; EOS counts as one)."""
        if n < 0 or n > len(self._history):
            raise ValueError(f"cannot roll back {n} tokens: {len(self._history)} advanced")
        if n == 0:
            return
        keep = len(self._history) - n
        if n <= len(self._snapshots):
            self._m = self._snapshots[-n].deep_copy()
            del self._snapshots[-n:]
        else:  # deeper than the snapshots: the state from the start along the tokens kept
            m = self._start.deep_copy()
            for t, consumed in zip(self._tokens[:keep], self._history[:keep]):
                if consumed and m.try_consume_tokens([t]) != 1:
                    raise GrammarError(f"rebuilding the grammar state refused token {t}: {m.get_error()}")
            self._m = m
            self._snapshots = []
        del self._history[keep:]
        del self._tokens[keep:]
        self._finished = False  # EOS is always the last token, and n >= 1 undoes it

    # -- speculation --------------------------------------------------------------------------------
    def forced_tokens(self, max_n: int) -> list[int]:
        """Up to `max_n` tokens the grammar determines from here, without changing the state.

        First the engine's fast-forward tokens: where the grammar admits exactly one continuation in bytes
        (`{"name": "` after `{` with compact JSON), its tokenization by the tokenizer (the engine holds back
        a last token that could still merge with what follows). Then, while the mask allows exactly one
        token and EOS is not allowed, that token. Never contains EOS; every token is allowed in sequence
        (so `advance_many(forced_tokens(n)) == len(...)`). A target may still reject a forced token when it
        prefers another tokenization of the same bytes, so they are proposals, not emissions."""
        out: list[int] = []
        if max_n <= 0 or self._finished:
            return out
        try:
            while len(out) < max_n:
                ff = self._m.compute_ff_tokens()
                if ff:
                    taken = self.advance_many(ff[: max_n - len(out)])
                    out.extend(ff[:taken])
                    if taken == 0:
                        break
                    continue
                only = self._only_allowed_token()
                if only is None or not self.advance(only):
                    break
                out.append(only)
        finally:
            self.rollback(len(out))
        return out

    def held_back_bytes(self) -> bytes:
        """Bytes the grammar forces here that `forced_tokens` does not give as tokens (the engine holds back a
        token that could still merge with what follows: `"` after a JSON key, since `":` is one token); b""
        where the forced bytes were given as tokens or nothing is forced."""
        if self._finished or self._m.compute_ff_tokens():
            return b""
        return bytes(self._m.compute_ff_bytes())

    def _only_allowed_token(self) -> int | None:
        if self._m.is_accepting() or self._m.is_stopped():
            return None  # EOS is allowed: never forced
        words = self.bitmask()
        nonzero = words.nonzero()
        if nonzero.numel() != 1:
            return None
        w = int(nonzero[0, 0])
        word = int(words[w]) & 0xFFFFFFFF
        if word & (word - 1):
            return None  # more than one bit
        token = 32 * w + word.bit_length() - 1
        if token in self._never_set or token in self._eos:
            return None
        return token

    def masks_along(
        self,
        draft_ids: Sequence[int] | torch.Tensor,  # [k] int64
        vocab_size: int,
    ) -> tuple[torch.Tensor, int]:  # ([k + 1, vocab_size] bool, num_valid)
        """The masks of the k+1 positions a verification step scores, without changing the state.

        Row i is `allowed(vocab_size)` in the state reached after advancing `draft_ids[:i]`, for
        i = 0..num_valid, where num_valid is the length of the longest draft prefix the grammar allows
        (the first forbidden draft token ends it: the target rejects it at no cost). Rows after num_valid
        are all False and must not be sampled from. Row num_valid is where the target's correction (or,
        when num_valid == k, the bonus token) is drawn. An EOS in the draft counts as valid when the
        grammar is complete there; nothing after it is. On return the matcher is where it started;
        after verification the caller advances the tokens it emits (accepted prefix + one)."""
        ids = draft_ids.tolist() if isinstance(draft_ids, torch.Tensor) else [int(t) for t in draft_ids]
        k = len(ids)
        out = torch.zeros(k + 1, vocab_size, dtype=torch.bool)
        num_valid = 0
        try:
            for i in range(k + 1):
                self.allowed_into(out[i])
                if i == k or not self.advance(ids[i]):
                    break
                num_valid += 1
        finally:
            self.rollback(num_valid)
        return out, num_valid


def _static_bits(
    vocab_size: int, never_allowed: torch.Tensor, eos_token_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:  # ([ceil(V/32)] int32 keep, [ceil(V/32)] int32 eos)
    """Bitmasks applied to every mask: `keep` clears placeholder and EOS bits, `eos` holds the EOS bits."""
    words = (vocab_size + 31) // 32
    bits = np.ones(words * 32, dtype=np.bool_)
    eos = np.zeros(words * 32, dtype=np.bool_)
    bits[never_allowed.numpy()] = False
    for e in eos_token_ids:
        if 0 <= e < vocab_size:
            bits[e] = False
            eos[e] = True
    pack = lambda b: np.packbits(b, bitorder="little").view(np.int32)
    return pack(bits), pack(eos)


def mask_logits(
    logits: torch.Tensor,  # [..., V]
    allowed: torch.Tensor,  # [..., V] bool (broadcastable)
) -> torch.Tensor:  # [..., V], -inf where not allowed
    """Logits with forbidden ids at -inf, ready for `sampling.process_logits` (a masked softmax). A row
    with nothing allowed would become NaN there: masks_along rows past num_valid must not be used."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

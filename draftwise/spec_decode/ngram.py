"""N-gram (prompt lookup) proposer: no model; guesses that the text will continue as it did after the most
recent earlier occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min),
searching prompt + generated tokens (+ the tokens of `after`, e.g. the grammar's forced ones). Same knobs as
vLLM's `ngram` method (Saxena 2023, "prompt lookup decoding"). Ignores grammars: the engine cuts a draft at
its first token the grammar forbids. Knows nothing of models or the engine.
"""
from __future__ import annotations

import numpy as np
import torch

from draftwise.spec_decode.proposer import EMPTY_DRAFT_IDS, Draft


class NgramProposer:
    vocab_limit = None  # guesses are ids already in the sequence

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: dict[int, list[int]] = {}
        self._last: dict[int, list[int]] = {}

    def begin(self, slot, prompt_ids, params, generator, grammar=None, scope=""):
        self.tokens[slot] = list(prompt_ids)
        self._last[slot] = []

    def propose(self, slots, k_per_seq, after=None):
        drafts = []
        for i, (slot, k) in enumerate(zip(slots, k_per_seq)):
            before = list(after[i]) if after else []
            guess = []
            if k > 0:  # a plain row costs no lookup (nor a copy of its context)
                guess = lookup(np.asarray(self.tokens[slot] + before, dtype=np.int64), self.min_n, self.max_n, k)
            self._last[slot] = before + guess
            drafts.append(Draft(torch.tensor(guess, dtype=torch.int64) if guess else EMPTY_DRAFT_IDS))
        return drafts

    def accept(self, slot, num_accepted, token_id):
        self.tokens[slot].extend(self._last[slot][:num_accepted])
        self.tokens[slot].append(token_id)
        self._last[slot] = []

    def end(self, slot):
        self.tokens.pop(slot, None)
        self._last.pop(slot, None)


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:  # tokens [L]
    """The up-to-k tokens that followed the latest earlier match of the longest matching suffix n-gram."""
    L = tokens.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        # candidate starts i with i + n < L (the match must be followed by at least one token, and not be the suffix)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []

"""Prefix cache: the K/V of recent prompts (and of finished requests' prompt + output), kept so a new prompt that
starts with the same tokens (a shared system prompt, the earlier turns of a chat, a repeated request) skips
recomputing them — vLLM's automatic prefix caching, llama.cpp's prompt cache.

Owns: the stored entries (a prompt's token ids and a copy of its K/V, every layer), the longest-common-prefix
lookup at token granularity, least-recently-used eviction under a byte budget, and the counters (tokens queried,
tokens reused). Knows nothing of models, requests or speculation: it copies between itself and a KVCache slot.

Exact only where a prompt's rows do not depend on how the prompt is cut into forwards (row-exact linears and
attention: api.py turns it on by itself only then). There, a prompt prefilled after a cached prefix yields
bitwise the logits and K/V of a prompt prefilled whole, so greedy outputs are the same with and without it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from draftwise.kv_cache import KVCache

DEFAULT_BYTES = 256 * 2**20  # 256 MiB of K/V: ~4,700 tokens of the packaged 1.5B target (float32 K/V)


@dataclass
class _Entry:
    token_ids: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [H_kv, n, D]
    values: list[torch.Tensor]  # per layer [H_kv, n, D]
    nbytes: int


class PrefixCache:
    """Entries of (token ids, their K/V copied out of a KVCache slot), least recently used first."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        if max_bytes < 0:
            raise ValueError("the prefix cache's byte budget must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._ids = 0
        self.nbytes = 0
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, tokens whose K/V came from the cache

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt_ids: list[int]) -> tuple[int | None, int]:
        """(entry id, n): the stored entry sharing the longest prefix with `prompt_ids`, at most all but the last
        prompt token (its logits are what the prefill is for); (None, 0) when nothing is shared."""
        best, best_n = None, 0
        limit = len(prompt_ids) - 1
        for key, e in self._entries.items():
            n, top = 0, min(limit, len(e.token_ids))
            while n < top and e.token_ids[n] == prompt_ids[n]:
                n += 1
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def load(self, entry: int | None, n: int, cache: KVCache, slot: int) -> None:
        """Write the entry's first n tokens' K/V into `slot` (which must be empty), taking its blocks."""
        if entry is None or n == 0:
            return
        e = self._entries[entry]
        self._entries.move_to_end(entry)
        cache.load(slot, e.keys, e.values, n)

    def count(self, num_prompt_tokens: int, num_cached: int) -> None:  # once per prompt admitted
        self.queries += num_prompt_tokens
        self.hits += num_cached

    def store(self, prompt_ids: list[int], cache: KVCache, slot: int) -> None:
        """Keep a copy of the K/V of `prompt_ids` (the first len(prompt_ids) positions of `slot`), unless an entry
        already starts with all of them; entries the new one extends are dropped; the least recently used go
        while the budget is exceeded."""
        n = len(prompt_ids)
        if n == 0 or cache.lengths[slot] < n:
            return
        per_token = cache.bytes_per_block // cache.block_size
        if n * per_token > self.max_bytes:
            return
        ids = tuple(prompt_ids)
        for key, e in list(self._entries.items()):
            if e.token_ids[:n] == ids:  # already covered: only refresh its recency
                self._entries.move_to_end(key)
                return
            if ids[: len(e.token_ids)] == e.token_ids:  # the new entry extends it
                self._drop(key)
        keys, values = cache.gather(slot, n)
        while self._entries and self.nbytes + n * per_token > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._ids += 1
        self._entries[self._ids] = _Entry(ids, keys, values, n * per_token)
        self.nbytes += n * per_token

    def forget(self, prompt_ids: list[int]) -> None:
        """Drop the entries that start with all of `prompt_ids` (so that prompt finds only what it shares with
        others: what a benchmark wants when the same prompt runs under several configurations)."""
        ids, n = tuple(prompt_ids), len(prompt_ids)
        for key in [key for key, e in self._entries.items() if e.token_ids[:n] == ids]:
            self._drop(key)

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

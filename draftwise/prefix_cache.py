"""Prefix cache: the K/V blocks of recent prompts (and of finished requests' prompt + output), kept so a new prompt
that starts with the same tokens (a shared system prompt, the earlier turns of a chat, a repeated request, the n
samples of one prompt) skips recomputing them and shares their memory — vLLM's automatic prefix caching, llama.cpp's
prompt cache.

Owns: the stored entries (a prompt's token ids and the KVCache blocks holding its K/V, which it `retain`s: shared
with the sequences using them, never copied), the longest-common-prefix lookup at token granularity, the budget
(distinct blocks retained, least recently used entries dropped beyond it), the counters (tokens queried, tokens
reused) and, as the pool's reclaimer (kv_cache.Reclaimer), giving blocks back under pressure: entries are dropped
least recently used first until the pool has the blocks a forward needs, before anyone is preempted. A loaded
prefix maps the entry's blocks into the slot (`KVCache.share`); the slot's first write into the last, partial block
copies it (copy-on-write in KVCache.reserve), so the entry's bits never change while it is held. Knows nothing of
models, requests or speculation; serves one KVCache (the first it is given).

Exact only where a prompt's rows do not depend on how the prompt is cut into forwards (row-exact linears and
attention: api.py turns it on by itself only then). There, a prompt prefilled after a cached prefix yields
bitwise the logits and K/V of a prompt prefilled whole, so greedy outputs are the same with and without it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from draftwise.kv_cache import KVCache, blocks_for

DEFAULT_BYTES = 256 * 2**20  # 256 MiB of the pool: ~4,700 tokens of the packaged 1.5B target (float32 K/V)


@dataclass
class _Entry:
    token_ids: tuple[int, ...]
    blocks: list[int]  # the KVCache blocks holding positions 0 .. len(token_ids) - 1, retained


class PrefixCache:
    """Entries of (token ids, the KVCache blocks holding their K/V), least recently used first."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        if max_bytes < 0:
            raise ValueError("the prefix cache's byte budget must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._holds: dict[int, int] = {}  # block -> entries listing it (the cache retains each block once)
        self._cache: KVCache | None = None
        self._ids = 0
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, tokens whose K/V came from the cache

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_blocks(self) -> int:
        """Distinct pool blocks the entries retain."""
        return len(self._holds)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool the entries retain (shared with the sequences that also hold some of them)."""
        return 0 if self._cache is None else len(self._holds) * self._cache.bytes_per_block

    def _bind(self, cache: KVCache) -> None:
        if self._cache is None:
            self._cache = cache
            cache.reclaimer = self
        elif cache is not self._cache:
            raise ValueError("a prefix cache serves one KV cache (its entries are blocks of that pool)")

    def match(self, prompt_ids: list[int]) -> tuple[int | None, int]:
        """(entry id, n): the stored entry sharing the longest prefix with `prompt_ids`, at most all but the last
        prompt token (its logits are what the prefill is for); (None, 0) when nothing is shared. Changes nothing."""
        best, best_n = None, 0
        limit = len(prompt_ids) - 1
        for key, e in self._entries.items():
            n, top = 0, min(limit, len(e.token_ids))
            while n < top and e.token_ids[n] == prompt_ids[n]:
                n += 1
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def blocks(self, entry: int | None, n: int) -> list[int]:
        """The blocks of an entry holding its first n tokens (what `load` would share)."""
        if entry is None or n == 0:
            return []
        return self._entries[entry].blocks[: blocks_for(n, self._cache.block_size)]

    def load(self, entry: int | None, n: int, cache: KVCache, slot: int) -> None:
        """Map the entry's first n tokens' blocks into `slot` (which must be empty): shared, not copied."""
        if entry is None or n == 0:
            return
        self._bind(cache)
        self._entries.move_to_end(entry)
        cache.share(slot, self.blocks(entry, n), n)

    def count(self, num_prompt_tokens: int, num_cached: int) -> None:  # once per prompt admitted
        self.queries += num_prompt_tokens
        self.hits += num_cached

    def store(self, prompt_ids: list[int], cache: KVCache, slot: int) -> None:
        """Retain the blocks holding `prompt_ids` (the first len(prompt_ids) positions of `slot`), unless an entry
        already starts with all of them; entries the new one extends are dropped; the least recently used go
        while the budget is exceeded."""
        n = len(prompt_ids)
        if n == 0 or cache.lengths[slot] < n:
            return
        self._bind(cache)
        blocks = cache.blocks(slot, n)
        if len(blocks) * cache.bytes_per_block > self.max_bytes:
            return
        ids = tuple(prompt_ids)
        for key, e in list(self._entries.items()):
            if e.token_ids[:n] == ids:  # already covered: only refresh its recency
                self._entries.move_to_end(key)
                return
            if ids[: len(e.token_ids)] == e.token_ids:  # the new entry extends it
                self._drop(key)
        cache.retain(blocks)  # held while the budget is made (dropping an entry must not free them)
        while self._entries and self.nbytes + self._new(blocks) * cache.bytes_per_block > self.max_bytes:
            self._drop(next(iter(self._entries)))
        for b in blocks:
            self._holds[b] = self._holds.get(b, 0) + 1
            if self._holds[b] > 1:
                cache.release([b])  # retained once per block, however many entries list it
        self._ids += 1
        self._entries[self._ids] = _Entry(ids, list(blocks))

    def _new(self, blocks: list[int]) -> int:
        return sum(b not in self._holds for b in blocks)

    def forget(self, prompt_ids: list[int]) -> None:
        """Drop the entries that start with all of `prompt_ids` (so that prompt finds only what it shares with
        others: what a benchmark wants when the same prompt runs under several configurations)."""
        ids, n = tuple(prompt_ids), len(prompt_ids)
        for key in [key for key, e in self._entries.items() if e.token_ids[:n] == ids]:
            self._drop(key)

    def reclaimable(self) -> int:
        """Blocks only the cache holds (free once their entries go)."""
        return 0 if self._cache is None else sum(self._cache.refs[b] == 1 for b in self._holds)

    def reclaim(self, num_blocks: int) -> None:
        """The pool is short: drop entries, least recently used first, until `num_blocks` more blocks are free or
        none is left. Entries that free blocks go first; one whose blocks running sequences all hold costs nothing
        and goes only after them (dropping it can still spare a copy: a block it shares with a writer)."""
        target = self._cache.num_free_blocks + num_blocks
        for frees in (True, False):
            for key in list(self._entries):
                if self._cache.num_free_blocks >= target:
                    return
                if not frees or any(self._holds[b] == 1 and self._cache.refs[b] == 1
                                    for b in self._entries[key].blocks):
                    self._drop(key)

    def _drop(self, key: int) -> None:
        gone = []
        for b in self._entries.pop(key).blocks:
            self._holds[b] -= 1
            if not self._holds[b]:
                del self._holds[b]
                gone.append(b)
        self._cache.release(gone)

"""Prefix cache: the K/V blocks of recent prompts (and of finished requests' prompt + output), kept so a new prompt
that starts with the same tokens (a shared system prompt, the earlier turns of a chat, a repeated request, the n
samples of one prompt) skips recomputing them and shares their memory — vLLM's automatic prefix caching, llama.cpp's
prompt cache.

Owns: the stored entries (a prompt's token ids and the KVCache blocks holding its K/V, which it `retain`s: shared
with the sequences using them, never copied), the longest-common-prefix lookup at token granularity (whole blocks
found by a hash of the token ids up to and including each, chained as in vLLM; token by token past them), the budget
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
    hashes: list[int]  # per whole block: the hash of the token ids up to and including it (`_chain`)


class PrefixCache:
    """Entries of (token ids, the KVCache blocks holding their K/V), least recently used first."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        if max_bytes < 0:
            raise ValueError("the prefix cache's byte budget must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._holds: dict[int, int] = {}  # block -> entries listing it (the cache retains each block once)
        self._by_hash: dict[int, set[int]] = {}  # chained block hash -> entries whose tokens start with that chain
        self._short: set[int] = set()  # entries shorter than one block (in no chain)
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

    def _chain(self, ids) -> list[int]:
        """Per whole block of `ids`: the hash of the token ids up to and including it, each chained on the one
        before (vLLM's prefix-caching block hash), so equal hashes mean equal prefixes (verified where it matters)."""
        bs, out, h = self._cache.block_size, [], 0
        for i in range(len(ids) // bs):
            h = hash((h, tuple(ids[i * bs : (i + 1) * bs])))
            out.append(h)
        return out

    def match(self, prompt_ids: list[int]) -> tuple[int | None, int]:
        """(entry id, n): the stored entry sharing the longest prefix with `prompt_ids`, at most all but the last
        prompt token (its logits are what the prefill is for); (None, 0) when nothing is shared. Changes nothing.
        The whole blocks are matched by their chained hashes; token by token only past the last one matched."""
        if not self._entries:
            return None, 0
        limit = len(prompt_ids) - 1
        whole, candidates = 0, None
        for i, h in enumerate(self._chain(prompt_ids[:limit])):
            if not self._by_hash.get(h):
                break
            whole, candidates = i + 1, self._by_hash[h]
        start = whole * self._cache.block_size
        best, best_n = self._longest(prompt_ids, limit, start, candidates)
        if best is not None and self._entries[best].token_ids[:start] != tuple(prompt_ids[:start]):
            best, best_n = self._longest(prompt_ids, limit, 0, None)  # a hash collision: token by token
        return best, best_n

    def _longest(self, prompt_ids, limit: int, start: int, candidates: set[int] | None) -> tuple[int | None, int]:
        """The first (least recently used) of the entries (all, or `candidates`, which share positions
        0 .. start - 1) sharing the most tokens with `prompt_ids`, at most `limit`."""
        best, best_n = None, 0
        for key, e in self._entries.items():
            if candidates is not None and key not in candidates:
                continue
            n, top = start, min(limit, len(e.token_ids))
            while n < top and e.token_ids[n] == prompt_ids[n]:
                n += 1
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def _starting_with(self, ids: tuple[int, ...], chain: list[int]) -> list[int]:
        """Entries whose tokens start with all of `ids` (`chain`: its whole blocks' hashes)."""
        pool = self._entries if not chain else self._by_hash.get(chain[-1], ())
        return [key for key in list(pool) if self._entries[key].token_ids[: len(ids)] == ids]

    def _prefixes_of(self, ids: tuple[int, ...], chain: list[int]) -> list[int]:
        """Entries whose tokens are all a prefix of `ids`."""
        pool = set(self._short).union(*(self._by_hash.get(h, ()) for h in chain))
        return [key for key in pool if ids[: len(self._entries[key].token_ids)] == self._entries[key].token_ids]

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
        chain = self._chain(ids)
        covered = self._starting_with(ids, chain)
        if covered:  # already covered: only refresh its recency
            self._entries.move_to_end(covered[0])
            return
        for key in self._prefixes_of(ids, chain):  # the new entry extends them
            self._drop(key)
        cache.retain(blocks)  # held while the budget is made (dropping an entry must not free them)
        while self._entries and self.nbytes + self._new(blocks) * cache.bytes_per_block > self.max_bytes:
            self._drop(next(iter(self._entries)))
        for b in blocks:
            self._holds[b] = self._holds.get(b, 0) + 1
            if self._holds[b] > 1:
                cache.release([b])  # retained once per block, however many entries list it
        self._ids += 1
        self._entries[self._ids] = _Entry(ids, list(blocks), chain)
        for h in chain:
            self._by_hash.setdefault(h, set()).add(self._ids)
        if not chain:
            self._short.add(self._ids)

    def _new(self, blocks: list[int]) -> int:
        return sum(b not in self._holds for b in blocks)

    def forget(self, prompt_ids: list[int]) -> None:
        """Drop the entries that start with all of `prompt_ids` (so that prompt finds only what it shares with
        others: what a benchmark wants when the same prompt runs under several configurations)."""
        if self._cache is None:
            return
        ids = tuple(prompt_ids)
        for key in self._starting_with(ids, self._chain(ids)):
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
        e = self._entries.pop(key)
        self._short.discard(key)
        for h in e.hashes:
            entries = self._by_hash[h]
            entries.discard(key)
            if not entries:
                del self._by_hash[h]
        gone = []
        for b in e.blocks:
            self._holds[b] -= 1
            if not self._holds[b]:
                del self._holds[b]
                gone.append(b)
        self._cache.release(gone)

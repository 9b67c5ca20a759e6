"""KV cache: keys and values in fixed-size pages (blocks) of one pool, a block table per sequence slot, and the
arithmetic that sizes them — vLLM's paged attention, on the CPU.

Owns the pool (per layer [num_blocks, kv heads, block_size, head_dim], allocated uncommitted: a page of memory
costs RSS only once a block on it is taken), each slot's block table and valid length, the free list and each
block's reference count. Position p of a slot lives in block tables[slot, p // block_size], row p % block_size. A
forward first `reserve`s the blocks its positions need (CacheFull when the pool has too few free blocks: the engine
admits and preempts by `num_available_blocks`), writes K/V through the table (`write`, or the C++ glue given
`table(slots)`), then `extend`s the lengths. `truncate(slot, new_len)` is the only rollback: the length moves back
and the slot lets go of the blocks wholly past it; entries past the length are never visible (attention reads by
position) and are overwritten by the next write. A block is zeroed when taken, and padding rows (a forward's
positions past a row's real tokens) write into one null block past the pool, which no table maps; so whatever the
torch path reads past a sequence's end (masked out) is finite, and padding costs no block. `block_size >= capacity`
gives one block per slot: the contiguous layout of earlier versions (the tests compare the two bit for bit).

Blocks are shared, vLLM-style: `share` maps another holder's blocks into an empty slot (the prefix cache's, whose
entries `retain` blocks of their own); a block returns to the free list only when its last holder lets go
(`release`, truncate, free). A forward never writes into a block someone else also holds: `reserve` first copies
each shared block in the range it writes (copy-on-write; in practice the last, partial block of a shared prefix).
The `reclaimer` (the prefix cache) holds blocks no sequence needs: `reserve` asks it to let go of some (least
recently used first) before it reports CacheFull, and `num_available_blocks` counts them as free.

Also owns what a cache weighs: `target_cache_capacity` and `draft_cache_capacity` (the most tokens a slot may
hold, from the context length and the look-ahead), `cache_bytes`, `bytes_per_token` and `blocks_for_budget`,
which the engine, the draft-model proposer and the memory estimate (bench/memory.py) all call. Knows nothing
about models, requests or token ids; of speculation, only how many positions beyond the context a verification or
a draft's catch-up writes before its rollback.
"""
from __future__ import annotations

from typing import Protocol

import torch

from draftwise.config import ConfigError, auto_kv_cache_dtype

MAX_BATCHED_CATCH_UP = 4  # a draft's rows with more unseen tokens than this (a new prompt) are prefilled alone
BLOCK_SIZE = 16  # positions per block: a multiple of 16 (the attention op reads keys in aligned blocks of 16)


class Reclaimer(Protocol):
    """Who holds blocks that no sequence needs and lets go of them under pressure (prefix_cache.PrefixCache)."""

    def reclaimable(self) -> int: ...  # blocks it alone holds (free once it lets go)

    def reclaim(self, num_blocks: int) -> None: ...  # let go of (at least, if it can) this many such blocks


class CacheFull(RuntimeError):
    """The pool has fewer free blocks than a forward needs (the engine preempts or waits; others fail)."""


def target_cache_capacity(max_model_len: int, k_max: int) -> int:
    """Most tokens a slot of the target's KV cache holds: the context plus one verification's look-ahead (the
    pending token and up to k_max guesses are written before the rollback)."""
    return max_model_len + k_max + 1


def draft_cache_capacity(max_model_len: int, k_max: int) -> int:
    """Most tokens a slot of the draft's KV cache holds: the context, k guesses, a batched catch-up and two spare
    positions (the draft may run one token ahead of the target's context before a rollback)."""
    return max_model_len + k_max + MAX_BATCHED_CATCH_UP + 2


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """K and V of one position, every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * element_size


def cache_bytes(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                element_size: int) -> int:
    """Bytes the pool of a KVCache with these arguments spans: K and V, [num_blocks, num_kv_heads, block_size,
    head_dim] per layer, element_size bytes each (address space; RSS follows the blocks taken)."""
    return num_blocks * block_size * bytes_per_token(num_layers, num_kv_heads, head_dim, element_size)


def blocks_for_budget(budget_bytes: int, per_token: int, block_size: int = BLOCK_SIZE) -> int:
    """Whole blocks of `block_size` positions at `per_token` bytes each that fit in `budget_bytes`."""
    return budget_bytes // (per_token * block_size)


def available_memory() -> int:
    """Bytes of RAM available now (/proc/meminfo MemAvailable; elsewhere physical pages x page size)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def budget_bytes(kv_cache_memory: int | float) -> int:
    """config.parse_kv_cache_memory's value in bytes: an int is bytes, a float a fraction of available RAM."""
    if isinstance(kv_cache_memory, float):
        return int(kv_cache_memory * available_memory())
    return int(kv_cache_memory)


def pool_blocks(kv_cache_memory: int | float, per_token: int, num_slots: int, capacity: int,
                block_size: int = BLOCK_SIZE) -> int:
    """Blocks of the target's pool: what the budget holds at `per_token` bytes a position, at most every slot at
    full capacity, at least one block."""
    return max(1, min(blocks_for_budget(budget_bytes(kv_cache_memory), per_token, block_size),
                      num_slots * blocks_for(capacity, block_size)))


def draft_pool_blocks(target_blocks: int, num_slots: int, capacity: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks of a draft model's pool next to a target pool of `target_blocks`: the same positions, plus each
    slot's lead over the target's (a catch-up and a spare: draft_cache_capacity - target_cache_capacity), at
    most every slot at full capacity — so a draft never runs out while the target's admission holds."""
    lead = MAX_BATCHED_CATCH_UP + 1
    return min(target_blocks + num_slots * blocks_for(lead, block_size), num_slots * blocks_for(capacity, block_size))


def kv_dtype(name: str, activations: torch.dtype, fused: bool = False) -> torch.dtype:
    """--kv-cache-dtype for a model with these activations: "auto" as config.auto_kv_cache_dtype picks it (bfloat16
    where `fused`, the C++ glue and attention op, float32 activations); `fused` takes float32 or bfloat16 only."""
    if name == "auto":
        name = auto_kv_cache_dtype(str(activations).removeprefix("torch."), fused and activations == torch.float32)
    dtype = getattr(torch, name)
    if fused and dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"kv_cache_dtype {name}: our CPU kernels store K/V as float32 or bfloat16 only")
    return dtype


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks holding positions 0 .. num_tokens - 1."""
    return -(-num_tokens // block_size)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,  # max tokens per slot, including room for speculative look-ahead
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        block_size: int = BLOCK_SIZE,
        num_blocks: int | None = None,  # the pool; None: every slot at full capacity (never runs out)
    ):
        if block_size >= capacity:
            block_size = capacity  # one block per slot: the contiguous layout
        elif block_size <= 0 or block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16 (or >= capacity), got {block_size}")
        self.block_size = block_size
        self.blocks_per_slot = blocks_for(capacity, block_size)
        if num_blocks is None:
            num_blocks = num_slots * self.blocks_per_slot
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # one more block past the pool: the null block, where unmapped table entries point (never handed out; it
        # takes padding rows' writes and is never read unmasked)
        shape = (num_blocks + 1, num_kv_heads, block_size, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.keys + self.values:
            t[num_blocks].zero_()
        self.null_block = num_blocks
        self.capacity = capacity
        self.num_slots = num_slots
        self.lengths = [0] * num_slots  # valid tokens per slot
        self.held: list[list[int]] = [[] for _ in range(num_slots)]  # each slot's blocks, in position order
        self.tables = torch.full((num_slots, self.blocks_per_slot), num_blocks, dtype=torch.int64)  # CPU
        self._free = list(range(num_blocks))[::-1]  # taken from the end: low ids first, recently freed first
        self.refs = [0] * num_blocks  # holders of each block: slots mapping it, prefix-cache entries retaining it
        self.reclaimer: Reclaimer | None = None  # the prefix cache, once it holds blocks of this pool
        self.num_copies = 0  # blocks copied on write so far (a shared block a forward was about to write)
        self._head_index = torch.arange(num_kv_heads, device=device)[None, :, None]  # [1, H, 1]
        self._device = device

    @property
    def nbytes(self) -> int:
        """Bytes the pool spans (the null block excluded)."""
        return sum(t[: self.num_blocks].numel() * t.element_size() for t in self.keys + self.values)

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds."""
        return len(self._free)

    @property
    def num_available_blocks(self) -> int:
        """Blocks a reserve can take: the free ones and those only the reclaimer (prefix cache) holds."""
        return len(self._free) + (self.reclaimer.reclaimable() if self.reclaimer is not None else 0)

    def blocks_needed(self, slot: int, num_tokens: int) -> int:
        """Blocks `slot` must still take to hold positions 0 .. num_tokens - 1 (copies of shared ones aside)."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.held[slot]))

    def _shared_in(self, slot: int, end: int) -> list[int]:
        """Indices into held[slot] of the blocks a forward writing positions lengths[slot] .. end - 1 would write
        and someone else also holds (a forward never writes below the slot's length: the engine truncates first)."""
        if end <= self.lengths[slot]:
            return []
        first, stop = self.lengths[slot] // self.block_size, min(len(self.held[slot]), blocks_for(end, self.block_size))
        return [i for i in range(first, stop) if self.refs[self.held[slot][i]] > 1]

    def _take(self, k: int) -> list[int]:
        ids = [self._free.pop() for _ in range(k)]
        for b in ids:
            self.refs[b] = 1
        return ids

    def reserve(self, slots: list[int], ends: list[int]) -> None:
        """Take the blocks each slot needs to hold positions up to ends[i] (exclusive) and copy the shared blocks
        its writes would land in, all or none: CacheFull (nothing taken) when the pool, after the reclaimer let go
        of what it could, has too few free blocks; ValueError beyond a slot's capacity."""
        for s, n in zip(slots, ends):
            if n > self.capacity:
                raise ValueError(f"slot {s}: length {n} exceeds cache capacity {self.capacity}")

        def needed() -> int:
            return sum(self.blocks_needed(s, n) + len(self._shared_in(s, n)) for s, n in zip(slots, ends))

        need = needed()
        if need == 0:
            return  # (most decode steps: every position lands in a block the slot already holds alone)
        if need > len(self._free) and self.reclaimer is not None:
            self.reclaimer.reclaim(need - len(self._free))
            need = needed()  # letting go may have left a block this forward writes with one holder: no copy
        if need > len(self._free):
            raise CacheFull(f"the KV cache needs {need} more blocks of {self.block_size} positions, "
                            f"{len(self._free)} of {self.num_blocks} are free (--kv-cache-memory sizes the pool)")
        fresh = []
        for s, n in zip(slots, ends):
            cow = self._shared_in(s, n)
            if cow:  # copy-on-write: this slot gets its own copy, the other holders keep the original bits
                src = [self.held[s][i] for i in cow]
                dst = self._take(len(cow))
                si, di = torch.tensor(src, device=self._device), torch.tensor(dst, device=self._device)
                for t in self.keys + self.values:
                    t[di] = t[si]
                for i, b in zip(cow, dst):
                    self.held[s][i] = b
                    self.tables[s, i] = b
                self.release(src)
                self.num_copies += len(cow)
            k = self.blocks_needed(s, n)
            if k == 0:
                continue
            ids = self._take(k)
            fresh += ids
            first = len(self.held[s])
            self.held[s].extend(ids)
            self.tables[s, first : first + k] = torch.tensor(ids)
        if fresh:
            index = torch.tensor(fresh, device=self._device)
            for t in self.keys + self.values:
                t.index_fill_(0, index, 0)

    def share(self, slot: int, blocks: list[int], num_tokens: int) -> None:
        """Map `blocks` (another holder's, e.g. a prefix-cache entry's) as positions 0 .. num_tokens - 1 of the
        empty `slot`: referenced, not copied (the slot's first write into one copies it: `reserve`)."""
        if self.held[slot] or self.lengths[slot]:
            raise ValueError(f"slot {slot}: share needs an empty slot")
        if len(blocks) != blocks_for(num_tokens, self.block_size) or num_tokens > self.capacity:
            raise ValueError(f"slot {slot}: {len(blocks)} blocks cannot hold exactly {num_tokens} positions")
        self.retain(blocks)
        self.held[slot] = list(blocks)
        if blocks:
            self.tables[slot, : len(blocks)] = torch.tensor(blocks)
        self.lengths[slot] = num_tokens

    def blocks(self, slot: int, num_tokens: int) -> list[int]:
        """The blocks holding positions 0 .. num_tokens - 1 of `slot` (what a prefix-cache entry retains)."""
        if num_tokens > self.lengths[slot]:
            raise ValueError(f"slot {slot}: holds {self.lengths[slot]} positions, not {num_tokens}")
        return self.held[slot][: blocks_for(num_tokens, self.block_size)]

    def retain(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (all held by someone already)."""
        if any(self.refs[b] < 1 for b in blocks):
            raise ValueError("cannot retain a free block")
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        """One holder fewer of each of `blocks`; a block nobody holds any more returns to the free list."""
        for b in blocks:
            if self.refs[b] < 1:
                raise ValueError(f"block {b} released more often than held")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)

    def table(self, slots: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:  # slots [B] -> [B, nb]
        """The block-table rows of `slots` (what the attention and glue ops and write/read take), as many columns as
        the longest holds (or as `num_tokens` positions need); unmapped entries name the null block."""
        nb = max((len(self.held[int(s)]) for s in slots.tolist()), default=1) if num_tokens is None \
            else blocks_for(num_tokens, self.block_size)
        return self.tables[slots.cpu(), : max(1, nb)]

    def _locate(self, tables: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, row) of each position [B, T] of the sequences whose table rows are `tables` [B, nb]."""
        tables = tables.to(positions.device)
        return tables.gather(1, positions // self.block_size), positions % self.block_size

    def write(
        self,
        layer: int,
        tables: torch.Tensor,  # [B, nb] int64: the sequences' block-table rows (`table`)
        positions: torch.Tensor,  # [B, T] int64
        k: torch.Tensor,  # [B, H, T, D]
        v: torch.Tensor,  # [B, H, T, D]
    ) -> None:
        blocks, rows = self._locate(tables, positions)
        index = (blocks[:, None, :], self._head_index, rows[:, None, :])
        dtype = self.keys[layer].dtype  # a narrower K/V dtype: rounded to nearest even (what the C++ glue does)
        self.keys[layer].index_put_(index, k.to(dtype))
        self.values[layer].index_put_(index, v.to(dtype))

    def read(
        self, layer: int, tables: torch.Tensor, kv_len: int,  # tables [B, nb]
        dtype: torch.dtype | None = None,  # widened (or not) to this dtype; None: as stored
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [B, H, kv_len, D]
        """Positions 0 .. kv_len - 1 of each sequence, gathered out of its blocks (a copy unless one block holds
        them); past a sequence's blocks: the null block (finite values, for masked positions only)."""
        nb = blocks_for(kv_len, self.block_size)
        ids = tables[:, :nb].to(self.keys[layer].device)
        if nb > ids.shape[1]:  # a shorter table: the null block beyond
            ids = torch.cat([ids, ids.new_full((ids.shape[0], nb - ids.shape[1]), self.null_block)], dim=1)
        out = []
        for t in (self.keys[layer], self.values[layer]):
            g = t[ids]  # [B, nb, H, bs, D]
            B, _, H, bs, D = g.shape
            out.append(g.transpose(1, 2).reshape(B, H, nb * bs, D)[:, :, :kv_len].to(dtype or t.dtype))
        return out[0], out[1]

    def extend(self, slots: list[int], new_lengths: list[int]) -> None:
        """Record that a forward pass wrote tokens up to `new_lengths` (exclusive) in each slot."""
        for s, n in zip(slots, new_lengths):
            if n > len(self.held[s]) * self.block_size:
                raise ValueError(f"slot {s}: length {n} beyond its {len(self.held[s])} blocks (reserve first)")
            self.lengths[s] = max(self.lengths[s], n)

    def truncate(self, slot: int, new_len: int) -> None:
        """Roll slot back to its first `new_len` tokens (the only rollback there is); the slot lets go of the blocks
        past them (free unless another holder shares them)."""
        if not 0 <= new_len <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot truncate length {self.lengths[slot]} to {new_len}")
        self.lengths[slot] = new_len
        self._let_go(slot, blocks_for(new_len, self.block_size))

    def _let_go(self, slot: int, keep: int) -> None:
        """`slot` keeps its first `keep` blocks; the rest lose it as a holder (free once nobody holds them)."""
        gone = self.held[slot][keep:]
        if gone:
            del self.held[slot][keep:]
            self.tables[slot, keep : keep + len(gone)] = self.null_block
            self.release(gone[::-1])

    def compact(self, slot: int, start: int, rows: list[int]) -> None:
        """Token-tree verification kept one root-to-node path: move the K/V of chunk rows `rows` (ascending, rows[0]
        = 0) from positions start + rows[j] to start + j, every layer; the caller then truncates the rest."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or start + rows[-1] >= self.lengths[slot]:
            raise ValueError(f"slot {slot}: rows {rows} are not ascending rows of the last chunk")
        if rows == list(range(len(rows))):
            return  # already consecutive (a chain, or the first branch all along)
        shared = [i for i in range(start // self.block_size, blocks_for(start + len(rows), self.block_size))
                  if self.refs[self.held[slot][i]] > 1]
        if shared:  # never: a verification's own blocks were copied on write by its forward, and nothing shares
            # them before its rollback (the prefix cache stores prompts, which the last chunk is past)
            raise RuntimeError(f"slot {slot}: compact would write shared blocks {shared}")
        table = self.tables[slot : slot + 1]
        src = torch.tensor([[start + r for r in rows]])
        dst = torch.arange(start, start + len(rows))[None]
        (sb, sr), (db, dr) = self._locate(table, src), self._locate(table, dst)
        sb, sr, db, dr = (x[0].to(self.keys[0].device) for x in (sb, sr, db, dr))
        for t in self.keys + self.values:
            t[db, :, dr] = t[sb, :, sr]

    def gather(self, slot: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the first n positions' K and V, per layer [H_kv, n, D] (what tests compare)."""
        table = self.tables[slot : slot + 1]
        keys, values = [], []
        for layer in range(len(self.keys)):
            k, v = self.read(layer, table, n)
            keys.append(k[0].clone())
            values.append(v[0].clone())
        return keys, values

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._let_go(slot, 0)

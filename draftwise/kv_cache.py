"""KV cache: keys and values in fixed-size pages (blocks) of one pool, a block table per sequence slot, and the
arithmetic that sizes them — vLLM's paged attention, on the CPU.

Owns the pool (per layer [num_blocks, kv heads, block_size, head_dim], allocated uncommitted: a page of memory
costs RSS only once a block on it is taken), each slot's block table and valid length, and the free list.
Position p of a slot lives in block tables[slot, p // block_size], row p % block_size. A forward first
`reserve`s the blocks its positions need (CacheFull when the pool has too few free blocks: the engine admits
and preempts by `num_free_blocks`), writes K/V through the table (`write`, or the C++ glue given `table(slots)`),
then `extend`s the lengths. `truncate(slot, new_len)` is the only rollback: the length moves back and the blocks
wholly past it return to the pool; entries past the length are never visible (attention reads by position) and
are overwritten by the next write. A block is zeroed when taken, and padding rows (a forward's positions past a
row's real tokens) write into one null block past the pool, which no table maps; so whatever the torch path reads
past a sequence's end (masked out) is finite, and padding costs no block. `block_size >= capacity` gives one block per slot: the
contiguous layout of earlier versions (the tests compare the two bit for bit).

Also owns what a cache weighs: `target_cache_capacity` and `draft_cache_capacity` (the most tokens a slot may
hold, from the context length and the look-ahead), `cache_bytes`, `bytes_per_token` and `blocks_for_budget`,
which the engine, the draft-model proposer and the memory estimate (bench/memory.py) all call. Knows nothing
about models or requests; of speculation, only how many positions beyond the context a verification or a
draft's catch-up writes before its rollback.
"""
from __future__ import annotations

import torch

from draftwise.config import ConfigError, auto_kv_cache_dtype

MAX_BATCHED_CATCH_UP = 4  # a draft's rows with more unseen tokens than this (a new prompt) are prefilled alone
BLOCK_SIZE = 16  # positions per block: a multiple of 16 (the attention op reads keys in aligned blocks of 16)


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
        return len(self._free)

    def blocks_needed(self, slot: int, num_tokens: int) -> int:
        """Blocks `slot` must still take to hold positions 0 .. num_tokens - 1."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(self.held[slot]))

    def reserve(self, slots: list[int], ends: list[int]) -> None:
        """Take the blocks each slot needs to hold positions up to ends[i] (exclusive), all or none: CacheFull
        (nothing taken) when the pool has too few free blocks, ValueError beyond a slot's capacity."""
        need = 0
        for s, n in zip(slots, ends):
            if n > self.capacity:
                raise ValueError(f"slot {s}: length {n} exceeds cache capacity {self.capacity}")
            need += self.blocks_needed(s, n)
        if need > len(self._free):
            raise CacheFull(f"the KV cache needs {need} more blocks of {self.block_size} positions, "
                            f"{len(self._free)} of {self.num_blocks} are free (--kv-cache-memory sizes the pool)")
        for s, n in zip(slots, ends):
            k = self.blocks_needed(s, n)
            if k == 0:
                continue
            ids = [self._free.pop() for _ in range(k)]
            index = torch.tensor(ids, device=self._device)
            for t in self.keys + self.values:
                t.index_fill_(0, index, 0)
            first = len(self.held[s])
            self.held[s].extend(ids)
            self.tables[s, first : first + k] = torch.tensor(ids)

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
        """Roll slot back to its first `new_len` tokens (the only rollback there is); the blocks past them return."""
        if not 0 <= new_len <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot truncate length {self.lengths[slot]} to {new_len}")
        self.lengths[slot] = new_len
        self._release(slot, blocks_for(new_len, self.block_size))

    def _release(self, slot: int, keep: int) -> None:
        gone = self.held[slot][keep:]
        if gone:
            del self.held[slot][keep:]
            self.tables[slot, keep : keep + len(gone)] = self.null_block
            self._free.extend(reversed(gone))

    def compact(self, slot: int, start: int, rows: list[int]) -> None:
        """Token-tree verification kept one root-to-node path: move the K/V of chunk rows `rows` (ascending, rows[0]
        = 0) from positions start + rows[j] to start + j, every layer; the caller then truncates the rest."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or start + rows[-1] >= self.lengths[slot]:
            raise ValueError(f"slot {slot}: rows {rows} are not ascending rows of the last chunk")
        if rows == list(range(len(rows))):
            return  # already consecutive (a chain, or the first branch all along)
        table = self.tables[slot : slot + 1]
        src = torch.tensor([[start + r for r in rows]])
        dst = torch.arange(start, start + len(rows))[None]
        (sb, sr), (db, dr) = self._locate(table, src), self._locate(table, dst)
        sb, sr, db, dr = (x[0].to(self.keys[0].device) for x in (sb, sr, db, dr))
        for t in self.keys + self.values:
            t[db, :, dr] = t[sb, :, sr]

    def gather(self, slot: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the first n positions' K and V, per layer [H_kv, n, D] (what the prefix cache stores)."""
        table = self.tables[slot : slot + 1]
        keys, values = [], []
        for layer in range(len(self.keys)):
            k, v = self.read(layer, table, n)
            keys.append(k[0].clone())
            values.append(v[0].clone())
        return keys, values

    def load(self, slot: int, keys: list[torch.Tensor], values: list[torch.Tensor], n: int) -> None:
        """Write the first n positions of per-layer K/V copies ([H_kv, >= n, D]) into `slot` (empty), taking its
        blocks (CacheFull when the pool is short)."""
        self.reserve([slot], [n])
        table = self.tables[slot : slot + 1]
        pos = torch.arange(n, device=self.keys[0].device)[None]
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.write(layer, table, pos, k[None, :, :n], v[None, :, :n])
        self.extend([slot], [n])

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._release(slot, 0)

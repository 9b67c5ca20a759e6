"""KV cache: preallocated keys and values for a fixed number of sequence slots, and the arithmetic that sizes them.

Owns the storage and each slot's valid length. A forward pass writes K/V at the positions it was given
(`write`, which extends the slot's length); `truncate(slot, new_len)` is the only rollback — it just moves
the length back, the stale entries beyond it are never visible (attention masks by position) and are
overwritten by the next write. Also owns how long a slot is and what a cache weighs: `target_cache_capacity`
and `draft_cache_capacity` (tokens per slot from the context length and the look-ahead) and `cache_bytes`,
which the engine, the draft-model proposer and the memory estimate (bench/memory.py) all call, so the
estimate is what gets allocated. Knows nothing about models or requests; of speculation, only how many
positions beyond the context a verification or a draft's catch-up writes before its rollback.
"""
from __future__ import annotations

import torch

MAX_BATCHED_CATCH_UP = 4  # a draft's rows with more unseen tokens than this (a new prompt) are prefilled alone


def target_cache_capacity(max_model_len: int, k_max: int) -> int:
    """Tokens per slot in the target's KV cache: the context plus one verification's look-ahead (the pending
    token and up to k_max guesses are written before the rollback)."""
    return max_model_len + k_max + 1


def draft_cache_capacity(max_model_len: int, k_max: int) -> int:
    """Tokens per slot in the draft's KV cache: the context, k guesses, a batched catch-up and two spare
    positions (the draft may run one token ahead of the target's context before a rollback)."""
    return max_model_len + k_max + MAX_BATCHED_CATCH_UP + 2


def cache_bytes(num_layers: int, num_slots: int, num_kv_heads: int, capacity: int, head_dim: int,
                element_size: int) -> int:
    """Bytes a KVCache built with these arguments holds: K and V, [num_slots, num_kv_heads, capacity, head_dim]
    per layer, element_size bytes each."""
    return 2 * num_layers * num_slots * num_kv_heads * capacity * head_dim * element_size


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
    ):
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.num_slots = num_slots
        self.lengths = [0] * num_slots  # valid tokens per slot
        self._head_index = torch.arange(num_kv_heads, device=device)[None, :, None]  # [1, H, 1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write(
        self,
        layer: int,
        slots: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B, T] int64
        k: torch.Tensor,  # [B, H, T, D]
        v: torch.Tensor,  # [B, H, T, D]
    ) -> None:
        if positions.shape[0] == 1 and positions.shape[1] > 0:
            # one sequence with contiguous positions (prefill, decode, verify): a plain slice copy
            s, start, t = int(slots[0]), int(positions[0, 0]), positions.shape[1]
            self.keys[layer][s, :, start : start + t] = k[0]
            self.values[layer][s, :, start : start + t] = v[0]
            return
        index = (slots[:, None, None], self._head_index, positions[:, None, :])
        self.keys[layer].index_put_(index, k)
        self.values[layer].index_put_(index, v)

    def read(
        self, layer: int, slots: torch.Tensor, kv_len: int  # slots [B]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [B, H, kv_len, D]
        if slots.shape[0] == 1:
            s = int(slots[0])
            return self.keys[layer][s : s + 1, :, :kv_len], self.values[layer][s : s + 1, :, :kv_len]
        return self.keys[layer][slots, :, :kv_len], self.values[layer][slots, :, :kv_len]

    def extend(self, slots: list[int], new_lengths: list[int]) -> None:
        """Record that a forward pass wrote tokens up to `new_lengths` (exclusive) in each slot."""
        for s, n in zip(slots, new_lengths):
            if n > self.capacity:
                raise ValueError(f"slot {s}: length {n} exceeds cache capacity {self.capacity}")
            self.lengths[s] = max(self.lengths[s], n)

    def truncate(self, slot: int, new_len: int) -> None:
        """Roll slot back to its first `new_len` tokens (the only rollback there is)."""
        if not 0 <= new_len <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot truncate length {self.lengths[slot]} to {new_len}")
        self.lengths[slot] = new_len

    def compact(self, slot: int, start: int, rows: list[int]) -> None:
        """Token-tree verification kept one root-to-node path: move the K/V of chunk rows `rows` (ascending, rows[0]
        = 0) from positions start + rows[j] to start + j, every layer; the caller then truncates the rest."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or start + rows[-1] >= self.lengths[slot]:
            raise ValueError(f"slot {slot}: rows {rows} are not ascending rows of the last chunk")
        if rows == list(range(len(rows))):
            return  # already consecutive (a chain, or the first branch all along)
        src = torch.tensor(rows, device=self.keys[0].device) + start
        for t in self.keys + self.values:
            t[slot, :, start : start + len(rows)] = t[slot, :, src]

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

"""The decoder's layer loop as one C++ call (csrc/stack.cpp, built into the q4x8 library).

A forward makes ~11 op calls per layer (norm, q/k/v projection, RoPE + K/V write, attention, o projection,
add + norm, gate/up projection, activation, down projection, residual add), and the Python between them (module
dispatch, argument parsing, views) kept the second core idle. `layers` makes those same calls, on the same
registered operators with the same arguments, from C++: its result is bitwise the Python loop's (transformer.py's
fused path), 3-8 ms sooner per forward of the 1.5B on 2 cores (docs/ARCHITECTURE.md, Kernels).

Owns: building the flat weight list (`layer_weights`: one layer's entries in csrc/stack.cpp's Slot order, checked
to be exactly SLOTS long); whether it can run here is glue's `available` (one library). The layout itself is
csrc/stack.cpp's alone: SLOTS, the entries per layer, is read from the loaded library (`weights_per_layer`) the first
time it is used, never written here. Knows nothing of models beyond those shapes: the decoder
(models/transformer.py) decides when its layers qualify (q4x8 projections with merged q/k/v and gate/up, our glue
and attention ops, no sandwich norms) and keeps its Python loop for everything else.
"""
from __future__ import annotations

import functools

import torch

from draftwise.kernels import q4x8
from draftwise.kernels.linear import Q4x8Linear
from draftwise.kernels.glue import available  # noqa: F401 (one library: built and loaded, or not)


@functools.cache
def slots_per_layer() -> int:
    """Weights per layer in the flat list: csrc/stack.cpp's WEIGHTS_PER_LAYER, from the loaded library (built on
    first use; KernelBuildError where it cannot be). Also readable as `SLOTS`."""
    q4x8.load()
    return int(torch.ops.draftwise_stack.weights_per_layer())


def __getattr__(name: str) -> int:  # `stack.SLOTS`: the library's count, read once it is asked for
    if name == "SLOTS":
        return slots_per_layer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _linear(m: Q4x8Linear) -> list[torch.Tensor | None]:  # packed, sc, mn, d, dmin, bias
    b = m._buffers  # read directly, as Q4x8Linear.forward does (a model's buffers may be swapped: hugepages.py)
    return [b["packed"], b["sc"], b["mn"], b["d"], b["dmin"], b["bias"]]


def layer_weights(in_norm: torch.Tensor, qkv: Q4x8Linear, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, o: Q4x8Linear, post_norm: torch.Tensor,
                  gate_up: Q4x8Linear, down: Q4x8Linear) -> list[torch.Tensor | None]:
    """One layer's SLOTS entries: norm weights [hidden] / [head_dim] float32, projections as q4x8 modules."""
    w = [in_norm, *_linear(qkv), q_norm, k_norm, *_linear(o), post_norm, *_linear(gate_up), *_linear(down)]
    if len(w) != slots_per_layer():
        raise RuntimeError(f"stack.layer_weights built {len(w)} entries for a layer, but csrc/stack.cpp's Slot layout "
                           f"takes {slots_per_layer()} (weights_per_layer): layer_weights no longer follows that "
                           f"layout; make it build csrc/stack.cpp's Slot order")
    return w


def layers(
    x: torch.Tensor,  # [B, T, hidden] float32
    weights: list[torch.Tensor | None],  # SLOTS per layer (layer_weights)
    keys: list[torch.Tensor],  # per layer: the KV cache's pool [P, H_kv, BS, D], written in place
    values: list[torch.Tensor],
    cos: list[torch.Tensor],  # per layer: RoPE angles [B * T, D / 2] (Decoder.angles)
    sin: list[torch.Tensor],
    tables: torch.Tensor,  # [B, nb] int64: block-table rows (KVCache.table)
    positions: torch.Tensor,  # [B, T] int64
    num_tokens: list[int],  # real tokens per row: the row-exact attention
    windows: list[int],  # per layer: sliding window, 0 for none
    dims: tuple[int, int, int, int, int],  # num_heads, num_kv_heads, head_dim, intermediate, activation (glue)
    norm: tuple[float, float],  # eps, weight offset of the layer norms
    qk_norm: tuple[float, float],  # eps, weight offset of the q/k norms (ignored without them)
    scale: float,  # attention softmax scale
    ancestors: torch.Tensor | None = None,  # [B, T] int64 token-tree masks (kernels/attention.py attend_tree)
) -> torch.Tensor:  # [B, T, hidden]: x after every layer; K/V of every layer stored at positions
    return torch.ops.draftwise_stack.layers(x, weights, keys, values, cos, sin, tables, positions, num_tokens,
                                            windows, list(dims), list(norm), list(qk_norm), float(scale),
                                            None if ancestors is None else ancestors.contiguous())

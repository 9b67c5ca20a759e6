"""The decoder's layer loop as one C++ call (csrc/stack.cpp, built into the one library, kernels/library.py).

A forward makes ~11 op calls per layer (norm, q/k/v projection, RoPE + K/V write, attention, o projection,
add + norm, gate/up projection, activation, down projection, residual add; a mixture layer: router logits, route,
its experts' one call (kernels/experts.py), the shared expert's gate and MLP), and the Python between them (module
dispatch, argument parsing, views) kept the second core idle. `layers` makes those same calls, on the same
registered operators with the same arguments, from C++: its result is bitwise the Python loop's (transformer.py's
fused path), 3-8 ms sooner per forward of the 1.5B on 2 cores (docs/ARCHITECTURE.md, Kernels).

Owns: building the flat weight list and the projections' kinds (`layer_weights`: one layer's entries in
csrc/stack.cpp's Slot order, checked to be exactly SLOTS long, its KINDS_PER_LAYER kind ids and its feed-forward
shape in FfnField order); whether it can run
here is glue's `available` (one library). The layout itself is csrc/stack.cpp's alone: SLOTS, the entries per layer,
the kinds per layer, the entries per projection and the kinds' ids are read from the loaded library
(`weights_per_layer`, `kinds_per_layer`, `ffn_per_layer`, `linear_entries`, `linear_kinds`) the first time they are used, never
written here; and `generation()`, a count of every (re)binding of a module, parameter or buffer anywhere (torch's
global registration hooks: setattr, register_buffer (kernels/hugepages.py's moves), add_module; code that writes a
module's dicts directly calls `changed`), by which a caller that keeps a built list knows it may be stale. Each projection may be any of the row-exact
kernels the library runs (q4x8 and every block kernel of kernels/blocktypes.py: a faithful plan mixes them layer by layer), with q/k/v merged or as
three calls. A mixture layer passes its router's weight, its ExpertSet (kernels/experts.py `grouped`) and, for
qwen2_moe, its shared expert as the layer's MLP with the shared gate's weight. Knows nothing of models beyond those
shapes: the decoder (models/transformer.py) decides when its layers qualify (those kernels on their auto path,
gate/up merged, our glue and attention ops, no sandwich norms; a mixture's experts grouped and its router on the
few-row op) and keeps its Python loop for everything else.
"""
from __future__ import annotations

import functools

import torch

from draftwise.kernels import blocktypes, glue, library
from draftwise.kernels.linear import LINEARS, LinearImpl, Q4x8Linear
from draftwise.kernels.glue import available  # noqa: F401 (one library: built and loaded, or not)

# the projections' kernels the library's loop calls, by registry name (csrc/stack.cpp's Kind: linear_kinds())
KERNELS = {name: LINEARS[name] for name in ("q4x8", *blocktypes.block_kernels())}
_KERNEL_TYPES = frozenset(KERNELS.values())  # (kernel_of runs for every projection of every step)
ABSENT = -1  # csrc/stack.cpp's Kind for k_proj / v_proj where q/k/v are merged

_generation = 0  # changed() calls so far


def generation() -> int:
    """How many times a module, parameter or buffer has been (re)bound anywhere in this process: a flat list built
    at one generation may hold modules or buffers a model no longer has at a later one."""
    return _generation


def changed(*_) -> None:
    """A module, parameter or buffer was (re)bound: every flat list built before is stale. Called by torch's global
    registration hooks (setattr, register_buffer, register_parameter, add_module anywhere); code that rebinds in a
    module's dicts directly must call it."""
    global _generation
    _generation += 1


def _registered(module, name, value) -> None:  # torch's hook signature; None leaves the value as it is
    changed()  # (looked up at each call: a test may replace it)


for _register in (torch.nn.modules.module.register_module_module_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook,
                  torch.nn.modules.module.register_module_parameter_registration_hook):
    _register(_registered)


@functools.cache
def _layout_count(op: str) -> int:
    """One count of csrc/stack.cpp's layout, by the name of the operator that returns it, from the loaded library
    (built on first use; KernelBuildError where it cannot be)."""
    library.load()
    return int(getattr(torch.ops.draftwise_stack, op)())


def slots_per_layer() -> int:
    """Weights per layer in the flat list: csrc/stack.cpp's WEIGHTS_PER_LAYER. Also readable as `SLOTS`."""
    return _layout_count("weights_per_layer")


def __getattr__(name: str) -> int:  # `stack.SLOTS`: the library's count, read once it is asked for
    if name == "SLOTS":
        return slots_per_layer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def kind_ids() -> dict[str, int]:
    """Registry name -> csrc/stack.cpp's Kind id, from the loaded library (linear_kinds)."""
    library.load()
    return {name: i for i, name in enumerate(torch.ops.draftwise_stack.linear_kinds())}


def kernel_of(m) -> LinearImpl | None:
    """`m` itself when the library's loop can call it: one of KERNELS on its auto path (the kernel picked by cpuid,
    as the Python loop calls it); else None."""
    return m if type(m) in _KERNEL_TYPES and m.path == "auto" and m.name in kind_ids() else None


def kinds_per_layer() -> int:
    """Kind ids per layer: csrc/stack.cpp's KINDS_PER_LAYER."""
    return _layout_count("kinds_per_layer")


def ffn_per_layer() -> int:
    """Feed-forward shape entries per layer: csrc/stack.cpp's FFN_PER_LAYER."""
    return _layout_count("ffn_per_layer")


def linear_entries() -> int:
    """Entries per projection in the flat list: csrc/stack.cpp's LINEAR."""
    return _layout_count("linear_entries")


def _linear(m: LinearImpl | None) -> list[torch.Tensor | None]:  # csrc/stack.cpp's LINEAR entries, by kind
    n = linear_entries()
    if m is None:
        return [None] * n
    b = m._buffers  # read directly, as the modules' forward does (a model's buffers may be swapped: hugepages.py)
    packed = ([b["packed"], b["sc"], b["mn"], b["d"], b["dmin"]] if isinstance(m, Q4x8Linear)
              else [b[name] for name in m.PACKED])  # a block kernel's buffers in its operator's order
    return [*packed, *[None] * (n - 1 - len(packed)), b["bias"]]  # then None, the bias last


def layer_weights(in_norm: torch.Tensor, qkv: LinearImpl, k: LinearImpl | None, v: LinearImpl | None,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, o: LinearImpl, post_norm: torch.Tensor,
                  gate_up: LinearImpl | None, down: LinearImpl | None, intermediate: int,
                  router: torch.Tensor | None = None, top_k: int = 0, norm_topk: bool = False,
                  shared_gate: torch.Tensor | None = None) -> tuple[list[torch.Tensor | None], list[int], list[int]]:
    """One layer's SLOTS entries (norm weights [hidden] / [head_dim] float32, projections as kernel_of modules:
    `qkv` the merged q|k|v with `k`, `v` None, or q_proj with k_proj and v_proj), its projections' kind ids in
    csrc/stack.cpp's Proj order (qkv, k, v, o, gate_up, down) and its feed-forward shape (FfnField: intermediate,
    top_k, norm_topk). A dense layer: `gate_up` / `down` its MLP of width `intermediate`. A mixture layer: `router`
    [experts, hidden] float32 and its `top_k` / `norm_topk`; `gate_up` / `down` its shared expert's (width
    `intermediate`) with `shared_gate` [1, hidden] float32, or None and 0 where it has none."""
    w = [in_norm, *_linear(qkv), *_linear(k), *_linear(v), q_norm, k_norm, *_linear(o), post_norm,
         *_linear(gate_up), *_linear(down), router, shared_gate]
    if len(w) != slots_per_layer():
        raise RuntimeError(f"stack.layer_weights built {len(w)} entries for a layer, but csrc/stack.cpp's Slot layout "
                           f"takes {slots_per_layer()} (weights_per_layer): layer_weights no longer follows that "
                           f"layout; make it build csrc/stack.cpp's Slot order")
    ids = kind_ids()
    kinds = [ABSENT if m is None else ids[m.name] for m in (qkv, k, v, o, gate_up, down)]
    if len(kinds) != kinds_per_layer():
        raise RuntimeError("stack.layer_weights: csrc/stack.cpp's Proj order changed; follow it here")
    ffn = [int(intermediate), int(top_k), int(bool(norm_topk))]
    if len(ffn) != ffn_per_layer():
        raise RuntimeError("stack.layer_weights: csrc/stack.cpp's FfnField order changed; follow it here")
    return w, kinds, ffn


def layers(
    x: torch.Tensor,  # [B, T, hidden] float32
    weights: list[torch.Tensor | None],  # SLOTS per layer (layer_weights)
    kinds: list[int],  # KINDS_PER_LAYER per layer: each projection's kernel (layer_weights)
    ffn: list[int],  # FFN_PER_LAYER per layer: intermediate, top_k (0: dense), norm_topk (layer_weights)
    experts: list[object | None],  # per layer: a mixture's ExpertSet (kernels/experts.py grouped), None if dense
    keys: list[torch.Tensor],  # per layer: the KV cache's pool [P, H_kv, BS, D], written in place
    values: list[torch.Tensor],
    cos: list[torch.Tensor],  # per layer: RoPE angles [B * T, D / 2] (Decoder.angles)
    sin: list[torch.Tensor],
    tables: torch.Tensor,  # [B, nb] int64: block-table rows (KVCache.table)
    positions: torch.Tensor,  # [B, T] int64
    num_tokens: list[int],  # real tokens per row: the row-exact attention
    windows: list[int],  # per layer: sliding window, 0 for none
    dims: tuple[int, int, int, int],  # num_heads, num_kv_heads, head_dim, activation (glue)
    norm: tuple[float, float],  # eps, weight offset of the layer norms
    qk_norm: tuple[float, float],  # eps, weight offset of the q/k norms (ignored without them)
    scale: float,  # attention softmax scale
    ancestors: torch.Tensor | None = None,  # [B, T] int64 token-tree masks (kernels/attention.py attend_tree)
    head: tuple | None = None,  # (final norm weight [hidden], LM head (a kernel_of module), norm eps, norm offset)
    index: torch.Tensor | None = None,  # [B, J] int64, with head: these rows' logits instead of the last token's
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x after every layer [B, T, hidden] (K/V of every layer stored at positions) and, per mixture layer in order,
    its rows' experts [B * T, k] int64. With `head`: in place of x, the logits [B, 1, V] of each row's last token,
    x[:, -1:] through the final RMSNorm (glue's op) and the head, as the decoder's last_only forward computes them
    (with `index`: [B, J, V], x[torch.arange(B)[:, None], index] through them: its logit_index).
    Where `weights` is a WeightList, the model's arguments (weights .. scale, and the head) are converted for the C++
    call once and kept on it (WeightList), and the norm and head run in that same call (csrc/stack.cpp Packed.last)."""
    anc = None if ancestors is None else ancestors.contiguous()
    held = getattr(weights, "packed", None)
    if held is not None and held[0] is kinds and held[1] is ffn and held[2] is experts and held[3] is windows \
            and held[4] is dims and held[5] is norm and held[6] is qk_norm and held[7] == scale and held[8] is head:
        packed = held[9]  # (the same objects: StackArgs reused step after step; any other call converts afresh)
    elif isinstance(weights, WeightList):
        library.load()
        packed = torch.classes.draftwise_stack.Packed(weights, list(windows), list(dims), [float(v) for v in norm],
                                                      [float(v) for v in qk_norm], float(scale), kinds, ffn, experts)
        if head is not None:
            w, module, eps, offset = head
            packed.set_head([*_linear(module), w], kind_ids()[module.name], module.out_features, float(eps),
                            float(offset))
        weights.packed = (kinds, ffn, experts, windows, dims, norm, qk_norm, scale, head, packed)
    else:
        x, routed = torch.ops.draftwise_stack.layers(x, weights, keys, values, cos, sin, tables, positions, num_tokens,
                                                     windows, list(dims), list(norm), list(qk_norm), float(scale), anc,
                                                     kinds, ffn, experts)
        if head is None:
            return x, routed
        w, module, eps, offset = head
        rows = x[:, -1:] if index is None else x[torch.arange(x.shape[0])[:, None], index]
        return module(glue.rms_norm(rows, w, eps, offset)), routed  # the decoder's tail, as its Python runs it
    if head is None:
        return packed.layers(x, keys, values, cos, sin, tables, positions, num_tokens, anc)
    return packed.last(x, keys, values, cos, sin, tables, positions, num_tokens, anc, index)


class WeightList(list):
    """A model's flat weight list (layer_weights' entries, layer after layer) that keeps its C++ copy: `layers`
    converts it with the other model arguments (csrc/stack.cpp Packed) at its first call and reuses that while the
    same kinds, ffn and experts lists and the same small arguments come with it. Turning the ~170 entries into the
    op's arguments at every call cost ~0.25 ms of a ~9 ms decode step of the 4-layer MoE file (1 thread), time the
    other core idled. Build it whole, then leave it be (Decoder._stack_weights; its lists are rebuilt, never edited,
    when the model changes); a plain list is converted at every call."""

    __slots__ = ("packed",)

    def __init__(self, *args):
        super().__init__(*args)
        self.packed = None

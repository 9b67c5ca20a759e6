"""Grouped experts: a mixture-of-experts layer's expert MLPs run by one C++ call (csrc/experts.cpp, built into the
one library, kernels/library.py) instead of a Python loop over experts.

Owns: whether a layer's experts can be grouped (`grouped`: every expert an MLP whose gate/up is one merged linear
and whose down is one linear, both of a block kernel of the block-type table (kernels/blocktypes.py KERNELS: any
of them, each called through its `linear` op with its PACKED buffers) on the 'auto' path, without bias, float32
glue on CPU) and the handle that holds their buffers (csrc/experts.cpp's ExpertSet: views of the modules' buffers,
so nothing is copied and mapped weights stay mapped).
`run` groups the rows by expert, calls each routed expert's kernels once over all its rows (the GEMV, or the wide
kernel for a prompt's many rows, as the Python modules would) and sums each row's weighted products in ascending
expert order: bitwise the Python loop of models/transformer.py SparseMoE, and row-exact.
Knows nothing of routing (the caller passes each row's experts and weights) or of models beyond the MLP's
attribute names (gate_up_proj, down_proj, act_name, fused).
"""
from __future__ import annotations

import torch
from torch import nn

from draftwise.kernels import blocktypes, glue, library


def grouped(mlps: list[nn.Module]) -> object | None:
    """An ExpertSet over `mlps` (one per expert, in expert order) where all of them qualify (module docstring);
    None otherwise (the caller keeps its Python loop)."""
    if not mlps or not all(getattr(m, "fused", False) and getattr(m, "gate_up_proj", None) is not None
                           for m in mlps):
        return None
    gu = [m.gate_up_proj for m in mlps]
    down = [m.down_proj for m in mlps]
    kinds = []
    for mods in (gu, down):
        first = mods[0]
        kind = getattr(type(first), "name", None)
        if kind not in blocktypes.KERNELS or not hasattr(type(first), "PACKED"):
            return None
        if any(type(m) is not type(first) or m.path != "auto" or m._buffers.get("bias") is not None
               or m.out_features != first.out_features or m.in_features != first.in_features for m in mods):
            return None
        if any(b.device.type != "cpu" for m in mods for b in m._buffers.values() if b is not None):
            return None
        kinds.append(kind)
    if mlps[0].act_name not in glue.ACTIVATIONS or len({m.act_name for m in mlps}) != 1:
        return None
    library.load()
    flat = lambda mods: [m._buffers[n] for m in mods for n in type(m).PACKED]  # noqa: E731
    return torch.classes.draftwise_experts.ExpertSet(
        kinds[0], len(type(gu[0]).PACKED), flat(gu), gu[0].out_features,
        kinds[1], len(type(down[0]).PACKED), flat(down), down[0].out_features,
        glue.ACTIVATIONS[mlps[0].act_name], library.PATHS["auto"])


def run(experts: object, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [M, H] float32, chosen [M, k] int64 (each row's experts, ascending), weights [M, k] float32 -> [M, H]:
    sum_j weights[m, j] * expert_{chosen[m, j]}(x[m]), summed in ascending expert order."""
    return experts.run(x, chosen, weights)

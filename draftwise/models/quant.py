"""Weight-only int8 / int4 linear layers on torch's native kernels, and the pass that swaps them into a Decoder.

int8: per-output-channel symmetric scales, `torch._weight_int8pack_mm`. int4: asymmetric min-max groups of 32
along K, `torch._weight_int4pack_mm_for_cpu` (CUDA: `torch._weight_int4pack_mm`), which computes
w = (q - 8) * scale + zero with q in [0, 15] packed by `_convert_weight_to_int4pack*`. Groups of 32 match
GGUF's Q4_K sub-blocks (scale and min per 32 weights), so Q4_K weights re-quantize almost exactly.
Activations stay in the model dtype. "int4+dense" keeps the dense weights too and uses them for calls with
more than DENSE_ABOVE_ROWS tokens per sequence (prefill): the int4 kernel's cost grows with rows while a dense matmul's hardly
does, and they cross near 10-12 rows on this CPU (docs/ARCHITECTURE.md, hardware facts). Knows nothing of checkpoints or the engine.
"""
from __future__ import annotations

import torch
from torch import nn

INT4_GROUP = 32
DENSE_ABOVE_ROWS = 12


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.out_features = w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.qweight, self.scale)
        y = y.view(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP, keep_dense: bool = False):
        super().__init__()
        self.dense = linear.weight if keep_dense else None  # [N, K] in the model dtype, for wide calls
        w = linear.weight.detach().float()  # [N, K]
        N, K = w.shape
        wg = w.view(N, K // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K/group]
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(N, K)
        zero = lo + 8 * scale  # kernel: w = (q - 8) * scale + zero
        self.cuda = w.is_cuda
        if self.cuda:
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 2)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("packed", packed)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/group, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(linear.weight.dtype))
        self.bias = linear.bias
        self.group, self.out_features = group, N

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, x.shape[-1])
        # by tokens per sequence, not rows: verification (k + 1 <= 9 tokens) always runs in int4, like plain
        # decoding, so greedy speculative output equals plain output; only prompts take the dense path
        if self.dense is not None and x.dim() == 3 and x.shape[1] > DENSE_ABOVE_ROWS:
            return nn.functional.linear(x, self.dense, self.bias)
        if self.cuda:
            y = torch._weight_int4pack_mm(x2, self.packed, self.group, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_and_zeros)
        y = y.view(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def _quantizable(linear: nn.Linear, fmt: str) -> bool:
    N, K = linear.weight.shape
    if fmt == "int4":
        return K % INT4_GROUP == 0 and N % 8 == 0
    return True


def quantize_decoder(model: nn.Module, fmt: str) -> int:
    """Replace every nn.Linear of `model` (attention, MLP, LM head) in place; returns how many were swapped."""
    cls = {"int8": Int8Linear, "int4": Int4Linear, "int4+dense": lambda l: Int4Linear(l, keep_dense=True)}.get(fmt)
    if cls is None:
        return 0
    base = fmt.split("+")[0]
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and _quantizable(child, base)]
    for parent, name, child in targets:
        setattr(parent, name, cls(child))
    return len(targets)

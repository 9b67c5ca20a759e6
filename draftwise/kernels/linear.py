"""Linear-layer implementations behind one small interface, each declaring where it runs and how exact it is.

Owns: how y = x W^T + b is computed by each candidate kernel, from an fp32 (or dequantized) weight W [N, K]
and optional bias [N]: dense fp32, dense bf16, torch's weight-only int4 (bf16 activations), torch's weight-only
int8 (bf16 activations), fbgemm's dynamic int8 (x86), and ours, q4x8 (int4 weights x int8 activations).
Where each runs: `devices` ("cpu", "cuda"); a module is built on the weight's device (a CUDA weight gives
a CUDA module: cuBLAS for the dense ones, torch's tinygemm for int4), and a probe says which device it
describes (probe.probe() the CPU, probe.cuda_probe() a GPU).
Every implementation: `available(probe) -> bool` (can it run on the probed device), `supports(N, K) -> bool`
(can it take this shape), `tolerance` (documented bound on the relative error ||y - y_ref|| / ||y_ref|| against
the fp32 reference x W^T + b, for Gaussian weights and activations, the test's distribution; real weights with
outliers quantize worse), `weight_bytes` (what one call streams from memory), `nbytes(N, K, bias)` (what the
module holds: `draftwise memory` counts with it) and forward(x [..., K]) ->
[..., N] in x's dtype. Knows nothing of models, checkpoints or which implementation is chosen (autotune.py).
"""
from __future__ import annotations

import platform
import warnings
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def probe_device(probe: dict) -> str:
    """The device a probe describes ("cpu" for probe.probe(), "cuda" for probe.cuda_probe())."""
    return probe.get("device", "cpu")


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias.detach().to(dtype).contiguous()


class LinearImpl(nn.Module):
    """Base class: subclasses set the class attributes and implement __init__(weight, bias) and forward."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    tolerance: ClassVar[float] = 0.0
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    out_features: int
    in_features: int
    weight_bytes: int

    @classmethod
    def available(cls, probe: dict) -> bool:  # probe: draftwise.kernels.probe.probe() or cuda_probe()
        return probe_device(probe) in cls.devices

    @classmethod
    def supports(cls, N: int, K: int) -> bool:
        return True

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False) -> int:
        """Bytes this implementation's module holds for a weight [N, K] (and a bias [N]): its stored layout."""
        raise NotImplementedError(cls.name)

    def _shape(self, weight: torch.Tensor) -> None:  # weight [N, K]
        if weight.dim() != 2:
            raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        if not self.supports(self.out_features, self.in_features):
            raise ValueError(f"{self.name} does not support shape N={self.out_features}, K={self.in_features}")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class DenseF32(LinearImpl):
    name = "dense_fp32"
    description = "float32 weights and activations (MKL / oneDNN sgemm; cuBLAS on CUDA)"
    tolerance = 1e-5  # summation order only (CUDA: TF32 stays off unless the user turns it on)
    devices = ("cpu", "cuda")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._shape(weight)
        self.register_buffer("weight", weight.detach().float().contiguous())
        self.register_buffer("bias", _bias(bias, torch.float32))
        self.weight_bytes = self.weight.numel() * 4

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False) -> int:
        return 4 * N * K + (4 * N if bias else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


class DenseBF16(LinearImpl):
    name = "dense_bf16"
    description = "bfloat16 weights and activations (native on AVX-512 BF16 / AMX, emulated elsewhere; cuBLAS)"
    tolerance = 0.02  # bf16 rounding of weights, activations and output (8-bit mantissa, ~0.4% each)
    devices = ("cpu", "cuda")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._shape(weight)
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", _bias(bias, torch.bfloat16))
        self.weight_bytes = self.weight.numel() * 2

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False) -> int:
        return 2 * N * K + (2 * N if bias else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)


class TorchInt4BF16(LinearImpl):
    """Torch's weight-only int4: asymmetric min-max groups of 32 along K, w = (q - 8) * scale + zero, activations
    in bfloat16. CPU: torch._weight_int4pack_mm_for_cpu (its SIMD path; float32 activations fall to a scalar
    loop). CUDA (compute capability 8.0+): torch._weight_int4pack_mm, the tinygemm kernel, over the same
    quantized values in its tiled layout (`inner_k_tiles`, the most of 8 / 4 / 2 that divides K by 16 x it)."""

    name = "int4_torch"
    description = "torch weight-only int4 (groups of 32), bf16 activations (CUDA: tinygemm)"
    tolerance = 0.10  # 4-bit weights: ~0.08 for Gaussian weights, plus bf16 activations
    devices = ("cpu", "cuda")
    GROUP = 32

    @classmethod
    def available(cls, probe: dict) -> bool:
        if not super().available(probe):
            return False
        if probe_device(probe) == "cuda":
            return hasattr(torch, "_weight_int4pack_mm") and tuple(probe.get("capability", (0, 0))) >= (8, 0)
        return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")

    @classmethod
    def supports(cls, N: int, K: int) -> bool:
        return K % cls.GROUP == 0 and N % 16 == 0

    @staticmethod
    def inner_k_tiles(K: int) -> int:
        """The CUDA layout's K tiles per super-tile: the most of 8, 4, 2 with K a multiple of 16 x it."""
        return next(t for t in (8, 4, 2) if K % (16 * t) == 0)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._shape(weight)
        w = weight.detach().float()
        N, K = w.shape
        wg = w.view(N, K // self.GROUP, self.GROUP)
        lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K/32]
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(N, K)
        zero = lo + 8 * scale
        if w.is_cuda:  # two 4-bit values per byte, even K index in the high nibble, then tinygemm's tiling
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [N, K / 2]
            packed = torch._convert_weight_to_int4pack(pairs, self.inner_k_tiles(K))
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("packed", packed)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))
        self.register_buffer("bias", _bias(bias, torch.bfloat16))
        self.weight_bytes = N * K // 2 + sz.numel() * 2

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                    bias: torch.Tensor | None = None) -> TorchInt4BF16:
        """A module around the buffers of one built before on the CPU (a cache's stored form): packed [N, K / 2]
        uint8 as torch._convert_weight_to_int4pack_for_cpu returns it (torch-version specific),
        scales_and_zeros [K / 32, N, 2] bf16."""
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.out_features, mod.in_features = int(packed.shape[0]), int(scales_and_zeros.shape[0]) * cls.GROUP
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (mod.out_features, mod.in_features // 2):
            raise ValueError(f"not a packed int4 weight: {tuple(packed.shape)} {packed.dtype}")
        mod.register_buffer("packed", packed.contiguous())
        mod.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
        mod.register_buffer("bias", _bias(bias, torch.bfloat16))
        mod.weight_bytes = packed.numel() + scales_and_zeros.numel() * 2
        return mod

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False) -> int:  # nibbles + bf16 scale and zero per 32
        return N * K // 2 + (K // cls.GROUP) * N * 2 * 2 + (2 * N if bias else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.packed.is_cuda:
            y = torch._weight_int4pack_mm(x2, self.packed, self.GROUP, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.GROUP, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


class TorchInt8BF16(LinearImpl):
    name = "int8_torch"
    description = "torch weight-only int8 (per-channel symmetric), bf16 activations"
    tolerance = 0.03  # 8-bit per-channel weights (~1%) plus bf16 activations
    devices = ("cpu", "cuda")

    @classmethod
    def available(cls, probe: dict) -> bool:
        if not (super().available(probe) and hasattr(torch, "_weight_int8pack_mm")):
            return False
        return probe_device(probe) == "cpu" or _runs_on_cuda(cls)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._shape(weight)
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", _bias(bias, torch.bfloat16))
        self.weight_bytes = w.numel() + scale.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2, self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


class FbgemmDynamicInt8(LinearImpl):
    """fbgemm's dynamically quantized linear: int8 per-channel weights, activations quantized per call over the
    whole [M, K] tensor (so a row's result depends on the other rows: never exact for speculation)."""

    name = "int8_fbgemm_dynamic"
    description = "fbgemm dynamic int8 (per-tensor activations, x86 only)"
    tolerance = 0.05  # 8-bit weights, 7-bit (reduce_range) per-tensor activations

    @classmethod
    def available(cls, probe: dict) -> bool:
        return super().available(probe) and _X86 and "fbgemm" in torch.backends.quantized.supported_engines

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._shape(weight)
        torch.backends.quantized.engine = "fbgemm"
        w = weight.detach().float().contiguous()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()  # [N]
        with warnings.catch_warnings():  # quantized tensor dtypes are deprecated in torch 2.13; still the only way in
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.int64), 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qw, _bias(bias, torch.float32))
        self.weight_bytes = w.numel() + scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, self.in_features).float().contiguous(), self._packed, True)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


class Q4x8(LinearImpl):
    """Ours (q4x8.py, csrc/): int4 weights in Q4_K-style groups of 32 x int8 activations per 256 (Q8_K-style),
    exact per row."""

    name = "q4x8"
    description = "ours: int4 weights x int8 activations, AVX-512 VNNI / AVX2 (C++ extension)"
    tolerance = 0.10  # 4-bit weights (~0.08 for Gaussian weights) plus int8 activations per 256 (~0.007)

    @classmethod
    def available(cls, probe: dict) -> bool:
        flags = probe.get("flags", {})
        if not super().available(probe):
            return False
        if not (flags.get("avx2") and flags.get("fma")) and not flags.get("avx512_vnni"):
            return False  # only the scalar path would run: correct, but never a candidate for speed
        from draftwise.kernels import q4x8

        try:
            q4x8.load()
        except q4x8.KernelBuildError:
            return False
        return True

    @classmethod
    def supports(cls, N: int, K: int) -> bool:
        return K % 32 == 0

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, path: str = "auto"):
        super().__init__()
        from draftwise.kernels.q4x8 import Q4x8Linear

        self._shape(weight)
        self.inner = Q4x8Linear(weight, bias, path=path)
        N, K = weight.shape
        self.weight_bytes = N * K // 2 + N * (K // 32) * 2 + N * (-(-K // 256)) * 8

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False) -> int:  # kernels/q4x8.py packed_bytes: 4.75 bits/weight
        from draftwise.kernels.q4x8 import packed_bytes

        return packed_bytes(N, K) + (4 * N if bias else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        return self.inner(x)


_CUDA_SMOKE: dict[str, bool] = {}


def _runs_on_cuda(cls: type[LinearImpl]) -> bool:
    """Whether `cls` computes on the current CUDA device (a torch build may lack an op's CUDA kernel): one tiny
    call, remembered per process."""
    if cls.name not in _CUDA_SMOKE:
        try:
            w = torch.randn(32, 64, device="cuda")  # [N, K]
            cls(w)(torch.randn(2, 64, device="cuda"))
            torch.cuda.synchronize()
            _CUDA_SMOKE[cls.name] = True
        except (RuntimeError, NotImplementedError, AssertionError):
            _CUDA_SMOKE[cls.name] = False
    return _CUDA_SMOKE[cls.name]


IMPLS: dict[str, type[LinearImpl]] = {
    c.name: c for c in (DenseF32, DenseBF16, TorchInt4BF16, TorchInt8BF16, FbgemmDynamicInt8, Q4x8)
}


def available_impls(probe: dict) -> list[str]:
    """Names of the implementations that can run on the probed machine, in IMPLS order."""
    return [name for name, cls in IMPLS.items() if cls.available(probe)]


FP32_ACTIVATIONS = ("q4x8", "dense_fp32")  # the rest compute in bfloat16


def auto_dtype(step: str) -> str:
    """The model dtype "auto" resolves to when `step` is the step kernel: the one its activations are in."""
    return "float32" if step in FP32_ACTIVATIONS else "bfloat16"


def dense_impl(dtype: str) -> str:
    """The dense implementation of a model dtype ("float32" / "bfloat16"): what takes a weight the chosen kernel
    cannot (`supports` False), and a plan's "dense" prefill."""
    return "dense_bf16" if dtype == "bfloat16" else "dense_fp32"


def make_linear(name: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearImpl:
    """Build implementation `name` from weight [N, K] (fp32 or any float dtype) and bias [N]."""
    if name not in IMPLS:
        raise ValueError(f"unknown linear implementation {name!r} (known: {', '.join(IMPLS)})")
    return IMPLS[name](weight, bias)


def q4x8_everywhere(device: str, kernels: dict | None) -> bool:
    """q4x8 for every width on the CPU (`kernels`: a loaded model's info["kernels"], {"step": .., "prefill": ..}):
    each output row is then bitwise independent of the other rows, of how many there are and of the thread count
    (q4x8 splits work by output column, never a reduction; so do our attention and glue ops) — where the thread
    guard and, by default, the prefix cache run. Torch's dense and int4 kernels may split a reduction by shape or
    thread."""
    kernels = kernels or {}
    return device == "cpu" and {kernels.get("step"), kernels.get("prefill")} == {"q4x8"}

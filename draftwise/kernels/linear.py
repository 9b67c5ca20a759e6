"""The one registry of linear implementations, `LINEARS`: every way draftwise computes y = x W^T + b.

Owns, per implementation (one class each, registered under the name a user types for `--weights`):
  fp32          dense float32 (MKL / oneDNN sgemm; cuBLAS on CUDA)
  bf16          dense bfloat16 (native on AVX-512 BF16 / AMX, emulated elsewhere; cuBLAS)
  int4          torch's weight-only int4, groups of 32 along K, bf16 activations (CPU kernel; tinygemm on CUDA)
  int8          torch's weight-only int8 per output channel, bf16 activations
  int8_dynamic  fbgemm's dynamically quantized int8 (x86): a row depends on the other rows, never chosen
  q4x8          ours: int4 weights x int8 activations (kernels/q4x8.py builds the C++ operator and the format)
  q5x8          ours: GGUF Q5_K weights held exactly (q4x8's layout plus a fifth-bit plane) x int8 activations per 256
  q6k           ours: GGUF Q6_K weights held exactly x int8 activations per 256 (GGUF's Q8_K)
  q6m           ours: GGUF Q2_K weights held exactly (q6k's layout plus a min per 16) x int8 activations per 256
  q3k           ours: GGUF Q3_K weights held exactly (q6k's arithmetic over 3-bit planes) x int8 activations per 256
  q8_0          ours: GGUF Q8_0 / Q5_0 weights held exactly x int8 activations per 32
  q8_1          ours: weights with a min per 32 held exactly as int8 (d * v + m) x int8 activations per 32
  q4c           ours: GGUF Q4_0 / IQ4_NL / IQ4_XS weights held exactly as 4-bit codes x int8 activations per 32
  q5m           ours: GGUF Q4_1 / Q5_1 weights held exactly as 5-bit values with a min x int8 activations per 32
  f16, ...      ours, one per float row of kernels/blocktypes.py: GGUF F16 (...) weights held as stored (16 bits) x
                float32 activations, one fp32 FMA chain per output (csrc/float.h)
and what each declares as class attributes: `devices` it runs on, `dtype` its activations are computed in (the
model dtype "auto" resolves to when it is the step kernel), `row_exact` (by construction: every output row is a
fixed computation of that row alone, whatever other rows share the call and however many threads run it —
q4x8 splits work by output column, never by a reduction), `mergeable` (parts over one input concatenate into
one module bitwise), `tolerance` (documented bound on ||y - y_ref|| / ||y_ref|| against fp32 for Gaussian
weights and activations), `nbytes(N, K)` (its stored layout: `draftwise memory` counts with it), its stored form
(`state` / `from_state`: what a prepared cache holds) and `rows(ids)`: a module computing just the outputs at
`ids`, bitwise this module's (a draft model's trimmed head, spec_decode/draft_model.py).

Also the compositions a plan builds from them: SplitLinear (the step kernel for calls of at most
STEP_MAX_TOKENS tokens per sequence, the prefill kernel above), ConcatLinear (parts that do not merge exactly),
Columns (some outputs of a module computed whole) and `merge` (q/k/v and gate/up into one call where exact).

Knows nothing of models, checkpoints or which implementation a model gets (kernels/plan.py chooses; autotune.py
measures): callers hand it float weights [N, K] and get modules with forward(x [..., K]) -> [..., N] in x's dtype.
"""
from __future__ import annotations

import platform
import warnings
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.kernels import blocktypes, ggml_blocks, library
from draftwise.kernels import q4x8 as q4x8_format

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
STEP_MAX_TOKENS = 12  # calls with at most this many tokens per sequence (decode, verification) run the step kernel
DEQUANT_CHUNK = 8192  # rows dequantized at a time when a dense half is derived from q4x8 (bounds the temporary)


def probe_device(probe: dict) -> str:
    """The device a probe describes ("cpu" for probe.probe(), "cuda" for probe.cuda_probe())."""
    return probe.get("device", "cpu")


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias.detach().to(dtype).contiguous()


def is_prefix(ids: torch.Tensor) -> bool:  # ids [M] int64
    """ids == 0, 1, ..., M - 1: a view of the first M rows serves them."""
    return bool(len(ids)) and bool(torch.equal(ids.cpu(), torch.arange(len(ids))))


class LinearImpl(nn.Module):
    """Base class: subclasses set the class attributes and implement __init__(weight [N, K], bias [N]) and forward."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    tolerance: ClassVar[float] = 0.0
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    dtype: ClassVar[str] = "bfloat16"  # the activations' dtype inside the call
    row_exact: ClassVar[bool] = False  # by construction (others may still measure row-independent: autotune.py)
    mergeable: ClassVar[bool] = False
    row_buffers: ClassVar[tuple[str, ...]] = ()  # buffers whose dim 0 is N: rows(ids) slices them; () = Columns
    out_features: int
    in_features: int

    @classmethod
    def available(cls, probe: dict) -> bool:  # probe: draftwise.kernels.probe.probe() or cuda_probe()
        return probe_device(probe) in cls.devices

    @classmethod
    def supports(cls, N: int, K: int) -> bool:
        return True

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False, kind: str | None = None) -> int:
        """Bytes this implementation's module holds for a weight [N, K] (and a bias [N]): its stored layout; `kind`
        the GGUF type it was built from (from_blocks) where the layout depends on it (the 32-block kernels' scale
        forms), None for a float weight's quantization."""
        raise NotImplementedError(cls.name)

    @property
    def weight_bytes(self) -> int:
        """What one call streams from memory: the stored weight."""
        return self.nbytes(self.out_features, self.in_features)

    def _shape(self, N: int, K: int) -> None:
        self.out_features, self.in_features = int(N), int(K)
        if not self.supports(self.out_features, self.in_features):
            raise ValueError(f"{self.name} does not support shape N={self.out_features}, K={self.in_features}")

    def _weight_shape(self, weight: torch.Tensor) -> None:  # weight [N, K]
        if weight.dim() != 2:
            raise ValueError(f"weight must be [N, K], got {tuple(weight.shape)}")
        self._shape(*weight.shape)

    # ---- the stored form: buffers as they are, rebuilt without quantizing ------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors a cache stores to rebuild this module (`from_state`)."""
        return {n: t for n, t in self._buffers.items() if t is not None}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], N: int, K: int) -> LinearImpl:
        """A module around stored buffers (`state`'s output, or views of another module's): no copy."""
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod._shape(N, K)
        for n in cls.stored_buffers():
            mod.register_buffer(n, tensors.get(n))
        return mod

    @classmethod
    def stored_buffers(cls) -> tuple[str, ...]:
        return cls.row_buffers

    # ---- some outputs only ------------------------------------------------------------------------------------
    def rows(self, ids: torch.Tensor) -> nn.Module:  # ids [M] int64 -> module x [..., K] -> [..., M]
        """This module's outputs at `ids`, bitwise: a view of the first M weight rows when ids is a prefix,
        the gathered rows otherwise; Columns (computed whole, then picked) where the layout has no rows."""
        if not self.row_buffers:
            return Columns(self, ids)
        pick = (lambda t: t[: len(ids)]) if is_prefix(ids) else (lambda t: t.index_select(0, ids.to(t.device)))
        return type(self).from_state({n: pick(t) for n, t in self.state().items()}, len(ids), self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class DenseF32(LinearImpl):
    name = "fp32"
    description = "float32 weights and activations (MKL / oneDNN sgemm; cuBLAS on CUDA)"
    tolerance = 1e-5  # summation order only (CUDA: TF32 stays off unless the user turns it on)
    devices = ("cpu", "cuda")
    dtype = "float32"
    row_buffers = ("weight", "bias")
    storage = torch.float32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._weight_shape(weight)
        self.register_buffer("weight", weight.detach().to(self.storage).contiguous())
        self.register_buffer("bias", _bias(bias, self.storage))

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False, kind: str | None = None) -> int:
        size = torch.finfo(cls.storage).bits // 8
        return size * N * K + (size * N if bias else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        return F.linear(x.to(self.storage), self.weight, self.bias).to(x.dtype)


class DenseBF16(DenseF32):
    name = "bf16"
    description = "bfloat16 weights and activations (native on AVX-512 BF16 / AMX, emulated elsewhere; cuBLAS)"
    tolerance = 0.02  # bf16 rounding of weights, activations and output (8-bit mantissa, ~0.4% each)
    dtype = "bfloat16"
    storage = torch.bfloat16


class TorchInt4(LinearImpl):
    """Torch's weight-only int4: asymmetric min-max groups of 32 along K, w = (q - 8) * scale + zero, activations
    in bfloat16. CPU: torch._weight_int4pack_mm_for_cpu (its SIMD path; float32 activations fall to a scalar
    loop). CUDA (compute capability 8.0+): torch._weight_int4pack_mm, the tinygemm kernel, over the same
    quantized values in its tiled layout (`inner_k_tiles`, the most of 8 / 4 / 2 that divides K by 16 x it).
    The packed layout is torch-version specific and opaque: `rows` computes the whole output (Columns)."""

    name = "int4"
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

    @classmethod
    def stored_buffers(cls) -> tuple[str, ...]:
        return ("packed", "scales_and_zeros", "bias")

    @staticmethod
    def inner_k_tiles(K: int) -> int:
        """The CUDA layout's K tiles per super-tile: the most of 8, 4, 2 with K a multiple of 16 x it."""
        return next(t for t in (8, 4, 2) if K % (16 * t) == 0)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._weight_shape(weight)
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

    @classmethod
    # nibbles + bf16 scale and zero per 32
    def nbytes(cls, N: int, K: int, bias: bool = False, kind: str | None = None) -> int:
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


class TorchInt8(LinearImpl):
    name = "int8"
    description = "torch weight-only int8 (per-channel symmetric), bf16 activations"
    tolerance = 0.03  # 8-bit per-channel weights (~1%) plus bf16 activations
    devices = ("cpu", "cuda")
    row_buffers = ("qweight", "scale", "bias")

    @classmethod
    def available(cls, probe: dict) -> bool:
        if not (super().available(probe) and hasattr(torch, "_weight_int8pack_mm")):
            return False
        return probe_device(probe) == "cpu" or _runs_on_cuda(cls)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._weight_shape(weight)
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", _bias(bias, torch.bfloat16))

    @classmethod
    # int8 weights + a bf16 scale per row
    def nbytes(cls, N: int, K: int, bias: bool = False, kind: str | None = None) -> int:
        return N * K + 2 * N + (2 * N if bias else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2, self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


class FbgemmDynamicInt8(LinearImpl):
    """fbgemm's dynamically quantized linear: int8 per-channel weights, activations quantized per call over the
    whole [M, K] tensor (so a row's result depends on the other rows: never exact for speculation). Its packed
    weight is an opaque object: no stored form, so a prepared cache never holds it."""

    name = "int8_dynamic"
    description = "fbgemm dynamic int8 (per-tensor activations, x86 only)"
    tolerance = 0.05  # 8-bit weights, 7-bit (reduce_range) per-tensor activations
    dtype = "float32"

    @classmethod
    def available(cls, probe: dict) -> bool:
        return super().available(probe) and _X86 and "fbgemm" in torch.backends.quantized.supported_engines

    @classmethod
    def stored_buffers(cls) -> tuple[str, ...]:
        raise NotImplementedError(f"{cls.name} has no stored form")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._weight_shape(weight)
        torch.backends.quantized.engine = "fbgemm"
        w = weight.detach().float().contiguous()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()  # [N]
        with warnings.catch_warnings():  # quantized tensor dtypes are deprecated in torch 2.13; still the only way in
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.int64), 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qw, _bias(bias, torch.float32))

    @classmethod
    # int8 weights + a float32 scale per row
    def nbytes(cls, N: int, K: int, bias: bool = False, kind: str | None = None) -> int:
        return N * K + 4 * N + (4 * N if bias else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, self.in_features).float().contiguous(), self._packed, True)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


_OP: list = []


def _q4x8_op():
    """torch.ops.draftwise_q4x8.linear.default, resolved once (the attribute chain costs microseconds per call)."""
    if not _OP:
        _OP.append(library.load().linear.default)
    return _OP[0]


class Q4x8Linear(LinearImpl):
    """Ours: y = x W^T + b with W in q4x8's int4 format (kernels/q4x8.py: Q4_K-style groups of 32, packed in
    16-column blocks) and x quantized to int8 per row (one scale per 256 K values) on the fly, by the C++
    operator (AVX-512 VNNI / AVX2 / portable, chosen by cpuid; every path bitwise the same).

    Q4x8Linear(weight [N, K] float, bias [N] | None, path="auto") quantizes `weight`; `from_parts(parts, bias)`
    takes `quantize_q4` / `q4k_parts` output as it is (exact for Q4_K); `from_state` takes packed buffers.
    forward(x [..., K] any float dtype) -> [..., N] in x's dtype. `path` ("auto", "avx512", "avx2", "scalar")
    exists for tests and benchmarks."""

    name = "q4x8"
    description = "ours: int4 weights x int8 activations, AVX-512 VNNI / AVX2 (C++ extension)"
    tolerance = 0.10  # 4-bit weights (~0.08 for Gaussian weights) plus int8 activations per 256 (~0.007)
    dtype = "float32"  # it quantizes float32 activations itself
    row_exact = True  # a column is computed from its own block and the row's int8 activations alone
    mergeable = True
    PACKED = q4x8_format.PACKED  # the buffers `pack` returns, as a module's state holds them

    @classmethod
    def available(cls, probe: dict) -> bool:
        flags = probe.get("flags", {})
        if not super().available(probe):
            return False
        if not (flags.get("avx2") and flags.get("fma")) and not flags.get("avx512_vnni"):
            return False  # only the scalar path would run: correct, but never a candidate for speed
        try:
            library.load()
        except library.KernelBuildError:
            return False
        return True

    @classmethod
    def supports(cls, N: int, K: int) -> bool:
        return K % q4x8_format.GROUP == 0

    @classmethod
    # kernels/q4x8.py packed_bytes: 4.75 bits/weight
    def nbytes(cls, N: int, K: int, bias: bool = False, kind: str | None = None) -> int:
        return q4x8_format.packed_bytes(N, K) + (4 * N if bias else 0)

    @classmethod
    def stored_buffers(cls) -> tuple[str, ...]:
        return (*cls.PACKED, "bias")

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, path: str = "auto",
                 parts: dict | None = None):
        super().__init__()
        if parts is None:
            parts = q4x8_format.quantize_q4(weight)
        library.load()
        library.check_path(path)
        self._shape(*parts["q"].shape)
        self.path = path
        for name, t in q4x8_format.pack(parts).items():
            self.register_buffer(name, t)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_parts(cls, parts: dict, bias: torch.Tensor | None = None, path: str = "auto") -> Q4x8Linear:
        return cls(bias=bias, path=path, parts=parts)

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], N: int, K: int | None = None) -> Q4x8Linear:
        """A module around tensors `pack` returned (or a module's buffers read back from a cache): no quantizing,
        no packing. packed [NB, G, 4, 64] uint8 gives K = G * 32; N <= NB * 16."""
        library.load()
        packed = tensors["packed"]
        if packed.dim() != 4 or packed.dtype != torch.uint8 or not 0 < N <= packed.shape[0] * q4x8_format.COLS:
            raise ValueError(f"not a packed q4x8 weight for N={N}: {tuple(packed.shape)} {packed.dtype}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod._shape(N, packed.shape[1] * q4x8_format.GROUP)
        mod.path = "auto"
        for name in cls.PACKED:
            mod.register_buffer(name, tensors[name].contiguous())
        bias = tensors.get("bias")
        mod.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        b = self._buffers  # read directly: five nn.Module.__getattr__ lookups cost more than a small call's kernel
        y = _q4x8_op()(x2, b["packed"], b["sc"], b["mn"], b["d"], b["dmin"], b["bias"], self.out_features,
                       library.PATHS[self.path])
        y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _with_path(self, mod: Q4x8Linear) -> Q4x8Linear:
        mod.path = self.path
        return mod

    def rows(self, ids: torch.Tensor) -> nn.Module:  # ids [M] int64 -> module x [..., K] -> [..., M]
        """A prefix: the first ceil(M / 16) blocks of every packed buffer, a view (no copy). Otherwise the
        16-column blocks holding `ids` (copied: a few blocks) with each id's column picked. Bitwise this module's
        outputs: a column is computed from its own block and the row's int8 activations alone (quantized per
        row, independently of N)."""
        cols = q4x8_format.COLS
        b = self._buffers
        if is_prefix(ids):
            n = len(ids)
            if n > self.out_features:
                raise ValueError(f"rows of a q4x8 linear with {self.out_features} outputs: {n}")
            nb = -(-n // cols)
            tensors = {name: b[name][:nb] for name in self.PACKED}
            tensors["bias"] = None if b["bias"] is None else b["bias"][:n]
            return self._with_path(Q4x8Linear.from_state(tensors, n))
        blocks, inverse = torch.unique(ids // cols, return_inverse=True)  # [nb], [M]
        tensors = {name: b[name].index_select(0, blocks.to(b[name].device)) for name in self.PACKED}
        if b["bias"] is not None:  # padding columns past out_features get 0
            bias = torch.zeros(len(blocks) * cols, device=b["bias"].device)
            span = blocks[:, None] * cols + torch.arange(cols)  # [nb, 16]
            real = span < self.out_features
            bias.view(-1, cols)[real] = b["bias"][span[real]]
            tensors["bias"] = bias
        whole = self._with_path(Q4x8Linear.from_state(tensors, len(blocks) * cols))
        return Columns(whole, inverse * cols + ids % cols)

    @classmethod
    def concat(cls, parts: list[Q4x8Linear]) -> Q4x8Linear | None:
        """One module bitwise torch.cat([p(x) for p in parts], -1): the packed layout is per 16-column block and
        the activations are quantized per row, independently of N, so concatenating the blocks along N is exact
        when every part but the last has N % 16 == 0 (no padding columns in the middle); a missing bias is a
        zero one (the kernel adds 0 without one). None where that does not hold."""
        if len({(p.in_features, p.path, p.packed.device) for p in parts}) != 1:
            return None
        if any(p.out_features % q4x8_format.COLS for p in parts[:-1]):
            return None
        tensors = {n: cat_rows([getattr(p, n) for p in parts]) for n in cls.PACKED}
        if any(p.bias is not None for p in parts):
            tensors["bias"] = cat_rows([p.bias if p.bias is not None else torch.zeros(p.out_features,
                                                                                         device=p.packed.device)
                                         for p in parts])
        merged = cls.from_state(tensors, sum(p.out_features for p in parts))
        merged.path = parts[0].path
        return merged

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}"


class _BlockLinear(LinearImpl):
    """Shared by our GGUF block kernels (Q6KLinear, Q80Linear): weights packed per 16 output columns
    (kernels/ggml_blocks.py), activations quantized per row inside the C++ operator, work split by column block
    (so every row is exact by construction, as q4x8). Subclasses set PACKED (the buffers of the layout, dim 0 the
    16-column block) in the operator's argument order, K_BLOCK (K values per block), K_PART (the part whose dim 1
    is K) and GGUF_TYPES; the layout's functions are ggml_blocks' `quantize_`, `pack_`, `unpack_`, `dequantize_`
    and `_bytes` of the kernel's name, and its operator is the library's op of that name."""

    dtype = "float32"
    row_exact = True
    mergeable = True
    PACKED: ClassVar[tuple[str, ...]] = ()
    GGUF_TYPES: ClassVar[tuple[str, ...]] = ()  # the GGUF block types this kernel holds exactly
    K_BLOCK: ClassVar[int] = 32
    K_PART: ClassVar[str] = "v"

    @classmethod
    def supports(cls, N: int, K: int) -> bool:
        return K % cls.K_BLOCK == 0

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False, kind: str | None = None) -> int:
        layout = getattr(ggml_blocks, f"{cls.name}_bytes")
        if blocktypes.KERNELS[cls.name].scale_terms:  # csrc/q8_0.h's kernels: the scales in the type's form
            return layout(N, K, blocktypes.scale_form(kind)) + (4 * N if bias else 0)
        return layout(N, K) + (4 * N if bias else 0)

    @property
    def weight_bytes(self) -> int:
        """What one call streams from memory: the packed buffers as held (their scale form is the parts')."""
        return sum(self._buffers[n].numel() * self._buffers[n].element_size() for n in self.PACKED)

    @classmethod
    def _quantize(cls, weight: torch.Tensor) -> dict:
        return getattr(ggml_blocks, f"quantize_{cls.name}")(weight)

    @classmethod
    def _k_of(cls, parts: dict) -> int:
        return parts[cls.K_PART].shape[1]

    @classmethod
    def _pack(cls, parts: dict) -> dict:
        return getattr(ggml_blocks, f"pack_{cls.name}")(parts)

    @classmethod
    def _dense(cls, buffers: dict, b0: int, b1: int) -> torch.Tensor:
        unpacked = getattr(ggml_blocks, f"unpack_{cls.name}")(buffers, b0, b1)
        return getattr(ggml_blocks, f"dequantize_{cls.name}")(unpacked)

    def _call(self, x2: torch.Tensor) -> torch.Tensor:  # x2 [M, K] float32 -> [M, N]
        b = self._buffers
        return _block_op(self.name)(x2, *(b[n] for n in self.PACKED), b["bias"], self.out_features,
                                    library.PATHS[self.path])

    @classmethod
    def available(cls, probe: dict) -> bool:
        if not super().available(probe):
            return False
        try:
            library.load()
        except library.KernelBuildError:
            return False
        return True

    @classmethod
    def stored_buffers(cls) -> tuple[str, ...]:
        return (*cls.PACKED, "bias")

    def __init__(self, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, path: str = "auto",
                 parts: dict | None = None):
        super().__init__()
        if parts is None:
            self._weight_shape(weight)
            parts = self._quantize(weight)
        library.load()
        library.check_path(path)
        first = next(iter(parts.values()))
        self._shape(first.shape[0], self._k_of(parts))
        self.path = path
        for name, t in self._pack(parts).items():
            self.register_buffer(name, t)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def parts_from_blocks(cls, kind: str, blocks, N: int, K: int) -> dict:
        """A GGUF tensor's raw blocks of type `kind` (one of GGUF_TYPES) -> the parts this kernel packs, exactly."""
        if kind not in cls.GGUF_TYPES:
            raise ValueError(f"{cls.name} holds {', '.join(cls.GGUF_TYPES)} blocks, not {kind}")
        return cls._parts_of(kind, blocks, N, K)

    @classmethod
    def _parts_of(cls, kind: str, blocks, N: int, K: int) -> dict:
        """parts_from_blocks once `kind` is known to be this kernel's: the table's reader of its blocks."""
        return ggml_blocks.FROM_BLOCKS[kind](blocks, N, K)

    @classmethod
    def from_blocks(cls, kind: str, blocks, N: int, K: int, bias: torch.Tensor | None = None) -> _BlockLinear:
        """A GGUF tensor's raw blocks of type `kind` (one of GGUF_TYPES), held exactly."""
        return cls(bias=bias, parts=cls.parts_from_blocks(kind, blocks, N, K))

    @classmethod
    def _packed_k(cls, first: torch.Tensor) -> int | None:  # first: the first PACKED buffer
        """K of a packed weight from its first buffer ([NB, G, ...]: G groups of 32), None if not this layout."""
        return first.shape[1] * 32 if first.dim() == 4 else None

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], N: int, K: int | None = None) -> _BlockLinear:
        library.load()
        first = tensors[cls.PACKED[0]]
        packed_k = cls._packed_k(first)
        if packed_k is None or not 0 < N <= first.shape[0] * ggml_blocks.COLS:
            raise ValueError(f"not a packed {cls.name} weight for N={N}: {tuple(first.shape)}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod._shape(N, packed_k)
        mod.path = "auto"
        for name in cls.PACKED:
            mod.register_buffer(name, tensors[name].contiguous())
        bias = tensors.get("bias")
        mod.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        y = self._call(x2).view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dense_rows(self, n0: int, n1: int) -> torch.Tensor:  # -> [n1 - n0, K] float32
        """Weight rows n0 .. n1 - 1 in float32, exactly the values the kernel computes with (what a GGUF of these
        blocks dequantizes to)."""
        b0, b1 = n0 // ggml_blocks.COLS, -(-n1 // ggml_blocks.COLS)
        w = self._dense(self._buffers, b0, b1)
        return w[n0 - b0 * ggml_blocks.COLS:n1 - b0 * ggml_blocks.COLS]

    def _with_path(self, mod: _BlockLinear) -> _BlockLinear:
        mod.path = self.path
        return mod

    def rows(self, ids: torch.Tensor) -> nn.Module:  # ids [M] int64 -> module x [..., K] -> [..., M]
        """As Q4x8Linear.rows: a prefix is a view of the first blocks; other ids gather their 16-column blocks
        and pick columns. Bitwise this module's outputs (a column depends on its block and the row only)."""
        cols, b = ggml_blocks.COLS, self._buffers
        if is_prefix(ids):
            n = len(ids)
            if n > self.out_features:
                raise ValueError(f"rows of a {self.name} linear with {self.out_features} outputs: {n}")
            tensors = {name: b[name][:-(-n // cols)] for name in self.PACKED}
            tensors["bias"] = None if b["bias"] is None else b["bias"][:n]
            return self._with_path(type(self).from_state(tensors, n))
        blocks, inverse = torch.unique(ids // cols, return_inverse=True)  # [nb], [M]
        tensors = {name: b[name].index_select(0, blocks) for name in self.PACKED}
        if b["bias"] is not None:
            bias = torch.zeros(len(blocks) * cols)
            span = blocks[:, None] * cols + torch.arange(cols)  # [nb, 16]
            real = span < self.out_features
            bias.view(-1, cols)[real] = b["bias"][span[real]]
            tensors["bias"] = bias
        whole = self._with_path(type(self).from_state(tensors, len(blocks) * cols))
        return Columns(whole, inverse * cols + ids % cols)

    @classmethod
    def concat(cls, parts: list[_BlockLinear]) -> _BlockLinear | None:
        """Bitwise torch.cat of the parts' outputs when every part but the last fills its 16-column blocks (as
        Q4x8Linear.concat) and the parts hold their scales in one form; None otherwise."""
        if len({(p.in_features, p.path, *(p._buffers[n].dtype for n in cls.PACKED)) for p in parts}) != 1:
            return None  # (the dtypes: csrc/q8_0.h's scale forms differ between parts)
        if any(p.out_features % ggml_blocks.COLS for p in parts[:-1]):
            return None
        tensors = {n: cat_rows([getattr(p, n) for p in parts]) for n in cls.PACKED}
        if any(p.bias is not None for p in parts):
            tensors["bias"] = cat_rows([p.bias if p.bias is not None else torch.zeros(p.out_features)
                                         for p in parts])
        merged = cls.from_state(tensors, sum(p.out_features for p in parts))
        merged.path = parts[0].path
        return merged

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}"


class Q5X8Linear(_BlockLinear):
    """Ours: GGUF Q5_K weights held exactly as q4x8 holds Q4_K (csrc/q4x8.h: the low 4 bits packed as q4x8's nibbles,
    6-bit sub-scales and mins, fp32 d and dmin per 256) plus a fifth-bit plane (qh, 1 bit per weight: 5.75 bits held),
    w = d * sc * q - dmin * mn with q in 0..31 (kernels/ggml_blocks.py pack_q5x8) x int8 activations per row and 256 K
    values (GGUF's Q8_K, as llama.cpp's CPU dot product of Q5_K); AVX-512 VNNI / AVX2 / scalar, bitwise the same; path
    'auto' calls of many rows take the wide side (csrc/gemm_q4x8.cpp: the AVX-512 GEMV's tile over row chunks; no AMX
    side; the q5x8 linear op hands them over; the same rows). Q5X8Linear(weight [N, K], bias) quantizes a float
    weight Q5_K-style (kernels/q4x8.py quantize_q4 with 5 bits); `from_blocks` takes the type's blocks as they are."""

    name = "q5x8"
    description = "ours: GGUF Q5_K weights (exact) x int8 activations per 256, AVX-512 VNNI / AVX2"
    tolerance = 0.06  # 5-bit min-max weights per 32 (~0.04 for Gaussian weights) plus int8 activations per 256
    PACKED = ("packed", "qh", "sc", "mn", "d", "dmin")
    GGUF_TYPES = blocktypes.types_of("q5x8")
    K_PART = "q"


class Q6KLinear(_BlockLinear):
    """Ours: GGUF Q6_K weights held exactly (kernels/ggml_blocks.py, csrc/q6k.h) x int8 activations per row and
    256 K values (GGUF's Q8_K, as llama.cpp's CPU dot product of Q6_K); AVX-512 VNNI / AVX2 / scalar, bitwise
    the same. Q6KLinear(weight [N, K], bias) quantizes a float weight (a simple max-abs Q6_K); `from_blocks`
    takes a GGUF tensor's blocks as they are. forward(x [..., K]) -> [..., N] in x's dtype."""

    name = "q6k"
    description = "ours: GGUF Q6_K weights (exact) x int8 activations per 256, AVX-512 VNNI / AVX2"
    tolerance = 0.03  # 6-bit weights (~0.02 for Gaussian weights) plus int8 activations per 256 (~0.007)
    PACKED = ("ql", "qh", "sc", "d")
    GGUF_TYPES = blocktypes.types_of("q6k")
    K_BLOCK, K_PART = ggml_blocks.QK_K, "q"

    def _call(self, x2: torch.Tensor) -> torch.Tensor:  # x2 [M, K] float32 -> [M, N]
        b = self._buffers
        if self.path == "auto" and x2.shape[0] > 1 and _q6k_wide_takes(x2.shape[0]):
            # the wide GEMM (csrc/gemm_q6k*.cpp: AMX, or VNNI over row chunks): bitwise the GEMV's rows, faster from the measured width on
            return _q6k_wide()(x2, b["ql"], b["qh"], b["sc"], b["d"], b["bias"], self.out_features)
        return super()._call(x2)


class Q6MLinear(_BlockLinear):
    """Ours: GGUF Q2_K weights held exactly as Q6KLinear holds Q6_K (2-bit values as q6k's 6-bit ones, d * sc per 16)
    plus a min term per 16, w = d * sc * (q - 32) - dmin * m (kernels/ggml_blocks.py pack_q6m, csrc/q6k.h) x int8
    activations per row and 256 K values with their sums per 16 (GGUF's Q8_K, as llama.cpp's CPU dot product of
    Q2_K); AVX-512 VNNI / AVX2 / scalar, bitwise the same; path 'auto' calls of many rows take the wide side
    (csrc/gemm_q6k.cpp: q6k's VNNI side with the min term; the q6m linear op hands them over; the same rows).
    Q6MLinear(weight [N, K], bias) quantizes a float weight as a simple Q2_K; `from_blocks` takes the type's blocks
    as they are."""

    name = "q6m"
    description = "ours: GGUF Q2_K weights (exact) x int8 activations per 256, AVX-512 VNNI / AVX2"
    tolerance = 0.4  # 2-bit min-max weights per 16 (measured 0.30-0.33 for Gaussian weights) plus int8 activations
    # per 256 (~0.007)
    PACKED = ("ql", "qh", "sc", "d", "mn", "dmin")
    GGUF_TYPES = blocktypes.types_of("q6m")
    K_BLOCK, K_PART = Q6KLinear.K_BLOCK, Q6KLinear.K_PART


class Q3KLinear(_BlockLinear):
    """Ours: GGUF Q3_K weights held exactly at their own width (kernels/ggml_blocks.py pack_q3k: a 2-bit and a 1-bit
    plane, q - 4 with q6k's int8 scale per 16 and float32 d per 256; csrc/q6k.h, q6k's code over these planes) x int8
    activations per row and 256 K values (GGUF's Q8_K, as llama.cpp's CPU dot product of Q3_K); AVX-512 VNNI /
    AVX2 / scalar, bitwise the same, and bitwise what q6k computed holding Q3_K as Q6_K values; path 'auto' calls of
    many rows take the wide side (csrc/gemm_q6k.cpp: the VNNI side, also on AMX CPUs; the q3k linear op hands them
    over; the same rows). Q3KLinear(weight [N, K], bias) quantizes a float weight as a simple 3-bit max-abs
    Q3_K; `from_blocks` takes the type's blocks as they are."""

    name = "q3k"
    description = "ours: GGUF Q3_K weights (exact) x int8 activations per 256, AVX-512 VNNI / AVX2"
    tolerance = 0.25  # 3-bit max-abs weights per 16 (steps of amax / 3) plus int8 activations per 256 (~0.007)
    PACKED = ("ql", "qh", "sc", "d")
    GGUF_TYPES = blocktypes.types_of("q3k")
    K_BLOCK, K_PART = Q6KLinear.K_BLOCK, Q6KLinear.K_PART


class Q80Linear(_BlockLinear):
    """Ours: GGUF Q8_0 or Q5_0 weights (any int8-per-32 parts: Q4_0 / IQ4 blocks too) held exactly as int8 per 32 with a scale (kernels/ggml_blocks.py,
    csrc/q8_0.h) x int8 activations per row and 32 K values (GGUF's Q8_0, as llama.cpp's CPU dot products of
    these types); AVX-512 VNNI / AVX2 / scalar, bitwise the same. Q80Linear(weight [N, K], bias) quantizes a float
    weight as ggml's Q8_0; `from_blocks` takes its types' blocks (kernels/blocktypes.py) as they are."""

    name = "q8_0"
    description = "ours: GGUF Q8_0 / Q5_0 weights (exact) x int8 activations per 32, AVX-512 VNNI / AVX2"
    tolerance = 0.02  # 8-bit weights (~0.005) plus int8 activations per 32 (~0.006)
    PACKED = ("qw", "d")
    GGUF_TYPES = blocktypes.types_of("q8_0")


class Q81Linear(_BlockLinear):
    """Ours: weights with a min per 32 (GGUF Q4_1, Q5_1 parts; the table holds those types on q5m) held exactly as int8 per 32 with a scale and a min, w = d * v + m
    (kernels/ggml_blocks.py, csrc/q8_0.h's min term) x int8 activations per row and 32 K values with their sums
    (GGUF's Q8_1, as llama.cpp pairs Q4_1 / Q5_1); AVX-512 VNNI / AVX2 /
    scalar, bitwise the same. Q81Linear(weight [N, K], bias) quantizes a float weight as ggml's Q5_1;
    `from_blocks` takes the types' blocks as they are."""

    name = "q8_1"
    description = "ours: weights with a min per 32 (exact, int8) x int8 activations per 32, AVX-512 VNNI / AVX2"
    tolerance = 0.06  # 5-bit min-max weights per 32 (steps of range / 31: ~0.04 for Gaussian weights, measured
    # 0.042 at worst on tests/test_kernels.py's shapes) plus int8 activations per 32 (~0.006)
    PACKED = ("qw", "d", "m")
    GGUF_TYPES = blocktypes.types_of("q8_1")


class Q4CLinear(_BlockLinear):
    """Ours: GGUF Q4_0, IQ4_NL and IQ4_XS weights held exactly as 4-bit codes into a 16-entry table of int8 values with
    a scale per 32 (fp16 as stored: 4.5 bits per weight; IQ4_XS: an int8 per 32 times an fp16 per 256, 4.3125;
    a float weight's quantization: float32, 5; kernels/ggml_blocks.py pack_q4c, csrc/q8_0.h's codes form) x int8
    activations per row and 32 K values (GGUF's Q8_0, as llama.cpp pairs these types): bitwise what q8_0 computes
    with the same blocks held as bytes; AVX-512 VNNI / AVX2 / scalar, bitwise the same. Q4CLinear(weight [N, K],
    bias) quantizes a float weight as ggml's Q4_0; `from_blocks` takes the types' blocks as they are."""

    name = "q4c"
    description = "ours: GGUF Q4_0 / IQ4 weights (exact, 4-bit codes) x int8 activations per 32, AVX-512 VNNI / AVX2"
    tolerance = 0.15  # 4-bit weights per 32 (~0.11 for Gaussian weights) plus int8 activations per 32 (~0.006)
    PACKED = ("qs", "lut", "d")
    GGUF_TYPES = blocktypes.types_of("q4c")


class Q5MLinear(_BlockLinear):
    """Ours: GGUF Q4_1 and Q5_1 weights held exactly as 5-bit values (4-bit codes plus a fifth-bit plane) with
    a scale and min per 32, w = d * v + m (fp16 as stored: 6 bits per weight; parts with int8s per 32 times fp16s per
    256: 5.625; a float weight's quantization: float32, 7; kernels/ggml_blocks.py pack_q5m, csrc/q8_0.h)
    x int8 activations per row and 32 K values with their sums (GGUF's Q8_1): bitwise what q8_1 computes with the
    same blocks held as bytes; AVX-512 VNNI / AVX2 / scalar, bitwise the same. Q5MLinear(weight [N, K], bias)
    quantizes a float weight as ggml's Q5_1; `from_blocks` takes the types' blocks as they are."""

    name = "q5m"
    description = "ours: GGUF Q4_1 / Q5_1 weights (exact, 5-bit) x int8 activations per 32, AVX-512 VNNI / AVX2"
    tolerance = Q81Linear.tolerance
    PACKED = ("qs", "qh", "lut", "d", "m")
    GGUF_TYPES = blocktypes.types_of("q5m")


class _FloatLinear(_BlockLinear):
    """Ours, one per float row of kernels/blocktypes.py (`element` set: F16 -> f16): the weight held as the file's
    16-bit values, 2 bytes per weight, packed per 16 output columns (w [NB, K, 16] of the element dtype, the
    stored bits; csrc/float.h) x float32 activations as they are (finer than llama.cpp's CPU path, which rounds the activations
    to the weight's 16-bit type), one float32 FMA chain per output in K order on every path (scalar, AVX2 with
    F16C, AVX-512): every path, width and thread count give bitwise the same row. FloatLinear(weight [N, K], bias)
    rounds a float weight to the type (round to nearest even); `from_blocks` takes a GGUF tensor's stored values
    as they are. The class of each row is made here from the row (`_float_linear`), so a float type is one table
    row plus its csrc/<name>.h."""

    PACKED = ("w",)
    K_BLOCK = 1
    K_PART = "w"
    ELEMENT: ClassVar[torch.dtype] = torch.float16

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False, kind: str | None = None) -> int:
        return -(-N // ggml_blocks.COLS) * ggml_blocks.COLS * K * 2 + (4 * N if bias else 0)

    @classmethod
    def _quantize(cls, weight: torch.Tensor) -> dict:  # weight [N, K] float
        return {"w": weight.detach().to(cls.ELEMENT)}

    @classmethod
    def _pack(cls, parts: dict) -> dict:  # parts["w"] [N, K] ELEMENT -> w [NB, K, 16] ELEMENT
        w = parts["w"]
        N, K = w.shape
        return {"w": ggml_blocks._pad(w, N).view(-1, ggml_blocks.COLS, K).transpose(1, 2).contiguous()}

    @classmethod
    def _dense(cls, buffers: dict, b0: int, b1: int) -> torch.Tensor:  # -> [(b1 - b0) * 16, K] float32
        w = buffers["w"][b0:b1]
        return w.transpose(1, 2).reshape(-1, w.shape[1]).float()

    @classmethod
    def _packed_k(cls, first: torch.Tensor) -> int | None:
        return first.shape[1] if first.dim() == 3 and first.shape[2] == ggml_blocks.COLS else None

    @classmethod
    def _parts_of(cls, kind: str, blocks, N: int, K: int) -> dict:
        """A GGUF tensor of type `kind` (one of GGUF_TYPES): its stored 16-bit values (raw bytes, N rows of 2 K)
        -> w [N, K] ELEMENT, as they are."""
        raw = torch.as_tensor(blocks).reshape(-1).view(torch.uint8)
        if raw.numel() != N * K * 2:
            raise ValueError(f"{kind} tensor [{N}, {K}] needs {N * K * 2} bytes, got {raw.numel()}")
        return {"w": raw.view(cls.ELEMENT).reshape(N, K)}


def _float_linear(k: blocktypes.Kernel) -> type[_FloatLinear]:
    """The linear of a float row of the table: its name, element dtype and types; its tolerance (Gaussian weights
    against fp32) two of its element's epsilons (the weight's rounding; the fp32 chain adds far less)."""
    element = getattr(torch, k.element)
    types = blocktypes.types_of(k.name)
    return type(f"Float{k.name.upper()}Linear", (_FloatLinear,), {
        "name": k.name, "ELEMENT": element, "GGUF_TYPES": types, "tolerance": 2 * torch.finfo(element).eps,
        "__doc__": f"_FloatLinear for {', '.join(types)} ({k.element} values held as stored).",
        "description": f"ours: GGUF {' / '.join(types)} weights (as stored, {k.element}) x float32 activations, "
                       "one fp32 FMA chain per output; AVX-512 / AVX2"})


FLOAT_LINEARS = tuple(_float_linear(k) for k in blocktypes.KERNELS.values() if k.element)

_BLOCK_OPS: dict[str, object] = {}


def _block_op(name: str):
    """torch.ops.draftwise_<name>.linear.default, resolved once."""
    if name not in _BLOCK_OPS:
        library.load()
        _BLOCK_OPS[name] = getattr(torch.ops, f"draftwise_{name}").linear.default
    return _BLOCK_OPS[name]


def _q6k_wide_takes(rows: int) -> bool:
    """Whether a path-'auto' Q6_K call of `rows` rows goes to the wide kernel (AMX or VNNI: q4x8.wide_min_rows)."""
    return torch.ops.draftwise_q6k.wide_takes(rows)


def _q6k_wide():
    if "q6k_wide" not in _BLOCK_OPS:
        library.load()
        _BLOCK_OPS["q6k_wide"] = torch.ops.draftwise_q6k.wide.default
    return _BLOCK_OPS["q6k_wide"]


def block_paths(name: str) -> list[str]:
    """The ISA paths the `name` ("q6k", "q8_0") operator can run on this CPU, slowest first."""
    library.load()
    return library.path_names(getattr(torch.ops, f"draftwise_{name}").paths())


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


_IMPLS = (DenseF32, DenseBF16, TorchInt4, TorchInt8, FbgemmDynamicInt8, Q4x8Linear, Q5X8Linear, Q6KLinear, Q6MLinear,
          Q3KLinear, Q80Linear,
          Q81Linear, Q4CLinear, Q5MLinear, *FLOAT_LINEARS)
LINEARS: dict[str, type[LinearImpl]] = {c.name: c for c in _IMPLS}
if len(LINEARS) != len(_IMPLS):  # one name means one thing: a table row may not take an implementation's name
    raise RuntimeError(f"two linear implementations share a name: {sorted(c.name for c in _IMPLS)}")


def available(probe: dict) -> list[str]:
    """Names of the implementations that can run on the probed device, in LINEARS order."""
    return [name for name, cls in LINEARS.items() if cls.available(probe)]


def dense_for(dtype: str) -> str:
    """The dense implementation of an activation dtype ("float32" / "bfloat16"): what takes a weight the chosen
    kernel cannot (`supports` False), and what "+dense" in `--weights` names."""
    return "bf16" if dtype == "bfloat16" else "fp32"


def impl_for(name: str, N: int, K: int) -> str:
    """`name`, or the dense implementation of its activation dtype where it cannot take a weight [N, K]."""
    return name if LINEARS[name].supports(N, K) else dense_for(LINEARS[name].dtype)


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along dim 0, bitwise; a view, not a copy, where the parts already lie back to back in one
    storage (a prepared file mapped as it is: models/quant.py storage_order), so a merged module shares the file."""
    first = parts[0]
    adjacent = all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device
                   and t.shape[1:] == first.shape[1:]
                   and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in parts)
    if adjacent and all(b.storage_offset() == a.storage_offset() + a.numel() for a, b in zip(parts, parts[1:])):
        shape = (sum(t.shape[0] for t in parts), *first.shape[1:])
        return first.as_strided(shape, torch.empty(shape, device="meta").stride(), first.storage_offset())
    return torch.cat(parts)


def make_linear(name: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearImpl:
    """Build implementation `name` from weight [N, K] (fp32 or any float dtype) and bias [N]."""
    if name not in LINEARS:
        raise ValueError(f"unknown linear implementation {name!r} (known: {', '.join(LINEARS)})")
    return LINEARS[name](weight, bias)


# ---- compositions ---------------------------------------------------------------------------------------------

class Columns(nn.Module):
    """module(x)[..., cols]: some outputs of a module computed whole (whole q4x8 blocks, or a layout without rows)."""

    def __init__(self, module: nn.Module, cols: torch.Tensor):  # cols [M] int64
        super().__init__()
        self.module, self.cols = module, cols
        self.in_features, self.out_features = getattr(module, "in_features", None), len(cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., M]
        y = self.module(x)
        return y.index_select(-1, self.cols.to(y.device))


class SplitLinear(nn.Module):
    """`step` for calls with at most STEP_MAX_TOKENS tokens per sequence (decode, verification), `prefill` above:
    by tokens per sequence, not rows, so a k + 1 <= 9 token verification always runs the step kernel."""

    def __init__(self, step: nn.Module, prefill: nn.Module):
        super().__init__()
        self.step, self.prefill = step, prefill
        self.in_features, self.out_features = step.in_features, step.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return self.module_for(x.shape[1] if x.dim() == 3 else 1)(x)

    def module_for(self, tokens: int) -> nn.Module:
        """The half that runs a call with `tokens` tokens per sequence."""
        return self.prefill if tokens > STEP_MAX_TOKENS else self.step

    def rows(self, ids: torch.Tensor) -> nn.Module:  # ids [M] int64
        return SplitLinear(rows(self.step, ids), rows(self.prefill, ids))


class ConcatLinear(nn.Module):
    """torch.cat([part(x) for part in parts], -1): the stand-in for a merge that is not exact (e.g. the dense
    prefill half of a SplitLinear whose q4x8 step half merged), so a merged projection is always one module."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., sum N]
        return torch.cat([p(x) for p in self.parts], dim=-1)


def rows(module: nn.Module, ids: torch.Tensor) -> nn.Module:  # ids [M] int64
    """`module`'s outputs at `ids`, bitwise: its own `rows`; a plain nn.Linear's as the dense implementation of its
    weight's dtype over the same tensors (no copy; the same F.linear on activations of that dtype); else Columns."""
    if isinstance(module, nn.Linear):
        w = module.weight.detach()  # [N, K]
        dense = LINEARS[dense_for("bfloat16" if w.dtype == torch.bfloat16 else "float32")]
        bias = None if module.bias is None else module.bias.detach()
        module = dense.from_state({"weight": w, "bias": bias}, *w.shape)
    if hasattr(module, "rows"):
        return module.rows(ids)
    return Columns(module, ids)


def merge(parts: list[nn.Module]) -> nn.Module | None:
    """One module whose output is bitwise torch.cat([part(x) for part in parts], -1), from linears over the same
    input (q/k/v, gate/up), or None where that is not exact by construction (then the caller keeps the parts).
    Only `mergeable` implementations concatenate (q4x8); SplitLinears merge when their step halves do (the
    prefill halves merge or become a ConcatLinear). Dense and torch-kernel linears never merge: a GEMM's
    reduction blocking may depend on N, so the merged result could differ in the last bits."""
    if len(parts) < 2:
        return None
    if all(isinstance(p, SplitLinear) for p in parts):
        step = merge([p.step for p in parts])
        if step is None:
            return None
        prefills = [p.prefill for p in parts]
        prefill = merge(prefills)
        return SplitLinear(step, ConcatLinear(prefills) if prefill is None else prefill)
    kind = type(parts[0])
    if not (issubclass(kind, LinearImpl) and kind.mergeable and all(type(p) is kind for p in parts)):
        return None
    return kind.concat(parts)


def derived_split(step: Q4x8Linear, dense: str, bias: torch.Tensor | None) -> SplitLinear:
    """A q4x8 step kernel with a dense prefill half (`dense`: "fp32" / "bf16") holding the same weights: the q4x8
    weight dequantized (bitwise the GGUF's values for Q4_K sources; the 4-bit requantization of other types).
    Only the q4x8 half is stored in a cache; the dense half is rebuilt from it at load (`from_stored`)."""
    table = q4x8_format.Q4x8Embedding.from_linear(step)  # row n = weight row n [K]
    N = step.out_features
    chunks = [table(torch.arange(i, min(i + DEQUANT_CHUNK, N))) for i in range(0, N, DEQUANT_CHUNK)]
    split = SplitLinear(step, make_linear(dense, torch.cat(chunks) if len(chunks) > 1 else chunks[0], bias))
    split.derived = True
    return split


def stored(module: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """(kind, tensors) of a module a plan built: what a cache stores to rebuild it without quantizing."""
    if isinstance(module, SplitLinear):
        k1, t1 = stored(module.step)
        if getattr(module, "derived", False):  # the dense half comes from the step half
            kind = {"split": [k1, {"impl": module.prefill.name, "derived": True}]}
            return kind, {f"step.{n}": t for n, t in t1.items()}
        k2, t2 = stored(module.prefill)
        return ({"split": [k1, k2]}, {**{f"step.{n}": t for n, t in t1.items()},
                                      **{f"prefill.{n}": t for n, t in t2.items()}})
    if not isinstance(module, LinearImpl):
        raise ValueError(f"{type(module).__name__} has no stored form")
    module.stored_buffers()  # raises where the implementation has none
    return {"impl": module.name, "N": module.out_features, "K": module.in_features}, module.state()


def from_stored(kind: dict, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The inverse of `stored`."""
    if "split" in kind:
        sub = lambda prefix: {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}  # noqa: E731
        step = from_stored(kind["split"][0], sub("step."))
        if kind["split"][1].get("derived"):
            return derived_split(step, kind["split"][1]["impl"], step.bias)
        return SplitLinear(step, from_stored(kind["split"][1], sub("prefill.")))
    return LINEARS[kind["impl"]].from_state(tensors, kind["N"], kind["K"])

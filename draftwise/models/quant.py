"""Linear layers in the chosen weight formats, the choice itself (`resolve_formats`: "auto" asks the kernel
autotuner), the pass that swaps them into a Decoder, and the prepared path that builds them straight from a
GGUF's blocks (`prepared_tensors`) with its on-disk form (`linear_state` / `linear_from_state`), and the
embedding table of 4-bit plans kept in q4x8's packed form (`prepared_weights`, `module_state`; shared with a
tied LM head), so neither memory nor the cache holds a dense copy of it.

Merged projections (`merge_linears`, which Decoder.merge_projections applies after loading, so the prepared cache
keeps one entry per HF linear): q/k/v and gate/up become one module each wherever its output is bitwise the
separate calls' (q4x8; a SplitLinear's non-mergeable prefill half becomes a ConcatLinear); elsewhere the parts stay.

Kernel formats (draftwise/kernels): a plan names one step implementation (every call with at most
DENSE_ABOVE_ROWS tokens per sequence: decode and verification, so greedy speculative output equals plain output)
and one prefill implementation; `kernel_linear` builds one implementation, or a SplitLinear holding both.
q4x8 takes a GGUF Q4_K tensor's blocks exactly (kernels/q4x8.py, q4k_from_blocks); other GGUF types are
dequantized and quantized to q4x8.
Legacy formats below use torch's native kernels directly:

int8: per-output-channel symmetric scales, `torch._weight_int8pack_mm`. int4: asymmetric min-max groups of 32
along K, `torch._weight_int4pack_mm_for_cpu` (CUDA: `torch._weight_int4pack_mm`), which computes
w = (q - 8) * scale + zero with q in [0, 15] packed by `_convert_weight_to_int4pack*`. Groups of 32 match
GGUF's Q4_K sub-blocks (scale and min per 32 weights), so Q4_K weights re-quantize almost exactly.
Activations stay in the model dtype. "int4+dense" keeps the dense weights too and uses them for calls with
more than DENSE_ABOVE_ROWS tokens per sequence (prefill): the int4 kernel's cost grows with rows while a dense matmul's hardly
does, and they cross near 10-12 rows on this CPU (docs/ARCHITECTURE.md, hardware facts). Knows nothing of the
engine; of checkpoints it knows only the GGUFTensor handle (shape, dense(), q4k_blocks()).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from draftwise.config import ConfigError

INT4_GROUP = 32
DENSE_ABOVE_ROWS = 12
PREPARED_FORMAT_VERSION = 3  # bump when a prepared module's stored tensors change; cached copies are then rebuilt
# (2: the embedding table in q4x8's packed form, shared with a tied head; torch int4 linears prepared too;
# 3: a q4x8 step + dense prefill split stores only the q4x8 half, the dense one is derived at load). Bump
# sources.CONVERSION_VERSION with it: the converted folder is rebuilt, so the old prepared files leave the disk.


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
    if fmt == "int4":  # torch's int4 packing takes whole groups of 32 along K and rows in multiples of 16
        return K % INT4_GROUP == 0 and N % 16 == 0
    return True


# ---- kernel formats (draftwise.kernels) ------------------------------------------------------------------

DEQUANT_CHUNK = 8192  # rows dequantized at a time when a dense half is derived from q4x8 (bounds the fp32 temporary)
KERNEL_FORMATS = {"q4x8": ("q4x8", "q4x8"), "q4x8+dense": ("q4x8", "dense")}  # weights -> (step, prefill)
_LABELS = {"q4x8": "q4x8", "int4_torch": "int4", "dense_bf16": "bf16", "dense_fp32": "fp32"}


class SplitLinear(nn.Module):
    """`step` for calls with at most DENSE_ABOVE_ROWS tokens per sequence (decode, verification), `prefill` above:
    by tokens per sequence, not rows, so a k + 1 <= 9 token verification always runs the step kernel."""

    def __init__(self, step: nn.Module, prefill: nn.Module):
        super().__init__()
        self.step, self.prefill = step, prefill
        self.in_features, self.out_features = step.in_features, step.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return self.module_for(x.shape[1] if x.dim() == 3 else 1)(x)

    def module_for(self, tokens: int) -> nn.Module:
        """The half that runs a call with `tokens` tokens per sequence."""
        return self.prefill if tokens > DENSE_ABOVE_ROWS else self.step


def _dense_impl(dtype: torch.dtype) -> str:
    from draftwise.kernels.linear import dense_impl

    return dense_impl("bfloat16" if dtype == torch.bfloat16 else "float32")


def _impl(name: str, N: int, K: int, dtype: torch.dtype) -> str:
    """`name` ("dense" = the model dtype's dense implementation), or that when the kernel cannot take N x K."""
    from draftwise.kernels.linear import IMPLS

    if name == "dense" or not IMPLS[name].supports(N, K):
        return _dense_impl(dtype)
    return name


def kernel_linear(step: str, prefill: str, N: int, K: int, dtype: torch.dtype, weight=None, bias=None,
                  parts: dict | None = None) -> nn.Module:
    """One linear layer for a plan: weight [N, K] (float; a callable returning it is called only if needed) and
    bias [N]; `parts` (q4x8 parts, e.g. exact from Q4_K blocks) are used for q4x8 instead of quantizing weight."""
    from draftwise.kernels.linear import make_linear
    from draftwise.kernels.q4x8 import Q4x8Linear

    dense = {}

    def get_weight() -> torch.Tensor:
        if "w" not in dense:
            dense["w"] = weight() if callable(weight) else weight
        return dense["w"]

    def one(name: str) -> nn.Module:
        name = _impl(name, N, K, dtype)
        if name == "q4x8":
            return Q4x8Linear.from_parts(parts, bias) if parts is not None else Q4x8Linear(get_weight(), bias)
        return make_linear(name, get_weight(), bias)

    step_mod = one(step)
    if _impl(step, N, K, dtype) == _impl(prefill, N, K, dtype):
        return step_mod
    if isinstance(step_mod, Q4x8Linear) and _impl(prefill, N, K, dtype).startswith("dense"):
        return derived_split(step_mod, _impl(prefill, N, K, dtype), bias)
    return SplitLinear(step_mod, one(prefill))


def derived_split(step: nn.Module, dense_impl: str, bias: torch.Tensor | None) -> SplitLinear:
    """A q4x8 step kernel with a dense prefill half holding the same weights: the q4x8 weight dequantized
    (bitwise the GGUF's values for Q4_K sources; the 4-bit requantization of other types). Only the q4x8 half is
    stored in a cache, the dense half is rebuilt from it at load, so a split plan costs no disk beyond q4x8."""
    from draftwise.kernels.linear import make_linear
    from draftwise.kernels.q4x8 import Q4x8Embedding

    rows = Q4x8Embedding.from_linear(step)  # row n of the table = row n of the dequantized weight [N, K]
    N = step.out_features
    chunks = [rows(torch.arange(i, min(i + DEQUANT_CHUNK, N))) for i in range(0, N, DEQUANT_CHUNK)]
    split = SplitLinear(step, make_linear(dense_impl, torch.cat(chunks) if len(chunks) > 1 else chunks[0], bias))
    split.derived = True
    return split


def build_linears(model: nn.Module, step: str, prefill: str) -> int:
    """Replace every nn.Linear of a built Decoder with the plan's kernels; returns how many were swapped."""
    dtype = model.dtype
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        N, K = child.weight.shape
        setattr(parent, name, kernel_linear(step, prefill, N, K, dtype, child.weight.detach().float(),
                                            None if child.bias is None else child.bias.detach().float()))
    if hasattr(model, "merge_projections"):  # a Decoder: q/k/v and gate/up into one call each where exact
        model.merge_projections(merge_linears)
    return len(targets)


# ---- merged projections: q/k/v and gate/up as one call ----------------------------------------------------

class ConcatLinear(nn.Module):
    """torch.cat([part(x) for part in parts], -1): the stand-in for a merge that is not exact (e.g. the dense
    prefill half of a SplitLinear whose q4x8 step half merged), so a merged projection is always one module."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., sum N]
        return torch.cat([p(x) for p in self.parts], dim=-1)


def merge_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One module whose output is bitwise torch.cat([part(x) for part in parts], -1), from linears over the same
    input (q/k/v, gate/up), or None where that is not exact by construction (then the caller keeps the parts).

    q4x8: the packed layout is per 16-output-column block and the activations are quantized per row,
    independently of N, so concatenating the blocks along N is exact when every part but the last has
    N % 16 == 0 (no padding columns in the middle); a missing bias is a zero one (the kernel adds 0 without
    one). SplitLinear: the step halves must merge; the prefill halves merge or become a ConcatLinear. Dense
    and torch-kernel linears are never merged: a GEMM's reduction blocking may depend on N, so the merged
    result could differ in the last bits from the separate calls."""
    from draftwise.kernels.q4x8 import COLS, Q4x8Linear

    if len(parts) < 2:
        return None
    if all(isinstance(p, SplitLinear) for p in parts):
        step = merge_linears([p.step for p in parts])
        if step is None:
            return None
        prefills = [p.prefill for p in parts]
        prefill = merge_linears(prefills)
        return SplitLinear(step, ConcatLinear(prefills) if prefill is None else prefill)
    if not all(type(p) is Q4x8Linear for p in parts):
        return None
    if len({(p.in_features, p.path, p.packed.device) for p in parts}) != 1:
        return None
    if any(p.out_features % COLS for p in parts[:-1]):
        return None
    tensors = {n: torch.cat([getattr(p, n) for p in parts]) for n in Q4x8Linear.PACKED}
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, device=p.packed.device)
                          for p in parts])
    merged = Q4x8Linear.from_packed(tensors, sum(p.out_features for p in parts), bias)
    merged.path = parts[0].path
    return merged


def linear_state(module: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """(kind, tensors) of a module kernel_linear built: what a cache stores to rebuild it without quantizing."""
    from draftwise.kernels.linear import DenseBF16, DenseF32, TorchInt4BF16
    from draftwise.kernels.q4x8 import Q4x8Linear

    if isinstance(module, SplitLinear) and getattr(module, "derived", False):  # the dense half comes from the step
        k1, t1 = linear_state(module.step)
        return {"split": [k1, {"impl": module.prefill.name, "derived": True}]}, {f"step.{n}": t for n, t in t1.items()}
    if isinstance(module, SplitLinear):
        k1, t1 = linear_state(module.step)
        k2, t2 = linear_state(module.prefill)
        return ({"split": [k1, k2]}, {**{f"step.{n}": t for n, t in t1.items()},
                                      **{f"prefill.{n}": t for n, t in t2.items()}})
    if isinstance(module, Q4x8Linear):
        kind = "q4x8"
    elif isinstance(module, (DenseF32, DenseBF16, TorchInt4BF16)):
        kind = module.name
    else:
        raise ValueError(f"{type(module).__name__} has no stored form")
    return ({"impl": kind, "N": module.out_features},
            {n: t for n, t in module.state_dict().items() if t is not None})


def linear_from_state(kind: dict, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The inverse of linear_state."""
    from draftwise.kernels.linear import IMPLS
    from draftwise.kernels.q4x8 import Q4x8Linear

    if "split" in kind:
        sub = lambda prefix: {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}  # noqa: E731
        if kind["split"][1].get("derived"):
            step = linear_from_state(kind["split"][0], sub("step."))
            return derived_split(step, kind["split"][1]["impl"], step.bias)
        return SplitLinear(linear_from_state(kind["split"][0], sub("step.")),
                           linear_from_state(kind["split"][1], sub("prefill.")))
    if kind["impl"] == "q4x8":
        return Q4x8Linear.from_packed(tensors, kind["N"], tensors.get("bias"))
    if kind["impl"] == "int4_torch":
        return IMPLS["int4_torch"].from_packed(tensors["packed"], tensors["scales_and_zeros"], tensors.get("bias"))
    return IMPLS[kind["impl"]](tensors["weight"], tensors.get("bias"))  # dense: already in its dtype, no copy


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_path(weight_name: str) -> str | None:
    """'model.layers.0.mlp.up_proj.weight' -> 'model.layers.0.mlp.up_proj' for a decoder linear; else None."""
    path, _, leaf = weight_name.rpartition(".")
    if leaf == "weight" and (path == "lm_head" or path.rpartition(".")[2] in LINEAR_NAMES):
        return path
    return None


def embed_storage_dtype(vocab: int, hidden: int, dtype: torch.dtype) -> torch.dtype:
    """Large embedding tables are kept in bf16 (rows are upcast after lookup); small ones in the model dtype."""
    return torch.bfloat16 if vocab * hidden >= 1 << 24 else dtype


def prepared_tensors(items: dict, cfg, step: str, prefill: str, dtype: torch.dtype,
                     progress: bool = True, dense_embedding: bool = True,
                     ) -> Iterator[tuple[str, torch.Tensor | nn.Module]]:
    """A GGUF's lazy tensors (gguf.GGUFFile.items()) -> what Decoder.from_tensors takes: each linear as a module
    built from its blocks (Q4_K exact for q4x8; other types dequantized once), the rest as float tensors.
    A tied LM head is built from the embedding's blocks. `dense_embedding=False` leaves the embedding table out
    (prepared_weights builds it compact)."""
    import sys

    from tqdm import tqdm

    linears = {path: name for name in items if (path := linear_path(name))}
    if cfg.tie_word_embeddings and "lm_head" not in linears:
        linears["lm_head"] = "model.embed_tokens.weight"
    biases = {f"{path}.bias" for path in linears}
    for name, item in items.items():
        if name not in biases and linear_path(name) is None and (dense_embedding or name != f"{EMBED}.weight"):
            yield name, item.dense()
    uses_q4x8 = "q4x8" in (step, prefill)
    for path, name in tqdm(linears.items(), desc="preparing weights", unit="linear", file=sys.stderr,
                           disable=not progress, leave=False):
        item = items[name]
        N, K = item.shape
        bias = items[f"{path}.bias"].dense() if f"{path}.bias" in items else None
        blocks = item.q4k_blocks() if uses_q4x8 else None
        parts = None
        if blocks is not None:
            from draftwise.kernels.q4x8 import q4k_from_blocks

            parts = q4k_from_blocks(blocks, N, K)
        yield path, kernel_linear(step, prefill, N, K, dtype, item.dense, bias, parts)


# ---- the embedding table in the prepared form ------------------------------------------------------------

EMBED = "model.embed_tokens"
COMPACT_EMBEDDING_KERNELS = ("q4x8", "int4_torch")  # plans with 4-bit linears keep a 4-bit embedding table too


def plan_impls(step: str, prefill: str, N: int, K: int, dtype: torch.dtype) -> list[str]:
    """The implementations kernel_linear builds for a weight [N, K] under a plan: one, or a SplitLinear's two."""
    return list(dict.fromkeys((_impl(step, N, K, dtype), _impl(prefill, N, K, dtype))))


def compact_embedding(step: str | None, prefill: str | None, hidden: int) -> bool:
    """Whether a plan keeps the embedding table in q4x8's packed form (kernels/q4x8.py Q4x8Embedding, 4.75 bits
    per weight): when its linears are 4-bit and the rows are whole groups of 32. Dense plans keep a dense table
    (embed_storage_dtype)."""
    return any(k in COMPACT_EMBEDDING_KERNELS for k in (step, prefill)) and hidden % 32 == 0


def prepared_weights(items: dict, cfg, step: str, prefill: str, dtype: torch.dtype,
                     progress: bool = True) -> Iterator[tuple[str, torch.Tensor | nn.Module]]:
    """prepared_tensors, with the embedding table as a module when compact_embedding says so (EMBED, after the
    linears): a tied LM head's q4x8 buffers shared (one copy serves both), else built from the table's own Q4_K
    blocks exactly, or dequantized (this one tensor) and quantized to q4x8."""
    compact = compact_embedding(step, prefill, cfg.hidden_size)
    head = None
    for name, value in prepared_tensors(items, cfg, step, prefill, dtype, progress, dense_embedding=not compact):
        if name == "lm_head":
            head = value
        yield name, value
    if compact:
        yield EMBED, _q4x8_embedding(items[f"{EMBED}.weight"], head if cfg.tie_word_embeddings else None)


def _q4x8_embedding(item, tied_head: nn.Module | None) -> nn.Module:
    from draftwise.kernels.q4x8 import Q4x8Embedding, q4k_from_blocks, quantize_q4

    shared = _q4x8_part(tied_head)
    if shared is not None:
        return Q4x8Embedding.from_linear(shared)
    V, H = item.shape
    blocks = item.q4k_blocks()
    return Q4x8Embedding.from_parts(q4k_from_blocks(blocks, V, H) if blocks is not None else quantize_q4(item.dense()))


def _q4x8_part(module: nn.Module | None):
    """The Q4x8Linear a built linear holds (itself, or a SplitLinear's step or prefill), or None."""
    from draftwise.kernels.q4x8 import Q4x8Linear

    for m in (module, getattr(module, "step", None), getattr(module, "prefill", None)):
        if isinstance(m, Q4x8Linear):
            return m
    return None


def module_state(module: nn.Module, modules: dict[str, nn.Module]) -> tuple[dict, dict[str, torch.Tensor]]:
    """linear_state, and for a Q4x8Embedding its packed tensors, or none but the name of the module in `modules`
    whose q4x8 buffers it shares (a tied head: the cache stores the table once)."""
    from draftwise.kernels.q4x8 import Q4x8Embedding, Q4x8Linear

    if not isinstance(module, Q4x8Embedding):
        return linear_state(module)
    kind = {"embedding": "q4x8", "N": module.num_embeddings}
    for owner, other in modules.items():
        part = _q4x8_part(other)
        if other is not module and part is not None and part.packed.data_ptr() == module.packed.data_ptr():
            return {**kind, "shares": owner}, {}
    return kind, {n: getattr(module, n) for n in Q4x8Linear.PACKED}


def module_from_state(kind: dict, tensors: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> nn.Module:
    """The inverse of module_state (`modules`: those already rebuilt, for a shared table)."""
    from draftwise.kernels.q4x8 import Q4x8Embedding

    if kind.get("embedding") == "q4x8":
        if "shares" in kind:
            return Q4x8Embedding.from_linear(_q4x8_part(modules[kind["shares"]]))
        return Q4x8Embedding(tensors, kind["N"])
    return linear_from_state(kind, tensors)


@dataclass(frozen=True)
class Plan:
    """Resolved formats of one model: `weights` (a label for info), `dtype` (activations), and for kernel formats
    the step / prefill implementations (draftwise.kernels.linear names); `tuning` what the autotuner said."""

    weights: str
    dtype: str
    step: str | None = None
    prefill: str | None = None
    tuning: dict | None = None

    def kernels(self) -> dict | None:
        if self.step is None:
            return None
        out = {"step": self.step, "prefill": self.prefill}
        if self.tuning:
            out.update(self.tuning)
        return out


def check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but this torch build sees no CUDA device; use --device cpu")


def resolve_formats(weights: str | None, dtype: str, cfg, device: str = "cpu", tune=None,
                    progress: bool = True) -> Plan:
    """The formats to load `cfg`'s model in. Explicit values win; "auto" weights (also None weights with "auto"
    dtype) run the autotuner on the model's real shapes on this machine's `device` (its CPU, or its CUDA device;
    fast mode, cached) and take its step and prefill kernels; "auto" dtype follows the step kernel (float32 for
    q4x8 and dense fp32, else bfloat16).
    `tune(shapes) -> autotune result` may be injected (tests)."""
    from draftwise.config import DTYPES, WEIGHT_FORMATS
    from draftwise.kernels.linear import auto_dtype, dense_impl

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise ConfigError(f"weights must be one of {list(WEIGHT_FORMATS)}, got {weights!r}")
    check_device(device)
    if weights == "auto" or (weights is None and dtype == "auto"):
        from draftwise.kernels import autotune as at

        tune = tune or (lambda shapes: at.autotune(shapes, fast=True, progress=progress, device=device))
        result = tune(at.shapes_from_config(cfg))
        choice = result["choice"]
        step, prefill = choice["step"], choice["prefill"]
        act = dtype if dtype != "auto" else auto_dtype(step)
        label = _LABELS.get(step, step) if step == prefill else f"{_LABELS.get(step, step)}+{_LABELS.get(prefill, prefill)}"
        p = result.get("probe") or {}
        tuning = {"autotune_key": result.get("key"), "device": device, "gpu": p.get("gpu"), "cpu": p.get("cpu"),
                  "torch_threads": p.get("torch_threads"),
                  "flags": sorted(k for k, v in p.get("flags", {}).items() if v),
                  "step_ms": {n: round(v, 3) for n, v in choice.get("step_score_ms", {}).items()},
                  "prefill_ms": {n: round(v, 3) for n, v in choice.get("prefill_ms", {}).items()}}
        return Plan(label, act, step, prefill, tuning)
    if weights in KERNEL_FORMATS:
        if device != "cpu":
            raise ConfigError(f"--weights {weights} is our CPU kernel; on {device} use --weights auto (the autotuner "
                              "times that device's kernels), bf16, int8 or int4")
        step, prefill = KERNEL_FORMATS[weights]
        act = "float32" if dtype == "auto" else dtype
        if prefill == "dense":
            prefill = dense_impl(act)
        return Plan(weights, act, step, prefill)
    act = dtype if dtype != "auto" else ("float32" if weights is None else "bfloat16")
    return Plan(weights or ("bf16" if act == "bfloat16" else "fp32"), act)


def quantize_decoder(model: nn.Module, fmt: str) -> int:
    """Replace every nn.Linear of `model` (attention, MLP, LM head) in place; returns how many were swapped."""
    if fmt in KERNEL_FORMATS:
        step, prefill = KERNEL_FORMATS[fmt]
        return build_linears(model, step, prefill)
    cls = {"int8": Int8Linear, "int4": Int4Linear, "int4+dense": lambda l: Int4Linear(l, keep_dense=True)}.get(fmt)
    if cls is None:
        return 0
    base = fmt.split("+")[0]
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and _quantizable(child, base)]
    for parent, name, child in targets:
        setattr(parent, name, cls(child))
    return len(targets)

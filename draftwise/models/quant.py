"""A plan's linear layers built into a decoder: from dense weights (`build_linears`), or straight from a GGUF's
blocks (`prepared_tensors`, `prepared_weights`) with their on-disk form (`module_state` / `module_from_state`,
kernels/linear.py's `stored` for linears), and the embedding table of 4-bit plans kept in q4x8's packed form
(shared with a tied LM head), so neither memory nor the cache holds a dense copy of it.

Which kernels a model gets is kernels/plan.py's KernelPlan; what each kernel is, kernels/linear.py's registry.
Here a plan becomes modules: each linear is one implementation, or a SplitLinear (the step kernel up to
STEP_MAX_TOKENS tokens per sequence, the prefill kernel above); a kernel that cannot take a weight's shape
falls back to the dense implementation of its activation dtype (linear.impl_for, the autotuner's rule too).
q4x8 takes a GGUF Q4_K tensor's blocks exactly (kernels/q4x8.py, q4k_from_blocks); under a named plan other GGUF
types are dequantized and quantized to the plan's format. A faithful plan (kernels/plan.py) gives each tensor the
kernel of its stored type instead, built from its blocks (kernels/blocktypes.py's table: Q6_K -> q6k, Q3_K -> q3k,
Q2_K -> q6m, Q5_K -> q5x8, Q8_0 / Q5_0 -> q8_0, Q4_0 / IQ4 -> q4c, Q4_1 / Q5_1 -> q5m, a float type with a row (F16, BF16) -> its float
kernel, others -> fp32 over the exactly dequantized weight),
and keeps the embedding table as stored (`GGUFRowsEmbedding` for types other than Q4_K; its rows decoded by
kernels/embed_rows.py's C++ op, or the `gguf` package's dequantizer for types the op does not decode). `type_census` counts a
file's types for the plan. Knows nothing of the engine; of checkpoints it knows only the GGUFTensor handle (shape,
type, dense(), blocks(), q4k_blocks()).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from draftwise.kernels import blocktypes, embed_rows, linear
from draftwise.kernels.linear import SplitLinear, derived_split, impl_for, make_linear
from draftwise.kernels.plan import EXACT_DENSE, KernelPlan, faithful_kernel

PREPARED_FORMAT_VERSION = 8  # bump when a prepared module's stored tensors change; cached copies are then rebuilt
# (2: the embedding table in q4x8's packed form, shared with a tied head; torch int4 linears prepared too;
# 3: a q4x8 step + dense prefill split stores only the q4x8 half, the dense one is derived at load;
# 4: one registry: implementations stored under their --weights names, with K; 5: faithful plans, q6k / q8_0
# linears and the GGUF-rows embedding; 6: merge groups' buffers stored back to back, `storage_order`, so a merged
# q/k/v or gate/up is a view of the mapped file; 7: the block-type table's kernels for Q3_K, Q4_0, Q4_1, Q5_1,
# Q5_K, IQ4_NL and IQ4_XS, which a faithful plan's file of version 6 held in fp32; 8: the 32-block kernels' d and m
# in the types' own scale forms, fp16 or SUB8, not float32: csrc/q8_0.h; from 8 on a faithful file's key names
# each stored type's kernel and scale form too, models/sources.py prepared_path: version 7's files held Q5_K on
# q8_1 or q5m under one key). Bump sources.CONVERSION_VERSION with it:
# the converted folder is rebuilt, so the old prepared files leave the disk (not done for 5-8: a new prepared
# file's writer removes the folder's files it can no longer reach instead, sources.drop_unreachable).


def kernel_linear(plan: KernelPlan, N: int, K: int, weight=None, bias=None, parts: dict | None = None,
                  stored_type: str | None = None, blocks=None) -> nn.Module:
    """One linear layer for a plan: weight [N, K] (float; a callable returning it is called only if needed) and
    bias [N]; `parts` (q4x8 parts, e.g. exact from Q4_K blocks) are used for q4x8 instead of quantizing weight.
    A faithful plan needs the tensor's `stored_type` (ggml type name) and, for a block type, its raw `blocks`."""
    dense = {}
    if plan.faithful:
        if stored_type is None:
            raise ValueError("a faithful plan builds a linear from its stored GGUF type; none was given")
        name = faithful_kernel(stored_type)
        if name == "q4x8" and parts is not None:
            return linear.Q4x8Linear.from_parts(parts, bias)
        if name in blocktypes.block_kernels() and blocks is not None and linear.LINEARS[name].supports(N, K):
            try:
                return linear.LINEARS[name].from_blocks(stored_type, blocks, N, K, bias)
            except ValueError:  # a value the kernel cannot take (a Q8_0 -128): the exact dense weight instead
                pass
        return make_linear(EXACT_DENSE, weight() if callable(weight) else weight, bias)

    def get_weight() -> torch.Tensor:
        if "w" not in dense:
            dense["w"] = weight() if callable(weight) else weight
        return dense["w"]

    def one(name: str) -> nn.Module:
        if name == "q4x8" and parts is not None:
            return linear.Q4x8Linear.from_parts(parts, bias)
        return make_linear(name, get_weight(), bias)

    step, prefill = impl_for(plan.step, N, K), impl_for(plan.prefill, N, K)
    step_mod = one(step)
    if step == prefill:
        return step_mod
    if step == "q4x8" and prefill in ("fp32", "bf16"):  # the dense half from the q4x8 weights: cached once
        return derived_split(step_mod, prefill, bias)
    return SplitLinear(step_mod, one(prefill))


def build_linears(model: nn.Module, plan: KernelPlan) -> int:
    """Replace every nn.Linear of a built Decoder with the plan's kernels and give the decoder the plan; returns
    how many were swapped."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        N, K = child.weight.shape
        setattr(parent, name, kernel_linear(plan, N, K, child.weight.detach().float(),
                                            None if child.bias is None else child.bias.detach().float()))
    if hasattr(model, "merge_projections"):  # a Decoder: q/k/v and gate/up into one call each where exact
        model.merge_projections(linear.merge)
        model.plan = plan
    return len(targets)


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_path(weight_name: str) -> str | None:
    """'model.layers.0.mlp.up_proj.weight' -> 'model.layers.0.mlp.up_proj' for a decoder linear; else None."""
    path, _, leaf = weight_name.rpartition(".")
    if leaf == "weight" and (path == "lm_head" or path.rpartition(".")[2] in LINEAR_NAMES):
        return path
    return None


def embed_storage_dtype(vocab: int, hidden: int, plan: KernelPlan) -> torch.dtype:
    """A dense table's storage dtype: large ones in bf16 (rows are upcast after lookup), small ones in the plan's
    dtype; the fp32 plan, the reference, keeps its table in float32 too."""
    dtype = getattr(torch, plan.dtype)
    if plan.label == "fp32":
        return dtype
    return torch.bfloat16 if vocab * hidden >= 1 << 24 else dtype


def prepared_tensors(items: dict, cfg, plan: KernelPlan,
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
    uses_q4x8 = "q4x8" in (plan.step, plan.prefill)
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
        faithful_blocks = item.blocks() if plan.faithful and faithful_kernel(item.type) in blocktypes.block_kernels() else None
        yield path, kernel_linear(plan, N, K, item.dense, bias, parts, item.type, faithful_blocks)


MERGE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # as Decoder.merge_projections merges


def storage_order(names: list[str], owners: dict[str, str]) -> list[str]:
    """The order a prepared file stores tensors in: `names` as given, except that the same buffer of the linears one
    merge concatenates (q/k/v, gate/up of a layer; `owners`: tensor name -> its linear's path) is stored back to
    back in group order — `q_proj.packed, k_proj.packed, v_proj.packed, q_proj.d, ...` — so a merged module over
    a mapped file is a view of it (kernels/linear.py cat_rows), not a copy."""
    group_of = {leaf: (g, i) for g, group in enumerate(MERGE_GROUPS) for i, leaf in enumerate(group)}
    members: dict[tuple, list[tuple[int, str]]] = {}
    keys = {}
    for name in names:
        owner = owners.get(name)
        parent, _, leaf = (owner or "").rpartition(".")
        if owner is None or leaf not in group_of:
            continue
        g, i = group_of[leaf]
        keys[name] = (parent, g, name[len(owner):])
        members.setdefault(keys[name], []).append((i, name))
    out, done = [], set()
    for name in names:
        key = keys.get(name)
        if key is None:
            out.append(name)
        elif key not in done:
            done.add(key)
            out += [n for _, n in sorted(members[key])]
    return out


def type_census(types: dict[str, str], cfg) -> dict[str, int]:
    """{HF tensor name: ggml type} of a GGUF -> {ggml type: count} over what a plan builds from it: the linears,
    the embedding table and (tied) the LM head that reuses it."""
    names = [n for n in types if linear_path(n) or n == f"{EMBED}.weight"]
    if cfg.tie_word_embeddings and "lm_head.weight" not in types and f"{EMBED}.weight" in types:
        names.append(f"{EMBED}.weight")
    census: dict[str, int] = {}
    for n in names:
        census[types[n]] = census.get(types[n], 0) + 1
    return census


# ---- the embedding table in the prepared form ------------------------------------------------------------

EMBED = "model.embed_tokens"
COMPACT_EMBEDDING_KERNELS = ("q4x8", "int4")  # plans with 4-bit linears keep a 4-bit embedding table too


def plan_impls(plan: KernelPlan, N: int, K: int) -> list[str]:
    """The implementations kernel_linear builds for a weight [N, K] under a plan: one, or a SplitLinear's two."""
    return list(dict.fromkeys((impl_for(plan.step, N, K), impl_for(plan.prefill, N, K))))


def compact_embedding(plan: KernelPlan, hidden: int) -> bool:
    """Whether a plan keeps the embedding table in q4x8's packed form (kernels/q4x8.py Q4x8Embedding, 4.75 bits
    per weight): when its linears are 4-bit and the rows are whole groups of 32. Dense plans keep a dense table
    (embed_storage_dtype)."""
    return any(k in COMPACT_EMBEDDING_KERNELS for k in (plan.step, plan.prefill)) and hidden % 32 == 0


def prepared_weights(items: dict, cfg, plan: KernelPlan,
                     progress: bool = True) -> Iterator[tuple[str, torch.Tensor | nn.Module]]:
    """prepared_tensors, with the embedding table as a module when compact_embedding says so (EMBED, after the
    linears): a tied LM head's q4x8 buffers shared (one copy serves both), else built from the table's own Q4_K
    blocks exactly, or dequantized (this one tensor) and quantized to q4x8."""
    table = items[f"{EMBED}.weight"]
    rows = plan.faithful and table.type != "Q4_K"  # faithful: a Q4_K table in q4x8 (exact), others as stored
    compact = compact_embedding(plan, cfg.hidden_size) and not rows
    head = None
    for name, value in prepared_tensors(items, cfg, plan, progress, dense_embedding=not (compact or rows)):
        if name == "lm_head":
            head = value
        yield name, value
    if compact:
        yield EMBED, _q4x8_embedding(table, head if cfg.tie_word_embeddings else None)
    elif rows:
        yield EMBED, GGUFRowsEmbedding(table.raw_rows(), table.type, *table.shape)


class GGUFRowsEmbedding(nn.Module):
    """An embedding table [V, H] kept as the GGUF stores it: raw [V, row bytes] uint8 (the file's blocks, or a
    float type's bytes), a looked-up row decoded bitwise as the `gguf` package's own dequantizer decodes it, so every
    row is bitwise the row of the dense float32 model (`--weights fp32`) and depends on its id alone (row-exact):
    by the C++ op of kernels/embed_rows.py for its DECODED_TYPES (Q6_K, Q8_0, F16, BF16, F32) where the library
    loads, by `gguf.quants.dequantize` otherwise (its numpy overhead, ~46 us a Q6_K row of 2048, is what the op
    removes). forward(ids [...] int64) -> [..., H] float32."""

    def __init__(self, raw: torch.Tensor, gguf_type: str, num_embeddings: int, embedding_dim: int):
        super().__init__()
        from gguf import GGMLQuantizationType

        if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[0] != num_embeddings:
            raise ValueError(f"not the raw rows of a [{num_embeddings}, {embedding_dim}] table: {tuple(raw.shape)}")
        self.gguf_type, self.num_embeddings, self.embedding_dim = gguf_type, num_embeddings, embedding_dim
        self._qtype = GGMLQuantizationType[gguf_type]
        self._op: bool | None = None  # the C++ op decodes the rows: decided at the first forward
        self.register_buffer("raw", raw)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., H] float32
        flat = ids.reshape(-1).cpu()
        if self._op is None:
            self._op = self.gguf_type in embed_rows.DECODED_TYPES and embed_rows.available()
        if self._op and self.raw.is_contiguous():
            dense = embed_rows.rows(self.raw, flat.long(), self.gguf_type, self.embedding_dim)  # IndexError
            return dense.reshape(*ids.shape, self.embedding_dim)
        return self._gguf_rows(flat).reshape(*ids.shape, self.embedding_dim)

    def _gguf_rows(self, flat: torch.Tensor) -> torch.Tensor:  # flat [n] int64 -> [n, H] float32, by gguf's numpy
        from gguf.quants import dequantize

        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        rows = self.raw.index_select(0, flat).numpy()
        dense = dequantize(rows, self._qtype).reshape(len(flat), self.embedding_dim)
        return torch.from_numpy(dense.astype("float32", copy=False))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.gguf_type} as stored"


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
    for m in (module, getattr(module, "step", None), getattr(module, "prefill", None)):
        if isinstance(m, linear.Q4x8Linear):
            return m
    return None


def module_state(module: nn.Module, modules: dict[str, nn.Module]) -> tuple[dict, dict[str, torch.Tensor]]:
    """linear.stored, and for a Q4x8Embedding its packed tensors, or none but the name of the module in `modules`
    whose q4x8 buffers it shares (a tied head: the cache stores the table once)."""
    from draftwise.kernels.q4x8 import PACKED, Q4x8Embedding

    if isinstance(module, GGUFRowsEmbedding):
        return ({"embedding": "gguf_rows", "type": module.gguf_type, "N": module.num_embeddings,
                 "K": module.embedding_dim}, {"raw": module.raw})
    if not isinstance(module, Q4x8Embedding):
        return linear.stored(module)
    kind = {"embedding": "q4x8", "N": module.num_embeddings}
    for owner, other in modules.items():
        part = _q4x8_part(other)
        if other is not module and part is not None and part.packed.data_ptr() == module.packed.data_ptr():
            return {**kind, "shares": owner}, {}
    return kind, {n: getattr(module, n) for n in PACKED}


def module_from_state(kind: dict, tensors: dict[str, torch.Tensor], modules: dict[str, nn.Module]) -> nn.Module:
    """The inverse of module_state (`modules`: those already rebuilt, for a shared table)."""
    from draftwise.kernels.q4x8 import Q4x8Embedding

    if kind.get("embedding") == "gguf_rows":
        return GGUFRowsEmbedding(tensors["raw"], kind["type"], kind["N"], kind["K"])
    if kind.get("embedding") == "q4x8":
        if "shares" in kind:
            return Q4x8Embedding.from_linear(_q4x8_part(modules[kind["shares"]]))
        return Q4x8Embedding(tensors, kind["N"])
    return linear.from_stored(kind, tensors)



"""The decoder's per-layer glue as single C++ calls (csrc/glue.cpp, built into the one library, kernels/library.py): RMSNorm, the
residual add fused with the norm after it, RoPE on q and k (after the optional per-head q/k norm; `rope_qk_cache`
also stores k and v into the layer's KV cache), the gated activation act(gate) * up, a mixture's router logits
(exact float32 products summed in double: `router_logits`) and its softmax / top-k routing (`route`), and the
greedy token of each logits row (`argmax`, what sampling.greedy_ids runs on float32 CPU rows). The torch reference
takes ~77 top-level calls per layer (180 aten events), which with the Python around them cost ~15 of the ~38 ms
of a one-token step of the 1.5B; with these ops (and merged projections) a layer makes ~23.

Owns: whether the ops can run here (`available`: the library builds and loads; `library.load`) and their Python
signatures. float32 CPU tensors only: the decoder (models/transformer.py) keeps its torch reference for other
dtypes and devices and where the library cannot be built. Knows nothing of models beyond these shapes and the KV
cache's layout (kv_cache.py: per layer a pool [blocks, kv heads, block_size, head_dim] and block-table rows,
written in place as KVCache.write would).

Exactness (csrc/glue.h and glue.cpp document the float sequences): every op computes a row from that row alone,
the same way for any number of rows and any thread split (row-exact), and on every ISA path (`cpu_paths`: scalar,
avx2, avx512, chosen by csrc/dispatch.h's rule like every op of the library: the best this CPU runs unless
`use_path` asked for another) bitwise the same. rope_qk(_cache) and the gelu glu
are bitwise the torch reference; rms_norm / add_rms_norm sum the squares in double, so they differ from the float
reference by a few ulps (NORM_TOLERANCE, relative, is what the tests hold them to); the silu glu uses our own exp
(GLU_TOLERANCE).
"""
from __future__ import annotations

import torch

from draftwise.kernels import library

NORM_TOLERANCE = 1e-6  # max |fused - reference| / max |reference| of rms_norm (float32)
GLU_TOLERANCE = 1e-6  # max |fused - reference| / |reference| per element of the silu glu (both <= 1.4 ulp of exact)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
PATHS = library.PATHS  # ISA path name -> id, from the library (csrc/dispatch.h)


def available() -> bool:
    """The ops are built and loaded (built on first use; False, once and for all, where they cannot be)."""
    return library.loads()


def cpu_paths() -> list[str]:
    """The ISA paths of the row loops this CPU can run, slowest first (the last is what 'auto' picks)."""
    library.load()
    return library.path_names(torch.ops.draftwise_glue.paths())


def use_path(path: str) -> str:
    """Run the ops' row loops on `path` from now on (process-wide; 'auto': the best here); returns the path in use
    before. For tests and benchmarks: every path gives bitwise the same results."""
    before = torch.ops.draftwise_glue.use_path(library.path_id(path))
    return library.path_names([before])[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x [..., N] float32 (last dim contiguous) -> weight * (x / rms(x)), or (x / rms(x)) * (offset + weight)."""
    return torch.ops.draftwise_glue.rms_norm(x, weight, eps, offset)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)): a residual add and the norm that follows it in one pass."""
    return torch.ops.draftwise_glue.add_rms_norm(x, h, weight, eps, offset)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
            offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., Hq * D], k [..., Hk * D] (R rows each; column slices of one merged projection are fine) -> rotated
    (q, k), contiguous. cos / sin [R, D / 2]: each row's angles (the reference's table holds them twice).
    q_norm / k_norm [D]: an RMSNorm over each head first (qwen3, gemma3), with `eps` and `offset`."""
    return torch.ops.draftwise_glue.rope_qk(q, k, cos, sin, head_dim, q_norm, k_norm, eps, offset)


def rope_qk_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, offset: float,
                  keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """rope_qk, then the rotated k and v (rows b * T + t of [B, T, Hk * D]) stored into one layer's KV cache
    (keys / values [P, Hk, BS, D] as kv_cache.py holds them) at [tables[b, p // BS], :, p % BS], p =
    positions[b, t] — what KVCache.write does, in the same call; blocks and lengths are the caller's
    (`KVCache.reserve`, `KVCache.extend`). Returns the rotated q, contiguous [..., Hq * D]."""
    return torch.ops.draftwise_glue.rope_qk_cache(q, k, v, cos, sin, head_dim, q_norm, k_norm, eps, offset, keys,
                                                  values, tables, positions)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, H] float32, weight [E, H] float32 -> [M, E] float64: sum_h x[m, h] * weight[e, h], every product exact
    in double and summed in a fixed order (csrc/glue.cpp), the same for any M and thread split."""
    return torch.ops.draftwise_glue.router_logits(x, weight)


def route(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] float64 (a router's) -> (experts [M, k] int64 ascending, weights [M, k] float32): the float32
    softmax, its k largest (ties: the lower expert), divided by their sum where `norm`, sorted by expert
    (csrc/glue.cpp; within a few ulps of torch's softmax / topk / sort, the same for any M)."""
    return torch.ops.draftwise_glue.route(logits, k, norm)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] float32 (N >= 1) -> [...] int64: torch.argmax(x, -1) exactly (the first maximum; a NaN counts above
    every number), in one vectorised pass a row (~10x torch's on a vocabulary row)."""
    return torch.ops.draftwise_glue.argmax(x)


def glu(gate: torch.Tensor, up: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(gate) * up; with `up` None, `gate` is a merged gate/up output [..., 2 I] (gate | up)."""
    return torch.ops.draftwise_glue.glu(gate, up, ACTIVATIONS[activation])

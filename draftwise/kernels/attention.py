"""Row-exact decode/verification attention: one C++ call per layer (csrc/attention*.{h,cpp}) computes, for every
real query (b, t) of a chunk, softmax(scale * q K^T) V over exactly keys [start, first_b + t] of sequence b
(its K/V in the pages its block-table row names; start = max(0, end - window) on sliding-window layers), GQA
included, float32 or bfloat16 queries over float32 or bfloat16 K/V (fp32 accumulation), in parallel over
(b, t, head) items.

Owns: whether the op can run here (it is built into the one library, kernels/library.py: `library.load`, KernelBuildError without a
compiler) and its Python signature; its ISA path is chosen by csrc/dispatch.h's rule, like every op of the library
('auto': the best this CPU runs; `cpu_paths` lists them). Knows nothing of models beyond the KV cache's layout
(kv_cache.py: per layer a pool [blocks, kv heads, block_size, head_dim] passed as it is, no copy; position p of
sequence b in block tables[b, p // block_size], row p % block_size).

Exactness: one query's result is a fixed sequence of float operations on that query, its keys and its values
(csrc/attention.h documents it), never on B, T, the other queries, the thread split or which blocks hold the
keys — so a token attended
inside a k + 1 verification chunk or a padded batch is bitwise the token attended alone (T = 1, B = 1). The
baseline (no -m flags), AVX2 and AVX-512 builds perform the same operations, every product-accumulate one fused
multiply-add (exactly rounded: libm's fmaf in the baseline unit), compiler contraction off: they agree bitwise, and
the library still loads on CPUs without AVX-512. Where the CPU has AMX-BF16 tiles and the K/V are bfloat16, 'auto'
takes the AMX path ('amx', csrc/attention_amx.cpp) for every width instead: the same exactness per row, its own bits
(TDPBF16PS does not round like a chain of fp32 FMAs, so it cannot agree with the other paths; `amx()` says whether
it runs here).
"""
from __future__ import annotations

import torch

from draftwise.kernels import library

PATHS = library.PATHS  # ISA path name -> id, from the library (csrc/dispatch.h)
AMX_PATH = "amx"  # attention's own path (attention.cpp AMX_PATH): bf16 tiles, not bitwise the ISA paths
_AMX_ID = 3
ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """The op is built and loaded (built on first use; False, once and for all, where it cannot be)."""
    return library.loads()


def usable(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """The op can compute attention for these tensors (CPU; q and the cache each float32 or bfloat16; library
    available)."""
    return (q.device.type == "cpu" and keys.device.type == "cpu" and q.dtype in ATTENTION_DTYPES
            and keys.dtype in ATTENTION_DTYPES and available())


def cpu_paths() -> list[str]:
    """The ISA paths the op can run on this CPU that agree bitwise, slowest first (the last is what 'auto' picks,
    except where `amx()` holds and the K/V are bfloat16)."""
    library.load()
    return library.path_names(torch.ops.draftwise_attn.paths())


def amx() -> bool:
    """This process runs the AMX path (CPU with AMX-BF16 tiles, no $DRAFTWISE_MAX_ISA cap, tile data permitted):
    'auto' then takes it for bfloat16 K/V with head_dim a multiple of 32 up to 256, at every width. Its rows are
    row-exact among themselves but not bitwise the other paths' (TDPBF16PS rounds its sums its own way)."""
    library.load()
    return bool(torch.ops.draftwise_attn.amx())


def _path_id(path: str) -> int:
    return _AMX_ID if path == AMX_PATH else library.path_id(path)


def attend_rows(
    q: torch.Tensor,  # [B, H, T, D], D contiguous
    keys: torch.Tensor,  # one layer's pool [P, H_kv, BS, D]
    values: torch.Tensor,  # [P, H_kv, BS, D]
    tables: torch.Tensor,  # [B, nb] int64 block-table rows (KVCache.table); BS % 16 == 0 unless nb == 1
    positions: torch.Tensor,  # [B, T] int64; positions[b, t] = positions[b, 0] + t
    num_tokens: list[int],  # real queries per sequence; rows t >= num_tokens[b] come back zero
    scale: float,
    window: int | None = None,  # sliding window: query at position p sees keys p - window + 1 .. p
    path: str = "auto",
) -> torch.Tensor:  # [B, H, T, D], a view of contiguous [B, T, H, D] storage
    """Query t of sequence b attends over keys [max(0, end - window), end) of sequence b (blocks tables[b]), end = positions[b, 0]
    + t + 1 (the K/V of the chunk itself must already be in the cache)."""
    return torch.ops.draftwise_attn.decode(q, keys, values, tables, positions, num_tokens, float(scale),
                                           int(window or 0), _path_id(path))


def attend_tree(
    q: torch.Tensor,  # [B, H, T, D], D contiguous; T <= 64
    keys: torch.Tensor,  # one layer's pool [P, H_kv, BS, D]
    values: torch.Tensor,  # [P, H_kv, BS, D]
    tables: torch.Tensor,  # [B, nb] int64 block-table rows (KVCache.table); BS % 16 == 0 unless nb == 1
    positions: torch.Tensor,  # [B, T] int64; the chunk's K/V at cache positions positions[b, 0] + t
    num_tokens: list[int],  # real queries per sequence; rows t >= num_tokens[b] come back zero
    ancestors: torch.Tensor,  # [B, T] int64 bitmasks: bit i of row t = row i is t's ancestor (or t itself)
    scale: float,
    window: int | None = None,
    path: str = "auto",
) -> torch.Tensor:  # [B, H, T, D], as attend_rows
    """Token-tree verification: row t of sequence b attends the keys of sequence b before positions[b, 0], then
    the chunk rows its ancestor mask names, in row order (a sliding window keeps the list's last `window`). Parents
    precede children, so each row is bitwise attend_rows' row for the chain of its path."""
    return torch.ops.draftwise_attn.tree(q, keys, values, tables, positions, num_tokens, ancestors.contiguous(),
                                         float(scale), int(window or 0), _path_id(path))

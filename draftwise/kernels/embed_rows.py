"""The rows of an embedding table kept as a GGUF stores it, decoded to float32 in one C++ call (csrc/embed_rows.cpp,
built into the one library, kernels/library.py): bitwise the rows the `gguf` package's dequantizer gives for the
same bytes (the csrc file lists each type's float32 sequence), without its per-call numpy overhead (~46 us a Q6_K
row of 2048, a fixed cost of every decode step).

Owns: which GGUF types the op decodes (`DECODED_TYPES`), whether it can run here (`available`) and its Python
signature (`rows`). Types it does not decode stay with the caller's `gguf` path (models/quant.py GGUFRowsEmbedding).
Knows nothing of models or checkpoints.
"""
from __future__ import annotations

import torch

from draftwise.kernels import library

DECODED_TYPES = frozenset({"Q6_K", "Q8_0", "F16", "BF16", "F32"})  # csrc/embed_rows.cpp layout_of


def available() -> bool:
    """The op is built and loaded (built on first use; False, once and for all, where it cannot be)."""
    return library.loads()


def rows(raw: torch.Tensor, ids: torch.Tensor, gguf_type: str, H: int) -> torch.Tensor:
    """raw [V, row bytes] uint8 (contiguous), ids [n] int64 -> [n, H] float32: row j is raw[ids[j]] decoded as
    `gguf.quants.dequantize` decodes it. An id outside [0, V) raises IndexError."""
    library.load()
    return torch.ops.draftwise_embed.rows(raw, ids, gguf_type, H)

"""GGUF block types other than Q4_K, read exactly and packed for our kernels: Q6_K for csrc/q6k.h, Q8_0 and Q5_0
for csrc/q8_0.h (a Q5_0 value, 0..31 - 16, is exact in Q8_0's int8), plus simple quantizers that build the same
layouts from float weights (tests, `make_linear`, a dense checkpoint pinned to these kernels).

Owns: the ggml block layouts of these types (parsing raw bytes into integer values and scales, as ggml's
dequantize_row_* reads them), the packing into the kernels' 16-column layouts, and `dequantize_*` (the float weight
the parts represent, what the kernels compute with). The linear modules are kernels/linear.py's Q6KLinear and
Q80Linear; which tensor gets which is models/quant.py's. Knows nothing of files, models or torch ops.
"""
from __future__ import annotations

import torch

from draftwise.kernels import blocktypes

COLS = 16  # output columns per packed block (as q4x8)
QK_K = 256  # K values per K-quant super-block
# values and bytes per block, per ggml type: kernels/blocktypes.py's table
BLOCK_BYTES = {name: t.block_bytes for name, t in blocktypes.TYPES.items()}
BLOCK_VALUES = {name: t.values for name, t in blocktypes.TYPES.items()}
Q6K_BLOCK_BYTES = BLOCK_BYTES["Q6_K"]  # ql[128], qh[64], scales[16] int8, d fp16
Q8_0_BLOCK_BYTES = BLOCK_BYTES["Q8_0"]  # d fp16, qs[32] int8
Q5_0_BLOCK_BYTES = BLOCK_BYTES["Q5_0"]  # d fp16, qh[4] (bit j: value j's fifth bit), qs[16] (nibbles: values j and j + 16)


def _raw(blocks, N: int, K: int, kind: str) -> torch.Tensor:
    """Raw bytes (any uint8 array / tensor of N rows) -> [N * K / values, block bytes] uint8."""
    per = BLOCK_VALUES[kind]
    if K % per:
        raise ValueError(f"{kind} rows are whole blocks of {per} values, got K={K}")
    raw = torch.as_tensor(blocks).reshape(-1).view(torch.uint8)
    if raw.numel() != N * K // per * BLOCK_BYTES[kind]:
        raise ValueError(f"{kind} tensor [{N}, {K}] needs {N * K // per * BLOCK_BYTES[kind]} bytes, got {raw.numel()}")
    return raw.reshape(N * K // per, BLOCK_BYTES[kind])


def _pad(t: torch.Tensor, N: int) -> torch.Tensor:  # t [N, ...] -> [NB * 16, ...], zero rows appended
    Np = -(-N // COLS) * COLS
    if t.shape[0] == Np:
        return t
    out = torch.zeros(Np, *t.shape[1:], dtype=t.dtype)
    out[:N] = t
    return out


# ---- Q6_K ---------------------------------------------------------------------------------------------------

def q6k_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF Q6_K tensor's raw bytes (N rows of K / 256 blocks of 210 bytes) -> parts q [N, K] uint8 (0..63),
    sc [N, K / 16] int8, d [N, K / 256] float32 with w = d * sc * (q - 32), exactly ggml's dequantize_row_q6_K:
    per half of 128 values, byte l < 32 of ql (64 bytes) holds value l (low nibble) and l + 64 (high nibble), byte
    l + 32 values l + 32 and l + 96; byte l of qh (32 bytes) the top 2 bits of values l, l + 32, l + 64, l + 96."""
    raw = _raw(blocks, N, K, "Q6_K")
    nb = raw.shape[0]
    ql = raw[:, :128].reshape(nb, 2, 2, 32)  # [block, half, l // 32, l % 32]
    qh = raw[:, 128:192].reshape(nb, 2, 1, 32)
    lo = torch.stack([ql & 15, ql >> 4], dim=2).reshape(nb, 2, 4, 32)  # quarter j: values 32 j + l of the half
    top = torch.cat([(qh >> (2 * j)) & 3 for j in range(4)], dim=2)  # [block, half, 4, 32]
    q = (lo | (top << 4)).reshape(N, K)
    sc = raw[:, 192:208].contiguous().view(torch.int8).reshape(N, K // 16)
    d = raw[:, 208:210].contiguous().view(torch.float16).float().reshape(N, K // QK_K)
    return {"q": q.contiguous(), "sc": sc.contiguous(), "d": d.contiguous()}


def quantize_q6k(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] (K % 256 == 0) -> Q6_K-style parts (a simple max-abs quantizer, not llama.cpp's search)."""
    N, K = weight.shape
    if K % QK_K:
        raise ValueError(f"Q6_K needs K divisible by {QK_K}, got K={K}")
    w = weight.detach().float().view(N, K // 16, 16)
    scale = w.abs().amax(-1) / 31.0  # [N, K/16]
    d = scale.view(N, K // QK_K, 16).abs().amax(-1) / 127.0  # [N, S]
    dg = d.repeat_interleave(16, dim=1)
    sc = torch.where(dg > 0, (scale / dg.clamp(min=1e-30)).round(), torch.zeros_like(scale)).clamp(-127, 127)
    s_eff = dg * sc
    q = torch.where(s_eff[..., None] > 0, (w / s_eff[..., None].clamp(min=1e-30)).round(), torch.zeros_like(w))
    q = (q.clamp(-32, 31) + 32).to(torch.uint8).view(N, K)
    return {"q": q, "sc": sc.to(torch.int8), "d": d.contiguous()}


def dequantize_q6k(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [N, K] float32 the parts represent: (d * sc) * (q - 32)."""
    q = parts["q"]
    N, K = q.shape
    s = parts["d"].repeat_interleave(16, dim=1) * parts["sc"].float()  # [N, K/16]
    return (s[..., None] * (q.reshape(N, K // 16, 16).float() - 32)).reshape(N, K)


def pack_q6k(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q6_K parts -> csrc/q6k.h's layout: ql [NB, G, 4, 64], qh [NB, G, 2, 64] uint8, sc [NB, G, 2, 16] int8,
    d [NB, S, 16] float32."""
    q, sc, d = parts["q"], parts["sc"], parts["d"]
    N, K = q.shape
    G, S = K // 32, K // QK_K
    NB = -(-N // COLS)
    qp = _pad(q, N).view(NB, COLS, G, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [b, g, c, col, t, half]
    low, top = qp & 15, (qp >> 4).to(torch.uint8)
    ql = (low[..., 0] | (low[..., 1] << 4)).contiguous().view(NB, G, 4, 64)
    tp = top.reshape(NB, G, 2, 2, COLS, 4, 2)  # [b, g, pair, chunk in pair, col, t, half]
    qh = torch.zeros(NB, G, 2, COLS, 4, dtype=torch.uint8)
    for r in range(2):
        for h in range(2):
            qh |= tp[:, :, :, r, :, :, h] << (4 * r + 2 * h)
    scp = _pad(sc, N).view(NB, COLS, G, 2).permute(0, 2, 3, 1).contiguous()
    dp = _pad(d.float(), N).view(NB, COLS, S).transpose(1, 2).contiguous()
    return {"ql": ql, "qh": qh.view(NB, G, 2, 64), "sc": scp, "d": dp}


def q6k_bytes(N: int, K: int) -> int:
    """Bytes of pack_q6k's output: per 16 columns and 32 K values 256 (ql) + 128 (qh) + 32 (sc), per 256 K values
    64 (d): 6.625 bits per weight (the file's Q6_K: 6.5625)."""
    NB = -(-N // COLS)
    return NB * (K // 32) * (256 + 128 + 32) + NB * (K // QK_K) * COLS * 4


# ---- Q8_0 and Q5_0 ------------------------------------------------------------------------------------------

def q8_0_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF Q8_0 tensor's raw bytes -> parts v [N, K] int8, d [N, K / 32] float32 with w = d * v."""
    raw = _raw(blocks, N, K, "Q8_0")
    d = raw[:, :2].contiguous().view(torch.float16).float().reshape(N, K // 32)
    v = raw[:, 2:].contiguous().view(torch.int8).reshape(N, K)
    return {"v": v, "d": d}


def q5_0_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF Q5_0 tensor's raw bytes -> the same parts (v = 5-bit value - 16, in -16..15), exactly ggml's
    dequantize_row_q5_0: value j < 16 is the low nibble of qs[j] plus bit j of qh as its fifth bit, value j + 16
    the high nibble of qs[j] plus bit j + 16."""
    raw = _raw(blocks, N, K, "Q5_0")
    nb = raw.shape[0]
    d = raw[:, :2].contiguous().view(torch.float16).float().reshape(N, K // 32)
    qh = raw[:, 2:6].to(torch.int64)
    bits = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)  # [blocks]
    fifth = ((bits[:, None] >> torch.arange(32)) & 1).to(torch.uint8)  # [blocks, 32]
    qs = raw[:, 6:22]
    nib = torch.cat([qs & 15, qs >> 4], dim=1)  # [blocks, 32]
    v = ((nib | (fifth << 4)).to(torch.int16) - 16).to(torch.int8).reshape(N, K)
    del nb
    return {"v": v, "d": d}


def quantize_q8_0(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] (K % 32 == 0) -> Q8_0 parts, as ggml quantizes: d = amax / 127 per 32, v = round(w / d)."""
    N, K = weight.shape
    if K % 32:
        raise ValueError(f"Q8_0 needs K divisible by 32, got K={K}")
    w = weight.detach().float().view(N, K // 32, 32)
    d = w.abs().amax(-1) / 127.0
    v = torch.where(d[..., None] > 0, (w / d[..., None].clamp(min=1e-30)).round(), torch.zeros_like(w))
    return {"v": v.clamp(-127, 127).to(torch.int8).view(N, K), "d": d.contiguous()}


def dequantize_q8_0(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    v = parts["v"]
    N, K = v.shape
    return (parts["d"][..., None] * v.reshape(N, K // 32, 32).float()).reshape(N, K)


def pack_q8_0(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q8_0 parts -> csrc/q8_0.h's layout: qw [NB, G, 8, 64] uint8 (v + 128), d [NB, G, 16] float32. A value of
    -128 (which ggml's quantizers never write) is refused: the AVX2 path's signed product cannot take it."""
    v, d = parts["v"], parts["d"]
    N, K = v.shape
    if bool((v == -128).any()):
        raise ValueError("a Q8_0 value of -128: the q8_0 kernel takes -127..127")
    G, NB = K // 32, -(-N // COLS)
    u = (_pad(v, N).to(torch.int16) + 128).to(torch.uint8)
    qw = u.view(NB, COLS, G, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(NB, G, 8, 64)
    dp = _pad(d.float(), N).view(NB, COLS, G).transpose(1, 2).contiguous()
    return {"qw": qw, "d": dp}


def q8_0_bytes(N: int, K: int) -> int:
    """Bytes of pack_q8_0's output: 8 bits per weight plus a float32 per 32 (9 bits per weight; the file's Q8_0:
    8.5, Q5_0: 5.5)."""
    NB = -(-N // COLS)
    return NB * (K // 32) * (512 + COLS * 4)


def unpack_q6k(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q6k's buffers -> the parts of the 16-column blocks [b0, b1) (rows 16 b0 .. 16 b1), the inverse of
    pack_q6k: dequantize_q6k of them is those rows' weights."""
    ql, qh, sc, d = (packed[k][b0:b1] for k in ("ql", "qh", "sc", "d"))
    nb, G = ql.shape[:2]
    lo = ql.view(nb, G, 4, COLS, 4)
    hi = qh.view(nb, G, 2, 1, COLS, 4).expand(nb, G, 2, 2, COLS, 4).reshape(nb, G, 4, COLS, 4)
    shift = (4 * (torch.arange(4) % 2)).view(1, 1, 4, 1, 1).to(torch.uint8)  # chunk c = 2 p + r: bits 4 r + 2 half
    halves = [((lo >> (4 * h)) & 15) | (((hi >> (shift + 2 * h)) & 3) << 4) for h in range(2)]
    q = torch.stack(halves, dim=-1)  # [b, g, c, col, t, half]
    q = q.permute(0, 3, 1, 5, 2, 4).reshape(nb * COLS, G * 32)  # K index 32 g + 16 half + 4 c + t
    return {"q": q, "sc": sc.permute(0, 3, 1, 2).reshape(nb * COLS, G * 2),
            "d": d.permute(0, 2, 1).reshape(nb * COLS, -1)}


def unpack_q8_0(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q8_0's buffers -> the parts of the 16-column blocks [b0, b1), the inverse of pack_q8_0."""
    qw, d = packed["qw"][b0:b1], packed["d"][b0:b1]
    nb, G = qw.shape[:2]
    v = (qw.view(nb, G, 8, COLS, 4).to(torch.int16) - 128).to(torch.int8)
    return {"v": v.permute(0, 3, 1, 2, 4).reshape(nb * COLS, G * 32), "d": d.permute(0, 2, 1).reshape(nb * COLS, G)}


FROM_BLOCKS = {"Q6_K": q6k_from_blocks, "Q8_0": q8_0_from_blocks, "Q5_0": q5_0_from_blocks}

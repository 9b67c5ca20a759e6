"""GGUF block types other than Q4_K, read exactly and packed for our kernels: Q5_K for csrc/q4x8.h with its fifth-bit
plane (the q5x8 kernel: q4x8's parts and packing, kernels/q4x8.py, plus the plane); Q6_K and Q3_K for csrc/q6k.h (each
in its own value planes: kernels q6k and q3k), Q2_K for
its min-term form (the q6m kernel: w = d * sc * (q - 32) - dmin * m per 16); Q8_0 and
Q5_0 for csrc/q8_0.h (values exact in int8, group scales held exactly in the narrowest of its scale forms: the fp16
the file stores, or SUB8's int8 per group times an fp16 per 256 for IQ4_XS), Q4_0, IQ4_NL and IQ4_XS for its 4-bit
codes form (the q4c kernel: a 16-entry table), Q4_1 and Q5_1 for its codes, fifth-bit plane and min-term form
(the q5m kernel: w = d * v + m per 32; q8_1 holds the same parts as bytes), plus simple quantizers that build the same layouts from
float weights (tests, `make_linear`, a dense checkpoint pinned to these kernels). Which type goes to which kernel
is kernels/blocktypes.py's table; here are the block layouts.

Owns: the ggml block layouts of these types (parsing raw bytes into integer values and scales, as ggml's
dequantize_row_* reads them), the packing into the kernels' 16-column layouts (for csrc/q8_0.h, the choice of
scale form: `_pack_scales`), and `dequantize_*` (the float weight
the parts represent, what the kernels compute with). The linear modules are kernels/linear.py's Q6KLinear and
Q80Linear; which tensor gets which is models/quant.py's. Knows nothing of files, models or torch ops.
"""
from __future__ import annotations

import torch

from draftwise.kernels import blocktypes
from draftwise.kernels import q4x8 as q4x8_format

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


def q3k_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF Q3_K tensor's raw bytes -> q3k parts, exactly ggml's dequantize_row_q3_K: w = d * (scale - 32) * q3 per
    16 values, q3 = low 2 bits - 4 where the high bit is 0, held as q = low | high << 2 (0..7, w = d * sc * (q - 4):
    csrc/q6k.h's 3-bit planes), the signed 6-bit scale as sc. Block (110 bytes):
    hmask[32] (bit j of byte l: value 32 j + l's high bit), qs[64] (half h of
    128 values: byte 32 h + l holds values 128 h + 32 j + l in bits 2j..2j+1), 12 bytes of 16 6-bit scales (low
    nibbles of bytes 0-7 for scales 0-7, their high nibbles 8-15, the top 2 bits from bytes 8-11), d fp16."""
    raw = _raw(blocks, N, K, "Q3_K")
    nb = raw.shape[0]
    low = (raw[:, 32:96].reshape(nb, 2, 1, 32) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1)) & 3
    high = (raw[:, 0:32].reshape(nb, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    q = low.reshape(nb, 256) | (high.reshape(nb, 256) << 2)
    ls = raw[:, 96:104].reshape(nb, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 2, 1)
    hs = raw[:, 104:108].reshape(nb, 1, 4) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 4, 1)
    sc = ((ls.reshape(nb, 16) & 15) | ((hs.reshape(nb, 16) & 3) << 4)).to(torch.int16) - 32
    d = raw[:, 108:110].contiguous().view(torch.float16).float().reshape(N, K // QK_K)
    return {"q": q.reshape(N, K).contiguous(), "sc": sc.to(torch.int8).reshape(N, K // 16), "d": d}


# csrc/q6k.h's layouts by kernel: (low bits, high bits) of the two value planes; the offset is 2^(bits - 1)
PLANES = {"q6k": (4, 2), "q3k": (2, 1)}
SCALE_TOP = {"q6k": 127, "q3k": 31}  # the largest scale the simple quantizers write (Q3_K's field: 6 bits, sc + 32)


def _offset(kernel: str) -> int:
    return 1 << (sum(PLANES[kernel]) - 1)


def _quantize_planes(weight: torch.Tensor, kernel: str) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] (K % 256 == 0) -> `kernel`'s parts (a simple max-abs quantizer per 16, not llama.cpp's
    search): q unsigned with offset OFF (q - OFF in -OFF..OFF - 1), sc int8 per 16, d per 256."""
    N, K = weight.shape
    if K % QK_K:
        raise ValueError(f"{kernel} needs K divisible by {QK_K}, got K={K}")
    off, top = _offset(kernel), SCALE_TOP[kernel]
    w = weight.detach().float().view(N, K // 16, 16)
    scale = w.abs().amax(-1) / (off - 1.0)  # [N, K/16]
    d = scale.view(N, K // QK_K, 16).abs().amax(-1) / float(top)  # [N, S]
    dg = d.repeat_interleave(16, dim=1)
    sc = torch.where(dg > 0, (scale / dg.clamp(min=1e-30)).round(), torch.zeros_like(scale)).clamp(-top, top)
    s_eff = dg * sc
    q = torch.where(s_eff[..., None] > 0, (w / s_eff[..., None].clamp(min=1e-30)).round(), torch.zeros_like(w))
    q = (q.clamp(-off, off - 1) + off).to(torch.uint8).view(N, K)
    return {"q": q, "sc": sc.to(torch.int8), "d": d.contiguous()}


def quantize_q6k(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] (K % 256 == 0) -> Q6_K-style parts (a simple max-abs quantizer, not llama.cpp's search)."""
    return _quantize_planes(weight, "q6k")


def quantize_q3k(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] (K % 256 == 0) -> Q3_K-style parts (3-bit values, q - 4 in -4..3, scales in Q3_K's range
    0..31; a simple max-abs quantizer)."""
    return _quantize_planes(weight, "q3k")


def _dequantize_planes(parts: dict[str, torch.Tensor], off: int) -> torch.Tensor:
    q = parts["q"]
    N, K = q.shape
    s = parts["d"].repeat_interleave(16, dim=1) * parts["sc"].float()  # [N, K/16]
    return (s[..., None] * (q.reshape(N, K // 16, 16).float() - off)).reshape(N, K)


def dequantize_q6k(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [N, K] float32 the parts represent: (d * sc) * (q - 32)."""
    return _dequantize_planes(parts, _offset("q6k"))


def dequantize_q3k(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [N, K] float32 q3k parts represent: (d * sc) * (q - 4)."""
    return _dequantize_planes(parts, _offset("q3k"))


def _pack_planes(parts: dict[str, torch.Tensor], kernel: str) -> dict[str, torch.Tensor]:
    """Parts -> csrc/q6k.h's layout of `kernel`'s planes: ql [NB, G, LB, 64], qh [NB, G, HB, 64] uint8 (value v = 2 c +
    half of a chunk in byte row v * B / 8 at bit (v * B) % 8 of a plane of B bits), sc [NB, G, 2, 16] int8, d
    [NB, S, 16] float32."""
    q, sc, d = parts["q"], parts["sc"], parts["d"]
    N, K = q.shape
    G, NB = K // 32, -(-N // COLS)
    # [b, g, c, half, col, t] -> [b, g, v = 2 c + half, byte i = 4 col + t]
    qv = _pad(q, N).view(NB, COLS, G, 2, 4, 4).permute(0, 2, 4, 3, 1, 5).reshape(NB, G, 8, 64)
    planes, start = {}, 0
    for name, B in zip(("ql", "qh"), PLANES[kernel]):
        per = 8 // B  # values per byte
        bits = ((qv >> start) & ((1 << B) - 1)).view(NB, G, B, per, 64)
        plane = torch.zeros(NB, G, B, 64, dtype=torch.uint8)
        for slot in range(per):
            plane |= bits[:, :, :, slot] << (B * slot)
        planes[name], start = plane, start + B
    return {**planes, **_pack_q6k_scales(sc, d, N)}


def _unpack_planes(packed: dict[str, torch.Tensor], b0: int, b1: int, kernel: str) -> dict[str, torch.Tensor]:
    """_pack_planes's buffers -> the parts of the 16-column blocks [b0, b1) (rows 16 b0 .. 16 b1)."""
    nb, G = packed["ql"][b0:b1].shape[:2]
    q, start = torch.zeros(nb, G, 8, 64, dtype=torch.uint8), 0
    for name, B in zip(("ql", "qh"), PLANES[kernel]):
        per = 8 // B
        plane = packed[name][b0:b1]
        bits = torch.stack([(plane >> (B * slot)) & ((1 << B) - 1) for slot in range(per)], dim=3)  # [b, g, B, per, 64]
        q |= bits.reshape(nb, G, 8, 64) << start
        start += B
    q = q.view(nb, G, 4, 2, COLS, 4).permute(0, 4, 1, 3, 2, 5).reshape(nb * COLS, G * 32)  # K: 32 g + 16 half + 4 c + t
    return {"q": q, **_unpack_q6k_scales(packed["sc"][b0:b1], packed["d"][b0:b1])}


def pack_q6k(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q6_K parts -> csrc/q6k.h's layout: ql [NB, G, 4, 64], qh [NB, G, 2, 64] uint8, sc [NB, G, 2, 16] int8,
    d [NB, S, 16] float32."""
    return _pack_planes(parts, "q6k")


def pack_q3k(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q3k parts -> csrc/q6k.h's 3-bit layout: ql [NB, G, 2, 64], qh [NB, G, 1, 64] uint8, sc and d as q6k's."""
    return _pack_planes(parts, "q3k")


def unpack_q3k(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q3k's buffers -> the parts of the 16-column blocks [b0, b1)."""
    return _unpack_planes(packed, b0, b1, "q3k")


def q3k_bytes(N: int, K: int) -> int:
    """Bytes of pack_q3k's output: per 16 columns and 32 K values 128 (ql) + 64 (qh) + 32 (sc), per 256 K values
    64 (d): 3.625 bits per weight (the file's Q3_K: 3.4375)."""
    NB = -(-N // COLS)
    return NB * (K // 32) * (128 + 64 + 32) + NB * (K // QK_K) * COLS * 4


def _pack_q6k_scales(sc: torch.Tensor, d: torch.Tensor, N: int) -> dict[str, torch.Tensor]:
    """sc [N, K / 16] int8, d [N, K / 256] -> csrc/q6k.h's sc [NB, G, 2, 16] int8 and d [NB, S, 16] float32 (q6m's
    mn and dmin take the same layout)."""
    NB, G, S = -(-N // COLS), sc.shape[1] // 2, d.shape[1]
    scp = _pad(sc, N).view(NB, COLS, G, 2).permute(0, 2, 3, 1).contiguous()
    dp = _pad(d.float(), N).view(NB, COLS, S).transpose(1, 2).contiguous()
    return {"sc": scp, "d": dp}


def _unpack_q6k_scales(sc: torch.Tensor, d: torch.Tensor) -> dict[str, torch.Tensor]:
    """_pack_q6k_scales's sc and d of nb blocks -> sc [nb * 16, K / 16] int8, d [nb * 16, K / 256] float32."""
    nb = sc.shape[0]
    return {"sc": sc.permute(0, 3, 1, 2).reshape(nb * COLS, -1), "d": d.permute(0, 2, 1).reshape(nb * COLS, -1)}


def q6k_bytes(N: int, K: int) -> int:
    """Bytes of pack_q6k's output: per 16 columns and 32 K values 256 (ql) + 128 (qh) + 32 (sc), per 256 K values
    64 (d): 6.625 bits per weight (the file's Q6_K: 6.5625)."""
    NB = -(-N // COLS)
    return NB * (K // 32) * (256 + 128 + 32) + NB * (K // QK_K) * COLS * 4


# ---- Q2_K: q6k with a min term (the q6m kernel) ------------------------------------------------------------------

def q2k_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF Q2_K tensor's raw bytes -> q6m parts, exactly ggml's dequantize_row_q2_K: w = d * sc * q - dmin * m per
    16 values, q in 0..3 held as q + 32 (Q6_K's offset), sc and m (4 bits each) as sc and mn, d and dmin [N, K / 256]
    float32 (fp16 in the file: exact). Block (84 bytes): scales[16] (sub-block j: its scale in the low nibble, its
    min in the high), qs[64] (half h of 128 values: byte 32 h + l holds values 128 h + 32 i + l in bits 2i..2i+1),
    d, dmin fp16."""
    raw = _raw(blocks, N, K, "Q2_K")
    nb = raw.shape[0]
    q = (raw[:, 16:80].reshape(nb, 2, 1, 32) >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1)) & 3
    scales = raw[:, 0:16]
    return {"q": (q.reshape(N, K) + 32).contiguous(), "sc": (scales & 15).view(torch.int8).reshape(N, K // 16),
            "d": _fp16(raw, 80).reshape(N, K // QK_K), "mn": (scales >> 4).view(torch.int8).reshape(N, K // 16),
            "dmin": _fp16(raw, 82).reshape(N, K // QK_K)}


def quantize_q6m(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] (K % 256 == 0) -> Q2_K-style q6m parts (a simple min-max quantizer per 16, 4-bit scales and
    mins per super-block, 2-bit values; not llama.cpp's search)."""
    N, K = weight.shape
    if K % QK_K:
        raise ValueError(f"Q2_K needs K divisible by {QK_K}, got K={K}")
    w = weight.detach().float().view(N, K // 16, 16)
    low = (-w.amin(-1)).clamp(min=0)  # [N, K/16]: the min to subtract
    step = (w.amax(-1) + low) / 3.0
    per = lambda t: t.view(N, K // QK_K, 16).amax(-1) / 15.0  # noqa: E731  [N, S]
    d, dmin = per(step), per(low)
    spread = lambda t: t.repeat_interleave(16, dim=1)  # noqa: E731
    sc = torch.where(spread(d) > 0, (step / spread(d).clamp(min=1e-30)).round(), torch.zeros_like(step)).clamp(0, 15)
    mn = torch.where(spread(dmin) > 0, (low / spread(dmin).clamp(min=1e-30)).round(),
                     torch.zeros_like(low)).clamp(0, 15)
    s_eff, m_eff = spread(d) * sc, spread(dmin) * mn
    q = torch.where(s_eff[..., None] > 0, ((w + m_eff[..., None]) / s_eff[..., None].clamp(min=1e-30)).round(),
                    torch.zeros_like(w)).clamp(0, 3)
    return {"q": (q + 32).to(torch.uint8).view(N, K), "sc": sc.to(torch.int8), "d": d.contiguous(),
            "mn": mn.to(torch.int8), "dmin": dmin.contiguous()}


def dequantize_q6m(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [N, K] float32 the parts represent: (d * sc) * (q - 32) - dmin * mn, per 16 (gguf's order)."""
    w = dequantize_q6k(parts)
    N, K = w.shape
    m = parts["dmin"].repeat_interleave(16, dim=1) * parts["mn"].float()  # [N, K/16]
    return (w.view(N, K // 16, 16) - m[..., None]).view(N, K)


def pack_q6m(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q6m parts -> csrc/q6k.h's layout with the min term: pack_q6k's, then mn [NB, G, 2, 16] int8 (as sc) and dmin
    [NB, S, 16] float32 (as d)."""
    mins = _pack_q6k_scales(parts["mn"], parts["dmin"], parts["q"].shape[0])
    return {**pack_q6k(parts), "mn": mins["sc"], "dmin": mins["d"]}


def unpack_q6m(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q6m's buffers -> the q6m parts of the 16-column blocks [b0, b1)."""
    mins = _unpack_q6k_scales(packed["mn"][b0:b1], packed["dmin"][b0:b1])
    return {**unpack_q6k(packed, b0, b1), "mn": mins["sc"], "dmin": mins["d"]}


def q6m_bytes(N: int, K: int) -> int:
    """Bytes of pack_q6m's output: q6k's plus an int8 min per 16 and a float32 dmin per 256 (7.25 bits per weight;
    the file's Q2_K: 2.625)."""
    NB = -(-N // COLS)
    return q6k_bytes(N, K) + NB * (K // 32) * 32 + NB * (K // QK_K) * COLS * 4


# ---- the per-32 scales of csrc/q8_0.h in its three scale forms ------------------------------------------------

SUB8_BYTES = 160  # SUB8: per 16 columns and 8 groups, int8 sub [8, 16] then fp16 super [16]


def _fp16_exact(t: torch.Tensor) -> bool:  # t float32: every value an fp16, bit for bit (signed zeros too)
    return torch.equal(t.half().float().view(torch.int32), t.view(torch.int32))


def _pack_scales(parts: dict[str, torch.Tensor], names: tuple[str, ...], N: int,
                 scales: str | None) -> dict[str, torch.Tensor]:
    """The parts' per-32 scale terms `names` (d [N, G] float32, and m) -> csrc/q8_0.h's buffers in one scale form
    for all of them: `scales` "f32" ([NB, G, 16] float32), "f16" ([NB, G, 16] float16) or "sub8" ([NB, G / 8, 160]
    uint8, from the parts' `<name>_sub` [N, G] int8 and `<name>_super` [N, G / 8] float32 with name = sub * super);
    None: the narrowest exact one (sub8 where the parts carry subs, else f16 where every value is an fp16, else
    f32). ValueError when the form asked for would not hold the values bitwise."""
    if scales is None:
        scales = ("sub8" if all(f"{n}_sub" in parts for n in names)
                  else "f16" if all(_fp16_exact(parts[n].float()) for n in names) else "f32")
    G, NB = parts[names[0]].shape[1], -(-N // COLS)
    out = {}
    for n in names:
        d = parts[n].float()
        if scales == "f32":
            out[n] = _pad(d, N).view(NB, COLS, G).transpose(1, 2).contiguous()
        elif scales == "f16":
            if not _fp16_exact(d):
                raise ValueError(f"{n}: values that are not fp16 cannot take the f16 scale form")
            out[n] = _pad(d, N).view(NB, COLS, G).transpose(1, 2).contiguous().half()
        elif scales == "sub8":
            if f"{n}_sub" not in parts or f"{n}_super" not in parts:
                raise ValueError(f"{n}: sub8 takes the parts' {n}_sub and {n}_super")
            sub, sup = parts[f"{n}_sub"], parts[f"{n}_super"].float()
            if G % 8 or sub.shape != (N, G) or sup.shape != (N, G // 8) or not _fp16_exact(sup):
                raise ValueError(f"{n}: sub8 takes {n}_sub [N, G] int8 and {n}_super [N, G / 8] fp16 values, G % 8 == 0")
            if not torch.equal((sub.float() * sup.repeat_interleave(8, 1)).view(torch.int32), d.view(torch.int32)):
                raise ValueError(f"{n} is not bitwise {n}_sub * {n}_super")
            S = G // 8
            subp = _pad(sub.to(torch.int8), N).view(NB, COLS, S, 8).permute(0, 2, 3, 1).reshape(NB, S, 128)
            supp = _pad(sup.half(), N).view(NB, COLS, S).transpose(1, 2).contiguous().view(torch.uint8)
            out[n] = torch.cat([subp.view(torch.uint8), supp], dim=2).contiguous()
        else:
            raise ValueError(f"unknown scale form {scales!r} (f32, f16, sub8)")
    return out


def _unpack_scales(t: torch.Tensor) -> torch.Tensor:
    """A packed scale term of nb blocks in any form ([nb, G, 16] float32 / float16, [nb, G / 8, 160] uint8) -> its
    values [nb * 16, G] float32, bitwise what the kernels form."""
    nb = t.shape[0]
    if t.dtype == torch.uint8:
        S = t.shape[1]
        sub = t[..., :128].contiguous().view(torch.int8).view(nb, S, 8, COLS).float()
        sup = t[..., 128:].contiguous().view(torch.float16).float().view(nb, S, 1, COLS)
        t = (sub * sup).reshape(nb, S * 8, COLS)
    return t.float().permute(0, 2, 1).reshape(nb * COLS, -1)


def scale_bytes(N: int, K: int, scales: str) -> int:
    """Bytes of one packed scale term (d, or m) of a [N, K] weight in a scale form (blocktypes.SCALE_BITS)."""
    NB, G = -(-N // COLS), K // 32
    return NB * G // 8 * SUB8_BYTES if scales == "sub8" else NB * G * COLS * (2 if scales == "f16" else 4)


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


def pack_q8_0(parts: dict[str, torch.Tensor], scales: str | None = None) -> dict[str, torch.Tensor]:
    """Q8_0 parts -> csrc/q8_0.h's layout: qw [NB, G, 8, 64] uint8 (v + 128), d in the scale form `scales`
    (_pack_scales; None: the narrowest exact). A value of -128 (which ggml's quantizers never write) is refused:
    the AVX2 path's signed product cannot take it."""
    v = parts["v"]
    N, K = v.shape
    if bool((v == -128).any()):
        raise ValueError("a Q8_0 value of -128: the q8_0 kernel takes -127..127")
    G, NB = K // 32, -(-N // COLS)
    u = (_pad(v, N).to(torch.int16) + 128).to(torch.uint8)
    qw = u.view(NB, COLS, G, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(NB, G, 8, 64)
    return {"qw": qw, **_pack_scales(parts, ("d",), N, scales)}


def q8_0_bytes(N: int, K: int, scales: str = "f32") -> int:
    """Bytes of pack_q8_0's output: 8 bits per weight plus the scales in `scales` (float32: 9 bits per weight;
    fp16, Q8_0 and Q5_0: 8.5, the file's Q8_0 8.5, Q5_0 5.5)."""
    NB = -(-N // COLS)
    return NB * (K // 32) * 512 + scale_bytes(N, K, scales)


def unpack_q6k(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q6k's buffers -> the parts of the 16-column blocks [b0, b1) (rows 16 b0 .. 16 b1), the inverse of
    pack_q6k: dequantize_q6k of them is those rows' weights."""
    return _unpack_planes(packed, b0, b1, "q6k")


def unpack_q8_0(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q8_0's buffers -> the parts of the 16-column blocks [b0, b1), the inverse of pack_q8_0."""
    qw = packed["qw"][b0:b1]
    nb, G = qw.shape[:2]
    v = (qw.view(nb, G, 8, COLS, 4).to(torch.int16) - 128).to(torch.int8)
    return {"v": v.permute(0, 3, 1, 2, 4).reshape(nb * COLS, G * 32), "d": _unpack_scales(packed["d"][b0:b1])}


# ---- the other 32-value types on q8_0, and the types with a min on q8_1 ------------------------------------------

IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def _fp16(raw: torch.Tensor, at: int) -> torch.Tensor:  # raw [blocks, bytes] -> [blocks] float32, the fp16 at `at`
    return raw[:, at:at + 2].contiguous().view(torch.float16).float().reshape(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[blocks, ..., 16] bytes -> [blocks, ..., 32]: ggml's 32-value nibble order, value j < 16 the low nibble of
    byte j, value j + 16 its high nibble."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[blocks, 4] bytes, a little-endian uint32 whose bit j is value j's fifth bit -> [blocks, 32] uint8 (0 / 16)."""
    q = qh.to(torch.int64)
    bits = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)
    return (((bits[:, None] >> torch.arange(32)) & 1) << 4).to(torch.uint8)


def q4_0_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF Q4_0 tensor's raw bytes (d fp16, 16 bytes of nibbles) -> q8_0 parts, v = nibble - 8, exactly ggml's
    dequantize_row_q4_0."""
    raw = _raw(blocks, N, K, "Q4_0")
    v = (_nibbles(raw[:, 2:18]).to(torch.int16) - 8).to(torch.int8)
    return {"v": v.reshape(N, K), "d": _fp16(raw, 0).reshape(N, K // 32)}


def iq4_nl_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF IQ4_NL tensor's raw bytes (d fp16, 16 bytes of nibbles indexing IQ4_NL_VALUES) -> q8_0 parts, v the
    looked-up int8 (-127..113), exactly ggml's dequantize_row_iq4_nl."""
    raw = _raw(blocks, N, K, "IQ4_NL")
    v = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8)[_nibbles(raw[:, 2:18]).long()]
    return {"v": v.reshape(N, K), "d": _fp16(raw, 0).reshape(N, K // 32)}


def iq4_xs_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF IQ4_XS tensor's raw bytes -> q8_0 parts, exactly ggml's dequantize_row_iq4_xs: per 256 values d fp16,
    a uint16 of the 8 sub-blocks' top 2 scale bits (sub-block i at bits 2i), 4 bytes of their low 4 bits (sub-block
    i in nibble i % 2 of byte i / 2) and 8 x 16 bytes of nibbles indexing IQ4_NL_VALUES; the group scale
    d * (scale - 32) is exact in float32 (an fp16 times a 6-bit integer), and its factors are parts too (d_sub
    [N, K / 32] int8 = scale - 32, d_super [N, K / 256] = d: the SUB8 scale form)."""
    raw = _raw(blocks, N, K, "IQ4_XS")
    nb = raw.shape[0]
    hi = raw[:, 2].to(torch.int32) | (raw[:, 3].to(torch.int32) << 8)  # [blocks]
    lo = torch.stack([raw[:, 4:8] & 15, raw[:, 4:8] >> 4], dim=-1).reshape(nb, 8).to(torch.int32)
    ls = lo | (((hi[:, None] >> (2 * torch.arange(8))) & 3) << 4)  # [blocks, 8] in 0..63
    d = _fp16(raw, 0)[:, None] * (ls - 32).float()  # [blocks, 8]
    v = torch.tensor(IQ4_NL_VALUES, dtype=torch.int8)[_nibbles(raw[:, 8:].reshape(nb, 8, 16)).long()]
    return {"v": v.reshape(N, K), "d": d.reshape(N, K // 32),
            "d_sub": (ls - 32).to(torch.int8).reshape(N, K // 32), "d_super": _fp16(raw, 0).reshape(N, K // QK_K)}


def q4_1_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF Q4_1 tensor's raw bytes (d, m fp16, 16 bytes of nibbles) -> q8_1 parts v (0..15), d, m with
    w = d * v + m, exactly ggml's dequantize_row_q4_1."""
    raw = _raw(blocks, N, K, "Q4_1")
    return {"v": _nibbles(raw[:, 4:20]).to(torch.int8).reshape(N, K), "d": _fp16(raw, 0).reshape(N, K // 32),
            "m": _fp16(raw, 2).reshape(N, K // 32)}


def q5_1_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF Q5_1 tensor's raw bytes (d, m fp16, qh[4], 16 bytes of nibbles) -> q8_1 parts v (0..31), d, m,
    exactly ggml's dequantize_row_q5_1 (fifth bits as Q5_0's)."""
    raw = _raw(blocks, N, K, "Q5_1")
    v = (_nibbles(raw[:, 8:24]) | _fifth_bits(raw[:, 4:8])).to(torch.int8)
    return {"v": v.reshape(N, K), "d": _fp16(raw, 0).reshape(N, K // 32), "m": _fp16(raw, 2).reshape(N, K // 32)}


def _k_scales(sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of a Q4_K / Q5_K block's 6-bit scales and mins -> sc, mn [blocks, 8] int32 (ggml's
    get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7, 4-7 in the nibbles of bytes 8-11 plus
    the top 2 bits of bytes 0-7)."""
    sb = sb.to(torch.int32)
    sc = torch.cat([sb[:, 0:4] & 63, (sb[:, 8:12] & 15) | ((sb[:, 0:4] >> 6) << 4)], 1)
    mn = torch.cat([sb[:, 4:8] & 63, (sb[:, 8:12] >> 4) | ((sb[:, 4:8] >> 6) << 4)], 1)
    return sc, mn


def quantize_q8_1(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] (K % 32 == 0) -> q8_1 parts as ggml quantizes Q5_1: per 32, m = min, d = (max - min) / 31,
    v = round((w - m) / d) in 0..31."""
    N, K = weight.shape
    if K % 32:
        raise ValueError(f"q8_1 needs K divisible by 32, got K={K}")
    w = weight.detach().float().view(N, K // 32, 32)
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 31.0
    v = torch.where(d[..., None] > 0, ((w - lo[..., None]) / d[..., None].clamp(min=1e-30)).round(), torch.zeros_like(w))
    return {"v": v.clamp(0, 31).to(torch.int8).view(N, K), "d": d.contiguous(), "m": lo.contiguous()}


def dequantize_q8_1(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [N, K] float32 the parts represent: d * v + m per group of 32."""
    v = parts["v"]
    N, K = v.shape
    return (parts["d"][..., None] * v.reshape(N, K // 32, 32).float() + parts["m"][..., None]).reshape(N, K)


def pack_q8_1(parts: dict[str, torch.Tensor], scales: str | None = None) -> dict[str, torch.Tensor]:
    """q8_1 parts -> csrc/q8_0.h's layout with the min term: qw as pack_q8_0, d and m in one scale form
    (_pack_scales)."""
    out = pack_q8_0({"v": parts["v"], "d": parts["d"]}, "f32")
    return {"qw": out["qw"], **_pack_scales(parts, ("d", "m"), parts["v"].shape[0], scales)}


def unpack_q8_1(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q8_1's buffers -> the parts of the 16-column blocks [b0, b1)."""
    parts = unpack_q8_0(packed, b0, b1)
    return {**parts, "m": _unpack_scales(packed["m"][b0:b1])}


def q8_1_bytes(N: int, K: int, scales: str = "f32") -> int:
    """Bytes of pack_q8_1's output: q8_0's plus the min per 32 in the same scale form (float32: 10 bits per
    weight)."""
    return q8_0_bytes(N, K, scales) + scale_bytes(N, K, scales)



# ---- the same parts held as 4-bit codes: q4c (a 16-entry table per 16 columns) and q5m (plus a fifth-bit plane) ----

def _chunks(t: torch.Tensor, N: int) -> torch.Tensor:
    """[N, K] per-value bytes -> csrc/q8_0.h's chunk order [NB, G, 8, 64] (byte i of chunk c: column 16 b + i / 4,
    K value 32 g + 4 c + i % 4), rows padded with zeros."""
    K = t.shape[1]
    G, NB = K // 32, -(-N // COLS)
    return _pad(t, N).view(NB, COLS, G, 8, 4).permute(0, 2, 3, 1, 4).reshape(NB, G, 8, 64)


def _unchunk(t: torch.Tensor) -> torch.Tensor:
    """The inverse of _chunks: [nb, G, 8, 64] -> [nb * 16, G * 32]."""
    nb, G = t.shape[:2]
    return t.view(nb, G, 8, COLS, 4).permute(0, 3, 1, 2, 4).reshape(nb * COLS, G * 32)


def _code_lines(codes: torch.Tensor) -> torch.Tensor:
    """[NB, G, 8, 64] codes (0..15) -> [NB, G, 4, 64] bytes: chunk L in the low nibble, chunk L + 4 in the high."""
    return (codes[:, :, :4] | (codes[:, :, 4:] << 4)).contiguous()


def _line_codes(qs: torch.Tensor) -> torch.Tensor:
    """The inverse of _code_lines: [nb, G, 4, 64] -> [nb, G, 8, 64]."""
    return torch.cat([qs & 15, qs >> 4], dim=2)


def pack_q4c(parts: dict[str, torch.Tensor], scales: str | None = None) -> dict[str, torch.Tensor]:
    """q8_0 parts whose values take at most 16 distinct values (Q4_0: -8..7, IQ4_NL / IQ4_XS: the IQ4 table) ->
    csrc/q8_0.h's codes form: qs [NB, G, 4, 64] uint8 (codes into the table), lut [NB, 16] uint8 (the tensor's
    values + 128, in increasing order, repeated per block), d in the scale form `scales` (_pack_scales)."""
    v = parts["v"]
    N = v.shape[0]
    u = v.to(torch.int64) + 128
    present = torch.bincount(u.reshape(-1), minlength=256).nonzero().reshape(-1)
    if len(present) > 16:
        raise ValueError(f"q4c holds at most 16 distinct values per tensor, got {len(present)}")
    table = torch.cat([present, present[-1:].expand(16 - len(present))]) if len(present) else torch.full((16,), 128)
    code = torch.zeros(256, dtype=torch.uint8)
    code[present] = torch.arange(len(present), dtype=torch.uint8)
    NB = -(-N // COLS)
    return {"qs": _code_lines(_chunks(code[u], N)), "lut": table.to(torch.uint8).expand(NB, 16).contiguous(),
            **_pack_scales(parts, ("d",), N, scales)}


def unpack_q4c(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q4c's buffers -> the q8_0 parts of the 16-column blocks [b0, b1)."""
    qs, lut = packed["qs"][b0:b1], packed["lut"][b0:b1]
    codes = _line_codes(qs).long()  # [nb, G, 8, 64]
    nb = qs.shape[0]
    u = torch.gather(lut.long().view(nb, 1, 1, 16).expand(*codes.shape[:3], 16), 3, codes)
    return {"v": (_unchunk(u) - 128).to(torch.int8), "d": _unpack_scales(packed["d"][b0:b1])}


def quantize_q4c(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] (K % 32 == 0) -> q8_0 parts as ggml quantizes Q4_0: per 32, d = (the value of largest
    magnitude) / -8, v = round(w / d) clamped to -8..7."""
    N, K = weight.shape
    if K % 32:
        raise ValueError(f"q4c needs K divisible by 32, got K={K}")
    w = weight.detach().float().view(N, K // 32, 32)
    big = torch.gather(w, -1, w.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = big / -8.0
    v = torch.where(d[..., None] != 0, (w / torch.where(d == 0, 1.0, d)[..., None]).round(), torch.zeros_like(w))
    return {"v": v.clamp(-8, 7).to(torch.int8).view(N, K), "d": d.contiguous()}


dequantize_q4c = dequantize_q8_0


def q4c_bytes(N: int, K: int, scales: str = "f32") -> int:
    """Bytes of pack_q4c's output: 4 bits per weight plus the scales (float32: 5 bits per weight; fp16, Q4_0 and
    IQ4_NL: 4.5, as the file; sub8, IQ4_XS: 4.3125, the file 4.25), and the 16-byte table per 16 columns."""
    NB = -(-N // COLS)
    return NB * (K // 32) * 256 + scale_bytes(N, K, scales) + NB * 16


def pack_q5m(parts: dict[str, torch.Tensor], scales: str | None = None) -> dict[str, torch.Tensor]:
    """q8_1 parts (v in 0..31) -> csrc/q8_0.h's codes form with the fifth-bit plane and the min term: qs [NB, G, 4, 64]
    (the low 4 bits), qh [NB, G, 8, 8] uint8 (the fifth bits, chunk c's 64 as a little-endian uint64), lut [NB, 16]
    (128 + 0..15), d and m in one scale form `scales` (_pack_scales)."""
    v = parts["v"]
    N = v.shape[0]
    if bool(((v < 0) | (v > 31)).any()):
        raise ValueError("q5m holds values 0..31")
    u = _chunks(v.to(torch.uint8), N)  # [NB, G, 8, 64]
    NB, G = u.shape[:2]
    weights = (1 << torch.arange(8, dtype=torch.int32)).view(1, 1, 1, 1, 8)
    qh = ((u >> 4).view(NB, G, 8, 8, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)
    return {"qs": _code_lines(u & 15), "qh": qh.contiguous(),
            "lut": (torch.arange(16, dtype=torch.uint8) + 128).expand(NB, 16).contiguous(),
            **_pack_scales(parts, ("d", "m"), N, scales)}


def unpack_q5m(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q5m's buffers -> the q8_1 parts of the 16-column blocks [b0, b1)."""
    qs, qh, lut = packed["qs"][b0:b1], packed["qh"][b0:b1], packed["lut"][b0:b1]
    nb, G = qs.shape[:2]
    low = torch.gather(lut.long().view(nb, 1, 1, 16).expand(nb, G, 8, 16), 3, _line_codes(qs).long()) - 128
    fifth = ((qh.view(nb, G, 8, 8, 1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(nb, G, 8, 64).long() << 4
    return {"v": _unchunk(low + fifth).to(torch.int8), "d": _unpack_scales(packed["d"][b0:b1]),
            "m": _unpack_scales(packed["m"][b0:b1])}


quantize_q5m = quantize_q8_1
dequantize_q5m = dequantize_q8_1


def q5m_bytes(N: int, K: int, scales: str = "f32") -> int:
    """Bytes of pack_q5m's output: 5 bits per weight plus a scale and a min per 32 in one scale form (float32: 7
    bits per weight; fp16, Q4_1 and Q5_1: 6, the file's 5 and 6; sub8, Q5_K: 5.625, the file 5.5), and the 16-byte
    table per 16 columns."""
    NB = -(-N // COLS)
    return NB * (K // 32) * (256 + 64) + 2 * scale_bytes(N, K, scales) + NB * 16


# ---- Q5_K: q4x8's arithmetic with a fifth-bit plane (the q5x8 kernel) ------------------------------------------

def q5k_from_blocks(blocks, N: int, K: int) -> dict[str, torch.Tensor]:
    """A GGUF Q5_K tensor's raw bytes -> q5x8 parts, exactly ggml's dequantize_row_q5_K: w = d * sc * q - dmin * mn per
    sub-block of 32, q [N, K] uint8 in 0..31, sc and mn [N, K / 32] uint8 (6 bits), d and dmin [N, K / 256] float32
    (fp16 in the file: exact). Block (176 bytes): d, dmin fp16, 12 bytes of scales and mins (as Q4_K), qh[32] (bit i
    of byte l: sub-block i's value l, fifth bit), qs[128] (chunk j of 32 bytes: sub-block 2j in the low nibbles,
    2j + 1 in the high)."""
    raw = _raw(blocks, N, K, "Q5_K")
    nb = raw.shape[0]
    sc, mn = _k_scales(raw[:, 4:16])
    qs = raw[:, 48:176].reshape(nb, 4, 32)
    low = torch.stack([qs & 15, qs >> 4], dim=2).reshape(nb, 8, 32)
    top = ((raw[:, 16:48].reshape(nb, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1) << 4
    return q4x8_format.q4k_parts((low | top).reshape(N, K), _fp16(raw, 0).reshape(N, K // QK_K),
                                 _fp16(raw, 2).reshape(N, K // QK_K), sc.reshape(N, K // 32), mn.reshape(N, K // 32))


def quantize_q5x8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] (K % 32 == 0) -> Q5_K-style q5x8 parts (q4x8's quantizer with 5-bit values)."""
    return q4x8_format.quantize_q4(weight, bits=5)


dequantize_q5x8 = q4x8_format.dequantize_q4  # w = (d * sc) * q - dmin * mn per 32, gguf's order


def _plane_order(t: torch.Tensor, N: int) -> torch.Tensor:
    """[N, K] per-value bytes -> csrc/q4x8.h's packed order [NB, G, 4 (chunk), 2 (half), 64 (byte)]: byte j of chunk
    c's half h is column 16 b + j / 4, K value 32 g + 16 h + 4 c + j % 4 (rows padded with zeros)."""
    G, NB = t.shape[1] // 32, -(-N // COLS)
    return _pad(t, N).view(NB, COLS, G, 2, 4, 4).permute(0, 2, 4, 3, 1, 5).reshape(NB, G, 4, 2, 64)


def pack_q5x8(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q5x8 parts -> csrc/q4x8.h's layout with the plane: q4x8's buffers of the low 4 bits (q4x8.pack), and qh
    [NB, G, 4, 2, 8] uint8, per chunk and half a little-endian 64-bit mask of the values' fifth bits."""
    q = parts["q"]
    NB, G = -(-q.shape[0] // COLS), q.shape[1] // 32
    bits = _plane_order(q >> 4, q.shape[0]).reshape(NB, G, 4, 2, 8, 8).to(torch.int32)  # [..., byte, bit]
    qh = (bits << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)
    low = q4x8_format.pack({**parts, "q": q & 15})
    return {"packed": low["packed"], "qh": qh.contiguous(), **{k: low[k] for k in ("sc", "mn", "d", "dmin")}}


def unpack_q5x8(packed: dict[str, torch.Tensor], b0: int, b1: int) -> dict[str, torch.Tensor]:
    """pack_q5x8's buffers -> the q5x8 parts of the 16-column blocks [b0, b1)."""
    nib, qh = packed["packed"][b0:b1], packed["qh"][b0:b1]
    nb, G = nib.shape[:2]
    halves = torch.stack([nib & 15, nib >> 4], dim=3)  # [b, g, c, half, 64]
    fifth = (qh.view(nb, G, 4, 2, 8, 1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [b, g, c, half, 8, 8]
    v = halves | (fifth.view(nb, G, 4, 2, 64) << 4)
    q = v.view(nb, G, 4, 2, COLS, 4).permute(0, 4, 1, 3, 2, 5).reshape(nb * COLS, G * 32)
    cols = lambda t: t[b0:b1].transpose(1, 2).reshape(nb * COLS, -1)  # noqa: E731  [NB, X, 16] -> [NB * 16, X]
    return {"q": q.contiguous(), **{k: cols(packed[k]).contiguous() for k in ("sc", "mn", "d", "dmin")}}


def q5x8_bytes(N: int, K: int) -> int:
    """Bytes of pack_q5x8's output: q4x8's (4.75 bits per weight) plus the plane's 1 (5.75; the file's Q5_K: 5.5)."""
    return q4x8_format.packed_bytes(N, K) + -(-N // COLS) * (K // 32) * 64


FROM_BLOCKS = {"Q6_K": q6k_from_blocks, "Q8_0": q8_0_from_blocks, "Q5_0": q5_0_from_blocks, "Q4_0": q4_0_from_blocks,
               "IQ4_NL": iq4_nl_from_blocks, "IQ4_XS": iq4_xs_from_blocks, "Q4_1": q4_1_from_blocks,
               "Q5_1": q5_1_from_blocks, "Q5_K": q5k_from_blocks, "Q3_K": q3k_from_blocks, "Q2_K": q2k_from_blocks}

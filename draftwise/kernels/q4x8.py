"""Our CPU kernel "q4x8"'s weight format: int4 weights (groups of 32 along K, asymmetric like GGUF Q4_K) x int8
activations (quantized per row with one scale per 256 K values, symmetric like GGUF's Q8_K, plus per-32 integer
sums for the weights' min term), a C++ torch operator with an AVX-512 VNNI path and an AVX2 path chosen at run time
from cpuid (one binary serves both kinds of CPU).

Owns: quantizing an fp32 weight to the Q4_K-style representation, mapping Q4_K sub-blocks onto it exactly, packing
it into the kernel's layout (csrc/q4x8.h documents it), the packed embedding table `Q4x8Embedding`, and
`prefill_table`, which times the GEMV against the wide kernel at prompt widths (`draftwise kernels`). The linear
module is kernels/linear.py's `Q4x8Linear`; building and loading the one C++ library that holds this and every
other op (and the wide switch `wide_min_rows`) is kernels/library.py's; `load`, `build`, `KernelBuildError` and the
path helpers are re-exported here for callers outside kernels/. Knows nothing of checkpoints or decoders.

Exactness: every output row is bitwise the same whatever M is and whatever other rows share the call, on a
given path; the AVX-512, AVX2 and scalar paths perform the same float sequence, so they agree bitwise too.
Per super-block of 256 K values the scale and min terms are summed exactly in int32 (sc * isum and mn * qsum,
csrc/q4x8.h) and only then meet d, dmin and the activation scale in three float operations.
Why it is fast for verification: each weight block is unpacked once and used for all rows of the call
(up to 12 rows per tile on AVX-512, 4 on AVX2, further tiles re-read it from L1/L2), so decode is bound by
weight bandwidth (4.75 bits per weight) and a 9-row call costs little more than a 1-row call; at more rows the
arithmetic bounds it, and what each row adds per group beyond the dot products is one integer multiply and add.
"""
from __future__ import annotations

import torch
from torch import nn

from draftwise.kernels.library import (PATHS, KernelBuildError, build, check_path, cpu_paths, load,  # noqa: F401
                                       path_id, path_names)

GROUP = 32  # K values per scale/min group (a Q4_K sub-block)
SUPER = 8  # groups per super-block (Q4_K: 8 x 32 = 256), which share the fp32 d and dmin
COLS = 16  # output columns per packed block
QUANT_CHUNK_ROWS = 8192
PACKED = ("packed", "sc", "mn", "d", "dmin")  # the buffers `pack` returns, as a module's state holds them


PREFILL_WIDTHS = (64, 512)  # rows per call the prefill table times: a short prompt chunk and a long one


def prefill_table(shapes, widths=PREFILL_WIDTHS, repeats: int = 3) -> list[dict]:
    """Per (name, N, K) of `shapes` (autotune.ProjShape-like, the LM head skipped: prefill computes it on one row)
    and per width: ms per call of the best GEMV path and of the wide kernel (None where it cannot run), best
    of `repeats`, on random weights, and which one 'auto' takes there. Both give bitwise the same rows."""
    import time

    ops = load()
    gemv_path = int(ops.paths()[-1])
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in shapes:
        if shape.name == "lm_head":
            continue
        t = pack(quantize_q4(torch.randn(shape.N, shape.K, generator=gen)))
        args = (t["packed"], t["sc"], t["mn"], t["d"], t["dmin"], None, shape.N)
        for M in widths:
            x = torch.randn(M, shape.K, generator=gen)
            ms = {}
            kernels = {"gemv": lambda: ops.linear(x, *args, gemv_path)}
            if ops.wide_available():
                kernels["wide"] = lambda: ops.wide(x, *args)
            for name, run in kernels.items():
                run()
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    run()
                    best = min(best, time.perf_counter() - t0)
                ms[name] = best * 1e3
            rows.append({"name": shape.name, "N": shape.N, "K": shape.K, "rows": M, "gemv_ms": ms["gemv"],
                         "wide_ms": ms.get("wide"), "auto": "wide" if M >= ops.wide_min_rows() and "wide" in ms
                         else "gemv"})
    return rows


def format_prefill_table(rows: list[dict]) -> str:
    ops = load()
    side = {"amx": "the AMX GEMM", "vnni": "the AVX-512 VNNI row-blocked GEMM"}.get(ops.wide_kind(), "none")
    head = (f"q4x8 at prefill widths (ms per call; 'wide' = {side}, bitwise the GEMV's rows; 'auto' takes it "
            f"from {ops.wide_min_rows() if ops.wide_available() else 'no'} rows on)")
    lines = [head, f"  {'projection':28s} {'N x K':>12s} {'rows':>5s} {'gemv ms':>9s} {'wide ms':>9s} {'speed-up':>8s}  auto"]
    for r in rows:
        wide = f"{r['wide_ms']:9.2f}" if r["wide_ms"] is not None else f"{'-':>9s}"
        up = f"{r['gemv_ms'] / r['wide_ms']:7.2f}x" if r["wide_ms"] else f"{'-':>8s}"
        lines.append(f"  {r['name'][:28]:28s} {r['N']:>5d} x {r['K']:<5d} {r['rows']:5d} {r['gemv_ms']:9.2f} {wide} {up}  "
                     f"{r['auto']}")
    return "\n".join(lines)


# ---- weights -------------------------------------------------------------------------------------------------

def quantize_q4(weight: torch.Tensor, bits: int = 4) -> dict[str, torch.Tensor]:
    """fp32 weight [N, K] -> Q4_K-style parts: q [N, K] uint8 (0..15), sc/mn [N, G] uint8, d/dmin [N, S] float32,
    with w ~= d * sc * q - dmin * mn per group of 32 (the group's range min(w, 0)..max(w), like Q4_K, but with
    8-bit sub-scales where Q4_K has 6). bits=5: q in 0..31, Q5_K-style (the q5x8 kernel's parts)."""
    N, K = weight.shape
    if K % GROUP:
        raise ValueError(f"q4x8 needs K divisible by {GROUP}, got K={K}")
    if N > QUANT_CHUNK_ROWS:  # rows are independent: bound the float32 temporaries (an LM head is 150k rows)
        chunks = [quantize_q4(weight[i:i + QUANT_CHUNK_ROWS], bits) for i in range(0, N, QUANT_CHUNK_ROWS)]
        return {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}
    w = weight.detach().float()
    G = K // GROUP
    S = (G + SUPER - 1) // SUPER
    wg = w.view(N, G, GROUP)
    lo = wg.amin(-1).clamp(max=0.0)  # [N, G]
    hi = wg.amax(-1)
    top = (1 << bits) - 1
    scale = (hi - lo) / float(top)  # [N, G] >= 0
    minv = -lo  # [N, G] >= 0

    def split(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # v [N, G] >= 0 -> d [N, S], code [N, G]
        pad = torch.zeros(N, S * SUPER, dtype=v.dtype)
        pad[:, :G] = v
        d = pad.view(N, S, SUPER).amax(-1) / 255.0  # [N, S]
        dg = d.repeat_interleave(SUPER, dim=1)[:, :G]
        code = torch.where(dg > 0, (v / dg.clamp(min=1e-30)).round(), torch.zeros_like(v)).clamp(0, 255)
        return d.contiguous(), code.to(torch.uint8)

    d, sc = split(scale)
    dmin, mn = split(minv)
    s_eff, m_eff = effective_scale_min(d, sc, dmin, mn)  # [N, G] each, exactly as the kernel computes them
    q = torch.where(s_eff[..., None] > 0, ((wg + m_eff[..., None]) / s_eff[..., None].clamp(min=1e-30)).round(),
                    torch.zeros_like(wg))
    q = q.clamp(0, top).to(torch.uint8).view(N, K)
    return {"q": q, "sc": sc, "mn": mn, "d": d, "dmin": dmin}


def effective_scale_min(d, sc, dmin, mn) -> tuple[torch.Tensor, torch.Tensor]:
    """d/dmin [N, S] float32, sc/mn [N, G] uint8 -> per-group scale and min [N, G] float32 (fp32 products)."""
    G = sc.shape[1]
    s = d.repeat_interleave(SUPER, dim=1)[:, :G] * sc.float()
    m = dmin.repeat_interleave(SUPER, dim=1)[:, :G] * mn.float()
    return s, m


def dequantize_q4(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [N, K] float32 that the parts represent (w = s * q - m)."""
    q = parts["q"]
    N, K = q.shape
    s, m = effective_scale_min(parts["d"], parts["sc"], parts["dmin"], parts["mn"])
    return (s[..., None] * q.view(N, K // GROUP, GROUP).float() - m[..., None]).view(N, K)


def pack(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q4 parts -> the kernel's layout (csrc/q4x8.h): packed [NB, G, 4, 64], sc/mn [NB, G, 16], d/dmin [NB, S, 16]."""
    q, sc, mn, d, dmin = (parts[k] for k in ("q", "sc", "mn", "d", "dmin"))
    N, K = q.shape
    G = K // GROUP
    NB = (N + COLS - 1) // COLS
    Np = NB * COLS

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == Np:
            return t
        out = torch.zeros(Np, *t.shape[1:], dtype=t.dtype)
        out[:N] = t
        return out

    qb = pad(q).view(NB, COLS, G, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [b, g, c, col, t, half]
    packed = (qb[..., 0] | (qb[..., 1] << 4)).contiguous().view(NB, G, 4, 64)
    cols = lambda t: pad(t).view(NB, COLS, -1).transpose(1, 2).contiguous()
    return {"packed": packed, "sc": cols(sc), "mn": cols(mn), "d": cols(d.float()), "dmin": cols(dmin.float())}


def q4k_parts(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor) -> dict:
    """GGUF Q4_K, already unpacked per row: q [N, K] (0..15), d/dmin [N, K/256] (the fp16 super-block scales, any
    float dtype), sc/mn [N, K/32] (the 6-bit sub-block scales and mins). The kernel represents these exactly:
    w = d * sc * q - dmin * mn, as ggml defines Q4_K."""
    if q.shape[1] % (GROUP * SUPER):
        raise ValueError("Q4_K rows are whole super-blocks of 256")
    return {"q": q.to(torch.uint8), "sc": sc.to(torch.uint8), "mn": mn.to(torch.uint8),
            "d": d.float().contiguous(), "dmin": dmin.float().contiguous()}


Q4K_BLOCK_BYTES = 144  # GGUF Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles


def q4k_from_blocks(blocks, N: int, K: int) -> dict:
    """A GGUF Q4_K tensor's raw bytes (N rows of K / 256 blocks, 144 bytes each: any uint8 array or tensor) ->
    q4x8 parts that represent it exactly. Block layout (ggml): d and dmin as fp16; 8 sub-block scales and mins
    of 6 bits packed in 12 bytes (sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7, sub-blocks 4-7 in the
    nibbles of bytes 8-11 plus the top 2 bits of bytes 0-7); 128 bytes where byte i of the j-th 32 holds
    sub-block 2j's value i in its low nibble and sub-block 2j+1's in its high nibble."""
    if K % 256:
        raise ValueError("Q4_K rows are whole super-blocks of 256")
    nb = K // 256
    raw = torch.as_tensor(blocks).reshape(-1).view(torch.uint8).reshape(N * nb, Q4K_BLOCK_BYTES)
    d = raw[:, 0:2].contiguous().view(torch.float16).float().view(N, nb)
    dmin = raw[:, 2:4].contiguous().view(torch.float16).float().view(N, nb)
    sb = raw[:, 4:16].to(torch.int32)  # [blocks, 12]
    lo_sc, lo_mn = sb[:, 0:4] & 63, sb[:, 4:8] & 63
    hi_sc = (sb[:, 8:12] & 15) | ((sb[:, 0:4] >> 6) << 4)
    hi_mn = (sb[:, 8:12] >> 4) | ((sb[:, 4:8] >> 6) << 4)
    sc = torch.cat([lo_sc, hi_sc], 1).to(torch.uint8).view(N, nb * 8)
    mn = torch.cat([lo_mn, hi_mn], 1).to(torch.uint8).view(N, nb * 8)
    qs = raw[:, 16:].reshape(N * nb, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(N, K)  # [N, K]: chunk j -> sub-blocks 2j, 2j + 1
    return q4k_parts(q, d, dmin, sc, mn)


def packed_bytes(N: int, K: int) -> int:
    """Bytes of `pack`'s output for a weight [N, K] (csrc/q4x8.h): N padded to NB = ceil(N / 16) blocks of 16
    columns; per block and group of 32 K values 256 bytes of nibbles (0.5 B per weight) and 16 + 16 bytes of sc and
    mn; per block and super-block of 8 groups 16 + 16 float32 d and dmin. 4.75 bits per weight when N % 16 == 0 and
    K % 256 == 0: 4 (nibbles) + 0.5 (sc, mn) + 0.25 (d, dmin)."""
    NB, G = -(-N // COLS), K // GROUP
    S = -(-G // SUPER)
    return NB * G * (4 * 64 + 2 * COLS) + NB * S * COLS * 4 * 2


class Q4x8Embedding(nn.Module):
    """An embedding table [V, H] kept in q4x8's packed layout (`pack`'s tensors: 4.75 bits per weight instead of
    16 or 32); `from_linear` shares a Q4x8Linear's buffers, so a tied LM head and the embedding hold one copy.

    forward(ids [...] int64) -> [..., H] float32: gathers each id's column of its 16-column block and dequantizes
    that row only, w = (d * sc) * q - dmin * mn in float32 — `dequantize_q4`'s very operations, so a row equals
    the corresponding row of dequantize_q4(parts) bitwise, and the same id always gives the same vector whatever
    else is in the batch (row-exact). Pure torch: needs no C++ (only the B x T looked-up rows are touched)."""

    def __init__(self, tensors: dict[str, torch.Tensor], num_embeddings: int):
        super().__init__()
        packed = tensors["packed"]
        if packed.dim() != 4 or packed.dtype != torch.uint8 or not 0 < num_embeddings <= packed.shape[0] * COLS:
            raise ValueError(f"not a packed q4x8 table for {num_embeddings} rows: {tuple(packed.shape)} {packed.dtype}")
        self.num_embeddings, self.embedding_dim = num_embeddings, packed.shape[1] * GROUP
        for name in PACKED:
            self.register_buffer(name, tensors[name])  # as given: a tied head's buffers stay shared

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor]) -> Q4x8Embedding:
        """From `quantize_q4` / `q4k_from_blocks` output for the table [V, H] (exact for Q4_K)."""
        return cls(pack(parts), parts["q"].shape[0])

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Q4x8Embedding:
        """The table a q4x8 linear over it holds (kernels/linear.py Q4x8Linear; a tied LM head: weight [V, H]),
        sharing its buffers (no copy)."""
        return cls({name: getattr(linear, name) for name in PACKED}, linear.out_features)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., H] float32
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        block, col = flat // COLS, flat % COLS
        NB, G = self.packed.shape[:2]
        nib = self.packed.view(NB, G, 4, COLS, 4)[block, :, :, col]  # [M, G, chunk, t]: column col's bytes
        q = torch.cat([(nib & 15).reshape(-1, G, 16), (nib >> 4).reshape(-1, G, 16)], dim=-1)  # [M, G, 32]
        sc, mn = self.sc[block, :, col], self.mn[block, :, col]  # [M, G]
        d, dmin = self.d[block, :, col], self.dmin[block, :, col]  # [M, S]
        s, m = effective_scale_min(d, sc, dmin, mn)  # [M, G]
        w = s[..., None] * q.float() - m[..., None]  # [M, G, 32]
        return w.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q4x8 packed"

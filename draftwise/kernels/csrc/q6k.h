// q6k: GGUF Q6_K weights (and Q3_K; as the "q6m" kernel, with a min term, Q2_K) x int8 activations (GGUF's Q8_K),
// the plain-C interface shared by the ISA units.
//
// Owns: the packed Q6_K layout and the arithmetic every path performs, described here once, and (for units compiled
// with AVX-512) the one rebuild of a chunk's 6-bit values from ql and qh. Knows nothing of torch
// (the ISA units include only this header and intrin.h) or of how the blocks were read (kernels/ggml_blocks.py).
//
// Weights W [N, K], K a multiple of 256, N padded to NB = ceil(N / 16) blocks of 16 output columns. As ggml defines
// Q6_K: w[n, k] = d[n, s] * sc[n, j] * (q[n, k] - 32), q in 0..63 (6 bits), sc int8 per sub-block j of 16 K values,
// d per super-block s of 256 (fp16 in the file, float32 here: exact). Group g = 32 K values = sub-blocks 2g, 2g + 1.
//   ql [NB, G, 4, 64] uint8: byte i of chunk c of group g of block b holds, for column n = 16 b + i / 4, t = i % 4,
//     the low 4 bits of q[n, 32 g + 4 c + t] in its low nibble and of q[n, 32 g + 16 + 4 c + t] in its high one
//     (q4x8's nibble layout: the low nibbles are sub-block 2g, the high ones sub-block 2g + 1).
//   qh [NB, G, 2, 64] uint8: byte i of pair p holds the top 2 bits of, from bit 0 up: chunk 2p's low-nibble value,
//     its high-nibble value, chunk 2p + 1's low-nibble value, its high-nibble value (same column and t as ql's i).
//   sc [NB, G, 2, 16] int8 (sub-block 2g + h of column 16 b + i at [b, g, h, i]); d [NB, S, 16] float32.
// Activations X [M, K]: q4x8's Q8_K quantization (q4x8.h: per row and super-block, dx = amax / 127, q =
// round_half_even(x * 127 / amax)), stored q [G, M, 32], dx [S, M], plus per sub-block of 16 the integer sum
// qsum16 [S, M, 16] int16 (|qsum16| <= 16 * 127) and the same times -32 as qoff16 [G, M, 2] int32.
// Per output (m, n) and super-block s, with isum_j = sum over sub-block j of q[n, k] * q_x[m, k] (0 <= q <= 63,
// |isum_j| <= 16 * 63 * 127 = 128,016):
//   isc = sum_j sc_j * isum_j           int32, exact: |isc| <= 16 * 128 * 128,016 = 262,176,768
//   imn = sum_j sc_j * qsum16_j         int32, exact: |imn| <= 16 * 128 * 2,032 = 4,161,536
//   tot = isc - 32 * imn                int32, exact: |tot| <= 395,345,920 < 2^31
//   (the AVX-512 path starts each isum_j at qoff16_j = -32 * qsum16_j and multiplies by sc_j: the same exact tot)
//   then in super-block order, one rounding per operation, identically in every path:
//   t = (float) tot * d[n, s];  acc = fma(t, dx[s, m], acc);  y = acc + bias.
// With a min term (the "q6m" kernel: GGUF Q2_K, w = d * sc_j * q - dmin * m_j, held as q + 32 with d and sc_j as
// above), two more buffers: mn [NB, G, 2, 16] int8 (m_j, laid out as sc) and dmin [NB, S, 16] float32 (fp16 in the
// file: exact), and per super-block one more exact integer and one more float step right after t's:
//   B = sum_j m_j * qsum16_j            int32, exact: |B| <= 16 * 128 * 2,032 = 4,161,536
//   u = (float) B * dmin[n, s];  acc = fma(-u, dx[s, m], acc)   (fnmadd: bitwise fma(u', dx, acc) for u' = (float)
//   B * (-dmin), rounding being symmetric in sign)
// With mn null there is no min term: the Q6_K / Q3_K sequence above, the same code (a template parameter).
// Every integer sum is exact and the float steps are the same sequence, so a row never depends on M, on other rows
// or on the path (scalar, AVX2, AVX-512 agree bitwise).
#pragma once
#include <stdint.h>

extern "C" {

struct DwQ6 {
    const uint8_t* ql;  // [NB, G, 4, 64]
    const uint8_t* qh;  // [NB, G, 2, 64]
    const int8_t* sc;   // [NB, G, 2, 16]
    const float* d;     // [NB, S, 16]
    const float* bias;  // [N] or null
    int64_t N, K, G, S;
    const int8_t* mn;    // [NB, G, 2, 16] or null: the min term (q6m)
    const float* dmin;   // [NB, S, 16] (with mn)
};

struct DwQ8K16 {
    const int8_t* q;         // [G, M, 32]
    const float* dx;         // [S, M]
    const int16_t* qsum16;   // [S, M, 16]
    const int32_t* qoff16;   // [G, M, 2]
    int64_t M;
};

// out [M, N] float32 for the 16-column blocks [b0, b1), all M rows
void dw_q6k_gemm_scalar(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1);
void dw_q6k_gemm_avx2(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1);
void dw_q6k_gemm_avx512(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1);

}

#if defined(__AVX512BW__)
#include "intrin.h"
#endif

namespace {
namespace dwq6k {

// f.template operator()<MIN>() for the weights' min term: each ISA unit's one dispatch.
template <class Fn>
inline void by_min(const DwQ6* w, Fn&& f) {
    w->mn ? f.template operator()<true>() : f.template operator()<false>();
}

#if defined(__AVX512BW__)
// Chunk c (0-3) of a group's weights as the 6-bit values q (0..63, one per byte, the layout of ql's chunk): wl the
// K values 4c..4c+3 of the 16 columns (ql's low nibbles), wh the values 16 + 4c.. (its high nibbles), each with its
// top 2 bits from hv, the group's qh pair c / 2. For the AVX-512 GEMV (q6k_avx512.cpp) and the AMX side's B tiles
// (gemm_q6k_amx.cpp) alike. Internal linkage: only units compiled for AVX-512 see it.
inline void unpack_chunk(__m512i raw, __m512i hv, int c, __m512i& wl, __m512i& wh) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    const __m512i hl = (c & 1) ? _mm512_and_si512(hv, top2) : _mm512_and_si512(_mm512_slli_epi16(hv, 4), top2);
    const __m512i hh = (c & 1) ? _mm512_and_si512(_mm512_srli_epi16(hv, 2), top2)
                               : _mm512_and_si512(_mm512_slli_epi16(hv, 2), top2);
    wl = _mm512_or_si512(_mm512_and_si512(raw, low4), hl);
    wh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4), hh);
}
#endif

}  // namespace dwq6k
}  // namespace


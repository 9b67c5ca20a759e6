// q8_0: weights that are small integers per group of 32 with one float scale each (GGUF Q8_0, and the types whose
// values are exact in int8 with an exact float32 group scale: Q5_0, Q4_0, IQ4_NL, IQ4_XS), and, as the "q8_1"
// kernel, with a float min per group too (Q4_1, Q5_1, Q5_K), x int8 activations quantized per 32 (GGUF's Q8_0
// activations; with a min, their group sums as Q8_1 carries them), the plain-C interface shared by the ISA units.
// The values are stored in one of three forms with the same arithmetic: bytes (q8_0, q8_1: 8 bits a value),
// 4-bit codes through a 16-entry table (the "q4c" kernel: Q4_0, IQ4_NL, IQ4_XS), or 4-bit codes plus a fifth-bit
// plane with a min term (the "q5m" kernel: Q4_1, Q5_1, Q5_K), as llama.cpp's CPU path keeps them.
//
// Owns: the packed layouts and the arithmetic every path performs, described here once. Knows nothing of torch or
// of how blocks were read (kernels/ggml_blocks.py maps each type's blocks onto it exactly; kernels/blocktypes.py
// lists them).
//
// Weights W [N, K], K a multiple of 32, N padded to NB = ceil(N / 16) blocks of 16 output columns.
//   w[n, k] = d[n, g] * v[n, k], v integer in -127..127 (Q8_0: its int8; Q5_0: its 5-bit value - 16), g = k / 32,
//   d fp16 in the file, float32 here (exact); with a min term (q8_1, q5m):
//   w[n, k] = d[n, g] * v[n, k] + m[n, g], v in 0..31 (Q4_1 / Q5_1: their values, Q5_K: q), d and m exact float32
//   (Q4_1 / Q5_1: d and m; Q5_K: d * sc and -(dmin * mn), products of an fp16 and a 6-bit integer).
//   Every form yields, per chunk c (0..7) of group g of block b, 64 bytes u = v + 128: byte i for column
//   n = 16 b + i / 4 and k = 32 g + 4 c + i % 4 (16 columns x 4 K values, a VPDPBUSD operand):
//   bytes (lut null): qw [NB, G, 8, 64] uint8 holds u itself;
//   codes (lut set):  qw [NB, G, 4, 64] uint8, byte i of line L holds the code of chunk L in its low nibble and
//     of chunk L + 4 in its high nibble; u = lut[b][code] (lut [NB, 16] uint8: the block's values + 128);
//   codes + plane (lut set, qh set): as codes, plus 16 where bit i of chunk c's little-endian uint64 in
//     qh [NB, G, 8, 8] is set (the fifth bit; lut then holds 128 + 0..15).
//   d [NB, G, 16] float32; m [NB, G, 16] float32 or null (no min term).
// Activations X [M, K] quantized per row and group of 32 (symmetric int8): amax = max |x| over the group,
//   dx = amax / 127, q = round_half_even(x * (127 / amax)) (0 where amax = 0); stored q [G, M, 32], dx [G, M] and
//   qoff [G, M] int32 = -128 * (sum of the group's 32 q), which turns the offset weights' sum into the true one,
//   and qsum [G, M] int32 = that sum (the min term's).
// Per output (m, n) and group g: isum = sum_k v * q_x = qoff + sum_k u * q_x, int32, exact (|isum| <= 32 *
//   127 * 127); then in group order, one rounding per operation, identically in every path and every form:
//   t = (float) isum * d[n, g];  acc = fma(t, dx[g, m], acc);
//   with a min term then u = (float) qsum[g, m] * m[n, g];  acc = fma(u, dx[g, m], acc);
//   and after the last group y = acc + bias.
// The AVX2 path sums v * q_x as llama.cpp does (|q_x| x sign(v, q_x), needs v != -128); the AVX-512 path adds to
// qoff; both are the exact integer, so every path, every form and every M give bitwise the same row (a type held
// as codes computes bitwise what it computes held as bytes).
#pragma once
#include <stdint.h>

extern "C" {

struct DwQ80 {
    const uint8_t* qw;  // bytes [NB, G, 8, 64], or codes [NB, G, 4, 64] when lut is set
    const float* d;     // [NB, G, 16]
    const float* m;     // [NB, G, 16] or null: the min term (q8_1)
    const float* bias;  // [N] or null
    int64_t N, K, G;
    const uint8_t* lut;  // [NB, 16] or null: qw holds bytes
    const uint8_t* qh;   // [NB, G, 8, 8] or null: no fifth-bit plane (only with lut)
};

// The byte u = v + 128 of column j (0..15), K value 4 c + t of group g of block b, whichever form (the scalar path's
// reading; the SIMD paths compute the same bytes 64 at a time).
static inline uint8_t dw_q80_byte(const DwQ80* w, int64_t b, int64_t g, int c, int j, int t) {
    const int64_t bg = b * w->G + g;
    const int i = j * 4 + t;
    if (!w->lut) return w->qw[bg * 512 + c * 64 + i];
    const uint8_t code = (uint8_t)((w->qw[bg * 256 + (c & 3) * 64 + i] >> (c & 4)) & 15);
    const uint8_t fifth = w->qh ? (uint8_t)(((w->qh[bg * 64 + c * 8 + i / 8] >> (i % 8)) & 1) << 4) : 0;
    return (uint8_t)(w->lut[b * 16 + code] + fifth);
}

struct DwQ80Act {
    const int8_t* q;      // [G, M, 32]
    const float* dx;      // [G, M]
    const int32_t* qoff;  // [G, M]
    const int32_t* qsum;  // [G, M]
    int64_t M;
};

// out [M, N] float32 for the 16-column blocks [b0, b1), all M rows
void dw_q80_gemm_scalar(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1);
void dw_q80_gemm_avx2(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1);
void dw_q80_gemm_avx512(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1);

}

namespace {
namespace dwq80 {

enum Form { BYTES, CODES, CODES_PLANE };  // the three weight forms above

// f.template operator()<MIN, F>() for the weights' min term and form: each ISA unit's one dispatch.
template <class Fn>
inline void by_form(const DwQ80* w, Fn&& f) {
    const bool min = w->m != nullptr;
    if (!w->lut) min ? f.template operator()<true, BYTES>() : f.template operator()<false, BYTES>();
    else if (!w->qh) min ? f.template operator()<true, CODES>() : f.template operator()<false, CODES>();
    else min ? f.template operator()<true, CODES_PLANE>() : f.template operator()<false, CODES_PLANE>();
}

}  // namespace dwq80
}  // namespace

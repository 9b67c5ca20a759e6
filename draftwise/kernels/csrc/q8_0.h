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
//   d fp16 in the file (exact in every scale form below); with a min term (q8_1, q5m):
//   w[n, k] = d[n, g] * v[n, k] + m[n, g], v in 0..31 (Q4_1 / Q5_1: their values, Q5_K: q), d and m exact float32
//   (Q4_1 / Q5_1: d and m; Q5_K: d * sc and -(dmin * mn), products of an fp16 and a 6-bit integer).
//   Every form yields, per chunk c (0..7) of group g of block b, 64 bytes u = v + 128: byte i for column
//   n = 16 b + i / 4 and k = 32 g + 4 c + i % 4 (16 columns x 4 K values, a VPDPBUSD operand):
//   bytes (lut null): qw [NB, G, 8, 64] uint8 holds u itself;
//   codes (lut set):  qw [NB, G, 4, 64] uint8, byte i of line L holds the code of chunk L in its low nibble and
//     of chunk L + 4 in its high nibble; u = lut[b][code] (lut [NB, 16] uint8: the block's values + 128);
//   codes + plane (lut set, qh set): as codes, plus 16 where bit i of chunk c's little-endian uint64 in
//     qh [NB, G, 8, 8] is set (the fifth bit; lut then holds 128 + 0..15).
//   d and m (m null: no min term) in one of three scale forms, the same for both, each giving bitwise the same
//   float32 per (n, g) (scales below; the form is a storage choice and changes no bit of any output):
//   F32:  [NB, G, 16] float32, as they are (a float weight's quantization, kernels/ggml_blocks.py quantize_*);
//   F16:  [NB, G, 16] fp16, widened exactly (Q8_0, Q5_0, Q4_0, IQ4_NL, Q4_1, Q5_1: their fp16 d and m);
//   SUB8: [NB, G / 8, 160] bytes (G a multiple of 8): per block and 8 groups (256 K values), 128 int8 sub[8][16]
//     (group g % 8, column) then 16 fp16 super[16] (column); the scale = (float) sub * (float) super, exact: an
//     fp16's 11-bit significand times an integer of at most 7 bits fits float32's 24 (IQ4_XS: d = d * (ls - 32);
//     Q5_K: d = d * sc, m = (-dmin) * mn, bitwise the float -(dmin * mn), signed zeros included).
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
#if defined(__AVX2__)
#include "intrin.h"
#endif
#include "f16.h"  // dwelem::to_float (scalar) and load16 / load8 (VCVTPH2PS on the SIMD paths): fp16 -> float32, exact

extern "C" {

struct DwQ80 {
    const uint8_t* qw;  // bytes [NB, G, 8, 64], or codes [NB, G, 4, 64] when lut is set
    const void* d;      // the group scales, in the form `scales` ([NB, G, 16] float32 / fp16, or SUB8 bytes)
    const void* m;      // the mins, in the same form, or null: no min term (q8_1, q5m)
    const float* bias;  // [N] or null
    int64_t N, K, G;
    const uint8_t* lut;  // [NB, 16] or null: qw holds bytes
    const uint8_t* qh;   // [NB, G, 8, 8] or null: no fifth-bit plane (only with lut)
    int32_t scales;      // DwQ80Scales: the form of d and m
};

enum DwQ80Scales { DW_Q80_F32 = 0, DW_Q80_F16 = 1, DW_Q80_SUB8 = 2 };  // the three scale forms above

// Where the scales of group g of block b lie in s (d or m) of form `scales`: F32 / F16: its 16 values; SUB8: the
// 160 bytes of its 8 groups (sub of group g at + (g % 8) * 16, super at + 128).
static inline const uint8_t* dw_q80_scales_at(const void* s, int32_t scales, int64_t G, int64_t b, int64_t g) {
    const uint8_t* p = (const uint8_t*)s;
    if (scales == DW_Q80_SUB8) return p + (b * (G / 8) + g / 8) * 160;
    return p + (b * G + g) * 16 * (scales == DW_Q80_F32 ? 4 : 2);
}

// The float32 scale of column j (0..15), group g of block b (the scalar path's reading; the SIMD paths form the
// same 16 or 8 at a time, q8_0_avx512.cpp / q8_0_avx2.cpp).
static inline float dw_q80_scale(const DwQ80* w, const void* s, int64_t b, int64_t g, int j) {
    const uint8_t* p = dw_q80_scales_at(s, w->scales, w->G, b, g);
    uint16_t h;
    if (w->scales == DW_Q80_F32) {
        float f;
        __builtin_memcpy(&f, p + j * 4, 4);
        return f;
    }
    if (w->scales == DW_Q80_F16) {
        __builtin_memcpy(&h, p + j * 2, 2);
        return dwelem::to_float(h);
    }
    __builtin_memcpy(&h, p + 128 + j * 2, 2);
    return (float)(int8_t)p[(g % 8) * 16 + j] * dwelem::to_float(h);
}

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

// x [M, K] -> q [G, M, 32], dx [G, M], qoff [G, M], qsum [G, M] for rows [r0, r1): the activation quantization
// above, the scalar form (q8_0.cpp: the scalar and AVX2 GEMVs') and the AVX-512 one (gemm_q8_0_avx512.cpp: the
// AVX-512 GEMV's and the wide side's), bitwise the same
void dw_q80_quantize_rows_scalar(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int32_t* qoff,
                                 int32_t* qsum, int64_t r0, int64_t r1);
void dw_q80_quantize_rows_avx512(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int32_t* qoff,
                                 int32_t* qsum, int64_t r0, int64_t r1);

// out [M, N] float32 for the 16-column blocks [b0, b1), all M rows
void dw_q80_gemm_scalar(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1);
void dw_q80_gemm_avx2(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1);
void dw_q80_gemm_avx512(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1);

}

namespace {
namespace dwq80 {

enum Form { BYTES, CODES, CODES_PLANE };  // the three weight forms above
enum Scales { F32 = DW_Q80_F32, F16 = DW_Q80_F16, SUB8 = DW_Q80_SUB8 };  // the three scale forms above

template <bool MIN, Form F, class Fn>
inline void by_scales(const DwQ80* w, Fn& f) {
    if (w->scales == DW_Q80_F16) f.template operator()<MIN, F, F16>();
    else if (w->scales == DW_Q80_SUB8) f.template operator()<MIN, F, SUB8>();
    else f.template operator()<MIN, F, F32>();
}

// f.template operator()<MIN, F, S>() for the weights' min term, form and scale form: each ISA unit's one dispatch.
template <class Fn>
inline void by_form(const DwQ80* w, Fn&& f) {
    const bool min = w->m != nullptr;
    if (!w->lut) min ? by_scales<true, BYTES>(w, f) : by_scales<false, BYTES>(w, f);
    else if (!w->qh) min ? by_scales<true, CODES>(w, f) : by_scales<false, CODES>(w, f);
    else min ? by_scales<true, CODES_PLANE>(w, f) : by_scales<false, CODES_PLANE>(w, f);
}

}  // namespace dwq80
}  // namespace

// q8_0: weights that are int8 values per group of 32 with one float scale each (GGUF Q8_0, and the types whose
// values are exact in int8 with an exact float32 group scale: Q5_0, Q4_0, IQ4_NL, IQ4_XS), and, as the "q8_1"
// kernel, with a float min per group too (Q4_1, Q5_1, Q5_K), x int8 activations quantized per 32 (GGUF's Q8_0
// activations; with a min, their group sums as Q8_1 carries them), the plain-C interface shared by the ISA units.
//
// Owns: the packed layout and the arithmetic every path performs, described here once. Knows nothing of torch or of
// how blocks were read (kernels/ggml_blocks.py maps each type's blocks onto it exactly; kernels/blocktypes.py lists them).
//
// Weights W [N, K], K a multiple of 32, N padded to NB = ceil(N / 16) blocks of 16 output columns.
//   w[n, k] = d[n, g] * v[n, k], v integer in -127..127 (Q8_0: its int8; Q5_0: its 5-bit value - 16), g = k / 32,
//   d fp16 in the file, float32 here (exact); with a min term (q8_1):
//   w[n, k] = d[n, g] * v[n, k] + m[n, g], v in 0..31 (Q4_1 / Q5_1: their values, Q5_K: q), d and m exact float32
//   (Q4_1 / Q5_1: d and m; Q5_K: d * sc and -(dmin * mn), products of an fp16 and a 6-bit integer).
//   qw [NB, G, 8, 64] uint8: byte i of chunk c of group g of block b holds v[n, 32 g + 4 c + t] + 128 for column
//     n = 16 b + i / 4, t = i % 4 (one 64-byte chunk = 16 columns x 4 K values, a VPDPBUSD operand).
//   d [NB, G, 16] float32; m [NB, G, 16] float32 or null (no min term).
// Activations X [M, K] quantized per row and group of 32 (symmetric int8): amax = max |x| over the group,
//   dx = amax / 127, q = round_half_even(x * (127 / amax)) (0 where amax = 0); stored q [G, M, 32], dx [G, M] and
//   qoff [G, M] int32 = -128 * (sum of the group's 32 q), which turns the offset weights' sum into the true one,
//   and qsum [G, M] int32 = that sum (the min term's).
// Per output (m, n) and group g: isum = sum_k v * q_x = qoff + sum_k (v + 128) * q_x, int32, exact (|isum| <= 32 *
//   127 * 127); then in group order, one rounding per operation, identically in every path:
//   t = (float) isum * d[n, g];  acc = fma(t, dx[g, m], acc);
//   with a min term then u = (float) qsum[g, m] * m[n, g];  acc = fma(u, dx[g, m], acc);
//   and after the last group y = acc + bias.
// The AVX2 path sums v * q_x as llama.cpp does (|q_x| x sign(v, q_x), needs v != -128); the AVX-512 path adds to
// qoff; both are the exact integer, so every path and every M give bitwise the same row.
#pragma once
#include <stdint.h>

extern "C" {

struct DwQ80 {
    const uint8_t* qw;  // [NB, G, 8, 64]
    const float* d;     // [NB, G, 16]
    const float* m;     // [NB, G, 16] or null: the min term (q8_1)
    const float* bias;  // [N] or null
    int64_t N, K, G;
};

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

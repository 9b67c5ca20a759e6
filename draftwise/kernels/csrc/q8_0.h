// q8_0: GGUF Q8_0 (and Q5_0, whose 5-bit values are exact in it) weights x int8 activations quantized per 32 (GGUF's
// Q8_0 activations, as llama.cpp's CPU dot product of these types), the plain-C interface shared by the ISA units.
//
// Owns: the packed layout and the arithmetic every path performs, described here once. Knows nothing of torch or of
// how blocks were read (kernels/ggml_blocks.py maps Q8_0 and Q5_0 blocks onto it exactly).
//
// Weights W [N, K], K a multiple of 32, N padded to NB = ceil(N / 16) blocks of 16 output columns.
//   w[n, k] = d[n, g] * v[n, k], v integer in -127..127 (Q8_0: its int8; Q5_0: its 5-bit value - 16), g = k / 32,
//   d fp16 in the file, float32 here (exact).
//   qw [NB, G, 8, 64] uint8: byte i of chunk c of group g of block b holds v[n, 32 g + 4 c + t] + 128 for column
//     n = 16 b + i / 4, t = i % 4 (one 64-byte chunk = 16 columns x 4 K values, a VPDPBUSD operand).
//   d [NB, G, 16] float32.
// Activations X [M, K] quantized per row and group of 32 (symmetric int8): amax = max |x| over the group,
//   dx = amax / 127, q = round_half_even(x * (127 / amax)) (0 where amax = 0); stored q [G, M, 32], dx [G, M] and
//   qoff [G, M] int32 = -128 * (sum of the group's 32 q), which turns the offset weights' sum into the true one.
// Per output (m, n) and group g: isum = sum_k v * q_x = qoff + sum_k (v + 128) * q_x, int32, exact (|isum| <= 32 *
//   127 * 127); then in group order, one rounding per operation, identically in every path:
//   t = (float) isum * d[n, g];  acc = fma(t, dx[g, m], acc);  y = acc + bias.
// The AVX2 path sums v * q_x as llama.cpp does (|q_x| x sign(v, q_x), needs v != -128); the AVX-512 path adds to
// qoff; both are the exact integer, so every path and every M give bitwise the same row.
#pragma once
#include <stdint.h>

extern "C" {

struct DwQ80 {
    const uint8_t* qw;  // [NB, G, 8, 64]
    const float* d;     // [NB, G, 16]
    const float* bias;  // [N] or null
    int64_t N, K, G;
};

struct DwQ80Act {
    const int8_t* q;      // [G, M, 32]
    const float* dx;      // [G, M]
    const int32_t* qoff;  // [G, M]
    int64_t M;
};

// out [M, N] float32 for the 16-column blocks [b0, b1), all M rows
void dw_q80_gemm_scalar(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1);
void dw_q80_gemm_avx2(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1);
void dw_q80_gemm_avx512(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1);

}

// q4x8: int4 weights x int8 activations, the plain-C interface shared by the ISA translation units.
//
// Owns: the packed weight layout and the per-row activation quantization, described here once.
// Knows nothing of torch (the ISA units include only this header and <immintrin.h>, so no inline
// function compiled with AVX-512 flags can be merged into code that runs on an AVX2-only CPU).
//
// Weights W [N, K], K a multiple of 32, N padded to NB = ceil(N / 16) blocks of 16 output columns.
//   Group g = 32 consecutive K values; super-block s = 8 consecutive groups (the last may be short).
//   w[n, k] = d[n, s] * sc[n, g] * q[n, k] - dmin[n, s] * mn[n, g]   (q in 0..15; sc, mn in 0..255)
//   which is GGUF Q4_K's sub-block definition (there sc, mn are 6-bit and d, dmin fp16: exact here).
//   packed [NB, G, 4, 64] uint8: byte j of chunk c of group g of block b holds, for column
//     n = 16 b + j / 4 and t = j % 4, q[n, 32 g + 4 c + t] in its low nibble and
//     q[n, 32 g + 16 + 4 c + t] in its high nibble (so one 64-byte chunk is 16 columns x 4 K values).
//   sc, mn [NB, G, 16] uint8; d, dmin [NB, S, 16] float32.
// Activations X [M, K] quantized per row in blocks of 32 (symmetric int8, like Q8_0):
//   amax = max |x|, dx = amax / 127, q = round_half_even(x * (127 / amax)), xs = dx * sum(q).
// Per output (m, n), in group order, with fused multiply-adds, identically in every ISA path:
//   acc = fma((float) isum_g, (d * sc) * dx, acc);  acc = fma(-(dmin * mn), xs, acc);  y = acc + bias.
// isum_g is an exact integer dot product, so a row's result never depends on M or on other rows.
#pragma once
#include <stdint.h>

extern "C" {

struct DwQ4 {
    const uint8_t* packed;  // [NB, G, 4, 64]
    const uint8_t* sc;      // [NB, G, 16]
    const uint8_t* mn;      // [NB, G, 16]
    const float* d;         // [NB, S, 16]
    const float* dmin;      // [NB, S, 16]
    const float* bias;      // [N] or null
    int64_t N, K, G, S;
};

struct DwQ8 {
    const int8_t* q;   // [M, K]
    const float* dx;   // [M, G]
    const float* xs;   // [M, G]
    int64_t M;
};

// x [M, K] float32 -> q [M, K], dx [M, G], xs [M, G] for rows [r0, r1)
void dw_q8_rows_scalar(const float* x, int64_t K, int8_t* q, float* dx, float* xs, int64_t r0, int64_t r1);
void dw_q8_rows_avx2(const float* x, int64_t K, int8_t* q, float* dx, float* xs, int64_t r0, int64_t r1);
void dw_q8_rows_avx512(const float* x, int64_t K, int8_t* q, float* dx, float* xs, int64_t r0, int64_t r1);

// out [M, N] float32 for the 16-column blocks [b0, b1), all M rows
void dw_gemm_scalar(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1);
void dw_gemm_avx2(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1);
void dw_gemm_avx512(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1);

}

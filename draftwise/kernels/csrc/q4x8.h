// q4x8: int4 weights x int8 activations, the plain-C interface shared by the ISA translation units; with a fifth-bit
// plane (qh set) the same arithmetic holds GGUF Q5_K exactly: the q5x8 kernel (kernels/blocktypes.py).
//
// Owns: the packed weight layout and the per-row activation quantization, described here once.
// Knows nothing of torch (the ISA units include only this header and intrin.h, so no inline
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
// q5x8 (GGUF Q5_K: w = d * sc * q - dmin * mn with q in 0..31): the same buffers hold q's low 4 bits, and
//   qh [NB, G, 4, 2, 8] uint8 its fifth bits: the 8 bytes [b, g, c, half] are a little-endian 64-bit mask whose bit j
//   is the fifth bit of the value in byte j of chunk c's low (half 0) or high (half 1) nibbles, so q = nibble | 16 *
//   bit (AVX-512: a masked byte add of 16 under that mask; AVX2: the mask's 32 bits of one 8-column half spread to
//   bytes). Everything below holds with q in 0..31: |isum_g| <= 32 * 31 * 127 = 125,984, |isc| <= 8 * 255 * 125,984 =
//   257,007,360 < 2^31; VPDPBUSD's unsigned side takes 0..31; AVX2's int16 sums are taken per 2 chunks (4 maddubs,
//   |lane| <= 4 * 2 * 31 * 127 = 31,496 < 32767) where q4x8's take all 4 chunks.
// Activations X [M, K] quantized per row per super-block of 256 K values (symmetric int8, like GGUF's Q8_K;
// a short last super-block covers its 32 (G - 8 s) values):
//   amax = max |x| over the super-block, dx[s, m] = amax / 127, q = round_half_even(x * (127 / amax))
//   (0 where amax = 0), and per group the integer sum qsum[s, m, g % 8] = sum of its 32 q (|qsum| <= 32 * 127 =
//   4064; 0 for the groups G..8S-1 past a short last super-block).
//   Stored group-major, q [G, M, 32], dx [S, M], qsum [S, M, 8] int16: the rows of one group (super-block) are
//   adjacent, so a tile of rows reads them at constant offsets from one pointer.
// Per output (m, n) and super-block s, with isum_g = sum_k q[n, k] * q_x[m, k] over group g (|isum_g| <= 60960):
//   isc = sum_g sc[n, g] * isum_g      int32, exact: |isc| <= 8 * 255 * 60960 = 124,358,400 < 2^31
//   imn = sum_g mn[n, g] * qsum_g      int32, exact: |imn| <= 8 * 255 * 4064 = 8,290,560 < 2^24, so
//                                      (float) imn is exact too (AVX-512 sums pairs of groups with VPDPWSSD:
//                                      |pair| <= 2,072,640, no overflow anywhere)
//   then, in super-block order, with one rounding per operation, identically in every ISA path:
//   t = (float) isc * d[n, s];  t = t - (float) imn * dmin[n, s] (fused: fnmadd);  acc = fma(t, dx[s, m], acc)
//   and y = acc + bias. (float) isc rounds to nearest even above 2^24.
// Everything before the float steps is exact integer arithmetic on the row's own q, qsum and dx, so a row's
// result never depends on M or on other rows.
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
    const uint8_t* qh = nullptr;  // [NB, G, 4, 2, 8]: q5x8's fifth-bit plane; null for q4x8
};

struct DwQ8 {
    const int8_t* q;       // [G, M, 32]
    const float* dx;       // [S, M]
    const int16_t* qsum;   // [S, M, 8], zero past G
    int64_t M;
};

// x [M, K] float32 -> q [G, M, 32], dx [S, M], qsum [S, M, 8]: the entries of rows [r0, r1)
void dw_q8_rows_scalar(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum, int64_t r0, int64_t r1);
void dw_q8_rows_avx2(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum, int64_t r0, int64_t r1);
void dw_q8_rows_avx512(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum, int64_t r0, int64_t r1);

// out [M, N] float32 for the 16-column blocks [b0, b1), all M rows
void dw_gemm_scalar(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1);
void dw_gemm_avx2(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1);
void dw_gemm_avx512(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1);

}

namespace dwq8k {

// The walk of every path's activation quantizer above (dw_q8_rows_*), which a path supplies only the lane work of:
// rows [r0, r1), per super-block amax = amax_of(p, n) (max |x| over its n = 32 live groups' values at p),
// id = 127 / amax (0 where amax = 0), each live group's 32 values at p_g quantized by group(p_g, id, q_g) into its 32
// int8 at q_g (returning their sum, the group's qsum; 0 for the groups past G), then dx = amax / 127.
template <class Amax, class Group>
inline void rows(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum, int64_t r0, int64_t r1,
                 Amax&& amax_of, Group&& group) {
    const int64_t G = K / 32, S = (G + 7) / 8;
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t s = 0; s < S; ++s) {
            const int64_t g0 = s * 8, ng = g0 + 8 < G ? 8 : G - g0;
            const float* p = x + r * K + g0 * 32;
            const float amax = amax_of(p, ng * 32);
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int64_t g = 0; g < 8; ++g)
                qsum[(s * M + r) * 8 + g] = g < ng ? (int16_t)group(p + g * 32, id, q + ((g0 + g) * M + r) * 32) : 0;
            dx[s * M + r] = amax / 127.0f;
        }
    }
}

// Whether the q5x8 fifth-bit plane is present, as a template argument: f.template operator()<true or false>()
// (the SIMD units instantiate their tile loops per value, so q4x8's loop carries no test of qh).
template <class Fn>
inline void by_plane(const DwQ4* w, Fn&& f) {
    w->qh ? f.template operator()<true>() : f.template operator()<false>();
}

}  // namespace dwq8k


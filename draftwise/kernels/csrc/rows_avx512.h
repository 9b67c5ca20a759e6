// The shared GEMV driver of the block kernels, AVX-512 part (included only by units compiled with -mavx512f
// -mavx512bw -mavx512vl -mavx512vnni): the walk over 16-column blocks, the masked store of a tile's rows with the
// bias, and the one VNNI instruction every type's inner loop is built on.
//
// Owns: gemv16 (blocks [b0, b1), each one's rows in rows.h's balanced tiles, the next block prefetched while a
// block's first tile computes), store16 (the 16 outputs of each tile row plus the bias, a short last block masked),
// dpbusd_b, and fma_rows / fnma_rows (the float step the types end a super-block or group with). A type supplies `Rows`: a
// template lambda <int MT>(b, m0, prefetch) computing rows [m0, m0 + MT) of block b into MT __m512 accumulators and
// handing them to store16. Knows nothing of any type's layout or arithmetic; includes no C++ library header.
#pragma once
#include "intrin.h"
#include "rows.h"

namespace dwrows {

typedef int32_t __attribute__((may_alias)) i32_alias;

// acc + dpbusd(w, the 4 bytes at p broadcast to all 16 lanes). The broadcast is folded into the instruction: from
// the intrinsics (_mm512_set1_epi32 of a load) GCC 12 emits a separate VPBROADCASTD per use, which on a Zen 4
// competes with the VNNI instructions (measured: the q4x8 kernel ~9% faster at 9 rows). Same integer results.
inline __m512i dpbusd_b(__m512i acc, __m512i w, const int8_t* p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_alias*)p));
    return acc;
}

// out[(m0 + m) * N + n] = acc[m][n - 16 b] + bias[n] for the live columns n of block b (all 16 but in a short last
// block), m < MT.
template <int MT>
inline void store16(const __m512 (&acc)[MT], const float* bias, float* out, int64_t N, int64_t b, int64_t m0) {
    const int64_t n0 = b * 16;
    const int64_t live = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 keep = (__mmask16)((1u << live) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(out + (m0 + m) * N + n0, keep, _mm512_add_ps(acc[m], bv));
}

// Blocks [b0, b1) of an M-row call: each block's rows in balanced tiles of at most MAX.
template <int MAX, class Rows>
inline void gemv16(int64_t M, int64_t b0, int64_t b1, Rows&& rows) {
    for (int64_t b = b0; b < b1; ++b)
        balanced_tiles<MAX>(M, b + 1 < b1, [&]<int MT>(int64_t m0, bool pf) { rows.template operator()<MT>(b, m0, pf); });
}

// A row's exact integer sums as floats: its 16 columns' own (a vector), or one for every column (a min term's).
inline __m512 to_lanes(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512 to_lanes(int32_t s) { return _mm512_set1_ps((float)s); }

// acc[m] = fma((float) s[m] * v, dx[m], acc[m]) for the tile's rows m < MT, s[m] a row's sums (to_lanes): the float
// step that ends a super-block or group of the types' sequences (q6k, q8_0; q4x8's t has a second term).
template <int MT, class S>
inline void fma_rows(__m512 (&acc)[MT], const float* dx, const S* s, __m512 v) {
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(to_lanes(s[m]), v), _mm512_set1_ps(dx[m]), acc[m]);
}

// acc[m] = fma(-((float) s[m] * v), dx[m], acc[m]): the same step subtracting (a min term's, q6k.h).
template <int MT, class S>
inline void fnma_rows(__m512 (&acc)[MT], const float* dx, const S* s, __m512 v) {
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fnmadd_ps(_mm512_mul_ps(to_lanes(s[m]), v), _mm512_set1_ps(dx[m]), acc[m]);
}

}  // namespace dwrows

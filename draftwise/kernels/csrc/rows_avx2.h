// The shared GEMV driver of the block kernels, AVX2 part (included only by units compiled with -mavx2 -mfma): the
// walk over 16-column blocks as two halves of 8 columns (one __m256 of outputs per row), the store of a tile's
// rows with the bias, and the 4-byte broadcast load the inner loops use.
//
// Owns: gemv8x2 (blocks [b0, b1), each block's halves h = 0 (columns 0-7) and h = 1 (8-15, skipped past N), each
// half's rows in rows.h's balanced tiles; the next block prefetched while the first tile of half 0 computes),
// store8 (a tile's 8 outputs per row plus the bias; a short half through a scalar tail, the same additions),
// load_i32, and fma_rows / fnma_rows (the float step the types end a super-block or group with). A type supplies `Rows`: a
// template lambda <int MT>(b, h, m0, prefetch) computing rows [m0, m0 + MT) of half h of block b into MT __m256
// accumulators and handing them to store8. Knows nothing of any type's layout or arithmetic; includes no C++
// library header.
#pragma once
#include "intrin.h"
#include "rows.h"

namespace dwrows {

inline int32_t load_i32(const void* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

// out[(m0 + m) * N + n] = acc[m][n - n0] + bias[n] for the live columns n of half h of block b, m < MT.
template <int MT>
inline void store8(const __m256 (&acc)[MT], const float* bias, float* out, int64_t N, int64_t b, int h, int64_t m0) {
    const int64_t n0 = b * 16 + h * 8;
    const int64_t live = N - n0 < 8 ? N - n0 : 8;
    for (int m = 0; m < MT; ++m) {
        float* o = out + (m0 + m) * N + n0;
        if (live == 8) {
            const __m256 bv = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
            _mm256_storeu_ps(o, _mm256_add_ps(acc[m], bv));
        } else {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, acc[m]);
            for (int64_t j = 0; j < live; ++j) o[j] = tmp[j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}

// Blocks [b0, b1) of an M-row call over N columns: each block's two halves, each half's rows in balanced tiles of
// at most MAX.
template <int MAX, class Rows>
inline void gemv8x2(int64_t M, int64_t N, int64_t b0, int64_t b1, Rows&& rows) {
    for (int64_t b = b0; b < b1; ++b) {
        balanced_tiles<MAX>(M, b + 1 < b1, [&]<int MT>(int64_t m0, bool pf) { rows.template operator()<MT>(b, 0, m0, pf); });
        if (b * 16 + 8 < N)
            balanced_tiles<MAX>(M, false, [&]<int MT>(int64_t m0, bool pf) { rows.template operator()<MT>(b, 1, m0, pf); });
    }
}

// A row's exact integer sums as floats: its 8 columns' own (a vector), or one for every column (a min term's).
inline __m256 to_lanes(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256 to_lanes(int32_t s) { return _mm256_set1_ps((float)s); }

// acc[m] = fma((float) s[m] * v, dx[m], acc[m]) for the tile's rows m < MT, s[m] a row's sums (to_lanes): the float
// step that ends a super-block or group of the types' sequences (q6k, q8_0; q4x8's t has a second term).
template <int MT, class S>
inline void fma_rows(__m256 (&acc)[MT], const float* dx, const S* s, __m256 v) {
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(to_lanes(s[m]), v), _mm256_set1_ps(dx[m]), acc[m]);
}

// acc[m] = fma(-((float) s[m] * v), dx[m], acc[m]): the same step subtracting (a min term's, q6k.h).
template <int MT, class S>
inline void fnma_rows(__m256 (&acc)[MT], const float* dx, const S* s, __m256 v) {
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_fnmadd_ps(_mm256_mul_ps(to_lanes(s[m]), v), _mm256_set1_ps(dx[m]), acc[m]);
}

}  // namespace dwrows

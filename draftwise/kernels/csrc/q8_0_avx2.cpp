// q8_0, AVX2 path (AVX2 + FMA: Zen 2/3, Haswell on): llama.cpp's signed product, _mm256_maddubs_epi16(|x|,
// sign(v, x)) (|pair| <= 2 * 127 * 127 < 32767, no saturation since v != -128), then _mm256_madd_epi16 by ones to
// int32, per 8 columns x 4 K values; the group's exact isum meets d and dx in q8_0.h's float steps.
// Owns only this path's inner loop over one tile (the walk over blocks, the halves, tiles and stores:
// rows_avx2.h); knows nothing of torch, threads or when it runs. Compiled with -mavx2 -mfma and called only after
// a run-time cpuid check. Includes no C++ library header.
#include "q8_0.h"
#include "rows_avx2.h"

namespace {

using dwrows::load_i32;

// Rows [m0, m0 + MT) of one half (h = 0: columns 0-7, h = 1: columns 8-15) of the 16-column block b.
template <int MT, bool MIN>
[[gnu::noinline]] void half_rows(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b, int h, int64_t m0, bool prefetch) {
    const int64_t G = w->G, M = a->M;
    const uint8_t* P = w->qw + b * G * 512 + h * 32;
    const float* D = w->d + b * G * 16 + h * 8;
    const float* MN = MIN ? w->m + b * G * 16 + h * 8 : nullptr;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        if (prefetch) {
            const char* nxt = (const char*)(P + G * 512 + g * 512);
            for (int c = 0; c < 8; ++c) _mm_prefetch(nxt + 64 * c, _MM_HINT_T1);
        }
        __m256i isum[MT];
        for (int m = 0; m < MT; ++m) isum[m] = _mm256_setzero_si256();
        const int8_t* xg = a->q + (g * M + m0) * 32;
        for (int c = 0; c < 8; ++c) {
            const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(P + g * 512 + c * 64)), flip);
            for (int m = 0; m < MT; ++m) {
                const __m256i xb = _mm256_set1_epi32(load_i32(xg + m * 32 + 4 * c));
                const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(v, xb));
                isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(p, ones));
            }
        }
        const __m256 dv = _mm256_loadu_ps(D + g * 16);
        const float* DX = a->dx + g * M + m0;
        for (int m = 0; m < MT; ++m) {
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[m]), dv);
            acc[m] = _mm256_fmadd_ps(t, _mm256_set1_ps(DX[m]), acc[m]);
        }
        if constexpr (MIN) {
            const __m256 mv = _mm256_loadu_ps(MN + g * 16);
            const int32_t* QS = a->qsum + g * M + m0;
            for (int m = 0; m < MT; ++m) {
                const __m256 u = _mm256_mul_ps(_mm256_set1_ps((float)QS[m]), mv);
                acc[m] = _mm256_fmadd_ps(u, _mm256_set1_ps(DX[m]), acc[m]);
            }
        }
    }
    dwrows::store8(acc, w->bias, out, w->N, b, h, m0);
}

template <bool MIN>
void gemv(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1) {
    dwrows::gemv8x2<4>(a->M, w->N, b0, b1, [&]<int MT>(int64_t b, int h, int64_t m0, bool pf) {
        half_rows<MT, MIN>(w, a, out, b, h, m0, pf);
    });
}

}  // namespace

extern "C" void dw_q80_gemm_avx2(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1) {
    if (w->m) gemv<true>(w, a, out, b0, b1);
    else gemv<false>(w, a, out, b0, b1);
}

// q8_0, AVX2 path (AVX2 + FMA: Zen 2/3, Haswell on): llama.cpp's signed product, _mm256_maddubs_epi16(|x|,
// sign(v, x)) (|pair| <= 2 * 127 * 127 < 32767, no saturation since v != -128), then _mm256_madd_epi16 by ones to
// int32, per 8 columns x 4 K values; the group's exact isum meets d and dx in q8_0.h's float steps.
// Owns only this path's arithmetic; knows nothing of torch, threads or when it runs. Compiled with -mavx2 -mfma and
// called only after a run-time cpuid check. Includes no C++ library header.
#include "intrin.h"
#include "q8_0.h"

namespace {

inline int32_t load_i32(const void* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

// Rows [m0, m0 + MT) of one half (h = 0: columns 0-7, h = 1: columns 8-15) of the 16-column block b.
template <int MT>
void half_rows(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b, int h, int64_t m0, bool prefetch) {
    const int64_t G = w->G, N = w->N, M = a->M;
    const uint8_t* P = w->qw + b * G * 512 + h * 32;
    const float* D = w->d + b * G * 16 + h * 8;
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
    }
    const int64_t n0 = b * 16 + h * 8;
    const int64_t live = N - n0 < 8 ? N - n0 : 8;
    for (int m = 0; m < MT; ++m) {
        float* o = out + (m0 + m) * N + n0;
        if (live == 8) {
            const __m256 bias = w->bias ? _mm256_loadu_ps(w->bias + n0) : _mm256_setzero_ps();
            _mm256_storeu_ps(o, _mm256_add_ps(acc[m], bias));
        } else {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, acc[m]);
            for (int64_t j = 0; j < live; ++j) o[j] = tmp[j] + (w->bias ? w->bias[n0 + j] : 0.0f);
        }
    }
}

constexpr int MAX_TILE = 4;

void half(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b, int h, bool prefetch) {
    const int64_t M = a->M;
    const int64_t tiles = (M + MAX_TILE - 1) / MAX_TILE;
    int64_t m0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = (M - m0) / (tiles - t);
        const bool pf = prefetch && t == 0 && h == 0;
        switch (rows) {
            case 1: half_rows<1>(w, a, out, b, h, m0, pf); break;
            case 2: half_rows<2>(w, a, out, b, h, m0, pf); break;
            case 3: half_rows<3>(w, a, out, b, h, m0, pf); break;
            default: half_rows<4>(w, a, out, b, h, m0, pf); break;
        }
        m0 += rows;
    }
}

}  // namespace

extern "C" void dw_q80_gemm_avx2(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
        half(w, a, out, b, 0, b + 1 < b1);
        if (b * 16 + 8 < w->N) half(w, a, out, b, 1, false);
    }
}

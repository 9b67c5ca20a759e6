// q4x8, AVX2 path (AVX2 + FMA + F16C-era CPUs such as AMD Zen 2/3 and Intel Haswell on):
// _mm256_maddubs_epi16 (u8 weight x s8 activation pairs) summed in int16 over a group, then
// _mm256_madd_epi16 by ones to int32 — exact, since |sum| <= 8 * 2 * 15 * 127 = 30480 < 32767.
// Owns only this path's arithmetic (layout and float sequence are fixed in q4x8.h); compiled with
// -mavx2 -mfma and called only after a run-time cpuid check. Includes no C++ library header.
#include <immintrin.h>
#include "q4x8.h"

namespace {

inline int32_t load_i32(const int8_t* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

// Rows [m0, m0 + MT) of one half (h = 0: columns 0-7, h = 1: columns 8-15) of the 16-column block b.
// With `prefetch`, the next block's weights (this half's lines) are requested while this one computes; the
// nibbles into L2 (T1), as on the AVX-512 path (measured there, and for this path on a Zen 4: 8-37% more weight
// bytes per second at 1-9 rows than into L1; not measured on an AVX2-only CPU).
template <int MT>
void half_rows(const DwQ4* w, const DwQ8* a, float* out, int64_t b, int h, int64_t m0, bool prefetch) {
    const int64_t K = w->K, G = w->G, S = w->S, N = w->N;
    const uint8_t* P = w->packed + b * G * 256 + h * 32;
    const uint8_t* SC = w->sc + b * G * 16 + h * 8;
    const uint8_t* MN = w->mn + b * G * 16 + h * 8;
    const float* D = w->d + b * S * 16 + h * 8;
    const float* DM = w->dmin + b * S * 16 + h * 8;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    __m256 dv = _mm256_setzero_ps(), dmv = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        if ((g & 7) == 0) {
            dv = _mm256_loadu_ps(D + (g >> 3) * 16);
            dmv = _mm256_loadu_ps(DM + (g >> 3) * 16);
        }
        if (prefetch) {
            const char* nxt = (const char*)(P + G * 256 + g * 256);
            _mm_prefetch(nxt, _MM_HINT_T1);
            _mm_prefetch(nxt + 64, _MM_HINT_T1);
            _mm_prefetch(nxt + 128, _MM_HINT_T1);
            _mm_prefetch(nxt + 192, _MM_HINT_T1);
            if ((g & 3) == 0) {
                _mm_prefetch((const char*)(SC + G * 16 + g * 16), _MM_HINT_T0);
                _mm_prefetch((const char*)(MN + G * 16 + g * 16), _MM_HINT_T0);
            }
            if ((g & 7) == 0) {
                _mm_prefetch((const char*)(D + S * 16 + (g >> 3) * 16), _MM_HINT_T0);
                _mm_prefetch((const char*)(DM + S * 16 + (g >> 3) * 16), _MM_HINT_T0);
            }
        }
        __m256i i16[MT];
        for (int m = 0; m < MT; ++m) i16[m] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(P + g * 256 + c * 64));
            const __m256i wl = _mm256_and_si256(raw, low4);
            const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            for (int m = 0; m < MT; ++m) {
                const int8_t* xq = a->q + (m0 + m) * K + g * 32 + c * 4;
                const __m256i pl = _mm256_maddubs_epi16(wl, _mm256_set1_epi32(load_i32(xq)));
                const __m256i ph = _mm256_maddubs_epi16(wh, _mm256_set1_epi32(load_i32(xq + 16)));
                i16[m] = _mm256_add_epi16(i16[m], _mm256_add_epi16(pl, ph));
            }
        }
        long long scl, mnl;
        __builtin_memcpy(&scl, SC + g * 16, 8);
        __builtin_memcpy(&mnl, MN + g * 16, 8);
        const __m256 s = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(scl))));
        const __m256 mm = _mm256_mul_ps(dmv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mnl))));
        const __m256 negmm = _mm256_sub_ps(_mm256_setzero_ps(), mm);
        for (int m = 0; m < MT; ++m) {
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(i16[m], ones));
            const int64_t ag = (m0 + m) * G + g;
            acc[m] = _mm256_fmadd_ps(isum, _mm256_mul_ps(s, _mm256_set1_ps(a->dx[ag])), acc[m]);
            acc[m] = _mm256_fmadd_ps(negmm, _mm256_set1_ps(a->xs[ag]), acc[m]);
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

void half(const DwQ4* w, const DwQ8* a, float* out, int64_t b, int h, bool prefetch) {
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

extern "C" void dw_gemm_avx2(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
        half(w, a, out, b, 0, b + 1 < b1);
        if (b * 16 + 8 < w->N) half(w, a, out, b, 1, false);
    }
}

extern "C" void dw_q8_rows_avx2(const float* x, int64_t K, int8_t* q, float* dx, float* xs, int64_t r0,
                                int64_t r1) {
    const int64_t G = K / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t g = 0; g < G; ++g) {
            const float* p = x + r * K + g * 32;
            __m256 v[4];
            for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
            __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m256i qi[4];
            for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            const int32_t qsum = _mm_cvtsi128_si32(s4);
            const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
            const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
            const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
            _mm256_storeu_si256((__m256i*)(q + r * K + g * 32), p8);
            const float d = amax / 127.0f;
            dx[r * G + g] = d;
            xs[r * G + g] = d * (float)qsum;
        }
    }
}

// q4x8, AVX-512 path (F + BW + VNNI): _mm512_dpbusd_epi32 on 16 columns x 4 K values per instruction.
// Owns only this path's arithmetic (the layout and the float sequence are fixed in q4x8.h); compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni and called only after a run-time cpuid check.
// Includes no C++ library header: nothing inline from here can leak into code run on other CPUs.
#include <immintrin.h>
#include "q4x8.h"

namespace {

inline int32_t load_i32(const int8_t* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return v;
}

// Rows [m0, m0 + MT) of one 16-column block b; weights are unpacked once per group for all MT rows.
// With `prefetch`, the next block's weights are requested from memory while this one computes, so a
// compute-bound call (many rows) overlaps its memory traffic instead of stalling on it. The packed nibbles go to
// L2 (hint T1), not L1: a block is 12-70 KB (K = 1536-8960) and pulling the next one into a 32 KB L1 evicted the
// current block and the activations (measured: T1 streamed 10-20% more weight bytes per second at 4-9 rows).
template <int MT>
void block_rows(const DwQ4* w, const DwQ8* a, float* out, int64_t b, int64_t m0, bool prefetch) {
    const int64_t K = w->K, G = w->G, S = w->S, N = w->N;
    const uint8_t* P = w->packed + b * G * 256;
    const uint8_t* SC = w->sc + b * G * 16;
    const uint8_t* MN = w->mn + b * G * 16;
    const float* D = w->d + b * S * 16;
    const float* DM = w->dmin + b * S * 16;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[MT];
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    __m512 dv = _mm512_setzero_ps(), dmv = _mm512_setzero_ps();
#pragma GCC unroll 1
    for (int64_t g = 0; g < G; ++g) {
        if ((g & 7) == 0) {
            dv = _mm512_loadu_ps(D + (g >> 3) * 16);
            dmv = _mm512_loadu_ps(DM + (g >> 3) * 16);
        }
        const __m512 s = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                               _mm_loadu_si128((const __m128i*)(SC + g * 16)))));
        const __m512 mm = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                 _mm_loadu_si128((const __m128i*)(MN + g * 16)))));
        const __m512 negmm = _mm512_sub_ps(_mm512_setzero_ps(), mm);
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
        __m512i isum[MT];
#pragma GCC unroll 12
        for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
        const int8_t* xg = a->q + m0 * K + g * 32;
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m512i raw = _mm512_loadu_si512((const void*)(P + g * 256 + c * 64));
            const __m512i wl = _mm512_and_si512(raw, low4);
            const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
#pragma GCC unroll 12
            for (int m = 0; m < MT; ++m) {
                isum[m] = _mm512_dpbusd_epi32(isum[m], wl, _mm512_set1_epi32(load_i32(xg + m * K + 4 * c)));
                isum[m] = _mm512_dpbusd_epi32(isum[m], wh, _mm512_set1_epi32(load_i32(xg + m * K + 16 + 4 * c)));
            }
        }
#pragma GCC unroll 12
        for (int m = 0; m < MT; ++m) {
            const int64_t ag = (m0 + m) * G + g;
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(s, _mm512_set1_ps(a->dx[ag])), acc[m]);
            acc[m] = _mm512_fmadd_ps(negmm, _mm512_set1_ps(a->xs[ag]), acc[m]);
        }
    }
    const int64_t n0 = b * 16;
    const int64_t live = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 keep = (__mmask16)((1u << live) - 1u);
    const __m512 bias = w->bias ? _mm512_maskz_loadu_ps(keep, w->bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m)
        _mm512_mask_storeu_ps(out + (m0 + m) * N + n0, keep, _mm512_add_ps(acc[m], bias));
}

constexpr int MAX_TILE = 12;  // 12 int + 12 float accumulators + weights and constants fit 32 zmm registers

void block(const DwQ4* w, const DwQ8* a, float* out, int64_t b, bool prefetch) {
    const int64_t M = a->M;
    const int64_t tiles = (M + MAX_TILE - 1) / MAX_TILE;
    int64_t m0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = (M - m0) / (tiles - t);  // balanced tiles: 16 rows -> 8 + 8
        const bool pf = prefetch && t == 0;
        switch (rows) {
            case 1: block_rows<1>(w, a, out, b, m0, pf); break;
            case 2: block_rows<2>(w, a, out, b, m0, pf); break;
            case 3: block_rows<3>(w, a, out, b, m0, pf); break;
            case 4: block_rows<4>(w, a, out, b, m0, pf); break;
            case 5: block_rows<5>(w, a, out, b, m0, pf); break;
            case 6: block_rows<6>(w, a, out, b, m0, pf); break;
            case 7: block_rows<7>(w, a, out, b, m0, pf); break;
            case 8: block_rows<8>(w, a, out, b, m0, pf); break;
            case 9: block_rows<9>(w, a, out, b, m0, pf); break;
            case 10: block_rows<10>(w, a, out, b, m0, pf); break;
            case 11: block_rows<11>(w, a, out, b, m0, pf); break;
            default: block_rows<12>(w, a, out, b, m0, pf); break;
        }
        m0 += rows;
    }
}

}  // namespace

extern "C" void dw_gemm_avx512(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block(w, a, out, b, b + 1 < b1);
}

extern "C" void dw_q8_rows_avx512(const float* x, int64_t K, int8_t* q, float* dx, float* xs, int64_t r0,
                                  int64_t r1) {
    const int64_t G = K / 32;
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t g = 0; g < G; ++g) {
            const float* p = x + r * K + g * 32;
            const __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16);
            const float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i*)(q + r * K + g * 32), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i*)(q + r * K + g * 32 + 16), _mm512_cvtsepi32_epi8(q1));
            const int32_t qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            const float d = amax / 127.0f;
            dx[r * G + g] = d;
            xs[r * G + g] = d * (float)qsum;
        }
    }
}

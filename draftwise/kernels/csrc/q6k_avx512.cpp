// q6k, AVX-512 path (F + BW + VNNI): the 6-bit (q3k: 3-bit) weights rebuilt per 64-byte chunk from q6k.h's two
// planes (two shifts and three logic ops each), VPDPBUSD on 16 columns x 4 K values with the activation operand an
// embedded broadcast; each sub-block's sum starts at -OFF times the row's qsum16 (the offset) and meets its int8
// scale in one VPMULLD. Owns only this path's arithmetic (layout and float sequence: q6k.h); knows nothing of torch,
// threads or when it runs (q6k.cpp and dispatch.h decide). Compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512vnni and called only after a run-time cpuid check. Includes no C++ library header.
#include "q6k.h"
#include "rows_avx512.h"

namespace {

using dwrows::dpbusd_b;

// (m_lo, m_hi) of the 16 columns as int16 pairs, from a group's two rows of 16 int8 mins (mn [.., 2, 16])
inline __m512i mn_pairs(const int8_t* p) {
    const __m128i lo = _mm_loadu_si128((const __m128i*)p), hi = _mm_loadu_si128((const __m128i*)(p + 16));
    return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
}

// Rows [m0, m0 + MT) of one 16-column block b, its values in q6k.h's planes P: per group, 8 VPDPBUSD per row into
// two sub-block sums, two VPMULLD by the sub-blocks' scales into the super-block's int32; per super-block the float
// steps of q6k.h. MIN: with its min term (B after the group loop: one VPDPWSSD of (m_lo, m_hi) pairs by the row's
// (qsum16_lo, qsum16_hi) a group).
template <int MT, class P, bool MIN>
[[gnu::noinline]] void block_rows(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b, int64_t m0, bool prefetch) {
    const int64_t G = w->G, S = w->S, N = w->N, M = a->M;
    const uint8_t* L = w->ql + b * G * P::LOW;
    const uint8_t* H = w->qh + b * G * P::HIGH;
    const int8_t* SC = w->sc + b * G * 32;
    const float* D = w->d + b * S * 16;
    __m512 acc[MT];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
#pragma GCC unroll 1
    for (int64_t s = 0; s < S; ++s) {
        __m512i isc[MT];
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) isc[m] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int64_t g = s * 8; g < s * 8 + 8; ++g) {
            if (prefetch) {
                const char* nl = (const char*)(L + G * P::LOW + g * P::LOW);
                const char* nh = (const char*)(H + G * P::HIGH + g * P::HIGH);
#pragma GCC unroll 4
                for (int r = 0; r < P::LB; ++r) _mm_prefetch(nl + 64 * r, _MM_HINT_T1);
#pragma GCC unroll 2
                for (int r = 0; r < P::HB; ++r) _mm_prefetch(nh + 64 * r, _MM_HINT_T1);
                _mm_prefetch((const char*)(SC + G * 32 + g * 32), _MM_HINT_T0);
            }
            __m512i lo[MT], hi[MT];
            const int16_t* qs = a->qsum16 + (s * M + m0) * 16 + (g - s * 8) * 2;
#pragma GCC unroll 8
            for (int m = 0; m < MT; ++m) {
                lo[m] = _mm512_set1_epi32(-P::OFF * qs[16 * m]);
                hi[m] = _mm512_set1_epi32(-P::OFF * qs[16 * m + 1]);
            }
            const int8_t* xg = a->q + (g * M + m0) * 32;
            dwq6k::each_chunk([&]<int C>() {
                const __m512i wl = dwq6k::values<P, 2 * C, __m512i>(L + g * P::LOW, H + g * P::HIGH);
                const __m512i wh = dwq6k::values<P, 2 * C + 1, __m512i>(L + g * P::LOW, H + g * P::HIGH);
#pragma GCC unroll 8
                for (int m = 0; m < MT; ++m) {
                    lo[m] = dpbusd_b(lo[m], wl, xg + m * 32 + 4 * C);
                    hi[m] = dpbusd_b(hi[m], wh, xg + m * 32 + 16 + 4 * C);
                }
            });
            const __m512i scl = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(SC + g * 32)));
            const __m512i sch = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(SC + g * 32 + 16)));
#pragma GCC unroll 8
            for (int m = 0; m < MT; ++m)
                isc[m] = _mm512_add_epi32(isc[m], _mm512_add_epi32(_mm512_mullo_epi32(lo[m], scl),
                                                                   _mm512_mullo_epi32(hi[m], sch)));
        }
        dwrows::fma_rows(acc, a->dx + s * M + m0, isc, _mm512_loadu_ps(D + s * 16));
        if constexpr (MIN) {
            const int8_t* MN = w->mn + b * G * 32;
            __m512i ib[MT];
#pragma GCC unroll 8
            for (int m = 0; m < MT; ++m) ib[m] = _mm512_setzero_si512();
#pragma GCC unroll 1
            for (int64_t g = s * 8; g < s * 8 + 8; ++g) {
                const __m512i mnp = mn_pairs(MN + g * 32);
                const int16_t* QS = a->qsum16 + (s * M + m0) * 16 + (g - s * 8) * 2;
#pragma GCC unroll 8
                for (int m = 0; m < MT; ++m)
                    ib[m] = _mm512_dpwssd_epi32(ib[m], mnp,
                                                _mm512_set1_epi32(*(const dwrows::i32_alias*)(QS + m * 16)));
            }
            dwrows::fnma_rows(acc, a->dx + s * M + m0, ib, _mm512_loadu_ps(w->dmin + b * S * 16 + s * 16));
        }
    }
    dwrows::store16(acc, w->bias, out, N, b, m0);
}

// 8 rows x (2 sub-block sums + 1 super-block sum) = 24 zmm, plus weights and constants
constexpr int MAX_TILE = 8;

}  // namespace

extern "C" void dw_q6k_gemm_avx512(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1) {
    dwq6k::by_layout(w, [&]<class P, bool MIN>() {
        dwrows::gemv16<MAX_TILE>(a->M, b0, b1, [&]<int MT>(int64_t b, int64_t m0, bool pf) {
            block_rows<MT, P, MIN>(w, a, out, b, m0, pf);
        });
    });
}

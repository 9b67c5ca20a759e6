// q6k, AVX2 path (AVX2 + FMA): the 6-bit (q3k: 3-bit) weights rebuilt per 32-byte half chunk from q6k.h's planes,
// _mm256_maddubs_epi16 (u8 weight 0..63 x s8 activation pairs, |pair| <= 2 * 63 * 127 = 16002) summed over two
// chunks in int16 (<= 32004, no saturation), then _mm256_madd_epi16 by the column's (sc, sc) to int32; the -OFF
// offset as one _mm256_madd_epi16 of
// (sc_lo, sc_hi) pairs by the row's (qsum16_lo, qsum16_hi) per group. The exact totals meet d and dx in q6k.h's
// float steps (with the min term, one more madd per group and float step per super-block). Owns only this path's
// arithmetic; knows nothing of torch, threads or when it runs. Compiled with
// -mavx2 -mfma and called only after a run-time cpuid check. Includes no C++ library header.
#include "q6k.h"
#include "rows_avx2.h"

namespace {

using dwrows::load_i32;

// (sc, sc) per column as int16 pairs from 8 int8 scales
inline __m256i sc_twice(const int8_t* p) {
    long long v;
    __builtin_memcpy(&v, p, 8);
    const __m256i s32 = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v));
    return _mm256_or_si256(_mm256_and_si256(s32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(s32, 16));
}

// (sc_lo, sc_hi) per column as int16 pairs
inline __m256i sc_pair(const int8_t* lo, const int8_t* hi) {
    long long a, b;
    __builtin_memcpy(&a, lo, 8);
    __builtin_memcpy(&b, hi, 8);
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128(a), _mm_cvtsi64_si128(b)));
}

// Rows [m0, m0 + MT) of one half (h = 0: columns 0-7, h = 1: columns 8-15) of the 16-column block b, its values in
// q6k.h's planes P; MIN: with q6k.h's min term (B per super-block after the group loop: one _mm256_madd_epi16 of
// (m_lo, m_hi) pairs per group).
template <int MT, class P, bool MIN>
[[gnu::noinline]] void half_rows(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b, int h, int64_t m0, bool prefetch) {
    const int64_t G = w->G, S = w->S, N = w->N, M = a->M;
    const uint8_t* L = w->ql + b * G * P::LOW + h * 32;
    const uint8_t* H = w->qh + b * G * P::HIGH + h * 32;
    const int8_t* SC = w->sc + b * G * 32 + h * 8;
    const float* D = w->d + b * S * 16 + h * 8;
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
        __m256i isc[MT], imn[MT];
        for (int m = 0; m < MT; ++m) isc[m] = imn[m] = _mm256_setzero_si256();
        for (int64_t g = s * 8; g < s * 8 + 8; ++g) {
            if (prefetch) {
                const char* nl = (const char*)(L - h * 32 + G * P::LOW + g * P::LOW);
                const char* nh = (const char*)(H - h * 32 + G * P::HIGH + g * P::HIGH);
                for (int r = 0; r < P::LB; ++r) _mm_prefetch(nl + 64 * r, _MM_HINT_T1);
                for (int r = 0; r < P::HB; ++r) _mm_prefetch(nh + 64 * r, _MM_HINT_T1);
            }
            __m256i wl[4], wh[4];
            dwq6k::each_chunk([&]<int C>() {
                wl[C] = dwq6k::values<P, 2 * C, __m256i>(L + g * P::LOW, H + g * P::HIGH);
                wh[C] = dwq6k::values<P, 2 * C + 1, __m256i>(L + g * P::LOW, H + g * P::HIGH);
            });
            const __m256i scl = sc_twice(SC + g * 32), sch = sc_twice(SC + g * 32 + 16);
            const __m256i scp = sc_pair(SC + g * 32, SC + g * 32 + 16);
            const int8_t* xg = a->q + (g * M + m0) * 32;
            const int16_t* QS = a->qsum16 + (s * M + m0) * 16 + (g - s * 8) * 2;
            for (int m = 0; m < MT; ++m) {
                const int8_t* xq = xg + m * 32;
                __m256i pl[2], ph[2];
                for (int k = 0; k < 2; ++k) {
                    pl[k] = _mm256_add_epi16(
                        _mm256_maddubs_epi16(wl[2 * k], _mm256_set1_epi32(load_i32(xq + 8 * k))),
                        _mm256_maddubs_epi16(wl[2 * k + 1], _mm256_set1_epi32(load_i32(xq + 8 * k + 4))));
                    ph[k] = _mm256_add_epi16(
                        _mm256_maddubs_epi16(wh[2 * k], _mm256_set1_epi32(load_i32(xq + 16 + 8 * k))),
                        _mm256_maddubs_epi16(wh[2 * k + 1], _mm256_set1_epi32(load_i32(xq + 16 + 8 * k + 4))));
                }
                const __m256i sl = _mm256_add_epi32(_mm256_madd_epi16(pl[0], scl), _mm256_madd_epi16(pl[1], scl));
                const __m256i sh = _mm256_add_epi32(_mm256_madd_epi16(ph[0], sch), _mm256_madd_epi16(ph[1], sch));
                isc[m] = _mm256_add_epi32(isc[m], _mm256_add_epi32(sl, sh));
                imn[m] = _mm256_add_epi32(imn[m], _mm256_madd_epi16(scp, _mm256_set1_epi32(load_i32(QS + m * 16))));
            }
        }
        __m256i tot[MT];
        for (int m = 0; m < MT; ++m) tot[m] = _mm256_sub_epi32(isc[m], _mm256_slli_epi32(imn[m], P::SHIFT));
        dwrows::fma_rows(acc, a->dx + s * M + m0, tot, _mm256_loadu_ps(D + s * 16));
        if constexpr (MIN) {
            const int8_t* MN = w->mn + b * G * 32 + h * 8;
            __m256i ib[MT];
            for (int m = 0; m < MT; ++m) ib[m] = _mm256_setzero_si256();
            for (int64_t g = s * 8; g < s * 8 + 8; ++g) {
                const __m256i mnp = sc_pair(MN + g * 32, MN + g * 32 + 16);
                const int16_t* QS = a->qsum16 + (s * M + m0) * 16 + (g - s * 8) * 2;
                for (int m = 0; m < MT; ++m)
                    ib[m] = _mm256_add_epi32(ib[m], _mm256_madd_epi16(mnp, _mm256_set1_epi32(load_i32(QS + m * 16))));
            }
            dwrows::fnma_rows(acc, a->dx + s * M + m0, ib, _mm256_loadu_ps(w->dmin + b * S * 16 + h * 8 + s * 16));
        }
    }
    dwrows::store8(acc, w->bias, out, N, b, h, m0);
}

constexpr int MAX_TILE = 4;

}  // namespace

extern "C" void dw_q6k_gemm_avx2(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1) {
    dwq6k::by_layout(w, [&]<class P, bool MIN>() {
        dwrows::gemv8x2<MAX_TILE>(a->M, w->N, b0, b1, [&]<int MT>(int64_t b, int h, int64_t m0, bool pf) {
            half_rows<MT, P, MIN>(w, a, out, b, h, m0, pf);
        });
    });
}

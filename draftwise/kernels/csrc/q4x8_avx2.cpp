// q4x8, AVX2 path (AVX2 + FMA + F16C-era CPUs such as AMD Zen 2/3 and Intel Haswell on):
// _mm256_maddubs_epi16 (u8 weight x s8 activation pairs) summed in int16 over a group, then
// _mm256_madd_epi16 by the column's (sc, sc) to int32 — exact, since each int16 lane sums 8 maddubs of two
// products, |lane| <= 8 * 2 * 15 * 127 = 30480 < 32767, and sc * (lane + lane') <= 255 * 60960 fits int32.
// The min term: _mm256_madd_epi16 of (mn_g, mn_g+1) pairs by (qsum_g, qsum_g+1): |pair| <= 2 * 255 * 4064.
// q5x8 (values 0..31, q4x8.h): the fifth bits spread from qh to bytes and ORed in, and the int16 sums taken to int32
// after every 2 chunks (4 maddubs: |lane| <= 31,496) instead of once per group.
// Owns only this path's arithmetic (layout and float sequence are fixed in q4x8.h, the prefetch in q4x8_prefetch.h);
// knows nothing of torch, threads or when it runs (q4x8.cpp and dispatch.h decide). Compiled with -mavx2 -mfma and
// called only after a run-time cpuid check. Includes no C++ library header.
#include "q4x8.h"
#include "rows_avx2.h"
#include "q4x8_prefetch.h"

namespace {

using dwrows::load_i32;

// Columns 8h..8h+7 of block b, groups g and g + 1, as int16 pairs: 32-bit lane j holds (mn[j, g], mn[j, g + 1]),
// the operand _mm256_madd_epi16 multiplies by a broadcast pair (qsum[m, g], qsum[m, g + 1]). Group g + 1 = G (past
// a short last super-block) reads as 0 (its qsum is 0 too; this only avoids reading past the buffer).
inline __m256i mn_pair(const uint8_t* MN, int64_t g, int64_t G) {
    long long a, b = 0;
    __builtin_memcpy(&a, MN + g * 16, 8);
    if (g + 1 < G) __builtin_memcpy(&b, MN + (g + 1) * 16, 8);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128(a), _mm_cvtsi64_si128(b)));
}

// q5x8's fifth bits of one 8-column half of a chunk's nibbles: the 32 bits at p (bit j: byte j) -> 16 or 0 per byte.
inline __m256i plane_bytes(const uint8_t* p) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(load_i32(p)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Rows [m0, m0 + MT) of one half (h = 0: columns 0-7, h = 1: columns 8-15) of the 16-column block b.
// Per group and row: 8 maddubs summed in int16, then one _mm256_madd_epi16 by (sc, sc) pairs gives sc * isum in
// int32 (isc, summed over the super-block); per super-block and row: 4 madd for the min term, then the float
// steps of q4x8.h.
// With `prefetch`, the next block's weights are requested while this one computes (q4x8_prefetch.h: the nibbles
// into L2, as on the AVX-512 path; measured for this path on a Zen 4: 8-37% more weight bytes per second at 1-9 rows
// than into L1; not measured on an AVX2-only CPU).
template <int MT, bool H5>
[[gnu::noinline]] void half_rows(const DwQ4* w, const DwQ8* a, float* out, int64_t b, int h, int64_t m0, bool prefetch) {
    const int64_t G = w->G, S = w->S, N = w->N, M = a->M;
    const uint8_t* P = w->packed + b * G * 256 + h * 32;
    const uint8_t* SC = w->sc + b * G * 16 + h * 8;
    const uint8_t* MN = w->mn + b * G * 16 + h * 8;
    const float* D = w->d + b * S * 16 + h * 8;
    const float* DM = w->dmin + b * S * 16 + h * 8;
    const uint8_t* QH = H5 ? w->qh + b * G * 64 : nullptr;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
        const int64_t g0 = s * 8, g1 = g0 + 8 < G ? g0 + 8 : G;
        __m256i isc[MT];
        for (int m = 0; m < MT; ++m) isc[m] = _mm256_setzero_si256();
        for (int64_t g = g0; g < g1; ++g) {
            if (prefetch) DW_Q4X8_PREFETCH_NEXT_BLOCK();
            __m256i i16[MT];
            for (int m = 0; m < MT; ++m) i16[m] = _mm256_setzero_si256();
            const int8_t* xg = a->q + (g * M + m0) * 32;  // row m of the tile at xg + 32 m
            long long scl;
            __builtin_memcpy(&scl, SC + g * 16, 8);
            const __m256i sc32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(scl));
            const __m256i sc2 = _mm256_or_si256(sc32, _mm256_slli_epi32(sc32, 16));  // (sc, sc) per column
            for (int c = 0; c < 4; ++c) {
                const __m256i raw = _mm256_loadu_si256((const __m256i*)(P + g * 256 + c * 64));
                __m256i wl = _mm256_and_si256(raw, low4);
                __m256i wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                if constexpr (H5) {
                    wl = _mm256_or_si256(wl, plane_bytes(QH + g * 64 + c * 16 + h * 4));
                    wh = _mm256_or_si256(wh, plane_bytes(QH + g * 64 + c * 16 + 8 + h * 4));
                }
                for (int m = 0; m < MT; ++m) {
                    const int8_t* xq = xg + m * 32 + c * 4;
                    const __m256i pl = _mm256_maddubs_epi16(wl, _mm256_set1_epi32(load_i32(xq)));
                    const __m256i ph = _mm256_maddubs_epi16(wh, _mm256_set1_epi32(load_i32(xq + 16)));
                    i16[m] = _mm256_add_epi16(i16[m], _mm256_add_epi16(pl, ph));
                }
                if (c == 3 || (H5 && c == 1))  // sc * the int16 sums, into int32 (q5x8: every 2 chunks)
                    for (int m = 0; m < MT; ++m) {
                        isc[m] = _mm256_add_epi32(isc[m], _mm256_madd_epi16(i16[m], sc2));
                        i16[m] = _mm256_setzero_si256();
                    }
            }
        }
        __m256i mnp[4];
        for (int p = 0; p < 4; ++p) mnp[p] = g0 + 2 * p < g1 ? mn_pair(MN, g0 + 2 * p, G) : _mm256_setzero_si256();
        const __m256 dv = _mm256_loadu_ps(D + s * 16), dmv = _mm256_loadu_ps(DM + s * 16);
        const int16_t* QS = a->qsum + (s * M + m0) * 8;  // row m of the tile at QS + 8 m
        const float* DX = a->dx + s * M + m0;
        for (int m = 0; m < MT; ++m) {
            const int16_t* qs = QS + m * 8;
            __m256i imn = _mm256_madd_epi16(mnp[0], _mm256_set1_epi32(load_i32(qs)));
            for (int p = 1; p < 4; ++p)
                imn = _mm256_add_epi32(imn, _mm256_madd_epi16(mnp[p], _mm256_set1_epi32(load_i32(qs + 2 * p))));
            __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(isc[m]), dv);
            t = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imn), dmv, t);
            acc[m] = _mm256_fmadd_ps(t, _mm256_set1_ps(DX[m]), acc[m]);
        }
    }
    dwrows::store8(acc, w->bias, out, N, b, h, m0);
}

constexpr int MAX_TILE = 4;

}  // namespace

extern "C" void dw_gemm_avx2(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1) {
    dwq8k::by_plane(w, [&]<bool H5>() {
        dwrows::gemv8x2<MAX_TILE>(a->M, w->N, b0, b1, [&]<int MT>(int64_t b, int h, int64_t m0, bool pf) {
            half_rows<MT, H5>(w, a, out, b, h, m0, pf);
        });
    });
}

extern "C" void dw_q8_rows_avx2(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum,
                                int64_t r0, int64_t r1) {
    dwq8k::rows(x, M, K, q, dx, qsum, r0, r1,
        [](const float* p, int64_t n) {
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 mx = _mm256_setzero_ps();
            for (int64_t i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            return _mm_cvtss_f32(m4);
        },
        [](const float* p, float idf, int8_t* qg) {
            const __m256 id = _mm256_set1_ps(idf);
            __m256i qi[4];
            for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + 8 * i), id));
            const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
            const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
            const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            _mm256_storeu_si256((__m256i*)qg, _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order));
            return _mm_cvtsi128_si32(s4);
        });
}

// q4x8, AVX-512 path (F + BW + VNNI): VPDPBUSD on 16 columns x 4 K values per instruction, VPDPWSSD on
// 16 columns x 2 groups for the integer min term, both written as inline asm with the activation operand an
// embedded broadcast from memory ({1to16}).
// Owns only this path's arithmetic (the layout and the float sequence are fixed in q4x8.h, the prefetch in
// q4x8_prefetch.h); knows nothing of torch, threads or when it runs (q4x8.cpp and dispatch.h decide). Compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni and called only after a run-time cpuid check.
// Includes no C++ library header: nothing inline from here can leak into code run on other CPUs.
#include "q4x8.h"
#include "rows_avx512.h"
#include "q4x8_prefetch.h"

namespace {

// acc + dpbusd(w, the 4 bytes at p broadcast to all 16 lanes), and acc + dpwssd(w, the int16 pair at p broadcast).
// The broadcast is folded into the instruction: from the intrinsics (_mm512_set1_epi32 of a load) GCC 12 emits a
// separate VPBROADCASTD per use, which on a Zen 4 competes with the VNNI instructions (measured: 12 VPDPBUSD with
// {1to16} operands ~3.5/ns, each behind its own VPBROADCASTD ~3.2/ns; the kernel ~9% faster at 9 rows).
// Same instructions on the same values as the intrinsics: the integer results are unchanged.
typedef int32_t __attribute__((may_alias)) i32_alias;

using dwrows::dpbusd_b;

inline __m512i dpwssd_b(__m512i acc, __m512i w, const int16_t* p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_alias*)p));
    return acc;
}

// Columns 0-15 of block b, groups g and g + 1, as int16 pairs: 32-bit lane j holds (mn[j, g], mn[j, g + 1]),
// the operand VPDPWSSD multiplies by a broadcast pair (qsum[m, g], qsum[m, g + 1]). Group g + 1 = G (past a short
// last super-block) reads as 0 (its qsum is 0 too; this only avoids reading past the buffer).
inline __m512i mn_pair(const uint8_t* MN, int64_t g, int64_t G) {
    const __m128i a = _mm_loadu_si128((const __m128i*)(MN + g * 16));
    const __m128i b = g + 1 < G ? _mm_loadu_si128((const __m128i*)(MN + (g + 1) * 16)) : _mm_setzero_si128();
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
}

// Rows [m0, m0 + MT) of one 16-column block b; weights are unpacked once per group for all MT rows. H5 (q5x8): each
// chunk's nibbles get their fifth bits from qh (q4x8.h), a masked byte add of 16 per 64 values (KMOVQ + VPADDB).
// Per group and row: 8 VPDPBUSD (isum), one VPMULLD by sc and one add (isc, int32 over the super-block); per
// super-block and row: 4 VPDPWSSD for the min term, then the float steps of q4x8.h.
// With `prefetch`, the next block's weights are requested from memory while this one computes, so a
// compute-bound call (many rows) overlaps its memory traffic instead of stalling on it (q4x8_prefetch.h: the
// packed nibbles into L2, and why).
template <int MT, bool H5>
[[gnu::noinline]] void block_rows(const DwQ4* w, const DwQ8* a, float* out, int64_t b, int64_t m0, bool prefetch) {
    const int64_t G = w->G, S = w->S, N = w->N, M = a->M;
    const uint8_t* P = w->packed + b * G * 256;
    const uint8_t* SC = w->sc + b * G * 16;
    const uint8_t* MN = w->mn + b * G * 16;
    const float* D = w->d + b * S * 16;
    const float* DM = w->dmin + b * S * 16;
    const uint8_t* QH = H5 ? w->qh + b * G * 64 : nullptr;
    const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(16);
    __m512 acc[MT];
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
#pragma GCC unroll 1
    for (int64_t s = 0; s < S; ++s) {
        const int64_t g0 = s * 8, g1 = g0 + 8 < G ? g0 + 8 : G;
        __m512i isc[MT];
#pragma GCC unroll 12
        for (int m = 0; m < MT; ++m) isc[m] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int64_t g = g0; g < g1; ++g) {
            if (prefetch) DW_Q4X8_PREFETCH_NEXT_BLOCK();
            __m512i isum[MT];
#pragma GCC unroll 12
            for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
            const int8_t* xg = a->q + (g * M + m0) * 32;  // row m of the tile at xg + 32 m
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                const __m512i raw = _mm512_loadu_si512((const void*)(P + g * 256 + c * 64));
                __m512i wl = _mm512_and_si512(raw, low4);
                __m512i wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                if constexpr (H5) {
                    unsigned long long bl, bh;
                    __builtin_memcpy(&bl, QH + g * 64 + c * 16, 8);
                    __builtin_memcpy(&bh, QH + g * 64 + c * 16 + 8, 8);
                    wl = _mm512_mask_add_epi8(wl, _cvtu64_mask64(bl), wl, fifth);
                    wh = _mm512_mask_add_epi8(wh, _cvtu64_mask64(bh), wh, fifth);
                }
#pragma GCC unroll 12
                for (int m = 0; m < MT; ++m) {
                    isum[m] = dpbusd_b(isum[m], wl, xg + m * 32 + 4 * c);
                    isum[m] = dpbusd_b(isum[m], wh, xg + m * 32 + 16 + 4 * c);
                }
            }
            const __m512i scv = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(SC + g * 16)));
#pragma GCC unroll 12
            for (int m = 0; m < MT; ++m) isc[m] = _mm512_add_epi32(isc[m], _mm512_mullo_epi32(isum[m], scv));
        }
        __m512i mnp[4];
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) mnp[p] = g0 + 2 * p < g1 ? mn_pair(MN, g0 + 2 * p, G) : _mm512_setzero_si512();
        const __m512 dv = _mm512_loadu_ps(D + s * 16), dmv = _mm512_loadu_ps(DM + s * 16);
        const int16_t* QS = a->qsum + (s * M + m0) * 8;  // row m of the tile at QS + 8 m
        const float* DX = a->dx + s * M + m0;
#pragma GCC unroll 12
        for (int m = 0; m < MT; ++m) {
            const int16_t* qs = QS + m * 8;
            __m512i imn = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int p = 0; p < 4; ++p) imn = dpwssd_b(imn, mnp[p], qs + 2 * p);
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isc[m]), dv);
            t = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imn), dmv, t);
            acc[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(DX[m]), acc[m]);
        }
    }
    dwrows::store16(acc, w->bias, out, N, b, m0);
}

// 12 isum + 12 isc accumulators + weights and constants fill the 32 zmm registers; the 12 float acc, touched once
// per super-block, may live on the stack (measured on a Zen 4: 12 no slower than 8-10 at 9-128 rows)
constexpr int MAX_TILE = 12;

}  // namespace

extern "C" void dw_gemm_avx512(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1) {
    dwq8k::by_plane(w, [&]<bool H5>() {
        dwrows::gemv16<MAX_TILE>(a->M, b0, b1, [&]<int MT>(int64_t b, int64_t m0, bool pf) {
            block_rows<MT, H5>(w, a, out, b, m0, pf);
        });
    });
}

extern "C" void dw_q8_rows_avx512(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum,
                                  int64_t r0, int64_t r1) {
    dwq8k::rows(x, M, K, q, dx, qsum, r0, r1,
        [](const float* p, int64_t n) {
            __m512 mx = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(p + i)));
            return _mm512_reduce_max_ps(mx);
        },
        [](const float* p, float idf, int8_t* qg) {
            const __m512 id = _mm512_set1_ps(idf);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p), id));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(p + 16), id));
            _mm_storeu_si128((__m128i*)qg, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i*)(qg + 16), _mm512_cvtsepi32_epi8(q1));
            return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        });
}

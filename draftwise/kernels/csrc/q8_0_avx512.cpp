// q8_0, AVX-512 path (F + BW + VNNI): VPDPBUSD on 16 columns x 4 K values per instruction (the weights offset to
// unsigned, each row's group sum started at its qoff), the activation operand an embedded broadcast from memory.
// Owns only this path's inner loop over one tile (layout and float sequence: q8_0.h; the walk over blocks, the
// tiles and the stores: rows_avx512.h); knows nothing of torch, threads or when it runs (q8_0.cpp and dispatch.h
// decide). Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni and called only after a run-time cpuid
// check. Includes no C++ library header.
#include "q8_0.h"
#include "rows_avx512.h"

namespace {

using dwrows::dpbusd_b;

// Rows [m0, m0 + MT) of one 16-column block b: per group, 8 VPDPBUSD per row on the group's weights (read once for
// all MT rows), then the float steps of q8_0.h (with MIN, the min term's step too).
template <int MT, bool MIN>
[[gnu::noinline]] void block_rows(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b, int64_t m0, bool prefetch) {
    const int64_t G = w->G, M = a->M;
    const uint8_t* P = w->qw + b * G * 512;
    const float* D = w->d + b * G * 16;
    const float* MN = MIN ? w->m + b * G * 16 : nullptr;
    __m512 acc[MT];
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
#pragma GCC unroll 1
    for (int64_t g = 0; g < G; ++g) {
        if (prefetch) {
            const char* nxt = (const char*)(P + G * 512 + g * 512);
#pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) _mm_prefetch(nxt + 64 * c, _MM_HINT_T1);
            _mm_prefetch((const char*)(D + G * 16 + g * 16), _MM_HINT_T0);
        }
        __m512i isum[MT];
        const int32_t* qo = a->qoff + g * M + m0;
#pragma GCC unroll 12
        for (int m = 0; m < MT; ++m) isum[m] = _mm512_set1_epi32(qo[m]);
        const int8_t* xg = a->q + (g * M + m0) * 32;
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
            const __m512i wv = _mm512_loadu_si512((const void*)(P + g * 512 + c * 64));
#pragma GCC unroll 12
            for (int m = 0; m < MT; ++m) isum[m] = dpbusd_b(isum[m], wv, xg + m * 32 + 4 * c);
        }
        const __m512 dv = _mm512_loadu_ps(D + g * 16);
        const float* DX = a->dx + g * M + m0;
#pragma GCC unroll 12
        for (int m = 0; m < MT; ++m) {
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m]), dv);
            acc[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(DX[m]), acc[m]);
        }
        if constexpr (MIN) {
            const __m512 mv = _mm512_loadu_ps(MN + g * 16);
            const int32_t* QS = a->qsum + g * M + m0;
#pragma GCC unroll 12
            for (int m = 0; m < MT; ++m) {
                const __m512 u = _mm512_mul_ps(_mm512_set1_ps((float)QS[m]), mv);
                acc[m] = _mm512_fmadd_ps(u, _mm512_set1_ps(DX[m]), acc[m]);
            }
        }
    }
    dwrows::store16(acc, w->bias, out, w->N, b, m0);
}

template <bool MIN>
void gemv(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1) {
    dwrows::gemv16<12>(a->M, b0, b1, [&]<int MT>(int64_t b, int64_t m0, bool pf) {
        block_rows<MT, MIN>(w, a, out, b, m0, pf);
    });
}

}  // namespace

extern "C" void dw_q80_gemm_avx512(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1) {
    if (w->m) gemv<true>(w, a, out, b0, b1);
    else gemv<false>(w, a, out, b0, b1);
}

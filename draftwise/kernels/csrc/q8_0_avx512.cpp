// q8_0, AVX-512 path (F + BW + VNNI): VPDPBUSD on 16 columns x 4 K values per instruction (the weights offset to
// unsigned, each row's group sum started at its qoff), the activation operand an embedded broadcast from memory.
// Owns only this path's arithmetic (layout and float sequence: q8_0.h); knows nothing of torch, threads or when it
// runs (q8_0.cpp and dispatch.h decide). Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni and called only
// after a run-time cpuid check. Includes no C++ library header.
#include "intrin.h"
#include "q8_0.h"

namespace {

typedef int32_t __attribute__((may_alias)) i32_alias;

inline __m512i dpbusd_b(__m512i acc, __m512i w, const int8_t* p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_alias*)p));
    return acc;
}

// Rows [m0, m0 + MT) of one 16-column block b: per group, 8 VPDPBUSD per row on the group's weights (read once for
// all MT rows), then the float steps of q8_0.h.
template <int MT>
void block_rows(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b, int64_t m0, bool prefetch) {
    const int64_t G = w->G, N = w->N, M = a->M;
    const uint8_t* P = w->qw + b * G * 512;
    const float* D = w->d + b * G * 16;
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
    }
    const int64_t n0 = b * 16;
    const int64_t live = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 keep = (__mmask16)((1u << live) - 1u);
    const __m512 bias = w->bias ? _mm512_maskz_loadu_ps(keep, w->bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(out + (m0 + m) * N + n0, keep, _mm512_add_ps(acc[m], bias));
}

constexpr int MAX_TILE = 12;

void block(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b, bool prefetch) {
    const int64_t M = a->M;
    const int64_t tiles = (M + MAX_TILE - 1) / MAX_TILE;
    int64_t m0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = (M - m0) / (tiles - t);
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

extern "C" void dw_q80_gemm_avx512(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block(w, a, out, b, b + 1 < b1);
}

// q8_0, AVX-512 path (F + BW + VNNI): VPDPBUSD on 16 columns x 4 K values per instruction (the weights offset to
// unsigned, each row's group sum started at its qoff), the activation operand an embedded broadcast from memory.
// Owns only this path's inner loop over one tile and the unpacking of each weight form (q8_0.h: bytes as they
// are; 4-bit codes through the block's 16-entry table with VPSHUFB, plus the fifth-bit plane as a byte mask);
// layout and float sequence: q8_0.h; the walk over blocks, the tiles and the stores: rows_avx512.h. Knows nothing
// of torch, threads or when it runs (q8_0.cpp and dispatch.h decide). Compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512vnni and called only after a run-time cpuid check. Includes no C++ library header.
#include "rows_avx512.h"
#include "q8_0.h"

namespace {

using dwrows::dpbusd_b;

using dwq80::Form, dwq80::BYTES, dwq80::CODES, dwq80::CODES_PLANE, dwq80::Scales, dwq80::F32, dwq80::F16, dwq80::SUB8;

// Group g's 16 float32 scales of block b from s (d or m) in form S (q8_0.h): loaded, widened from fp16 (VCVTPH2PS),
// or the int8 sub widened and times the widened fp16 super (exact).
template <Scales S>
inline __m512 scales16(const DwQ80* w, const void* s, int64_t b, int64_t g) {
    const uint8_t* p = dw_q80_scales_at(s, S, w->G, b, g);
    if constexpr (S == F32) return _mm512_loadu_ps((const float*)p);
    if constexpr (S == F16) return dwelem::load16((const uint16_t*)p);
    const __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + (g % 8) * 16))));
    return _mm512_mul_ps(sub, dwelem::load16((const uint16_t*)(p + 128)));
}

// Hands each of group g's 8 chunks (u = v + 128, 64 bytes) to dot(c, u): bytes loaded, or codes looked up.
template <Form F, class Dot>
inline void chunks(const DwQ80* w, int64_t b, int64_t g, const __m512i& lut, Dot&& dot) {
    const int64_t bg = b * w->G + g;
    if constexpr (F == BYTES) {
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) dot(c, _mm512_loadu_si512((const void*)(w->qw + bg * 512 + c * 64)));
    } else {
        const __m512i low = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
#pragma GCC unroll 4
        for (int L = 0; L < 4; ++L) {
            const __m512i x = _mm512_loadu_si512((const void*)(w->qw + bg * 256 + L * 64));
            __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(x, low));
            __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(x, 4), low));
            if constexpr (F == CODES_PLANE) {
                const uint64_t* plane = (const uint64_t*)(w->qh + bg * 64);
                lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(plane[L]), lo, sixteen);
                hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(plane[L + 4]), hi, sixteen);
            }
            dot(L, lo);
            dot(L + 4, hi);
        }
    }
}

// Rows [m0, m0 + MT) of one 16-column block b: per group, 8 VPDPBUSD per row on the group's weights (unpacked once
// for all MT rows), then the float steps of q8_0.h (with MIN, the min term's step too) with the group's scales
// formed once for the tile (scales16).
template <int MT, bool MIN, Form F, Scales S>
[[gnu::noinline]] void block_rows(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b, int64_t m0, bool prefetch) {
    const int64_t G = w->G, M = a->M;
    constexpr int64_t stride = F == BYTES ? 512 : 256;  // weight bytes per group
    const uint8_t* P = w->qw + b * G * stride;
    const __m512i lut = F == BYTES ? _mm512_setzero_si512()
                                   : _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(w->lut + b * 16)));
    __m512 acc[MT];
#pragma GCC unroll 12
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
#pragma GCC unroll 1
    for (int64_t g = 0; g < G; ++g) {
        if (prefetch) {
            const char* nxt = (const char*)(P + G * stride + g * stride);
#pragma GCC unroll 8
            for (int c = 0; c < stride / 64; ++c) _mm_prefetch(nxt + 64 * c, _MM_HINT_T1);
            if constexpr (F == CODES_PLANE) _mm_prefetch((const char*)(w->qh + ((b + 1) * G + g) * 64), _MM_HINT_T1);
            _mm_prefetch((const char*)dw_q80_scales_at(w->d, S, G, b + 1, g), _MM_HINT_T0);
        }
        __m512i isum[MT];
        const int32_t* qo = a->qoff + g * M + m0;
#pragma GCC unroll 12
        for (int m = 0; m < MT; ++m) isum[m] = _mm512_set1_epi32(qo[m]);
        const int8_t* xg = a->q + (g * M + m0) * 32;
        chunks<F>(w, b, g, lut, [&](int c, const __m512i& wv) {
#pragma GCC unroll 12
            for (int m = 0; m < MT; ++m) isum[m] = dpbusd_b(isum[m], wv, xg + m * 32 + 4 * c);
        });
        const float* DX = a->dx + g * M + m0;
        dwrows::fma_rows(acc, DX, isum, scales16<S>(w, w->d, b, g));
        if constexpr (MIN) dwrows::fma_rows(acc, DX, a->qsum + g * M + m0, scales16<S>(w, w->m, b, g));
    }
    dwrows::store16(acc, w->bias, out, w->N, b, m0);
}

}  // namespace

extern "C" void dw_q80_gemm_avx512(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1) {
    dwq80::by_form(w, [&]<bool MIN, Form F, Scales S>() {
        dwrows::gemv16<12>(a->M, b0, b1, [&]<int MT>(int64_t b, int64_t m0, bool pf) {
            block_rows<MT, MIN, F, S>(w, a, out, b, m0, pf);
        });
    });
}

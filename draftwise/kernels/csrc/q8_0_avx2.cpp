// q8_0, AVX2 path (AVX2 + FMA: Zen 2/3, Haswell on): llama.cpp's signed product, _mm256_maddubs_epi16(|x|,
// sign(v, x)) (|pair| <= 2 * 127 * 127 < 32767, no saturation since v != -128), then _mm256_madd_epi16 by ones to
// int32, per 8 columns x 4 K values; the group's exact isum meets d and dx in q8_0.h's float steps.
// Owns only this path's inner loop over one tile and the unpacking of each weight form (q8_0.h: bytes; 4-bit codes
// through the block's table with VPSHUFB; the fifth-bit plane expanded to a byte mask); the walk over blocks, the
// halves, tiles and stores: rows_avx2.h. Knows nothing of torch, threads or when it runs. Compiled with -mavx2
// -mfma (F16C by the pragma below) and called only after a run-time cpuid check. Includes no C++ library header.
#pragma GCC target("f16c")  // VCVTPH2PS for the F16 / SUB8 scale forms (every AVX2 CPU has it, dispatch.h checks it)
#include "rows_avx2.h"
#include "q8_0.h"

namespace {

using dwrows::load_i32;

using dwq80::Form, dwq80::BYTES, dwq80::CODES, dwq80::CODES_PLANE, dwq80::Scales, dwq80::F32, dwq80::F16, dwq80::SUB8;

// Group g's 8 float32 scales of half h of block b from s (d or m) in form S (q8_0.h; as q8_0_avx512.cpp's scales16).
template <Scales S>
inline __m256 scales8(const DwQ80* w, const void* s, int64_t b, int h, int64_t g) {
    const uint8_t* p = dw_q80_scales_at(s, S, w->G, b, g);
    if constexpr (S == F32) return _mm256_loadu_ps((const float*)p + h * 8);
    if constexpr (S == F16) return dwelem::load8((const uint16_t*)p + h * 8);
    const __m128i sub = _mm_loadl_epi64((const __m128i*)(p + (g % 8) * 16 + h * 8));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sub)), dwelem::load8((const uint16_t*)(p + 128) + h * 8));
}

// 32 bits (byte i's bit at bit i) -> 16 in each byte whose bit is set, 0 elsewhere.
inline __m256i fifth_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)bits),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i sel = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), _mm256_set1_epi8(16));
}

// Hands each of group g's 8 chunks, half h (columns 8 h .. 8 h + 7: u = v + 128, 32 bytes), to dot(c, u).
template <Form F, class Dot>
inline void chunks(const DwQ80* w, int64_t b, int h, int64_t g, const __m256i& lut, Dot&& dot) {
    const int64_t bg = b * w->G + g;
    if constexpr (F == BYTES) {
        for (int c = 0; c < 8; ++c) dot(c, _mm256_loadu_si256((const __m256i*)(w->qw + bg * 512 + c * 64 + h * 32)));
    } else {
        const __m256i low = _mm256_set1_epi8(15);
        for (int L = 0; L < 4; ++L) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(w->qw + bg * 256 + L * 64 + h * 32));
            __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(x, low));
            __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(x, 4), low));
            if constexpr (F == CODES_PLANE) {
                const uint8_t* plane = w->qh + bg * 64 + h * 4;
                lo = _mm256_add_epi8(lo, fifth_bits((uint32_t)load_i32(plane + L * 8)));
                hi = _mm256_add_epi8(hi, fifth_bits((uint32_t)load_i32(plane + (L + 4) * 8)));
            }
            dot(L, lo);
            dot(L + 4, hi);
        }
    }
}

// Rows [m0, m0 + MT) of one half (h = 0: columns 0-7, h = 1: columns 8-15) of the 16-column block b.
template <int MT, bool MIN, Form F, Scales S>
[[gnu::noinline]] void half_rows(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b, int h, int64_t m0, bool prefetch) {
    const int64_t G = w->G, M = a->M;
    constexpr int64_t stride = F == BYTES ? 512 : 256;  // weight bytes per group
    const uint8_t* P = w->qw + b * G * stride;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const __m256i lut = F == BYTES ? _mm256_setzero_si256()
                                   : _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(w->lut + b * 16)));
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        if (prefetch) {
            const char* nxt = (const char*)(P + G * stride + g * stride);
            for (int c = 0; c < stride / 64; ++c) _mm_prefetch(nxt + 64 * c, _MM_HINT_T1);
        }
        __m256i isum[MT];
        for (int m = 0; m < MT; ++m) isum[m] = _mm256_setzero_si256();
        const int8_t* xg = a->q + (g * M + m0) * 32;
        chunks<F>(w, b, h, g, lut, [&](int c, const __m256i& u) {
            const __m256i v = _mm256_xor_si256(u, flip);
            for (int m = 0; m < MT; ++m) {
                const __m256i xb = _mm256_set1_epi32(load_i32(xg + m * 32 + 4 * c));
                const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(v, xb));
                isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(p, ones));
            }
        });
        const float* DX = a->dx + g * M + m0;
        dwrows::fma_rows(acc, DX, isum, scales8<S>(w, w->d, b, h, g));
        if constexpr (MIN) dwrows::fma_rows(acc, DX, a->qsum + g * M + m0, scales8<S>(w, w->m, b, h, g));
    }
    dwrows::store8(acc, w->bias, out, w->N, b, h, m0);
}

}  // namespace

extern "C" void dw_q80_gemm_avx2(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1) {
    dwq80::by_form(w, [&]<bool MIN, Form F, Scales S>() {
        dwrows::gemv8x2<4>(a->M, w->N, b0, b1, [&]<int MT>(int64_t b, int h, int64_t m0, bool pf) {
            half_rows<MT, MIN, F, S>(w, a, out, b, h, m0, pf);
        });
    });
}

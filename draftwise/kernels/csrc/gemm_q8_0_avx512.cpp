// q8_0, AVX-512: the activation quantization of q8_0.h, 32 values a step (the AVX-512 GEMV's rows, q8_0.cpp, and
// the wide side's, per chunk, gemm_q8_0.cpp).
// Owns only this vector form of the quantizer. Every operation is one IEEE operation on each value, as the scalar
// quantizer's (q8_0.cpp quantize_rows): |x|, the group's max (exact in any order), 127 / amax, x * id, the round
// half to even of the conversion (MXCSR's default mode, as nearbyint's), the int8 narrowing of values in -127..127,
// amax / 127 and the integer sum: bitwise the same q, dx, qoff and qsum, NaN values included (the tests compare the
// AVX-512 GEMV's and the wide side's rows with the scalar and AVX2 paths', whose quantizer is the scalar one). Knows nothing of torch, threads or layouts
// other than q8_0.h's [G, M, 32] activations. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni and called
// only after a run-time cpuid check. Includes no C++ library header.
#include "intrin.h"
#include "q8_0.h"

// x [M, K] -> q [G, M, 32], dx [G, M], qoff [G, M], qsum [G, M] for rows [r0, r1) (q8_0.h)
extern "C" void dw_q80_quantize_rows_avx512(const float* x, int64_t M, int64_t K, int8_t* q, float* dx,
                                            int32_t* qoff, int32_t* qsum, int64_t r0, int64_t r1) {
    const int64_t G = K / 32;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t g = 0; g < G; ++g) {
            const float* p = x + r * K + g * 32;
            const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
            // VMAXPS returns its second operand where either is NaN: |x| first, so a NaN value is passed over as
            // fmax passes it (the scalar quantizer's)
            const __m512 mx = _mm512_max_ps(_mm512_abs_ps(b), _mm512_max_ps(_mm512_abs_ps(a), _mm512_setzero_ps()));
            const float amax = _mm512_reduce_max_ps(mx);
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512 idv = _mm512_set1_ps(id);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, idv));
            const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, idv));
            int8_t* o = q + (g * M + r) * 32;
            _mm_storeu_si128((__m128i*)o, _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128((__m128i*)(o + 16), _mm512_cvtepi32_epi8(qb));
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
            dx[g * M + r] = amax / 127.0f;
            qoff[g * M + r] = -128 * sum;
            qsum[g * M + r] = sum;
        }
}

// e^t for float t in [-87, 88] (where 2^n stays a normal float): owns the one float sequence the attention op's
// softmax and the glue's silu use, Cephes expf (n = round(t log2 e) by adding and subtracting 1.5 * 2^23, round to
// nearest even; r = t - n ln 2 in two steps; a degree-5 polynomial; 2^n through the exponent bits). Callers clamp t.
// Written once (DW_EXP_POLY) for any lane type: scalar, and where the including unit is compiled for them, AVX2
// (8 lanes) and AVX-512 (16 lanes), so every version performs the very same operations (-ffp-contract=off: no fused
// multiply-adds) and every path agrees bitwise. Knows nothing of its callers (the clamping is theirs).
// Internal linkage only, no C++ library header: nothing compiled with AVX-512 flags can be merged into code that runs
// on other CPUs.
#pragma once
#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include "intrin.h"
#endif

namespace {
namespace dwexp {

// The sequence once, for any lane type: F the type (a float, or a vector of them), SET1 / ADD / SUB / MUL its
// operations and POW2(n) = 2^n for integral n in [-126, 127] (n + 127 in the exponent bits). Each step is one IEEE
// operation, so every lane type gives bitwise the same lanes. A macro, not a template over lane types: each version
// then compiles to exactly the machine code of its sequence written out by hand (inline wrappers around the
// intrinsics gave the same instructions, but GCC 12 scheduled and allocated the AVX-512 softmax's differently).
#define DW_EXP_POLY(F, SET1, ADD, SUB, MUL, POW2, t)                                 \
    const F magic = SET1(12582912.0f); /* 1.5 * 2^23: + and - it round to an integer, even ties */ \
    const F n = SUB(ADD(MUL(t, SET1(1.44269504088896341f)), magic), magic);          \
    F r = SUB(t, MUL(n, SET1(0.693359375f)));                                        \
    r = SUB(r, MUL(n, SET1(-2.12194440e-4f)));                                       \
    F p = SET1(1.9875691500e-4f);                                                    \
    p = ADD(MUL(p, r), SET1(1.3981999507e-3f));                                      \
    p = ADD(MUL(p, r), SET1(8.3334519073e-3f));                                      \
    p = ADD(MUL(p, r), SET1(4.1665795894e-2f));                                      \
    p = ADD(MUL(p, r), SET1(1.6666665459e-1f));                                      \
    p = ADD(MUL(p, r), SET1(5.0000001201e-1f));                                      \
    p = ADD(ADD(MUL(p, MUL(r, r)), r), SET1(1.0f));                                  \
    const F scale = POW2(n);                                                         \
    return MUL(p, scale)

inline float pow2_1(float n) {
    const int32_t ni = n == n ? (int32_t)n : 0;  // (a NaN's p is NaN already; no undefined conversion)
    const uint32_t bits = (uint32_t)(ni + 127) << 23;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}
#define DW_SET1_1(x) (x)
#define DW_ADD_1(a, b) ((a) + (b))
#define DW_SUB_1(a, b) ((a) - (b))
#define DW_MUL_1(a, b) ((a) * (b))

inline float exp_poly(float t) {  // a NaN stays NaN
    DW_EXP_POLY(float, DW_SET1_1, DW_ADD_1, DW_SUB_1, DW_MUL_1, pow2_1, t);
}

// The vector versions: the same intrinsics but for their prefix P (_mm256: AVX2, _mm512: AVX-512), and 2^n built
// as (int(n) + 127) << 23 in the exponent bits (DW_POW2 with that prefix).
#define DW_POW2_mm256(n) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23))
#define DW_POW2_mm512(n) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23))
#define DW_EXP_POLY_SIMD(F, P, t) DW_EXP_POLY(F, P##_set1_ps, P##_add_ps, P##_sub_ps, P##_mul_ps, DW_POW2##P, t)

#if defined(__AVX2__)
inline __m256 exp_poly8(__m256 t) { DW_EXP_POLY_SIMD(__m256, _mm256, t); }
#endif
#if defined(__AVX512F__)
inline __m512 exp_poly16(__m512 t) { DW_EXP_POLY_SIMD(__m512, _mm512, t); }
#endif

#undef DW_EXP_POLY
#undef DW_SET1_1
#undef DW_ADD_1
#undef DW_SUB_1
#undef DW_MUL_1
#undef DW_POW2_mm256
#undef DW_POW2_mm512
#undef DW_EXP_POLY_SIMD

}  // namespace dwexp
}  // namespace

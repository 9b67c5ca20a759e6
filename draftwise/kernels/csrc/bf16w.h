// BF16 (bfloat16) for the float kernel family (float.h), row "bf16w" ("bf16" names the dense bfloat16
// implementation): how one, 8 (AVX2) or 16 (AVX-512) stored 16-bit values become float32, exactly (a bfloat16 is
// the top half of a float32: shifted into place, every bit kept, NaNs too). Included by the family's units
// compiled for this type; each sees the conversion of its own ISA, after float.h (and intrin.h on the SIMD
// paths). Knows nothing else.
#pragma once

namespace {
namespace dwelem {

inline float to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

#if defined(__AVX512F__)
// 16 values: widened to 32 bits and shifted into the top half
inline __m512 load16(const uint16_t* p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
#elif defined(__AVX2__)
// 8 values, the same way
inline __m256 load8(const uint16_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#endif

}  // namespace dwelem
}  // namespace

// F16 (IEEE half) for the float kernel family (float.h): how one, 8 (AVX2) or 16 (AVX-512) stored 16-bit values
// become float32, exactly (every half is a float32; VCVTPH2PS and the scalar conversion agree bit for bit, NaNs
// quieted as the instruction quiets them). Included by the family's units compiled for this type, and by q8_0.h
// (its F16 and SUB8 scale forms); each sees the conversion of its own ISA, after intrin.h on the SIMD paths.
// Knows nothing else.
#pragma once

namespace {
namespace dwelem {

inline float to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    uint32_t bits;
    if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u);  // inf, or a NaN made quiet
    } else if (e == 0) {
        const float f = (float)m * 0x1p-24f;  // zero or a subnormal half: m * 2^-24, exact in float32
        __builtin_memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

#if defined(__AVX512F__)
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(__AVX2__)
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif

}  // namespace dwelem
}  // namespace

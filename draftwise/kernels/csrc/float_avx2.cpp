// The float kernel family (float.h), AVX2 path: 16 columns as two __m256 of 8 float32, the type's 8 weights
// converted by its header's `load8` (F16: VCVTPH2PS, F16C), tiles of 4 blocks for one row and 3 rows x 2 blocks
// otherwise (float_kernel.h walks them): the same chains as the AVX-512 and scalar paths, so bitwise their rows.
// Compiled once per type (-DDW_FLOAT, -DDW_FLOAT_HEADER) with -mavx2 -mfma, F16C by the pragma below (this unit
// alone: every AVX2 CPU has it, dispatch.h checks it), and called only after a run-time cpuid check (float.cpp,
// dispatch.h). Knows nothing of torch or threads; includes no C++ library header.
#pragma GCC target("f16c")
#include "intrin.h"
#include "float.h"
#include DW_FLOAT_HEADER
#include "float_kernel.h"

namespace {

// p[j] = v[j] + bias[j] (+ 0 without a bias) for the live j < min(live, 8): a short vector through the same float
// additions one at a time
inline void store8(float* p, __m256 v, const float* bias, int64_t live) {
    if (live >= 8) {
        _mm256_storeu_ps(p, _mm256_add_ps(v, bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps()));
        return;
    }
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    for (int64_t j = 0; j < live; ++j) p[j] = tmp[j] + (bias ? bias[j] : 0.0f);
}

DW_FLOAT_VEC(V256, __m256, _mm256, 8, 4, 3, 2, dwelem::load8, store8);

}  // namespace

extern "C" void DW_FLOAT_GEMM(avx2)(const DwFloat* w, const DwFloatAct* a, float* out, int64_t b0, int64_t b1) {
    dwfloat::gemm<V256>(w, a, out, b0, b1);
}

// The float kernel family (float.h), AVX-512 path: one __m512 of 16 float32 columns a vector, the type's 16
// weights converted by its header's `load16` (F16: VCVTPH2PS), tiles of 8 blocks for one row and 6 rows x 4 blocks
// otherwise (float_kernel.h walks them). Compiled once per type (-DDW_FLOAT, -DDW_FLOAT_HEADER) with -mavx512f
// -mavx512bw -mavx512vl -mavx512vnni and called only after a run-time cpuid check (float.cpp, dispatch.h). Knows
// nothing of torch or threads; includes no C++ library header.
#include "intrin.h"
#include "float.h"
#include DW_FLOAT_HEADER
#include "float_kernel.h"

namespace {

// p[j] = v[j] + bias[j] (+ 0 without a bias) for the live j < min(live, 16): one masked store
inline void store16(float* p, __m512 v, const float* bias, int64_t live) {
    const __mmask16 keep = (__mmask16)(live >= 16 ? 0xffffu : (1u << live) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(p, keep, _mm512_add_ps(v, bv));
}

DW_FLOAT_VEC(V512, __m512, _mm512, 16, 8, 6, 4, dwelem::load16, store16);

}  // namespace

extern "C" void DW_FLOAT_GEMM(avx512)(const DwFloat* w, const DwFloatAct* a, float* out, int64_t b0, int64_t b1) {
    dwfloat::gemm<V512>(w, a, out, b0, b1);
}

// The float kernel family (float.h), AVX-512 path: one __m512 of 16 float32 columns a vector, the type's 16
// weights converted by its header's `load` (F16: VCVTPH2PS), tiles of 8 blocks for one row and 6 rows x 4 blocks
// otherwise (float_kernel.h walks them). Compiled once per type (-DDW_FLOAT, -DDW_FLOAT_HEADER) with -mavx512f
// -mavx512bw -mavx512vl -mavx512vnni and called only after a run-time cpuid check (float.cpp, dispatch.h). Knows
// nothing of torch or threads; includes no C++ library header.
#include "intrin.h"
#include DW_FLOAT_HEADER
#include "float_kernel.h"

namespace {

struct V512 {
    using vec = __m512;
    static constexpr int LANES = 16, CB1 = 8, MT = 6, CB = 4;
    static vec zero() { return _mm512_setzero_ps(); }
    static vec load(const uint16_t* p) { return dwelem::load16(p); }
    static vec loadf(const float* p) { return _mm512_loadu_ps(p); }
    static vec bcast(const float* p) { return _mm512_set1_ps(*p); }
    static vec fma(vec w, vec x, vec acc) { return _mm512_fmadd_ps(w, x, acc); }
    static void storef(float* p, vec v) { _mm512_storeu_ps(p, v); }
    // p[j] = v[j] + bias[j] (+ 0 without a bias) for the live j < min(live, 16)
    static void store(float* p, vec v, const float* bias, int64_t live) {
        const __mmask16 keep = (__mmask16)(live >= 16 ? 0xffffu : (1u << live) - 1u);
        const vec bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(p, keep, _mm512_add_ps(v, bv));
    }
};

}  // namespace

extern "C" void DW_FLOAT_GEMM(avx512)(const DwFloat* w, const DwFloatAct* a, float* out, int64_t b0, int64_t b1) {
    dwfloat::gemm<V512>(w, a, out, b0, b1);
}

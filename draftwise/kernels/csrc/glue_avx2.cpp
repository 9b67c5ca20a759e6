// The decoder glue's row loops, AVX2 path (AVX2-era CPUs such as AMD Zen 2/3 and Intel Haswell on), compiled with
// -mavx2 (-ffp-contract=off: no fused multiply-adds) and called only after a run-time cpuid check. It performs
// glue.h's float sequence exactly (bitwise glue_kernel.h, its oracle): the 8 double lanes of dot (the norm's sum of
// squares, the router's logits) are two ymm (lanes 0-3, 4-7), elementwise steps are 8 floats at a time with the
// oracle's own code for the tail (argmax: four such accumulators, then the tail one by one), and the Cephes exp is
// cephes_exp.h's. Owns only this path's row loops (dwglue::Table makes them a DwGlue); knows nothing of torch,
// threads or when it runs (glue.cpp and dispatch.h decide). Includes no C++ library header.
#include "intrin.h"
#include "glue_kernel.h"

namespace {

// This path's row loops, put together into a DwGlue by dwglue::Table like every path's.
struct Avx2 {

static void silu_mul(const float* g, const float* u, float* out, int64_t n) {
    const __m256 lo = _mm256_set1_ps(dwglue::EXP_LO), hi = _mm256_set1_ps(dwglue::EXP_HI);
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 t0 = _mm256_xor_ps(gv, sign);  // -g: the sign bit flipped, as the scalar negation
        __m256 t = _mm256_max_ps(lo, t0);  // lo > t ? lo : t (a NaN t stays: max returns its second operand)
        t = _mm256_min_ps(hi, t);  // hi < t ? hi : t
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, dwexp::exp_poly8(t)));
        s = _mm256_blendv_ps(s, _mm256_mul_ps(gv, _mm256_setzero_ps()), _mm256_cmp_ps(t0, hi, _CMP_GT_OQ));  // g * 0
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; ++i) out[i] = dwglue::silu_mul1(g[i], u[i]);
}

static double dot(const float* x, const float* w, int64_t n) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();  // lanes 0-3, 4-7
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256d v0 = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), v1 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        const __m256d u0 = _mm256_cvtps_pd(_mm_loadu_ps(w + i)), u1 = _mm256_cvtps_pd(_mm_loadu_ps(w + i + 4));
        a0 = _mm256_add_pd(a0, _mm256_mul_pd(v0, u0));
        a1 = _mm256_add_pd(a1, _mm256_mul_pd(v1, u1));
    }
    double a[8];
    _mm256_storeu_pd(a, a0);
    _mm256_storeu_pd(a + 4, a1);
    for (; i < n; ++i) a[i & 7] = a[i & 7] + (double)x[i] * (double)w[i];
    return dwglue::lanes(a);
}

// four accumulators of 8 lanes (32 floats a pass), the last floats one by one; a lane takes a value only when it is
// strictly larger, so it keeps its first index of its maximum; a NaN anywhere sends the row to the portable loop
static int64_t argmax(const float* x, int64_t n) {
    if (n > dwglue::ARGMAX_LANE_MAX) return dwglue::Portable::argmax(x, n);
    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    const __m256i step = _mm256_set1_epi32(8);
    __m256 m[4] = {ninf, ninf, ninf, ninf};
    __m256i at[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int a = 0; a < 4; ++a) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * a);
            const __m256 gt = _mm256_cmp_ps(v, m[a], _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m[a] = _mm256_blendv_ps(m[a], v, gt);
            at[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at[a]), _mm256_castsi256_ps(idx), gt));
            idx = _mm256_add_epi32(idx, step);
        }
    }
    if (_mm256_movemask_ps(nan)) return dwglue::Portable::argmax(x, n);
    float v[32];
    int32_t id[32];
    for (int a = 0; a < 4; ++a) {
        _mm256_storeu_ps(v + 8 * a, m[a]);
        _mm256_storeu_si256((__m256i*)(id + 8 * a), at[a]);
    }
    int64_t best = dwglue::argmax_lanes(v, id, 32);
    float top = x[best];
    for (; i < n; ++i) {  // later indices: only a strictly larger value (or a NaN) takes over
        if (x[i] != x[i]) return dwglue::Portable::argmax(x, n);
        if (x[i] > top) {
            top = x[i];
            best = i;
        }
    }
    return best;
}

static void scale_row(const float* x, const float* w, float* y, int64_t n, float r, float offset) {
    const __m256 rv = _mm256_set1_ps(r), ov = _mm256_set1_ps(offset);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 xr = _mm256_mul_ps(_mm256_loadu_ps(x + i), rv);
        const __m256 wv = _mm256_loadu_ps(w + i);
        _mm256_storeu_ps(y + i, offset != 0.0f ? _mm256_mul_ps(xr, _mm256_add_ps(ov, wv)) : _mm256_mul_ps(wv, xr));
    }
    dwglue::Portable::scale_row(x + i, w + i, y + i, n - i, r, offset);
}

static void add_norm_row(const float* x, const float* h, const float* w, float* s, float* y, int64_t n, double eps,
                         float offset);

};

void Avx2::add_norm_row(const float* x, const float* h, const float* w, float* s, float* y, int64_t n, double eps,
                        float offset) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(h + i)));
    for (; i < n; ++i) s[i] = x[i] + h[i];
    dwglue::Table<Avx2>::norm_row(s, w, y, n, eps, offset);
}

}  // namespace

extern "C" void dw_glue_avx2(DwGlue* ops) { dwglue::Table<Avx2>::fill(ops); }

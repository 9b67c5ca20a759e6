// The decoder glue's row loops, AVX-512 path (F + DQ + VL), compiled with those -m flags and called only after a
// run-time cpuid check. It performs glue.h's float sequence exactly (bitwise glue_kernel.h, its oracle): the 8 double
// lanes of dot (the norm's sum of squares, the router's logits) are one zmm, elementwise steps are 16 floats at a
// time with a masked tail (argmax: four such accumulators), and the Cephes exp is cephes_exp.h's. Owns only this
// path's row loops (dwglue::Table makes them a DwGlue); knows nothing of torch, threads or when it runs (glue.cpp and
// dispatch.h decide). Includes no C++ library header.
#include "intrin.h"
#include "glue_kernel.h"

namespace {

inline __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }

// This path's row loops, put together into a DwGlue by dwglue::Table like every path's.
struct Avx512 {

static void silu_mul(const float* g, const float* u, float* out, int64_t n) {
    const __m512 lo = _mm512_set1_ps(dwglue::EXP_LO), hi = _mm512_set1_ps(dwglue::EXP_HI);
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail16(n - i);
        const __m512 gv = _mm512_maskz_loadu_ps(k, g + i), uv = _mm512_maskz_loadu_ps(k, u + i);
        const __m512 t0 = _mm512_xor_ps(gv, sign);  // -g: the sign bit flipped, as the scalar negation
        __m512 t = _mm512_max_ps(lo, t0);  // lo > t ? lo : t (a NaN t stays: max returns its second operand)
        t = _mm512_min_ps(hi, t);  // hi < t ? hi : t
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, dwexp::exp_poly16(t)));
        s = _mm512_mask_mul_ps(s, _mm512_cmp_ps_mask(t0, hi, _CMP_GT_OQ), gv, _mm512_setzero_ps());  // -g > 88: g * 0
        _mm512_mask_storeu_ps(out + i, k, _mm512_mul_ps(s, uv));
    }
}

static double dot(const float* x, const float* w, int64_t n) {
    __m512d acc = _mm512_setzero_pd();
    // lane l holds i = l mod 8; a masked tail adds +0 * +0 = +0, which changes no lane (a lane starts at +0 and a
    // round-to-nearest sum is -0 only when both terms are: no lane is ever -0)
    for (int64_t i = 0; i < n; i += 8) {
        const __mmask8 k = n - i >= 8 ? (__mmask8)0xFF : (__mmask8)((1u << (n - i)) - 1u);
        const __m512d v = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(k, x + i));
        const __m512d u = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(k, w + i));
        acc = _mm512_add_pd(acc, _mm512_mul_pd(v, u));
    }
    double a[8];
    _mm512_storeu_pd(a, acc);
    return dwglue::lanes(a);
}

// four accumulators of 16 lanes (64 floats a pass, masked tail into the first); a lane takes a value only when it is
// strictly larger, so it keeps its first index of its maximum; a NaN anywhere sends the row to the portable loop
static int64_t argmax(const float* x, int64_t n) {
    if (n > dwglue::ARGMAX_LANE_MAX) return dwglue::Portable::argmax(x, n);
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    const __m512i step = _mm512_set1_epi32(16);
    __m512 m[4] = {ninf, ninf, ninf, ninf};
    __m512i at[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        for (int a = 0; a < 4; ++a) {
            const __m512 v = _mm512_loadu_ps(x + i + 16 * a);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, m[a], _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            m[a] = _mm512_mask_mov_ps(m[a], gt, v);
            at[a] = _mm512_mask_mov_epi32(at[a], gt, idx);
            idx = _mm512_add_epi32(idx, step);
        }
    }
    for (; i < n; i += 16) {
        const __m512 v = _mm512_mask_loadu_ps(ninf, tail16(n - i), x + i);  // past the end: -inf, never larger
        const __mmask16 gt = _mm512_cmp_ps_mask(v, m[0], _CMP_GT_OQ);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m[0] = _mm512_mask_mov_ps(m[0], gt, v);
        at[0] = _mm512_mask_mov_epi32(at[0], gt, idx);
        idx = _mm512_add_epi32(idx, step);
    }
    if (nan) return dwglue::Portable::argmax(x, n);
    float v[64];
    int32_t id[64];
    for (int a = 0; a < 4; ++a) {
        _mm512_storeu_ps(v + 16 * a, m[a]);
        _mm512_storeu_si512(id + 16 * a, at[a]);
    }
    return dwglue::argmax_lanes(v, id, 64);
}

static void scale_row(const float* x, const float* w, float* y, int64_t n, float r, float offset) {
    const __m512 rv = _mm512_set1_ps(r), ov = _mm512_set1_ps(offset);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail16(n - i);
        const __m512 xr = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), rv);
        const __m512 wv = _mm512_maskz_loadu_ps(k, w + i);
        _mm512_mask_storeu_ps(y + i, k, offset != 0.0f ? _mm512_mul_ps(xr, _mm512_add_ps(ov, wv)) : _mm512_mul_ps(wv, xr));
    }
}

static void add_norm_row(const float* x, const float* h, const float* w, float* s, float* y, int64_t n, double eps,
                         float offset);

};

void Avx512::add_norm_row(const float* x, const float* h, const float* w, float* s, float* y, int64_t n, double eps,
                          float offset) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail16(n - i);
        _mm512_mask_storeu_ps(s + i, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, h + i)));
    }
    dwglue::Table<Avx512>::norm_row(s, w, y, n, eps, offset);
}

}  // namespace

extern "C" void dw_glue_avx512(DwGlue* ops) { dwglue::Table<Avx512>::fill(ops); }

// Row-exact attention, AVX2 path (AVX2 + FMA-era CPUs such as AMD Zen 2/3 and Intel Haswell on), compiled with
// -mavx2 -mfma (-ffp-contract=off: no fused multiply-adds) and called only after a run-time cpuid check, for
// head_dim a multiple of 16. It performs the float sequence of attention.h exactly (bitwise the portable path in
// attention_kernel.h, its oracle): a dot product's 16 lanes are two ymm (lanes 0-7, 8-15) whose sum is the fold's
// w = 8 step, and the 8 dots of a block of keys are folded together by a shuffle tree doing, per key, the very
// additions of the portable fold. Includes no C++ library header.
#include <immintrin.h>
#include "attention_kernel.h"

namespace {

inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const uint16_t* p) {  // bf16 -> fp32, exact
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// f[8]: one key's lanes after the w = 8 step -> the 8 folded dot products, key kk in lane kk.
inline __m256 fold8(const __m256* f) {
    __m256 r2[4], r3[2];
    for (int k = 0; k < 4; ++k)  // w = 4: 128-bit half c holds lanes 0-3 of key 2k + c
        r2[k] = _mm256_add_ps(_mm256_permute2f128_ps(f[2 * k], f[2 * k + 1], 0x20),
                              _mm256_permute2f128_ps(f[2 * k], f[2 * k + 1], 0x31));
    for (int k = 0; k < 2; ++k)  // w = 2: half c holds lanes 0-1 of keys 4k + c and 4k + c + 2
        r3[k] = _mm256_add_ps(_mm256_shuffle_ps(r2[2 * k], r2[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(r2[2 * k], r2[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // w = 1: half c holds keys c, c + 2, c + 4, c + 6; then key order
    const __m256 r4 = _mm256_add_ps(_mm256_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r4, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// dwattn::exp_nonpos on 8 lanes, operation for operation.
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-80.0f);
    const __m256 e = dwexp::exp_poly8(_mm256_max_ps(lo, x));  // lo > x ? lo : x
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), e);  // x < -80: 0
}

template <class E>
void one(const DwAttnArgs* a, int64_t b, int64_t t, int64_t h, float* scratch) {
    const int64_t D = a->D, dp = (D + 15) / 16 * 16;
    float* qf = scratch;
    float* res = scratch + dp;
    float* s = scratch + 2 * dp;
    dwattn::Query<E> q;
    if (!dwattn::query(a, b, t, h, qf, q)) return;
    E* o = q.o;
    const E *K = q.K, *V = q.V;
    const int64_t L = q.L, sc = q.sc;

    // scores, 8 keys at a time (missing keys of the last block stay 0 and are not stored)
    const __m256 vscale = _mm256_set1_ps(a->scale);
    float m = -__builtin_inff();
    for (int64_t j = 0; j < L; j += 8) {
        const int64_t nk = L - j < 8 ? L - j : 8;
        __m256 f[8];
        for (int half = 0; half < 2; ++half) {  // lanes 0-7, then 8-15 (16 ymm registers: 8 keys x 1 half fit)
            __m256 acc[8];
#pragma GCC unroll 8
            for (int kk = 0; kk < 8; ++kk) acc[kk] = _mm256_setzero_ps();
            for (int64_t i = 8 * half; i < D; i += 16) {
                const __m256 qv = _mm256_loadu_ps(qf + i);
                const E* kp = K + j * sc + i;
#pragma GCC unroll 8
                for (int kk = 0; kk < 8; ++kk)
                    if (kk < nk) acc[kk] = _mm256_add_ps(acc[kk], _mm256_mul_ps(qv, ld8(kp + kk * sc)));
            }
#pragma GCC unroll 8
            for (int kk = 0; kk < 8; ++kk) f[kk] = half ? _mm256_add_ps(f[kk], acc[kk]) : acc[kk];  // w = 8
        }
        float sv[8];
        _mm256_storeu_ps(sv, _mm256_mul_ps(fold8(f), vscale));
        for (int kk = 0; kk < nk; ++kk) {
            s[j + kk] = sv[kk];
            m = sv[kk] > m ? sv[kk] : m;
        }
    }

    // p_j = exp(s_j - m) and their sum in lanes j mod 16 (lanes 0-7 in slo, 8-15 in shi)
    const __m256 vm = _mm256_set1_ps(m);
    __m256 slo = _mm256_setzero_ps(), shi = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
        const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), vm));
        _mm256_storeu_ps(s + j, e0);
        _mm256_storeu_ps(s + j + 8, e1);
        slo = _mm256_add_ps(slo, e0);
        shi = _mm256_add_ps(shi, e1);
    }
    float sum[16];
    _mm256_storeu_ps(sum, slo);
    _mm256_storeu_ps(sum + 8, shi);
    for (int l = 0; j + l < L; ++l) {
        const float e = dwattn::exp_nonpos(s[j + l] - m);
        s[j + l] = e;
        sum[l] = sum[l] + e;
    }
    const __m256 vtotal = _mm256_set1_ps(dwattn::fold(sum));

    // o = (sum_j p_j v_j) / sum, 64 dims (8 ymm) at a time
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int nv = D - d0 >= 64 ? 8 : (int)((D - d0) / 8);
        __m256 acc[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
        const E* vp = V + d0;
        for (int64_t jj = 0; jj < L; ++jj, vp += sc) {
            const __m256 p = _mm256_set1_ps(s[jj]);
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r)
                if (r < nv) acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(p, ld8(vp + 8 * r)));
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r)
            if (r < nv) _mm256_storeu_ps(res + d0 + 8 * r, _mm256_div_ps(acc[r], vtotal));
    }
    for (int64_t d = 0; d < D; ++d) dwattn::store(o, d, res[d]);
}

template <class E>
void rows(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    const int64_t G = a->H / a->Hkv, T = a->T, Hkv = a->Hkv;
    for (int64_t i = i0; i < i1; ++i) {  // i = ((b * Hkv + g) * T + t) * G + hg, as in attention_kernel.h
        const int64_t hg = i % G, t = (i / G) % T, g = (i / (G * T)) % Hkv, b = i / (G * T * Hkv);
        one<E>(a, b, t, g * G + hg, scratch);
    }
}

}  // namespace

extern "C" void dw_attn_rows_avx2(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    if (a->dtype == DW_ATTN_BF16)
        rows<uint16_t>(a, i0, i1, scratch);
    else
        rows<float>(a, i0, i1, scratch);
}

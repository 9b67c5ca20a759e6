// Row-exact attention, AVX-512 path (F + BW + VL + DQ), compiled with those -m flags and called only after a
// run-time cpuid check, for head_dim a multiple of 16. It performs the float sequence of attention.h exactly
// (bitwise the portable path in attention_kernel.h, its oracle): a dot product's 16 lanes are one zmm, and the
// 16 dots of a block of keys are folded together by a shuffle tree that does, per key, the very additions
// a[l] += a[l + w] (w = 8, 4, 2, 1) of the portable fold. Includes no C++ library header: nothing inline from
// here can leak into code run on other CPUs.
#include <immintrin.h>
#include "attention_kernel.h"

namespace {

inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld16(const uint16_t* p) {  // bf16 -> fp32, exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// acc[16]: one key's 16 lanes each -> the 16 folded dot products, key kk in lane kk.
inline __m512 fold16(const __m512* a) {
    __m512 r1[8], r2[4], r3[2];
    for (int k = 0; k < 8; ++k)  // w = 8: lanes 0-7 of key 2k, then of key 2k+1
        r1[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 4; ++k)  // w = 4: 128-bit chunk c holds lanes 0-3 of key 4k + c
        r2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[2 * k], r1[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(r1[2 * k], r1[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 2; ++k)  // w = 2: chunk c holds lanes 0-1 of keys 8k + c and 8k + c + 4
        r3[k] = _mm512_add_ps(_mm512_shuffle_ps(r2[2 * k], r2[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(r2[2 * k], r2[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // w = 1: chunk c holds keys c, c + 4, c + 8, c + 12; then key order
    const __m512 r4 = _mm512_add_ps(_mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r4);
}

// dwattn::exp_nonpos on 16 lanes, operation for operation.
inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-80.0f), magic = _mm512_set1_ps(12582912.0f);
    const __m512 xc = _mm512_max_ps(lo, x);  // lo > x ? lo : x
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), magic), magic);
    __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    const __m512 scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
    const __m512 e = _mm512_mul_ps(p, scale);
    return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), e);  // x < -80: 0
}

// 16 keys' dot products with q (NC chunks of 16 lanes, held in registers): key kk's lanes accumulate in i
// order, exactly as the generic loop in `one` (only the loop nesting differs: keys outer, one pointer).
template <int NC, class E>
inline void dots16(const __m512* qv, const E* kp, int64_t sc, int64_t nk, __m512* acc) {
#pragma GCC unroll 16
    for (int kk = 0; kk < 16; ++kk, kp += sc) {
        __m512 a = _mm512_setzero_ps();
        if (kk < nk) {
#pragma GCC unroll 16
            for (int c = 0; c < NC; ++c) a = _mm512_add_ps(a, _mm512_mul_ps(qv[c], ld16(kp + 16 * c)));
        }
        acc[kk] = a;
    }
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

    // scores, 16 keys at a time (missing keys of the last block stay 0 and are not stored)
    __m512 q8[8];  // q in registers when head_dim is 64 or 128
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) q8[c] = 16 * c < D ? _mm512_loadu_ps(qf + 16 * c) : _mm512_setzero_ps();
    const __m512 vscale = _mm512_set1_ps(a->scale);
    __m512 vmax = _mm512_set1_ps(-__builtin_inff());
    for (int64_t j = 0; j < L; j += 16) {
        const int64_t nk = L - j < 16 ? L - j : 16;
        __m512 acc[16];
        if (D == 128) {
            dots16<8>(q8, K + j * sc, sc, nk, acc);
        } else if (D == 64) {
            dots16<4>(q8, K + j * sc, sc, nk, acc);
        } else {
#pragma GCC unroll 16
            for (int kk = 0; kk < 16; ++kk) acc[kk] = _mm512_setzero_ps();
            for (int64_t i = 0; i < D; i += 16) {
                const __m512 qv = _mm512_loadu_ps(qf + i);
                const E* kp = K + j * sc + i;
#pragma GCC unroll 16
                for (int kk = 0; kk < 16; ++kk)
                    if (kk < nk) acc[kk] = _mm512_add_ps(acc[kk], _mm512_mul_ps(qv, ld16(kp + kk * sc)));
            }
        }
        const __m512 sv = _mm512_mul_ps(fold16(acc), vscale);
        const __mmask16 valid = (__mmask16)((1u << nk) - 1u);
        _mm512_mask_storeu_ps(s + j, valid, sv);
        vmax = _mm512_mask_max_ps(vmax, valid, vmax, sv);
    }
    const float m = _mm512_reduce_max_ps(vmax);

    // p_j = exp(s_j - m) and their sum in lanes j mod 16
    const __m512 vm = _mm512_set1_ps(m);
    __m512 vsum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
        _mm512_storeu_ps(s + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    float sum[16];
    _mm512_storeu_ps(sum, vsum);
    for (int l = 0; j + l < L; ++l) {
        const float e = dwattn::exp_nonpos(s[j + l] - m);
        s[j + l] = e;
        sum[l] = sum[l] + e;
    }
    const __m512 vtotal = _mm512_set1_ps(dwattn::fold(sum));

    // o = (sum_j p_j v_j) / sum, 128 dims (8 zmm) at a time
    for (int64_t d0 = 0; d0 < D; d0 += 128) {
        const int nv = D - d0 >= 128 ? 8 : (int)((D - d0) / 16);
        __m512 acc[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) acc[r] = _mm512_setzero_ps();
        const E* vp = V + d0;
        for (int64_t jj = 0; jj < L; ++jj, vp += sc) {
            const __m512 p = _mm512_set1_ps(s[jj]);
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r)
                if (r < nv) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(p, ld16(vp + 16 * r)));
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r)
            if (r < nv) _mm512_storeu_ps(res + d0 + 16 * r, _mm512_div_ps(acc[r], vtotal));
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

extern "C" void dw_attn_rows_avx512(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    if (a->dtype == DW_ATTN_BF16)
        rows<uint16_t>(a, i0, i1, scratch);
    else
        rows<float>(a, i0, i1, scratch);
}

// Row-exact attention, the AVX-512 path's steps (F + BW + VL + DQ): included by attention_avx512.cpp (the path
// itself) and by attention_amx.cpp (whose softmax and exponentials are these, operation for operation), both
// compiled with those -m flags and run only after a run-time cpuid check. See attention_avx512.cpp for the path.
// Owns this path's loops over 16-key blocks (Steps) and their lane helpers; knows nothing of torch, threads or when
// it runs. Includes no C++ library header.
#pragma once
#include "intrin.h"
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
    const __m512 lo = _mm512_set1_ps(-80.0f);
    const __m512 e = dwexp::exp_poly16(_mm512_max_ps(lo, x));  // lo > x ? lo : x
    return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), e);  // x < -80: 0
}

// 16 keys' dot products with q (NC chunks of 16 lanes, held in registers), keys lo..hi-1 of the block (the
// others stay 0 and are never loaded: they may lie past the cache's end): key kk's lanes accumulate in i order,
// exactly as the generic loop in dwattn::dot. FULL: all 16 keys, no tests.
template <int NC, bool FULL, class E>
inline void dots16(const __m512* qv, const E* kp, int64_t sc, int lo, int hi, __m512* acc) {
#pragma GCC unroll 16
    for (int kk = 0; kk < 16; ++kk, kp += sc) {
        __m512 a = _mm512_setzero_ps();
        if (FULL || (kk >= lo && kk < hi)) {
#pragma GCC unroll 16
            for (int c = 0; c < NC; ++c) a = _mm512_fmadd_ps(qv[c], ld16(kp + 16 * c), a);
        }
        acc[kk] = a;
    }
}

// Any head_dim that is a multiple of 16: q from memory, chunk by chunk (the same additions in the same order).
template <class E>
inline void dots16_any(const float* qf, int64_t D, const E* kp, int64_t sc, int lo, int hi, __m512* acc) {
#pragma GCC unroll 16
    for (int kk = 0; kk < 16; ++kk) acc[kk] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
        const __m512 qv = _mm512_loadu_ps(qf + i);
#pragma GCC unroll 16
        for (int kk = 0; kk < 16; ++kk)
            if (kk >= lo && kk < hi) acc[kk] = _mm512_fmadd_ps(qv, ld16(kp + kk * sc + i), acc[kk]);
    }
}

// Query blocks (dwattn::Block, attention_kernel.h): each pass over a block of 16 keys (or values, 8 KiB at head_dim
// 128) serves up to QB queries of one (b, kv head) while it sits in L1, instead of each query streaming its whole
// K and V from L2 (65 KiB each per query for the 1.5B at context 130). Measured on Zen 4 at 9 rows it saves
// ~10-30% of the kernel: the rest is the arithmetic itself. Two queries per value load (16 accumulators) measured
// no faster.
using dwattn::Block;
using dwattn::QB;

// This path's loops over 16-key blocks, the steps dwattn::attend_block calls.
struct Steps {

template <int NC, class E>
static void scores(const DwAttnArgs* a, Block<E>& blk, float* mx) {
    const int64_t a_lo = blk.a_lo, a_hi = blk.a_hi;
    const int64_t sc = blk.q[0].sc, D = a->D;
    const __m512 vscale = _mm512_set1_ps(a->scale);
    __m512 vmax[QB];
    for (int u = 0; u < blk.n; ++u) vmax[u] = _mm512_set1_ps(-__builtin_inff());
    for (int64_t ab = a_lo; ab < a_hi; ab += 16) {
        const E* kb = dwattn::block_at(blk, blk.q[0].Kh, ab);
        for (int u = 0; u < blk.n; ++u) {
            const int64_t st = blk.start[u];
            int lo, hi;
            dwattn::span(blk, u, ab, lo, hi);
            if (lo >= hi) continue;
            __m512 acc[16];
            if constexpr (NC > 0) {
                __m512 qv[NC];
#pragma GCC unroll 8
                for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(blk.qf[u] + 16 * c);
                if (lo == 0 && hi == 16)
                    dots16<NC, true>(qv, kb, sc, 0, 16, acc);
                else
                    dots16<NC, false>(qv, kb, sc, lo, hi, acc);
            } else {
                dots16_any(blk.qf[u], D, kb, sc, lo, hi, acc);
            }
            const __m512 sv = _mm512_mul_ps(fold16(acc), vscale);
            const __mmask16 valid = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
            _mm512_mask_storeu_ps(blk.s[u] + (ab - st), valid, sv);  // s[u] has 16 floats of room before it
            vmax[u] = _mm512_mask_max_ps(vmax[u], valid, vmax[u], sv);
        }
    }
    for (int u = 0; u < blk.n; ++u) mx[u] = _mm512_reduce_max_ps(vmax[u]);
}

// p_j = exp(s_j - m) and their sum in lanes j mod 16 (one query; s in place)
static float softmax_weights(float* s, int64_t L, float m) {
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
    return dwattn::fold(sum);
}

// acc[u] += p_j v_j for the query's keys in this block of 16, in j order; 128 dims (8 zmm) at a time
template <class E>
static void values(const E* vb, int64_t sc, int64_t D, const float* p, int lo, int hi, float* accp) {
    for (int64_t d0 = 0; d0 < D; d0 += 128) {
        const int nv = D - d0 >= 128 ? 8 : (int)((D - d0) / 16);
        __m512 acc[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) acc[r] = r < nv ? _mm512_loadu_ps(accp + d0 + 16 * r) : _mm512_setzero_ps();
        const E* vp = vb + lo * sc + d0;
        for (int kk = lo; kk < hi; ++kk, vp += sc) {
            const __m512 pv = _mm512_set1_ps(p[kk]);
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r)
                if (r < nv) acc[r] = _mm512_fmadd_ps(pv, ld16(vp + 16 * r), acc[r]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r)
            if (r < nv) _mm512_storeu_ps(accp + d0 + 16 * r, acc[r]);
    }
}

};

}  // namespace

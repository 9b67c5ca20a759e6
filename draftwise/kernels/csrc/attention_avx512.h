// Row-exact attention, the AVX-512 path's steps (F + BW + VL + DQ): included by attention_avx512.cpp (the path
// itself) and by attention_amx.cpp (whose softmax and exponentials are these, operation for operation), both
// compiled with those -m flags and run only after a run-time cpuid check. See attention_avx512.cpp for the path.
// Owns this path's lanes and its score loop over 16-key blocks (Steps; softmax and values: attention_kernel.h's
// LaneSteps on these lanes) and their lane helpers; knows nothing of torch, threads or when
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

// This path's lanes for the steps it shares (dwattn::LaneSteps)
DW_ATTN_LANES(__m512, _mm512, exp16, ld16);

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

// The keys (or values) of a 16-key block that some query of blk uses, as a 16-bit mask of block offsets (a query's
// span lo..hi-1, dwattn::span; the others are never loaded: they may lie past the cache's end).
template <class E>
inline unsigned used16(const dwattn::Block<E>& blk, int64_t ab) {
    unsigned m = 0;
    for (int u = 0; u < blk.n; ++u) {
        int lo, hi;
        dwattn::span(blk, u, ab, lo, hi);
        if (lo < hi) m |= ((1u << hi) - 1u) & ~((1u << lo) - 1u);
    }
    return m;
}

// A block's rows for the queries' loops: fp32 rows as they are (stride sc); bf16 rows widened once into buf [16][D]
// (stride D) for all the block's queries instead of once per query (bf16 -> fp32 is exact: every product and
// sum is the one the widening load gave, so the bits do not move). Only the rows in `used` are read.
inline const float* widen16(const float* xb, int64_t sc, int64_t, unsigned, float*, int64_t& stride) {
    stride = sc;
    return xb;
}
inline const float* widen16(const uint16_t* xb, int64_t sc, int64_t D, unsigned used, float* buf, int64_t& stride) {
    for (unsigned m = used; m; m &= m - 1) {
        const int kk = __builtin_ctz(m);
        for (int64_t i = 0; i < D; i += 16) _mm512_store_ps(buf + kk * D + i, ld16(xb + kk * sc + i));
    }
    stride = D;
    return buf;
}

// Query blocks (dwattn::Block, attention_kernel.h): each pass over a block of 16 keys (or values, 8 KiB at head_dim
// 128) serves up to QB queries of one (b, kv head) while it sits in L1, instead of each query streaming its whole
// K and V from L2 (65 KiB each per query for the 1.5B at context 130). Measured on Zen 4 at 9 rows it saves
// ~10-30% of the kernel: the rest is the arithmetic itself. Two queries per value load (16 accumulators) measured
// no faster. A bf16 block is widened to fp32 once for the block's queries (widen16; head_dim up to 128: 8 KiB of
// L1), so each query's dot or value step is one FMA per 16 lanes with its operand from L1 instead of a widening
// load, a shift and the FMA. Steps: this path's loops over 16-key blocks, the steps dwattn::attend_block calls
// (softmax_weights: the shared LaneSteps on 16 lanes; values: LaneSteps' over the widened blocks).
struct Steps : dwattn::LaneSteps<Lanes> {
static constexpr int64_t WIDE_D = 128;  // the largest head_dim whose blocks are widened (16 x 128 floats)

template <int NC, class E>
static void scores(const DwAttnArgs* a, dwattn::Block<E>& blk, float* mx) {
    const int64_t sc = blk.q[0].sc, D = a->D;
    const __m512 vscale = _mm512_set1_ps(a->scale);
    __m512 vmax[dwattn::QB];
    alignas(64) float kbuf[16 * WIDE_D];
    for (int u = 0; u < blk.n; ++u) vmax[u] = _mm512_set1_ps(-__builtin_inff());
    for (int64_t ab = blk.a_lo; ab < blk.a_hi; ab += 16) {
        const E* kb = dwattn::block_at(blk, blk.q[0].Kh, ab);
        int64_t ks = sc;
        const unsigned used = used16(blk, ab);
        if (!used) continue;
        const float* kf = NC > 0 ? widen16(kb, sc, D, used, kbuf, ks) : nullptr;
        for (int u = 0; u < blk.n; ++u) {
            int lo, hi;
            dwattn::span(blk, u, ab, lo, hi);
            if (lo >= hi) continue;
            __m512 acc[16];
            if constexpr (NC > 0) {
                __m512 qv[NC];
#pragma GCC unroll 8
                for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(blk.qf[u] + 16 * c);
                if (lo == 0 && hi == 16)
                    dots16<NC, true>(qv, kf, ks, 0, 16, acc);
                else
                    dots16<NC, false>(qv, kf, ks, lo, hi, acc);
            } else {
                dots16_any(blk.qf[u], D, kb, sc, lo, hi, acc);
            }
            const __m512 sv = _mm512_mul_ps(fold16(acc), vscale);
            const __mmask16 valid = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
            _mm512_mask_storeu_ps(blk.s[u] + (ab - blk.start[u]), valid, sv);  // s[u] has 16 floats of room before it
            vmax[u] = _mm512_mask_max_ps(vmax[u], valid, vmax[u], sv);
        }
    }
    for (int u = 0; u < blk.n; ++u) mx[u] = _mm512_reduce_max_ps(vmax[u]);
}

// every query's acc += p_j v_j, block by block in position order, each block widened once (LaneSteps::values on
// the widened rows: the same FMAs in the same order)
template <class E>
static void block_values(const dwattn::Block<E>& blk, int64_t D, int64_t sc) {
    if (D > WIDE_D) return dwattn::LaneSteps<Lanes>::block_values(blk, D, sc);
    alignas(64) float vbuf[16 * WIDE_D];
    for (int64_t ab = blk.a_lo; ab < blk.a_hi; ab += 16) {
        const unsigned used = used16(blk, ab);
        if (!used) continue;
        int64_t vs;
        const float* vf = widen16(dwattn::block_at(blk, blk.q[0].Vh, ab), sc, D, used, vbuf, vs);
        for (int u = 0; u < blk.n; ++u) {
            int lo, hi;
            dwattn::span(blk, u, ab, lo, hi);
            if (lo < hi) values(vf, vs, D, blk.s[u] + (ab - blk.start[u]), lo, hi, blk.acc[u]);
        }
    }
}
};

}  // namespace

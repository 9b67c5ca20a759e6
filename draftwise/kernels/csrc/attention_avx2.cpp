// Row-exact attention, AVX2 path (AVX2 + FMA-era CPUs such as AMD Zen 2/3 and Intel Haswell on), compiled with
// -mavx2 -mfma (-ffp-contract=off: fused multiply-adds only where written) and called only after a run-time cpuid check, for
// head_dim a multiple of 16. It performs the float sequence of attention.h exactly (bitwise the portable path in
// attention_kernel.h, its oracle): a dot product's 16 lanes are two ymm (lanes 0-7, 8-15) whose sum is the fold's
// w = 8 step, and the 8 dots of a group of keys are folded together by a shuffle tree doing, per key, the very
// additions of the portable fold. Consecutive queries of one (b, kv head) are attended as a block (dwattn::attend_block,
// as in attention_avx512.cpp), so a block of 16 keys or values is read from L2 once for all of them.
// Owns only this path's lanes and its score loop over 16-key blocks (Steps; softmax and values are
// attention_kernel.h's LaneSteps on these lanes); knows nothing of torch, threads or when it runs (that is
// attention.cpp's and dispatch.h's). Includes no C++ library header: nothing inline from here can leak into code
// run on other CPUs.
#include "intrin.h"
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

// This path's lanes for the steps it shares (dwattn::LaneSteps)
DW_ATTN_LANES(__m256, _mm256, exp8, ld8);

// 8 keys' dot products with q, keys lo..hi-1 of the group (the others stay 0 and are never loaded: they may lie
// past the cache's end): lanes 0-7 of every key accumulate in i order in one ymm, then lanes 8-15 in another,
// exactly as the generic loop in dwattn::dot, and f = lanes 0-7 + lanes 8-15 is the fold's w = 8 step. NI: head_dim
// / 16 when known at compile time (0: D at run time). FULL: all 8 keys, no tests.
template <int NI, bool FULL, class E>
inline void dots8(const float* qf, int64_t D, const E* kp, int64_t sc, int lo, int hi, __m256* f) {
    const int64_t n = NI > 0 ? 16 * NI : D;
    for (int half = 0; half < 2; ++half) {  // lanes 0-7, then 8-15 (16 ymm registers: 8 keys x 1 half fit)
        __m256 acc[8];
#pragma GCC unroll 8
        for (int kk = 0; kk < 8; ++kk) acc[kk] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int64_t i = 8 * half; i < n; i += 16) {
            const __m256 qv = _mm256_loadu_ps(qf + i);
#pragma GCC unroll 8
            for (int kk = 0; kk < 8; ++kk)
                if (FULL || (kk >= lo && kk < hi))
                    acc[kk] = _mm256_fmadd_ps(qv, ld8(kp + kk * sc + i), acc[kk]);
        }
#pragma GCC unroll 8
        for (int kk = 0; kk < 8; ++kk) f[kk] = half ? _mm256_add_ps(f[kk], acc[kk]) : acc[kk];  // w = 8
    }
}

// Query blocks (dwattn::Block, attention_kernel.h), as in attention_avx512.cpp: each pass over a block of 16 keys
// (or values) serves up to QB queries of one (b, kv head) while it sits in L1; keys outside a query's range are
// never loaded. Steps: this path's loops over 16-key blocks, the steps dwattn::attend_block calls (softmax_weights and
// values: the shared LaneSteps on 8 lanes).
struct Steps : dwattn::LaneSteps<Lanes> {

// Every query's scores s_j (into s[u], j from its own start) and max, one 16-key block at a time, as two groups of
// 8 keys. A group's 8 folded scores are stored whole: the lanes outside the query's keys (before its start or at
// or past its end) land in the 16 floats of room on either side of s[u] and are never read.
template <int NI, class E>
static void scores(const DwAttnArgs* a, dwattn::Block<E>& blk, float* mx) {
    const int64_t sc = blk.q[0].sc, D = a->D;
    const __m256 vscale = _mm256_set1_ps(a->scale), ninf = _mm256_set1_ps(-__builtin_inff());
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 vmax[dwattn::QB];
    for (int u = 0; u < blk.n; ++u) vmax[u] = ninf;
    dwattn::for_spans(blk, blk.q[0].Kh, [&](const E* kblock, int64_t ab, int u, int lo, int hi) {
        for (int grp = 0; grp < 2; ++grp) {
            const int glo = lo - 8 * grp > 0 ? lo - 8 * grp : 0, ghi = hi - 8 * grp < 8 ? hi - 8 * grp : 8;
            if (glo >= ghi) continue;
            const E* kb = kblock + 8 * grp * sc;
            __m256 f[8];
            const bool full = glo == 0 && ghi == 8;
            if (full)
                dots8<NI, true>(blk.qf[u], D, kb, sc, 0, 8, f);
            else
                dots8<NI, false>(blk.qf[u], D, kb, sc, glo, ghi, f);
            const __m256 sv = _mm256_mul_ps(fold8(f), vscale);
            _mm256_storeu_ps(blk.s[u] + (ab + 8 * grp - blk.start[u]), sv);
            if (full) {
                vmax[u] = _mm256_max_ps(vmax[u], sv);
            } else {  // lanes glo..ghi-1 only
                const __m256 valid = _mm256_castsi256_ps(
                    _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(glo), iota),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(ghi), iota)));
                vmax[u] = _mm256_max_ps(vmax[u], _mm256_blendv_ps(ninf, sv, valid));
            }
        }
    });
    for (int u = 0; u < blk.n; ++u) {
        float m8[8];
        _mm256_storeu_ps(m8, vmax[u]);
        float m = m8[0];
        for (int l = 1; l < 8; ++l) m = m8[l] > m ? m8[l] : m;
        mx[u] = m;
    }
}
};

}  // namespace

extern "C" void dw_attn_rows_avx2(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    dwattn::run_blocks<Steps>(a, i0, i1, scratch);
}

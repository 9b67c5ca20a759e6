// The float kernel family's SIMD driver (float.h), shared by its AVX2 and AVX-512 units: tiles of MT rows x CB
// column blocks, each output one FMA chain in K order (float.h). An ISA unit supplies V, its vector traits: LANES
// (float32 per vector: 16 columns are 16 / LANES vectors), the widest tiles its registers hold (CB1 blocks for a
// one-row call, MT rows x CB blocks otherwise), and zero / load (LANES weights of the type as float32: the type's
// header) / loadf / bcast / fma / store (the live columns of one vector plus the bias): DW_FLOAT_VEC below.
//
// Owns: the walk. A one-row call (decode, bandwidth-bound) streams CB1 blocks at once, CB1 independent chains
// hiding the FMA latency. A call of up to MT rows takes one pass over K in balanced tiles (rows.h). A wider call
// (prompts) passes over K in chunks of KC values: per chunk and group of CB blocks, every row tile reads the
// group's chunk from cache, its partial sums stored to a.part and loaded back by the next chunk (exact), so each
// output's chain is unchanged. Knows nothing of torch, threads or any type's bits; includes no C++ library header.
#pragma once
#include "float.h"
#include "rows.h"

// The vector traits V of an ISA whose intrinsics are PS##_setzero_ps ... (_mm256, _mm512): VEC of LANES float32,
// the tiles, `load` (the type header's LOAD: LANES stored values as float32) and `store` (STORE: the live columns
// of one vector plus the bias, the ISA's own way of storing a short vector).
#define DW_FLOAT_VEC(NAME, VEC, PS, LANES_, CB1_, MT_, CB_, LOAD, STORE)                          \
    struct NAME {                                                                                  \
        using vec = VEC;                                                                           \
        static constexpr int LANES = LANES_, CB1 = CB1_, MT = MT_, CB = CB_;                        \
        static vec zero() { return PS##_setzero_ps(); }                                            \
        static vec load(const uint16_t* p) { return LOAD(p); }                                     \
        static vec loadf(const float* p) { return PS##_loadu_ps(p); }                              \
        static vec bcast(const float* p) { return PS##_set1_ps(*p); }                              \
        static vec fma(vec w, vec x, vec acc) { return PS##_fmadd_ps(w, x, acc); }                 \
        static void storef(float* p, vec v) { PS##_storeu_ps(p, v); }                              \
        static void store(float* p, vec v, const float* bias, int64_t live) { STORE(p, v, bias, live); } \
    }

namespace {
namespace dwfloat {

constexpr int64_t COLS = 16;
constexpr int64_t KC = 512;  // K values per pass of a wide call: a 4-block group's chunk is 64 KiB of fp16 (L2)

// Rows [m0, m0 + MT) x blocks [b, b + CB) over K values [k0, k1): chains started at zero (k0 == 0) or loaded from
// a.part; ended into out plus the bias (k1 == K) or stored to a.part.
template <class V, int MT, int CB>
[[gnu::noinline]] void tile(const DwFloat* w, const DwFloatAct* a, float* out, int64_t b, int64_t m0, int64_t k0,
                            int64_t k1) {
    constexpr int H = COLS / V::LANES;
    const int64_t K = w->K, N = w->N, NP = ((N + COLS - 1) / COLS) * COLS;
    typename V::vec acc[MT][CB * H];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
        for (int j = 0; j < CB * H; ++j)
            acc[m][j] = k0 == 0 ? V::zero() : V::loadf(a->part + (m0 + m) * NP + b * COLS + j * V::LANES);
    const uint16_t* P = w->w + b * K * COLS;
    const float* X = a->x + m0 * K;
#pragma GCC unroll 2
    for (int64_t k = k0; k < k1; ++k) {
        typename V::vec wv[CB * H];
#pragma GCC unroll 8
        for (int c = 0; c < CB; ++c)
#pragma GCC unroll 2
            for (int h = 0; h < H; ++h) wv[c * H + h] = V::load(P + (c * K + k) * COLS + h * V::LANES);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
            const typename V::vec xb = V::bcast(X + m * K + k);
#pragma GCC unroll 8
            for (int j = 0; j < CB * H; ++j) acc[m][j] = V::fma(wv[j], xb, acc[m][j]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
        for (int j = 0; j < CB * H; ++j) {
            const int64_t n0 = b * COLS + j * V::LANES;
            if (k1 == K) {
                V::store(out + (m0 + m) * N + n0, acc[m][j], w->bias ? w->bias + n0 : nullptr, N - n0);
            } else {
                V::storef(a->part + (m0 + m) * NP + n0, acc[m][j]);
            }
        }
}

// tile<V, MT, n> for the n = count (1..CB) blocks from b.
template <class V, int MT, int CB>
inline void blocks(int64_t count, const DwFloat* w, const DwFloatAct* a, float* out, int64_t b, int64_t m0,
                   int64_t k0, int64_t k1) {
    if constexpr (CB == 1) {
        tile<V, MT, 1>(w, a, out, b, m0, k0, k1);
    } else {
        if (count == CB) return tile<V, MT, CB>(w, a, out, b, m0, k0, k1);
        blocks<V, MT, CB - 1>(count, w, a, out, b, m0, k0, k1);
    }
}

// Blocks [b0, b1) of the call, all rows (float.h's chains; the walk above).
template <class V>
inline void gemm(const DwFloat* w, const DwFloatAct* a, float* out, int64_t b0, int64_t b1) {
    const int64_t M = a->M, K = w->K;
    if (M == 1) {
        for (int64_t b = b0; b < b1; b += V::CB1)
            blocks<V, 1, V::CB1>(b1 - b < V::CB1 ? b1 - b : V::CB1, w, a, out, b, 0, 0, K);
        return;
    }
    const int64_t step = M <= V::MT || a->part == nullptr ? K : KC;
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t k1 = K - k0 < step ? K : k0 + step;
        for (int64_t b = b0; b < b1; b += V::CB) {
            const int64_t count = b1 - b < V::CB ? b1 - b : V::CB;
            dwrows::balanced_tiles<V::MT>(M, false, [&]<int MT>(int64_t m0, bool) {
                blocks<V, MT, V::CB>(count, w, a, out, b, m0, k0, k1);
            });
        }
    }
}

}  // namespace dwfloat
}  // namespace

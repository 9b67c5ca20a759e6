// Row-exact attention: the portable implementation of the float sequence documented in attention.h — the
// baseline path (compiled into the main unit without -m flags), the path for a head_dim that is not a multiple
// of 16, and the oracle of the SIMD paths, which reuse its helpers (load, store, exp_nonpos, fold).
//
// Written lane by lane (arrays of 16 floats, every lane an independent chain), so -O3 may vectorize it at any
// width without reordering a single float operation (-ffp-contract=off: no fused multiply-adds either).
// Everything here has internal linkage and no C++ library header is included, so nothing compiled with
// AVX-512 flags can be merged into code that runs on an AVX2-only CPU.
#pragma once
#include <stdint.h>
#include "attention.h"
#include "cephes_exp.h"

namespace {
namespace dwattn {

constexpr int LANES = 16;

inline float bits_to_f32(uint32_t u) {
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    return u;
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bits_to_f32((uint32_t)p[i] << 16); }  // bf16: exact

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {  // fp32 -> bf16, round to nearest even (NaN stays NaN)
    uint32_t u = f32_to_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        p[i] = (uint16_t)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (uint16_t)(u >> 16);
}

// exp(x) for x <= 0: Cephes expf (n = round(x log2 e), two-step ln 2 reduction, degree-5 polynomial, 2^n
// through the exponent bits); below -80 it is 0 (e^-80 is 1.8e-35 next to the row's largest term, 1).
// Branch-free and lane-wise; rounding by adding and subtracting 1.5 * 2^23 (round to nearest even).
inline float exp_nonpos(float x) {
    const float e = dwexp::exp_poly(x < -80.0f ? -80.0f : x);  // 2^n, n in [-115, 0]
    return x < -80.0f ? 0.0f : e;
}

inline float fold(float* a) {  // a[16] -> one float: a[l] += a[l + w] for w = 8, 4, 2, 1
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) a[l] = a[l] + a[l + w];
    return a[0];
}

template <class E>
inline float dot(const float* q, const E* k, int64_t D) {
    float acc[LANES];
    for (int l = 0; l < LANES; ++l) acc[l] = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] = acc[l] + q[i + l] * load(k, i + l);
    for (int l = 0; i + l < D; ++l) acc[l] = acc[l] + q[i + l] * load(k, i + l);
    return fold(acc);
}

// The keys one query attends to and where its operands live. Every ISA path starts here, so the key range of
// the row-exact contract (keys [start, first_b + t], start = end - window on sliding layers) is written once.
template <class E>
struct Query {
    E* o;          // the output row [D]
    const E* K;    // the first key attended; key j at K + j * sc
    const E* V;    // the first value, same stride
    int64_t L;     // keys attended
    int64_t sc;    // key / value stride
};

// false for a padding query (its output row is zeroed); otherwise its q row is loaded into qf[D] as float
template <class E>
inline bool query(const DwAttnArgs* a, int64_t b, int64_t t, int64_t h, float* qf, Query<E>& q) {
    const int64_t D = a->D;
    q.o = (E*)a->out + ((b * a->T + t) * a->H + h) * D;
    if (t >= a->ntok[b]) {
        for (int64_t d = 0; d < D; ++d) store(q.o, d, 0.0f);
        return false;
    }
    const int64_t end = a->first[b] + t + 1;
    const int64_t start = a->window > 0 && end > a->window ? end - a->window : 0;
    const int64_t g = h / (a->H / a->Hkv);
    const int64_t base = a->slots[b] * a->kv_ss + g * a->kv_sh + start * a->kv_sc;
    q.K = (const E*)a->k + base;
    q.V = (const E*)a->v + base;
    q.L = end - start;
    q.sc = a->kv_sc;
    const E* qp = (const E*)a->q + b * a->q_sb + h * a->q_sh + t * a->q_st;
    for (int64_t d = 0; d < D; ++d) qf[d] = load(qp, d);
    return true;
}

// One item: query t of sequence b, head h (see attention.h).
template <class E>
void one(const DwAttnArgs* a, int64_t b, int64_t t, int64_t h, float* scratch) {
    const int64_t D = a->D, dp = (D + 15) / 16 * 16;
    float* qf = scratch;       // [dp]
    float* acc = scratch + dp;  // [dp]
    float* s = scratch + 2 * dp;  // [L]
    Query<E> q;
    if (!query(a, b, t, h, qf, q)) return;
    E* o = q.o;
    const E *K = q.K, *V = q.V;
    const int64_t L = q.L, sc = q.sc;

    float m = -__builtin_inff();
    for (int64_t j = 0; j < L; ++j) {
        const float x = dot(qf, K + j * sc, D) * a->scale;
        s[j] = x;
        m = x > m ? x : m;
    }

    float sum[LANES];
    for (int l = 0; l < LANES; ++l) sum[l] = 0.0f;
    int64_t j = 0;
    for (; j + LANES <= L; j += LANES)
        for (int l = 0; l < LANES; ++l) {
            const float e = exp_nonpos(s[j + l] - m);
            s[j + l] = e;
            sum[l] = sum[l] + e;
        }
    for (int l = 0; j + l < L; ++l) {
        const float e = exp_nonpos(s[j + l] - m);
        s[j + l] = e;
        sum[l] = sum[l] + e;
    }
    const float total = fold(sum);

    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    j = 0;
    for (; j + 4 <= L; j += 4) {  // four keys per pass over acc: the same additions, in the same order
        const float p0 = s[j], p1 = s[j + 1], p2 = s[j + 2], p3 = s[j + 3];
        const E* v0 = V + j * sc;
        const E* v1 = v0 + sc;
        const E* v2 = v1 + sc;
        const E* v3 = v2 + sc;
        for (int64_t d = 0; d < D; ++d)
            acc[d] = (((acc[d] + p0 * load(v0, d)) + p1 * load(v1, d)) + p2 * load(v2, d)) + p3 * load(v3, d);
    }
    for (; j < L; ++j) {
        const float p = s[j];
        const E* v = V + j * sc;
        for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + p * load(v, d);
    }
    for (int64_t d = 0; d < D; ++d) store(o, d, acc[d] / total);
}

template <class E>
void rows(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    const int64_t G = a->H / a->Hkv, T = a->T, Hkv = a->Hkv;
    for (int64_t i = i0; i < i1; ++i) {  // i = ((b * Hkv + g) * T + t) * G + hg
        const int64_t hg = i % G, t = (i / G) % T, g = (i / (G * T)) % Hkv, b = i / (G * T * Hkv);
        one<E>(a, b, t, g * G + hg, scratch);
    }
}

inline void run(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    if (a->dtype == DW_ATTN_BF16)
        rows<uint16_t>(a, i0, i1, scratch);
    else
        rows<float>(a, i0, i1, scratch);
}

}  // namespace dwattn
}  // namespace

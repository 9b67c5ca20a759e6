// The decoder glue's row loops, portable: the float sequence of glue.h written element by element (and dot's sum
// lane by lane), so -O3 may vectorize it at any width without reordering a float operation
// (-ffp-contract=off: no fused multiply-adds). The baseline path (compiled into glue.cpp without -m flags), the
// oracle of the SIMD paths, and the source of their scalar tails; the exp is cephes_exp.h's.
// Owns also how any path's loops make a DwGlue (Table: norm_row = scale_row after rms_of(dot(x, x)), for every
// path), so the SIMD units supply only their loops. Knows nothing of torch, threads or which path runs (glue.cpp
// and dispatch.h decide). Internal linkage only and no C++ library header, so nothing compiled with AVX-512 flags
// can be merged into code that runs on other CPUs.
#pragma once
#include <stdint.h>
#include "cephes_exp.h"
#include "glue.h"

namespace {
namespace dwglue {

constexpr float EXP_LO = -87.0f, EXP_HI = 88.0f;  // 2^n stays a normal float: n in [-126, 127]

// glue.h's combination of dot's 8 lanes, and norm_row's r = 1 / sqrt(mean(x^2) + eps) from the sum of squares
inline double lanes(const double a[8]) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }
inline float rms_of(double s, int64_t n, double eps) { return (float)(1.0 / __builtin_sqrt(s / (double)n + eps)); }

inline float silu_mul1(float g, float u) {
    const float t0 = -g;
    float t = t0 < EXP_LO ? EXP_LO : t0;
    t = t > EXP_HI ? EXP_HI : t;
    const float s = g / (1.0f + dwexp::exp_poly(t));
    return (t0 > EXP_HI ? g * 0.0f : s) * u;
}

// The portable path's row loops (and the SIMD paths' tails: silu_mul1, Portable::scale_row).
struct Portable {
    static void silu_mul(const float* g, const float* u, float* out, int64_t n) {
        for (int64_t i = 0; i < n; ++i) out[i] = silu_mul1(g[i], u[i]);
    }

    // glue.h's dot: exact products summed in 8 lanes l = i mod 8, the lanes combined in one fixed order
    static double dot(const float* x, const float* w, int64_t n) {
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; ++j) acc[j] = acc[j] + (double)x[i + j] * (double)w[i + j];
        for (; i < n; ++i) acc[i & 7] = acc[i & 7] + (double)x[i] * (double)w[i];
        return lanes(acc);
    }

    // glue.h's argmax, element by element; the SIMD paths' answer wherever a row holds a NaN
    static int64_t argmax(const float* x, int64_t n) {
        int64_t best = 0;
        float m = x[0];
        if (m != m) return 0;
        for (int64_t i = 1; i < n; ++i) {
            const float v = x[i];
            if (v != v) return i;
            if (v > m) {
                m = v;
                best = i;
            }
        }
        return best;
    }

    static void scale_row(const float* x, const float* w, float* y, int64_t n, float r, float offset) {
        if (offset != 0.0f) {
            for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * r) * (offset + w[i]);
        } else {
            for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
        }
    }

    static void add_norm_row(const float* x, const float* h, const float* w, float* s, float* y, int64_t n,
                             double eps, float offset);
};

// The SIMD paths' argmax ends alike: lanes, each holding the largest value it saw and that value's first index
// (-inf and 0 where it saw nothing larger), give the row's answer: the largest value, and of the lanes holding it
// the lowest index. (A row whose maximum is -inf is all -inf: index 0, which a lane that saw nothing larger holds.)
inline int64_t argmax_lanes(const float* v, const int32_t* idx, int n) {
    float m = v[0];
    int64_t best = idx[0];
    for (int j = 1; j < n; ++j)
        if (v[j] > m || (v[j] == m && idx[j] < best)) {
            m = v[j];
            best = idx[j];
        }
    return best;
}
constexpr int64_t ARGMAX_LANE_MAX = (int64_t(1) << 31) - 128;  // a lane's index is int32: longer rows go portable

// A path's DwGlue from its row loops, put together the same way for every path. P: static silu_mul, dot, argmax,
// scale_row and add_norm_row (the add, then the norm; the norm's sum of squares is P::dot(x, x)), each glue.h's
// sequence for its part (Portable; glue_avx2.cpp, glue_avx512.cpp). norm is glue.h's norm, inline; norm_row is the
// table's entry, never inlined: the SIMD paths' add_norm_row calls it and the portable one takes norm in, as each did
// before this table existed.
template <class P>
struct Table {
    static void norm(const float* x, const float* w, float* y, int64_t n, double eps, float offset) {
        P::scale_row(x, w, y, n, rms_of(P::dot(x, x, n), n, eps), offset);
    }
    __attribute__((noinline)) static void norm_row(const float* x, const float* w, float* y, int64_t n, double eps,
                                                   float offset);

    static void fill(DwGlue* ops) {
        ops->norm_row = norm_row;
        ops->add_norm_row = P::add_norm_row;
        ops->silu_mul = P::silu_mul;
        ops->dot = P::dot;
        ops->argmax = P::argmax;
    }
};

template <class P>
void Table<P>::norm_row(const float* x, const float* w, float* y, int64_t n, double eps, float offset) {
    norm(x, w, y, n, eps, offset);
}

inline void Portable::add_norm_row(const float* x, const float* h, const float* w, float* s, float* y, int64_t n,
                                   double eps, float offset) {
    for (int64_t i = 0; i < n; ++i) s[i] = x[i] + h[i];
    Table<Portable>::norm(s, w, y, n, eps, offset);
}

}  // namespace dwglue
}  // namespace

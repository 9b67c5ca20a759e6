// The decoder glue's row loops: the plain-C interface shared by the ISA translation units (glue.cpp owns the torch
// operators, checks and threading, and picks a path once per process with cpuid).
//
// Owns: the float sequence of one row of the norm and of the gated activation, described here once
// (glue_kernel.h is the portable implementation and the oracle; glue_avx2.cpp and glue_avx512.cpp perform the very
// same operations with intrinsics, so every path agrees bitwise). Knows nothing of torch (the ISA units include only
// this header, glue_kernel.h and intrin.h) or of models.
//
// norm_row(x[n], w[n]) -> y[n]:
//   s   = the squares (double)x[i] * (double)x[i] (exact: 24-bit mantissas) summed in 8 lanes l = i mod 8 in i
//         order, the lanes combined ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
//   r   = (float)(1 / sqrt(s / n + eps))   (double arithmetic, one rounding to float);
//   y_i = w_i * (x_i * r), or with offset != 0 (gemma's 1 + w) (x_i * r) * (offset + w_i)   (float).
// add_norm_row(x, h, w) -> s, y: s_i = x_i + h_i (float), then norm_row(s).
// dot(x[n], w[n]) -> the products (double)x[i] * (double)w[i] (exact) summed as norm_row's squares are (8 lanes in i
//   order, the same combination): norm_row's s is dot(x, x); a mixture's router logit is dot(row, expert's weights).
// silu_mul(g[n], u[n]) -> out[n]: out_i = s_i * u_i, s_i = g_i / (1 + e_i), e_i = dw_exp(clamp(-g_i, -87, 88)),
//   dw_exp the Cephes expf of cephes_exp.h (round-to-nearest n = x log2 e, two-step ln 2 reduction, degree-5
//   polynomial, 2^n through the exponent bits); where -g_i > 88, s_i = g_i * 0 instead (silu is below 6e-37 in
//   magnitude there). The clamp keeps 2^n a normal float; above g = 87 silu(g) is g to float precision anyway.
// argmax(x[n]) -> torch.argmax's index of the row: the first maximum (ties, +0 = -0 among them, to the lower index);
//   a NaN counts above every number, so a row with one gives its first NaN's index. No arithmetic: every path
//   returns the same index (n >= 1).
// No fused multiply-adds (-ffp-contract=off) and no reassociation; each element (row) depends only on its inputs.
#pragma once
#include <stdint.h>

extern "C" {

struct DwGlue {
    void (*norm_row)(const float* x, const float* w, float* y, int64_t n, double eps, float offset);
    void (*add_norm_row)(const float* x, const float* h, const float* w, float* s, float* y, int64_t n, double eps,
                         float offset);
    void (*silu_mul)(const float* g, const float* u, float* out, int64_t n);
    double (*dot)(const float* x, const float* w, int64_t n);
    int64_t (*argmax)(const float* x, int64_t n);
};

// Fill `ops` with this path's functions (the AVX2 / AVX-512 units only exist on x86; call them after cpuid says so).
void dw_glue_scalar(DwGlue* ops);
void dw_glue_avx2(DwGlue* ops);
void dw_glue_avx512(DwGlue* ops);

}

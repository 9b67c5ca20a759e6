// The float kernel family: weights stored as 16-bit floats (GGUF F16, BF16: each type one Kernel row of
// kernels/blocktypes.py and one small header, <type>.h, saying how its 16-bit values become float32) x float32
// activations, the plain-C interface shared by the family's units (float.cpp, float_avx2.cpp, float_avx512.cpp).
// Those units are compiled once per type, with -DDW_FLOAT=<type> -DDW_FLOAT_HEADER="<type>.h" (kernels/library.py),
// so a type's symbols and torch library (torch.ops.draftwise_<type>) are its own.
//
// Owns: the layout and the arithmetic every path performs, described here once. Knows nothing of torch or of any
// type's bits (the type's header converts them, exactly: every 16-bit float is a float32).
//
// Weights W [N, K] (any K), N padded to NB = ceil(N / 16) blocks of 16 output columns:
//   w [NB, K, 16] uint16: w[b, k, j] holds the file's 16 bits of W[16 b + j, k] (zero bits past N), as stored.
// Activations X [M, K] float32, used as they are (finer than llama.cpp's CPU path, which rounds them to fp16 for
// an F16 weight and to bf16 for a BF16 one).
// Per output (m, n), one float32 FMA chain in K order, identically in every path, at every M and thread count:
//   acc = 0;  for k = 0 .. K - 1: acc = fma(W[n, k], X[m, k], acc);  y = acc + bias[n] (+ 0 without a bias).
// A path may hold acc in a register, or store it to memory and load it back between passes over K (exact), and
// computes many outputs at once (16 columns a vector, several column blocks and rows a tile), never changing the
// chain of one output: so every path, every M and every thread count give bitwise the same row.
#pragma once
#include <stdint.h>

#define DW_FLOAT_CAT_(a, b, c) a##b##c
#define DW_FLOAT_CAT(a, b, c) DW_FLOAT_CAT_(a, b, c)
#define DW_FLOAT_GEMM(isa) DW_FLOAT_CAT(dw_, DW_FLOAT, _gemm_##isa)  // dw_f16_gemm_avx2, ...

extern "C" {

struct DwFloat {
    const uint16_t* w;  // [NB, K, 16]
    const float* bias;  // [N] or null
    int64_t N, K;
};

struct DwFloatAct {
    const float* x;  // [M, K]
    int64_t M;
    float* part;     // [M, NB * 16] or null: where a path may keep its partial sums between passes over K
};

// out [M, N] float32 for the 16-column blocks [b0, b1), all M rows
void DW_FLOAT_GEMM(scalar)(const DwFloat* w, const DwFloatAct* a, float* out, int64_t b0, int64_t b1);
void DW_FLOAT_GEMM(avx2)(const DwFloat* w, const DwFloatAct* a, float* out, int64_t b0, int64_t b1);
void DW_FLOAT_GEMM(avx512)(const DwFloat* w, const DwFloatAct* a, float* out, int64_t b0, int64_t b1);

}

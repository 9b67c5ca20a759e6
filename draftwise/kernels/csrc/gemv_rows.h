// The block GEMVs' raw entry points for a C++ caller that runs many small linears on its own threads (csrc/experts.cpp:
// a decode step's experts, each whole on one thread): the path-'auto' GEMV of an op (draftwise_q4x8 / q5x8 / q6k
// ::linear, not their wide side) on raw pointers, on the calling thread, into the caller's scratch.
//
// Owns only the declarations; each is defined beside its op (q4x8.cpp, q6k.cpp, glue.cpp), which picks the ISA path
// by its own rule (dispatch.h). Each output is bitwise the op's for the same rows: the same quantizer and GEMV
// functions, every 16-column block by the calling thread (block_op.h's split over blocks changes no bit). No
// argument checks: the caller checks the buffers once (dw_q4x8_check / dw_q6k_check, gemm_wide.h) and gives rows
// the wide side would not take (dw_wide_takes / dw_q6k_wide_takes false: the op would run this GEMV too).
#pragma once
#include <stdint.h>
#include "q4x8.h"
#include "q6k.h"

inline int64_t dw_up64(int64_t n) { return (n + 63) / 64 * 64; }

// The scratch of M quantized rows of K (either kernel; G = K / 32 groups, S = (G + 7) / 8 superblocks): q [G, M, 32]
// int8 at 0, dx [S, M] float32, qsum [S, M, 8] int16, qsum16 [S, M, 16] int16 (q6k's) at these byte offsets, each
// piece 64-byte aligned; `bytes` in all.
struct DwGemvScratch {
    int64_t dx, qsum, qsum16, bytes;
    DwGemvScratch(int64_t M, int64_t K) {
        const int64_t G = K / 32, S = (G + 7) / 8;
        dx = dw_up64(G * M * 32);
        qsum = dx + dw_up64(S * M * 4);
        qsum16 = qsum + dw_up64(S * M * 8 * 2);
        bytes = qsum16 + dw_up64(S * M * 16 * 2);
    }
    // The arrays of a scratch `base` (64-byte aligned, `bytes` long) in this layout.
    struct Arrays {
        int8_t* q;
        float* dx;
        int16_t* qsum;
        int16_t* qsum16;
    };
    Arrays in(uint8_t* base) const {
        return {(int8_t*)base, (float*)(base + dx), (int16_t*)(base + qsum), (int16_t*)(base + qsum16)};
    }
};

// Scratch bytes the quantized activations of M rows of K take (DwGemvScratch's layout).
inline int64_t dw_gemv_rows_scratch(int64_t M, int64_t K) { return DwGemvScratch(M, K).bytes; }

// y [M, w->N] = x [M, w->K] (rows contiguous) times q4x8 / q5x8 weights w (bias included); `path` as the op's
// argument (dispatch.h: AUTO the best here). scratch: dw_gemv_rows_scratch(M, K) bytes, 64-byte aligned.
void dw_q4x8_gemv_rows(const DwQ4* w, const float* x, int64_t M, float* y, int64_t path, uint8_t* scratch);

// The same for q6k / q3k / q6m weights (q6k.h's DwQ6, its value_bits and min term).
void dw_q6k_gemv_rows(const DwQ6* w, const float* x, int64_t M, float* y, int64_t path, uint8_t* scratch);

// draftwise_glue::glu(gu, None, 0) on raw pointers, the calling thread: gu [R, 2 I] contiguous (gate | up) -> out
// [R, I] = silu(gate) * up, in the op's chunks (bitwise its output).
void dw_glu_silu_rows(const float* gu, int64_t R, int64_t I, float* out);

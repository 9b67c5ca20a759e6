// The AMX int8 scaffolding both wide kernels share (gemm_q4x8_amx.cpp, gemm_q6k_amx.cpp): the 32-row x 16-column
// passes over runs of 64-K steps on the tiles amx_config.h configures (each pass's float epilogue pipelined into the
// next), and the per-block bias / column mask / accumulator store.
//
// Owns: the tile register assignment (tmm0-3 accumulators: lo rows 0-15, hi rows 0-15, lo rows 16-31, hi rows
// 16-31; tmm4-5 the two 16-row activation tiles; tmm6-7 the lo and hi weight tiles), the tile-major activation and
// B-tile strides (gemm_q4x8.h / gemm_q6k.h: an A tile is 1 KiB of consecutive bytes, step j's two B tiles lie at
// 2048 j) and the one choice between the kernels: the instruction for the high-byte tile (TDPBSUD where it is
// unsigned, TDPBSSD where it is signed). Knows nothing of what the weight bytes mean or of the float epilogue
// (each kernel's own); the integer sums it returns are exact (int32, bounds in the kernels' headers).
// Included only by units compiled with -mamx-tile -mamx-int8 and the AVX-512 flags; includes no C++ library header.
#pragma once
#include <stdint.h>
#include "amx_config.h"
#include "intrin.h"

namespace dwamx {

// Bytes of scratch one thread needs for one 16-column block: `steps` x 2 B tiles x 1 KiB, then 16 float32
// accumulators per row for M rows rounded up to 32 (64-byte aligned if scratch is).
inline int64_t scratch_bytes(int64_t steps, int64_t M) { return steps * 2048 + (M + 31) / 32 * 32 * 64; }

// 16 sc bytes (columns 0-15) -> 64 bytes, byte 4n + t = sc[n]: the VNNI layout of one B-tile row
inline __m512i sc_lanes(const void* sc16) {
    return _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)sc16)), _mm512_set1_epi32(0x01010101));
}

// The integer sums of consecutive 32-row tile passes over one 16-column block, double-buffered so that each pass's
// epilogue (the kernel's per-row float work, an Epilogue) runs between the tile multiplies of the next pass: the
// vector units work while the tile unit does, where a pass-then-epilogue order leaves each idle in turn. A row's
// epilogue still runs once per pass, in pass order, so its float sequence is unchanged.
// Epilogue: a copyable object with void operator()(int32_t (*C)[16][16], int r0, int r1) const, for rows [r0, r1)
// of its pass's sums C (it clamps r1 to the rows its pass has).
template <bool HiSigned, class Epilogue>
struct Pipeline {
    alignas(64) int32_t C[2][4][16][16];  // C[i]: one pass's sums (C[i][0] / [2]: lo of rows 0-15 / 16-31, [1] / [3]: hi)
    Epilogue pending;                     // the last pass's epilogue, not yet run
    bool live = false;
    int cur = 0;  // the buffer the next pass fills

    // One pass over steps [j0, j1): A0 / A1 the first step's activation tiles of rows 0-15 / 16-31 (1 KiB a step), B
    // the first step's lo tile (its hi tile 1 KiB on, 2 KiB a step). The lo sums come from TDPBSUD, the hi sums from
    // TDPBSSD if HiSigned, else TDPBSUD. `epi` runs on these sums during the next pass (or at flush()).
    void pass(const int8_t* A0, const int8_t* A1, const uint8_t* B, int64_t j0, int64_t j1, const Epilogue& epi) {
        const int per = (int)((32 + (j1 - j0) - 1) / (j1 - j0));  // rows of the last pass's epilogue per step
        int32_t (*prev)[16][16] = C[cur ^ 1];
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = j0; j < j1; ++j) {
            _tile_loadd(4, A0 + j * 1024, 64);
            _tile_loadd(5, A1 + j * 1024, 64);
            _tile_loadd(6, B + j * 2048, 64);
            _tile_loadd(7, B + j * 2048 + 1024, 64);
            _tile_dpbsud(0, 4, 6);
            if constexpr (HiSigned) _tile_dpbssd(1, 4, 7); else _tile_dpbsud(1, 4, 7);
            _tile_dpbsud(2, 5, 6);
            if constexpr (HiSigned) _tile_dpbssd(3, 5, 7); else _tile_dpbsud(3, 5, 7);
            if (live) {
                const int r0 = (int)(j - j0) * per;
                pending(prev, r0, r0 + per);
            }
        }
        _tile_stored(0, C[cur][0], 64);
        _tile_stored(1, C[cur][1], 64);
        _tile_stored(2, C[cur][2], 64);
        _tile_stored(3, C[cur][3], 64);
        pending = epi;
        live = true;
        cur ^= 1;
    }

    // Runs the last pass's epilogue now (before its block's accumulators are read).
    void flush() {
        if (live) pending(C[cur ^ 1], 0, 32);
        live = false;
    }
};

// Row m (0-31) of a pass's sums as lo + (hi << Shift): the exact int32 per column (Shift 4: q4x8's sc halves,
// 8: q6k's base-256 bytes)
template <int Shift>
inline __m512i row_sum(int32_t (*C)[16][16], int m) {
    const int half = m >> 4, r = m & 15;
    const __m512i lo = _mm512_load_si512((const void*)C[2 * half][r]);
    const __m512i hi = _mm512_load_si512((const void*)C[2 * half + 1][r]);
    return _mm512_add_epi32(lo, _mm512_slli_epi32(hi, Shift));
}

// The live columns of 16-column block b of N, and that block's bias (0 without one)
struct BlockCols {
    int64_t n0;
    __mmask16 keep;
    __m512 bias;
    BlockCols(int64_t b, int64_t N, const float* bias_or_null) : n0(b * 16) {
        const int64_t live = N - n0 < 16 ? N - n0 : 16;
        keep = (__mmask16)((1u << live) - 1u);
        bias = bias_or_null ? _mm512_maskz_loadu_ps(keep, bias_or_null + n0) : _mm512_setzero_ps();
    }
    // y[m, n0 ..] = acc + bias for rows 0..M-1 (accs: [M, 16] float32, 64-byte aligned; out: row stride N). Where
    // each row's 16 columns are one whole aligned cache line, the stores stream past the caches (the output is
    // written once and read by the next operator, usually after many other blocks have evicted it): no line is read
    // for ownership first. The caller fences (finish()) before other threads read the output.
    void store(const float* accs, int64_t M, float* out, int64_t N) const {
        float* y = out + n0;
        if (keep == (__mmask16)0xFFFF && (uintptr_t)y % 64 == 0 && N % 16 == 0) {
            for (int64_t m = 0; m < M; ++m) _mm512_stream_ps(y + m * N, _mm512_add_ps(_mm512_load_ps(accs + m * 16), bias));
            return;
        }
        for (int64_t m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * N, keep, _mm512_add_ps(_mm512_load_ps(accs + m * 16), bias));
    }
};

// The end of a kernel call: orders store()'s streaming stores before the caller's release of the tiles and return
inline void finish() {
    _mm_sfence();
    _tile_release();
}

inline void zero_accs(float* accs, int64_t M) {
    for (int64_t m = 0; m < M; ++m) _mm512_store_ps(accs + m * 16, _mm512_setzero_ps());
}

}  // namespace dwamx

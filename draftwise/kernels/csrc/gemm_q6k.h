// q6k wide side: the plain-C interface between the torch-facing unit (gemm_q6k.cpp) and the AMX unit
// (gemm_q6k_amx.cpp, compiled with -mamx-tile -mamx-int8 and the AVX-512 flags, run only where gemm_q4x8.cpp's
// dw_wide_side says the CPU and the process may run AMX int8 tiles).
//
// Owns: the tile layout the wide kernel rebuilds Q6_K weights into. Knows nothing of torch or threads. The
// arithmetic it must reproduce bit for bit is q6k.h's (the packed layout, the exact int32 tot per super-block and
// the two float steps).
//
// Activations: the GEMV's very Q8_K values (q4x8.h's dw_q8_rows_*, one row at a time), laid out tile-major so an
// AMX A tile is 1 KiB of consecutive bytes: q [Mp / 16, K / 64, 16, 64] int8 (row 16 i + r, K values 64 j .. 64 j +
// 63 at [i, j, r]; Mp = M rounded up to 32, padding rows zero), dx [Mp, S] float32.
//
// Weights, per 16-column block and step of 64 K values (groups 2j and 2j + 1), two AMX B tiles of 16 rows x 64
// bytes in the VNNI layout (row r = K values 4r..4r+3 of the step, byte 4n + t = column n), from the offset weight
// w = sc[n, j] * (q[n, k] - 32) (|w| <= 128 * 32 = 4096, j = k's sub-block of 16) split in base 256:
//   lo[r][4n + t] = w & 255 (uint8),  hi[r][4n + t] = w >> 8 (arithmetic: int8 in -16..15),  w = lo + 256 hi,
// so that, per super-block, with A the int8 activations (TDPBSUD for lo: signed x unsigned; TDPBSSD for hi:
// signed x signed; int32 sums, exact: |C_lo| <= 255 * 127 * 256, |256 C_hi| <= 256 * 16 * 127 * 256 < 2^31),
//   tot = C_lo + 256 C_hi = sum_j sc_j * (isum_j - 32 qsum16_j)   exactly q6k.h's tot (isc - 32 imn),
// then q6k.h's float steps in super-block order: t = (float) tot * d[n, s]; acc = fma(t, dx[s, m], acc); y = acc + bias.
#pragma once
#include <stdint.h>
#include "q6k.h"

extern "C" {

struct DwQ8Tiles {
    const int8_t* q;   // [Mp / 16, K / 64, 16, 64]
    const float* dx;   // [Mp, S]
    int64_t M, K;
};

// Bytes of scratch one thread needs for one 16-column block of M rows: (K / 64) steps x 2 B tiles x 1 KiB, then
// 16 float32 accumulators per row (64-byte aligned if scratch is).
int64_t dw_q6k_amx_scratch_bytes(int64_t K, int64_t M);

// out [M, N] float32 (row stride N) for the 16-column blocks [b0, b1), all a->M rows (q, dx padded to whole
// 32-row tiles with zeros); scratch: dw_q6k_amx_scratch_bytes(K, a->M), this thread's, 64-byte aligned. Configures the calling thread's
// tiles and releases them before it returns.
void dw_q6k_gemm_amx(const DwQ6* w, const DwQ8Tiles* a, float* out, int64_t b0, int64_t b1, uint8_t* scratch);

}

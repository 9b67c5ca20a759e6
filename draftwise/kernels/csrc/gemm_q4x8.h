// q4x8 wide side: the plain-C interface between the torch-facing unit (gemm_q4x8.cpp) and the AMX unit
// (gemm_q4x8_amx.cpp, compiled with -mamx-tile -mamx-int8 and the AVX-512 flags, run only where cpuid says AMX and
// the process holds the kernel's permission for the tile data).
//
// Owns: the row-major activation layout the wide kernel reads and the tile layout it rebuilds the weights into.
// Knows nothing of torch or threads. The arithmetic it must reproduce bit for bit is q4x8.h's (the weights' packed
// layout, the per-row quantization, the exact int32 isc / imn per super-block and the three float steps).
//
// Activations, quantized per row exactly as q4x8.h says (the same dw_q8_rows_* functions, called one row at a time,
// so every q, dx and qsum is the GEMV's):
//   q [Mp / 16, Kp / 64, 16, 64] int8 tile-major (row 16 i + r, K values 64 j .. 64 j + 63 at [i, j, r]: an AMX A
//   tile is 1 KiB of consecutive bytes), Kp = K rounded up to 64, Mp = M rounded up to 32 (q's padding is zero);
//   dx [Mp, S] float32; qsum [Mp, S, 8] int16.
// Weights, per 16-column block and step of 64 K values (groups 2j and 2j + 1; a missing group 2j + 1 is zero), two
// AMX B tiles of 16 rows x 64 bytes in the VNNI layout (row r = K values 4r..4r+3 of the step, byte 4n + t = column n):
//   lo[r][4n + t] = (sc[n, g] & 15) * q[n, k],  hi[r][4n + t] = (sc[n, g] >> 4) * q[n, k]   (both <= 225: uint8)
// so that, per super-block, with A the int8 activations (TDPBSUD: signed A x unsigned B, int32 sums, exact),
//   isc = C_lo + 16 C_hi = sum_g sc[n, g] * isum_g exactly (|16 C_hi| <= 16 * 15 * 15 * 127 * 256 < 2^31),
// the same integer q4x8.h defines; imn and the float steps are then the GEMV's instructions on the same values.
#pragma once
#include <stdint.h>
#include "q4x8.h"

extern "C" {

struct DwQ8Rows {
    const int8_t* q;      // [Mp / 16, Kp / 64, 16, 64]
    const float* dx;      // [Mp, S]
    const int16_t* qsum;  // [Mp, S, 8]
    int64_t M, Kp;
};

// Bytes of scratch one thread needs for one 16-column block of M rows: (Kp / 64) steps x 2 B tiles x 1 KiB, then 16
// float32 accumulators per row.
int64_t dw_amx_scratch_bytes(int64_t Kp, int64_t M);

// out [M, N] float32 for the 16-column blocks [b0, b1), all M rows; scratch: dw_amx_scratch_bytes(Kp, a->M), this thread's, 64-byte aligned.
// Configures the tiles of the calling thread and releases them before it returns.
void dw_gemm_amx(const DwQ4* w, const DwQ8Rows* a, float* out, int64_t b0, int64_t b1, uint8_t* scratch);

}

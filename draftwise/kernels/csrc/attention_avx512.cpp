// Row-exact attention, AVX-512 path (F + BW + VL + DQ), compiled with those -m flags and called only after a
// run-time cpuid check, for head_dim a multiple of 16. It performs the float sequence of attention.h exactly
// (bitwise the portable path in attention_kernel.h, its oracle): a dot product's 16 lanes are one zmm, and the
// 16 dots of a block of keys are folded together by a shuffle tree that does, per key, the very additions
// a[l] += a[l + w] (w = 8, 4, 2, 1) of the portable fold. Consecutive queries of one (b, kv head) are attended
// as a block (dwattn::attend_block), so a block of 16 keys or values is read from L2 once for all of them.
// Owns only this path's loops over 16-key blocks (Steps); knows nothing of torch, threads or when it runs (that is
// attention.cpp's and dispatch.h's). Includes no C++ library header: nothing inline from here can leak into code
// run on other CPUs.
#include "attention_avx512.h"

extern "C" void dw_attn_rows_avx512(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    dwattn::run_blocks<Steps>(a, i0, i1, scratch);
}

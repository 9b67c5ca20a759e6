// q4x8: the prefetch of the next 16-column block's weights that both SIMD units issue while one block computes.
//
// Owns: what is prefetched and into which cache. Per group g of the block: its 256 bytes of packed nibbles (and q5x8's
// 64 bytes of fifth-bit plane) into L2
// (hint T1), not L1 (a block is 12-70 KB at K = 1536-8960, and pulling the next one into a 32 KB L1 evicted the
// current block and the activations: measured on the AVX-512 path, T1 streamed 10-20% more weight bytes per second
// at 4-9 rows); every fourth group its sc / mn, and at a super-block's first group its d / dmin, into L1 (T0).
// Knows nothing of either path's registers, tiles or arithmetic (the layout is q4x8.h's); changes no result.
//
// A macro, not a function: GCC 12 treats a function that only prefetches as free of side effects and deleted every
// call of such a helper (the prefetches vanished from the AVX-512 kernel); always_inline kept them but compiled the
// kernel's loop differently. The macro compiles to exactly the code the units had written out. It reads the
// caller's P, SC, MN (this block's packed nibbles, sc and mn), D, DM (its d and dmin), QH (its q5x8 fifth-bit plane,
// null for q4x8: then nothing more is asked for), G, S, g, g0 (the first group of super-block s) and s. Includes no header: the units include intrin.h first.
#pragma once

#define DW_Q4X8_PREFETCH_NEXT_BLOCK()                                                  \
    do {                                                                               \
        const char* nxt = (const char*)(P + G * 256 + g * 256);                        \
        _mm_prefetch(nxt, _MM_HINT_T1);                                                \
        _mm_prefetch(nxt + 64, _MM_HINT_T1);                                           \
        _mm_prefetch(nxt + 128, _MM_HINT_T1);                                          \
        _mm_prefetch(nxt + 192, _MM_HINT_T1);                                          \
        if (QH) _mm_prefetch((const char*)(QH + G * 64 + g * 64), _MM_HINT_T1);        \
        if ((g & 3) == 0) {                                                            \
            _mm_prefetch((const char*)(SC + G * 16 + g * 16), _MM_HINT_T0);            \
            _mm_prefetch((const char*)(MN + G * 16 + g * 16), _MM_HINT_T0);            \
        }                                                                              \
        if (g == g0) {                                                                 \
            _mm_prefetch((const char*)(D + S * 16 + s * 16), _MM_HINT_T0);             \
            _mm_prefetch((const char*)(DM + S * 16 + s * 16), _MM_HINT_T0);            \
        }                                                                              \
    } while (0)

// The shared GEMV driver of the block kernels (q4x8, q6k, q8_0 and every type on them), ISA-neutral part: how the
// M rows of a call are cut into register tiles. A type's ISA unit supplies only its inner loop over one tile (a
// function template over the tile height MT, computing MT rows of one column block) and the widest tile its
// registers hold; the ISA's own driver (rows_avx512.h, rows_avx2.h) walks the column blocks and stores.
//
// A type's tile function is [[gnu::noinline]]: one function per height, called from the walk. Inlined into it,
// GCC's register allocation of the 1-row tile spilled the weight vectors of q4x8's AVX-512 loop to the stack (1.7x
// slower on a cache-resident 1536 x 8960 GEMV; called, it is within 4% of the old switch's inlined tile there and
// equal on a DRAM-resident one, where decode lives).
//
// Owns: the balanced tiling (ceil(M / MAX) tiles whose heights differ by at most one: 16 rows at MAX 12 -> 8 + 8)
// and the dispatch of each height to its instantiation. Which tile computes a row changes no bit of it: a type's
// tile computes each row on its own (its integer sums per row, its float steps per row), so every M and every
// tiling give bitwise the same row. Knows nothing of any type, ISA or torch; includes no header.
#pragma once
#include <stdint.h>

namespace dwrows {

// f.template operator()<MT>(m0, prefetch) with MT = rows, or MAX for any other count (never reached: 1 <= rows <= MAX)
template <int MT, int MAX, class F>
inline void tile(int64_t rows, F& f, int64_t m0, bool prefetch) {
    if constexpr (MT == MAX) {
        f.template operator()<MT>(m0, prefetch);
    } else {
        if (rows == MT) return f.template operator()<MT>(m0, prefetch);
        tile<MT + 1, MAX>(rows, f, m0, prefetch);
    }
}

// Rows [0, M) in balanced tiles of at most MAX; `prefetch` is passed to the first tile only (it asks for the next
// block's weights once, while this block's first tile computes).
template <int MAX, class F>
inline void balanced_tiles(int64_t M, bool prefetch, F&& f) {
    const int64_t tiles = (M + MAX - 1) / MAX;
    int64_t m0 = 0;
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = (M - m0) / (tiles - t);
        tile<1, MAX>(rows, f, m0, prefetch && t == 0);
        m0 += rows;
    }
}

}  // namespace dwrows

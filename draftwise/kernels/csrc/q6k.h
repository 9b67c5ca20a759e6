// q6k: GGUF Q6_K weights (as the "q3k" kernel, Q3_K at its own width; as the "q6m" kernel, with a min term, Q2_K)
// x int8 activations (GGUF's Q8_K), the plain-C interface shared by the ISA units.
//
// Owns: the packed layout (its two value planes, described once as a template parameter, `Planes`) and the
// arithmetic every path performs, described here once, and (for units compiled with AVX2 or AVX-512) the one
// rebuild of a chunk's values from the planes. Knows nothing of torch (the ISA units include only this header and
// intrin.h) or of how the blocks were read (kernels/ggml_blocks.py).
//
// Weights W [N, K], K a multiple of 256, N padded to NB = ceil(N / 16) blocks of 16 output columns. Each weight is
// w[n, k] = d[n, s] * sc[n, j] * (q[n, k] - OFF) with q an unsigned value of BITS = LB + HB bits and OFF = 2^(BITS - 1):
// Q6_K (kernel q6k, value_bits 6: LB 4, HB 2, OFF 32) and Q3_K (kernel q3k, value_bits 3: LB 2, HB 1, OFF 4: ggml's
// q3 = low 2 bits | high bit << 2, minus 4); sc int8 per sub-block j of 16 K values (Q3_K: its 6-bit scale - 32), d
// per super-block s of 256 (fp16 in the file, float32 here: exact). Group g = 32 K values = sub-blocks 2g, 2g + 1;
// chunk c (0-3) of a group: K values 4c..4c+3 (sub-block 2g, "half" 0) and 16 + 4c.. (sub-block 2g + 1, half 1).
// q = lo | hi << LB, lo (LB bits) in the low plane ql [NB, G, LB, 64] uint8 and hi (HB bits) in the high plane
// qh [NB, G, HB, 64] uint8. In a plane of B bits, value v = 2c + half of a chunk lies in byte row v * B / 8 at bit
// (v * B) % 8, byte i of each row of 64 belonging to column n = 16 b + i / 4 and K value t = i % 4 of the chunk:
//   Q6_K's ql [NB, G, 4, 64]: row c holds chunk c's half-0 values in its low nibble, half-1 in its high one (q4x8's
//   nibble layout); qh [NB, G, 2, 64]: row p holds, from bit 0 up, the top 2 bits of chunk 2p's half 0, half 1,
//   chunk 2p + 1's half 0, half 1. Q3_K's ql [NB, G, 2, 64] is laid out as Q6_K's qh; its qh [NB, G, 1, 64] holds
//   from bit 0 up the high bits of chunk 0's half 0, half 1, chunk 1's half 0, ... chunk 3's half 1.
//   sc [NB, G, 2, 16] int8 (sub-block 2g + h of column 16 b + i at [b, g, h, i]); d [NB, S, 16] float32.
// Activations X [M, K]: q4x8's Q8_K quantization (q4x8.h: per row and super-block, dx = amax / 127, q =
// round_half_even(x * 127 / amax)), stored q [G, M, 32], dx [S, M], plus per sub-block of 16 the integer sum
// qsum16 [S, M, 16] int16 (|qsum16| <= 16 * 127).
// Per output (m, n) and super-block s, with isum_j = sum over sub-block j of q[n, k] * q_x[m, k] (0 <= q <= 63,
// |isum_j| <= 16 * 63 * 127 = 128,016):
//   isc = sum_j sc_j * isum_j           int32, exact: |isc| <= 16 * 128 * 128,016 = 262,176,768
//   imn = sum_j sc_j * qsum16_j         int32, exact: |imn| <= 16 * 128 * 2,032 = 4,161,536
//   tot = isc - OFF * imn               int32, exact: |tot| <= 395,345,920 < 2^31
//   (the AVX-512 path starts each isum_j at -OFF * qsum16_j and multiplies by sc_j: the same exact tot)
//   then in super-block order, one rounding per operation, identically in every path:
//   t = (float) tot * d[n, s];  acc = fma(t, dx[s, m], acc);  y = acc + bias.
// tot is sum_j sc_j * sum_k (q - OFF) * q_x: for a Q3_K block, the one integer whichever layout holds its values
// (before q3k, Q3_K was held as Q6_K values q3 + 32 on q6k: the same tot, so the same bits).
// With a min term (the "q6m" kernel: GGUF Q2_K, w = d * sc_j * q - dmin * m_j, held as Q6_K values q + 32 with d and
// sc_j as above), two more buffers: mn [NB, G, 2, 16] int8 (m_j, laid out as sc) and dmin [NB, S, 16] float32 (fp16
// in the file: exact), and per super-block one more exact integer and one more float step right after t's:
//   B = sum_j m_j * qsum16_j            int32, exact: |B| <= 16 * 128 * 2,032 = 4,161,536
//   u = (float) B * dmin[n, s];  acc = fma(-u, dx[s, m], acc)   (fnmadd: bitwise fma(u', dx, acc) for u' = (float)
//   B * (-dmin), rounding being symmetric in sign)
// With mn null there is no min term: the Q6_K / Q3_K sequence above, the same code (a template parameter).
// Every integer sum is exact and the float steps are the same sequence, so a row never depends on M, on other rows
// or on the path (scalar, AVX2, AVX-512 agree bitwise).
#pragma once
#include <stdint.h>

extern "C" {

struct DwQ6 {
    const uint8_t* ql;  // [NB, G, 4, 64]
    const uint8_t* qh;  // [NB, G, 2, 64]
    const int8_t* sc;   // [NB, G, 2, 16]
    const float* d;     // [NB, S, 16]
    const float* bias;  // [N] or null
    int64_t N, K, G, S;
    const int8_t* mn;    // [NB, G, 2, 16] or null: the min term (q6m)
    const float* dmin;   // [NB, S, 16] (with mn)
    int64_t value_bits;  // 6: Q6_K's planes (ql [NB, G, 4, 64], qh [NB, G, 2, 64]); 3: Q3_K's ([NB, G, 2 / 1, 64])
};

struct DwQ8K16 {
    const int8_t* q;         // [G, M, 32]
    const float* dx;         // [S, M]
    const int16_t* qsum16;   // [S, M, 16]
    int64_t M;
};

// out [M, N] float32 for the 16-column blocks [b0, b1), all M rows
void dw_q6k_gemm_scalar(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1);
void dw_q6k_gemm_avx2(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1);
void dw_q6k_gemm_avx512(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1);

}

#if defined(__AVX2__)
#include "intrin.h"
#endif

namespace {
namespace dwq6k {

// A layout's two value planes (the header above): LB low bits and HB high bits per value, OFF its offset.
template <int LB_, int HB_>
struct Planes {
    static constexpr int LB = LB_, HB = HB_, BITS = LB_ + HB_, OFF = 1 << (LB_ + HB_ - 1);
    static constexpr int LOW = 64 * LB_, HIGH = 64 * HB_;  // bytes of each plane per 16-column block and group
    static constexpr int SHIFT = LB_ + HB_ - 1;           // OFF * x = x << SHIFT
};
using Q6Planes = Planes<4, 2>;  // Q6_K (and q6m's Q2_K)
using Q3Planes = Planes<2, 1>;  // Q3_K

// Value v = 2c + half of a chunk in a plane of B bits: its byte row (of 64 bytes) and bit.
constexpr int plane_row(int v, int B) { return v * B / 8; }
constexpr int plane_bit(int v, int B) { return v * B % 8; }

// f.template operator()<P, MIN>() for the weights' planes and min term: each ISA unit's one dispatch.
template <class Fn>
inline void by_layout(const DwQ6* w, Fn&& f) {
    if (w->value_bits == 3)
        f.template operator()<Q3Planes, false>();
    else
        w->mn ? f.template operator()<Q6Planes, true>() : f.template operator()<Q6Planes, false>();
}

// Value v of a chunk for the byte i of its rows (the scalar path): lo | hi << LB.
template <class P>
inline int32_t value_at(const uint8_t* L, const uint8_t* H, int v, int64_t i) {
    const int32_t lo = (L[plane_row(v, P::LB) * 64 + i] >> plane_bit(v, P::LB)) & ((1 << P::LB) - 1);
    const int32_t hi = (H[plane_row(v, P::HB) * 64 + i] >> plane_bit(v, P::HB)) & ((1 << P::HB) - 1);
    return lo | (hi << P::LB);
}

#if defined(__AVX2__)
template <int S, class U>  // each 16-bit lane of a shifted left by S (right by -S)
inline U shift16(U a) {
    if constexpr (S > 0) return a << S;
    else if constexpr (S < 0) return a >> -S;
    else return a;
}

// Value v = 2c + half of chunk c as bytes (one per column and t, the layout of a plane row) in a vector Vec
// (__m256i, __m512i), from the group's planes L and H (advanced to the vector's first byte: the AVX2 path's half of
// 8 columns at + 32); written once for both widths with GCC's vector extensions. Shifts are per 16-bit lane: the
// bits a shift carries over from the lane's other byte never reach the masked ones (a value's plane_bit is at most
// 8 - B, and the high bits land below BITS <= 6). For the GEMVs (q6k_avx2.cpp, q6k_avx512.cpp) and the AMX side's
// B tiles (gemm_q6k_amx.cpp) alike.
template <class P, int V, class Vec>
inline Vec values(const uint8_t* L, const uint8_t* H) {
    typedef unsigned short U16 __attribute__((vector_size(sizeof(Vec))));
    typedef unsigned char U8 __attribute__((vector_size(sizeof(Vec))));
    U16 lo, hi;
    __builtin_memcpy(&lo, L + plane_row(V, P::LB) * 64, sizeof(Vec));
    __builtin_memcpy(&hi, H + plane_row(V, P::HB) * 64, sizeof(Vec));
    const U8 l = (U8)shift16<-plane_bit(V, P::LB)>(lo) & (unsigned char)((1 << P::LB) - 1);
    const U8 h = (U8)shift16<P::LB - plane_bit(V, P::HB)>(hi) & (unsigned char)(((1 << P::HB) - 1) << P::LB);
    return (Vec)(l | h);
}

// f.template operator()<C>() for the chunks C = 0..3 in order (compile-time shifts per chunk)
template <class Fn>
inline void each_chunk(Fn&& f) {
    f.template operator()<0>();
    f.template operator()<1>();
    f.template operator()<2>();
    f.template operator()<3>();
}
#endif

}  // namespace dwq6k
}  // namespace

// Row-exact decode/verification attention: the plain-C interface shared by the ISA translation units.
//
// Owns: the argument block and the float sequence of one query, described here once (attention_kernel.h is its
// portable implementation and the oracle; the AVX2 and AVX-512 units perform the very same operations with
// intrinsics, so those paths agree bitwise). The AMX unit (attention_amx.cpp, bf16 K/V on AMX-BF16 CPUs, taken by
// 'auto' at every width) computes the dot products and P V on bf16 tiles instead: its own fixed sequence, row-exact
// in the same sense, not bitwise the others (its header says why). Knows nothing of torch (the ISA units include
// only this header, attention_kernel.h and intrin.h), of models or of speculation.
//
// Work item (b, t, h): query t of sequence b, head h; kv head g = h / (H / Hkv) (GQA). It attends over exactly
// the keys at positions [start, end) of sequence b: end = first[b] + t + 1, start = max(0, end - window) when
// window > 0, else 0. Items with t >= ntok[b] (padding) write zeros.
// Paged K/V (kv_cache.py): the layer's cache is a pool of pages [P, Hkv, BS, D]; position p of sequence b lives
// in page tables[b * nb + p / BS], row p % BS. Where the pages sit changes no float operation (keys are visited
// in position order whatever page holds them). The SIMD paths read keys in 16-position blocks aligned to 16, so
// BS is a multiple of 16, or a sequence holds one page (nb == 1: the contiguous layout, one page per slot).
// The float sequence of one item (fp32 throughout; bf16 inputs — q, or K/V, or both — are widened exactly, a bf16
// output is rounded to nearest even once at the end), with L = end - start, j = 0..L-1 counted from start, 16 "lanes":
//   s_j   = dot(q, k_j) * scale,  dot = lanes l = i mod 16 accumulated in i order, a[l] = fma(q_i, k_i, a[l]) (a
//           tail after the last whole 16 goes to lanes 0..), then lanes folded 8+8, 4+4, 2+2, 1+1 (a[l] += a[l + w]);
//   m     = max_j s_j;
//   p_j   = dw_exp(s_j - m) (cephes_exp.h's Cephes expf of max(x, -80); 0 below -80);
//   sum   = the p_j in lanes l = j mod 16 (j order), folded like dot;
//   o[d]  = acc[d] / sum, acc[d] = fma(p_j, v_j[d], acc[d]) over j in order, starting from 0.
// Every product-accumulate is one fused multiply-add (exactly rounded, so the same bits in every path: the
// compilers' own contraction stays off, -ffp-contract=off) and nothing is reassociated: it depends only on the
// query, its keys and its values, never on B, T, the other items or how items are split among threads. (The
// fused steps halve the floating-point instructions of a long prompt's attention, at the compute roof.)
// Tree rows (anc != null; token-tree verification): row t of sequence b attends the cache's keys before the
// chunk, then the chunk rows i whose bit i is set in anc[b * T + t] (its ancestors and itself), in row order; the
// "keys j" above are that list (a sliding window keeps its last `window`). Parents precede children, so a node's
// list is its path's chain list and its result is bitwise the chain forward's row for it.
#pragma once
#include <stdint.h>

extern "C" {

enum DwAttnDtype { DW_ATTN_F32 = 0, DW_ATTN_BF16 = 1 };

struct DwAttnArgs {
    const void* q;            // [B, H, T, D] with strides q_sb, q_sh, q_st (elements); D contiguous
    int64_t q_sb, q_sh, q_st;
    const void* k;            // the layer's page pool [P, Hkv, BS, D] with strides kv_ss, kv_sh, kv_sc; D contiguous
    const void* v;            // same shape and strides as k
    int64_t kv_ss, kv_sh, kv_sc;
    void* out;                // [B, T, H, D] contiguous
    const int64_t* tables;    // [B, nb] each sequence's pages, in position order
    int64_t nb, bs;           // pages per table row, positions per page (BS)
    const int64_t* first;     // [B] position of each sequence's first query
    const int64_t* ntok;      // [B] real queries per sequence (<= T)
    int64_t B, T, H, Hkv, D;
    float scale;
    int64_t window;           // 0: attend from position 0
    int64_t dtype;            // DwAttnDtype of q and out
    int64_t kv_dtype;         // DwAttnDtype of k and v (bf16 K/V under float32 queries: widened exactly)
    const uint64_t* anc;      // [B, T] ancestor masks of tree rows (T <= 64), or null: every row a chain row
    int64_t max_len;          // the most keys any query attends (what the scratch was sized for)
};

// Items [i0, i1) in the order (b, g, t, h within g): consecutive items share keys. scratch: at least
// dw_attn_scratch_floats(max L, D) floats, owned by the calling thread.
void dw_attn_rows_scalar(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch);
void dw_attn_rows_avx2(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch);
void dw_attn_rows_avx512(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch);
// The AMX path (attention_amx.cpp): bf16 K/V, D % 32 == 0, D <= 256; scratch: dw_attn_amx_scratch_floats floats.
void dw_attn_rows_amx(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch);

}

// The SIMD paths attend up to this many consecutive items of one (b, g) together (one pass over the keys and
// values serves them all; see attention_avx512.cpp).
#define DW_ATTN_QBLOCK 16

static inline int64_t dw_attn_scratch_floats(int64_t max_len, int64_t D) {
    const int64_t dp = (D + 15) / 16 * 16;  // per query: q row, accumulator, scores with 16 floats either side
    return DW_ATTN_QBLOCK * (2 * dp + (max_len + 15) / 16 * 16 + 32);
}

// The AMX path's scratch: dw_attn_scratch_floats' part, then (64-byte aligned) a pass's three score tiles, the
// queries' bf16 tiles, a key block copied and four value chunks of a pair of key blocks, and for every key
// block a query block spans (its queries' ranges differ by at most QB positions) P's hi / lo tiles and the packed
// values and keys (attention_amx.cpp Work).
static inline int64_t dw_attn_amx_scratch_floats(int64_t max_len, int64_t D) {
    return dw_attn_scratch_floats(max_len, D) + 16 + 768 + D / 32 * 512 + 8 * D + 1024 +
           (256 + 16 * D) * ((max_len + 15) / 16 + 5);
}

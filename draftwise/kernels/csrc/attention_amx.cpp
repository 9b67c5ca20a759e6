// Row-exact attention, AMX path: q K^T and P V on bfloat16 tiles (TDPBF16PS) for bfloat16 K/V, head_dim a multiple
// of 32 (at most 256). Compiled with -mamx-tile -mamx-bf16 and the AVX-512 flags of attention_avx512.cpp, and
// called only after attention.cpp's checks (cpuid AMX-TILE + AMX-BF16 + AVX-512, no $DRAFTWISE_MAX_ISA cap, and the
// process's permission for tile data).
//
// Not bitwise the other paths: TDPBF16PS does not round like a chain of fp32 fused multiply-adds (measured on
// Sapphire Rapids: ~23% of random 32-term dot products differ from a sequential fp32 emulation with DAZ/FTZ, and
// from a pairwise one, in the last bits), so no SIMD path can reproduce it. It is row-exact on its own terms instead
// ('auto' takes it for every width on a machine that has it, decode width 1 included): every float a query's row
// depends on is computed from that query's row alone, in a sequence fixed by its own key positions —
//   s_j  = S[j] * scale, where per absolute 16-position key block the tile C = sum over 32-dim chunks t of
//          Qhi_t K_t^T, then Qlo_t K_t^T (q = qhi + qlo, both bfloat16 rounded to nearest even; C[query][key]
//          depends only on that query's row and that key's column). Calls with many query blocks per (b, kv head)
//          (prompts, wide verification) pack K into B tiles once and compute C[query][key]; others (decode, token
//          trees) read K in place as A tiles and compute C[key][query] = K_t Qhi_t^T, then K_t Qlo_t^T: the same
//          products in the same order per element, and TDPBF16PS gives bitwise the same scores either way (measured on
//          Sapphire Rapids: 0 of 5.1 M random scores differ; test_kernels_attention_amx.py checks rows across widths,
//          which take both);
//   m, p_j = exp(s_j - m) and their sum: attention_avx512.h's Steps::softmax_weights, unchanged;
//   o    = acc / sum, acc = per absolute 32-position pair of key blocks in position order, the tile C += Phi V,
//          then C += Plo V, each one TDPBF16PS over the pair's 32 keys (p = phi + plo, bfloat16 each): each row of
//          C depends only on that query's row of P; keys the query does not attend (other queries' keys in a shared
//          block, or past the cache's end: zero rows) have p = 0.
// Splitting q and p in two keeps each product near fp32 precision (a bf16 x bf16 product is exact in fp32).
// A token-tree row sees its ancestors at the positions its chain would give them (first + n for the n-th), copied
// into the block it would occupy, so it is bitwise its chain row (attention.h).
// Owns the tile loops, the bfloat16 splits and the tile layouts; knows nothing of torch, threads or when it runs.
// Includes no C++ library header.
#include "amx_config.h"
#include "attention_avx512.h"

namespace {
namespace dwamx {

using dwattn::Block;
using dwattn::QB;

// Scores from packed keys, three key blocks a pass: tiles 0-2 = C [16 queries][16 keys] fp32, 3 / 4 = a 32-dim
// chunk of the queries' hi / lo parts [16 queries][32 bf16], 5-7 = that chunk of each key block in VNNI layout
// [16 dim pairs][16 keys][2]. Scores from keys in place: tile 0 = C [16 keys][16 queries], 1 = a key block's
// 32-dim chunk [16 keys][32 bf16], 2 / 3 = that chunk of the queries' hi / lo parts in VNNI layout [16 dim pairs]
// [16 queries][2].
// Values: tiles 0-3 = C [16 queries][16 dims] fp32 (4 dim chunks a pass), 4 / 5 = P's hi / lo parts of a pair of
// key blocks [16 queries][32 keys] bf16, 6 / 7 = that pair's values, one 16-dim chunk in VNNI layout [16 key
// pairs][16 dims][2]. Every tile 16 rows x 64 bytes (amx_config.h's dw_configure_tiles).

// fp32 bits -> bf16 bits, round to nearest even (finite inputs; lanes of 32 bits, result in the low half)
inline __m512i to_bf16(__m512i u) {
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
}

// x = hi + lo (+ what bfloat16 lo cannot hold): hi = bf16(x), lo = bf16(x - hi); x - hi is exact in fp32
inline void split16(__m512 x, __m256i& hi, __m256i& lo) {
    const __m512i h = to_bf16(_mm512_castps_si512(x));
    const __m512 rest = _mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
    hi = _mm512_cvtepi32_epi16(h);
    lo = _mm512_cvtepi32_epi16(to_bf16(_mm512_castps_si512(rest)));
}

// Per-thread buffers, carved from the caller's scratch past dwattn::gather's part (dw_attn_amx_scratch_floats).
struct Work {
    uint16_t* q;   // [D / 32][2 (hi, lo)]: the block's queries as A tiles [16 queries][32 dims] (packed keys) or
                   // as B tiles [16 dim pairs][16 queries][2] (keys in place)
    bool packed;   // keys packed once per (b, kv head) (chain calls with more than one query block per (b, g))
    uint16_t* p;   // [key block pairs][2 (hi, lo)][16 queries][32 keys]: P as A tiles
    uint16_t* k;   // [16][D]: a key block copied where it cannot be read in place (zero rows where no query looks)
    uint32_t* v;   // [4][16 key pairs][16 dims]: a tree block pair's value chunks of one pass, VNNI layout
    float* c;      // [3][16][16]: a pass's score tiles
    // Chain calls: one (b, kv head)'s key and value blocks from position lo (a multiple of 32) on, in VNNI layout,
    // packed once for all its query blocks (rows before lo_exact or past the sequence's last position zero):
    //   kr [D / 32 chunks][cap blocks][16 dim pairs][16 keys]: one B tile per chunk and block;
    //   vr [D / 16 chunks][cap blocks][8 key pairs][16 dims]: a pair of consecutive blocks' chunk is one B tile.
    // bg = b * Hkv + g whose blocks these are (-1: none yet), cap = blocks of room (even).
    uint32_t* kr;
    uint32_t* vr;
    int64_t bg, lo, lo_exact, hi, cap;
};

// The queries of one block, as this path sees them: query u attends the keys at positions [start[u], start[u] +
// L[u]) of its sequence (a tree row: its chain's positions, `mask` mapping them to cache rows).
struct Keys {
    int64_t lo, hi;   // union of the queries' ranges
    int64_t first;    // the chunk's first position
    uint64_t mask;    // a tree block's ancestor mask (all its queries share one row t), or 0: chain rows
    int64_t in_lo, in_hi;  // intersection of the queries' ranges (empty when in_lo >= in_hi)

    // Every query of the block attends all 16 keys of the block at ab (no per-query masks needed).
    bool whole(int64_t ab) const { return ab >= in_lo && ab + 16 <= in_hi; }
};

// The cache row (K: h = Kh, V: h = Vh) a query of the block sees at position p.
inline const uint16_t* row_at(const Block<uint16_t>& blk, const Keys& ks, const uint16_t* h, int64_t p) {
    if (ks.mask && p >= ks.first) p = ks.first + dwattn::tree_row(ks.mask, p - ks.first);
    return dwattn::at(h, blk.q[0], p);
}

// The rows of the key block at ab: rows[r] for position ab + r, null where no query of the block attends it.
// True when all 16 are the cache's consecutive rows (the block can be read in place, at the cache's row stride).
inline bool block_rows(const Block<uint16_t>& blk, const Keys& ks, const uint16_t* h, int64_t ab, const uint16_t** rows) {
    bool direct = !(ks.mask && ab + 16 > ks.first);
    for (int r = 0; r < 16; ++r) {
        const int64_t p = ab + r;
        rows[r] = p >= ks.lo && p < ks.hi ? row_at(blk, ks, h, p) : nullptr;
        direct = direct && rows[r] != nullptr;
    }
    return direct;
}

// The queries' rows, the hi and lo parts of each 32-dim chunk, as A tiles [16 queries][32 dims] (for packed keys)
// or, AsB, as B tiles in VNNI layout [16 dim pairs][16 queries][2] (for keys read in place); absent queries zero.
template <bool AsB>
inline void pack_queries(const Block<uint16_t>& blk, int64_t D, uint16_t* qt) {
    for (int64_t i = 0; i < D / 32 * 1024; i += 32) _mm512_storeu_si512((void*)(qt + i), _mm512_setzero_si512());
    for (int u = 0; u < blk.n; ++u)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m256i hi, lo;
            split16(_mm512_loadu_ps(blk.qf[u] + d0), hi, lo);
            if constexpr (!AsB) {
                uint16_t* row = qt + d0 / 32 * 1024 + u * 32 + d0 % 32;
                _mm256_storeu_si256((__m256i*)row, hi);
                _mm256_storeu_si256((__m256i*)(row + 512), lo);
            } else {
                alignas(32) uint16_t h[16], l[16];
                _mm256_store_si256((__m256i*)h, hi);
                _mm256_store_si256((__m256i*)l, lo);
                for (int i = 0; i < 16; ++i) {
                    const int64_t d = d0 + i, t = d / 32, k = (d % 32) / 2;
                    uint16_t* tile = qt + t * 1024;
                    tile[k * 32 + u * 2 + d % 2] = h[i];
                    tile[512 + k * 32 + u * 2 + d % 2] = l[i];
                }
            }
        }
}

// A key block (rows[0..15], null rows zero) as B tiles in VNNI layout, chunk t at out + t * chunk_stride:
// dword [pair p][key n] = dims 32 t + 2 p, 32 t + 2 p + 1 of key n (a 16 x 16 dword transpose per chunk).
inline void pack_keys(const uint16_t* const* rows, int64_t D, uint32_t* out, int64_t chunk_stride) {
    alignas(64) uint32_t tmp[16][16];
    const __m512i across = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    for (int64_t t = 0; t < D / 32; ++t) {
        for (int n = 0; n < 16; ++n)
            _mm512_store_si512((void*)tmp[n], rows[n] ? _mm512_loadu_si512((const void*)(rows[n] + 32 * t)) : _mm512_setzero_si512());
        uint32_t* o = out + t * chunk_stride;
        for (int p = 0; p < 16; ++p)
            _mm512_storeu_si512((void*)(o + p * 16), _mm512_i32gather_epi32(_mm512_add_epi32(across, _mm512_set1_epi32(p)), tmp, 4));
    }
}

// Query u's keys in the block at ab, as a lane mask (0: none). The common case, a block no query's range starts or
// ends in, is all 16 without looking at u.
inline __mmask16 keys_of(const Block<uint16_t>& blk, const Keys& ks, int u, int64_t ab) {
    if (ks.whole(ab)) return (__mmask16)0xFFFF;
    const int64_t st = blk.start[u], en = st + blk.q[u].L;
    const int lo = st > ab ? (int)(st - ab) : 0, hi = en - ab < 16 ? (int)(en - ab) : 16;
    return lo < hi ? (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u)) : (__mmask16)0;
}

// One score tile row: query u's s_j for the key block at ab (x: the block's 16 raw scores), into blk.s[u] and vmax[u]
inline void take_scores(Block<uint16_t>& blk, const Keys& ks, int u, int64_t ab, __m512 x, __m512 vscale, __m512* vmax) {
    const __mmask16 keep = keys_of(blk, ks, u, ab);
    if (!keep) return;
    x = _mm512_mul_ps(x, vscale);
    _mm512_mask_storeu_ps(blk.s[u] + (ab - blk.start[u]), keep, x);  // s[u] has 16 floats of room before it
    vmax[u] = _mm512_mask_max_ps(vmax[u], keep, vmax[u], x);
}

// Every query's s_j (into blk.s[u], scaled) and its max from the keys packed once (w.kr, chain rows), three key
// blocks a pass (each chunk's query tiles loaded once for the three).
void scores_packed(const DwAttnArgs* a, Block<uint16_t>& blk, const Keys& ks, int64_t a_lo, int64_t nblk, Work& w, float* mx) {
    const int64_t D = a->D;
    const __m512 vscale = _mm512_set1_ps(a->scale);
    __m512 vmax[QB];
    for (int u = 0; u < blk.n; ++u) vmax[u] = _mm512_set1_ps(-__builtin_inff());
    const int64_t cs = w.cap * 256;  // block i's chunk t at kt + t * cs + 256 i
    for (int64_t kb = 0; kb < nblk; kb += 3) {
        const int nb = nblk - kb < 3 ? (int)(nblk - kb) : 3;
        const uint32_t* kt = w.kr + (a_lo + 16 * kb - w.lo) / 16 * 256;
        _tile_zero(0);
        if (nb > 1) _tile_zero(1);
        if (nb > 2) _tile_zero(2);
        for (int64_t t = 0; t < D / 32; ++t) {
            _tile_loadd(3, w.q + t * 1024, 64);
            _tile_loadd(4, w.q + t * 1024 + 512, 64);
            _tile_loadd(5, kt + t * cs, 64);
            _tile_dpbf16ps(0, 3, 5);
            _tile_dpbf16ps(0, 4, 5);
            if (nb > 1) {
                _tile_loadd(6, kt + t * cs + 256, 64);
                _tile_dpbf16ps(1, 3, 6);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (nb > 2) {
                _tile_loadd(7, kt + t * cs + 512, 64);
                _tile_dpbf16ps(2, 3, 7);
                _tile_dpbf16ps(2, 4, 7);
            }
        }
        _tile_stored(0, w.c, 64);
        if (nb > 1) _tile_stored(1, w.c + 256, 64);
        if (nb > 2) _tile_stored(2, w.c + 512, 64);
        for (int i = 0; i < nb; ++i)  // row u of tile i: query u's scores for block kb + i
            for (int u = 0; u < blk.n; ++u)
                take_scores(blk, ks, u, a_lo + 16 * (kb + i), _mm512_load_ps(w.c + 256 * i + 16 * u), vscale, vmax);
    }
    for (int u = 0; u < blk.n; ++u) mx[u] = _mm512_reduce_max_ps(vmax[u]);
}

// The same scores with the keys read in place (copied where a block's rows are not the cache's consecutive rows),
// one key block a pass: C[key][query], column u gathered for query u.
void scores_in_place(const DwAttnArgs* a, Block<uint16_t>& blk, const Keys& ks, int64_t a_lo, int64_t nblk, Work& w,
                     float* mx) {
    const int64_t D = a->D, sc = blk.q[0].sc;
    const __m512 vscale = _mm512_set1_ps(a->scale);
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    __m512 vmax[QB];
    for (int u = 0; u < blk.n; ++u) vmax[u] = _mm512_set1_ps(-__builtin_inff());
    const uint16_t* rows[16];
    for (int64_t kb = 0; kb < nblk; ++kb) {
        const int64_t ab = a_lo + 16 * kb;
        const uint16_t* kp = w.k;
        int64_t stride = D * 2;
        if (block_rows(blk, ks, blk.q[0].Kh, ab, rows)) {
            kp = rows[0];
            stride = sc * 2;
        } else {
            for (int r = 0; r < 16; ++r)
                for (int64_t d = 0; d < D; d += 32)
                    _mm512_storeu_si512((void*)(w.k + r * D + d),
                                        rows[r] ? _mm512_loadu_si512((const void*)(rows[r] + d)) : _mm512_setzero_si512());
        }
        _tile_zero(0);
        for (int64_t t = 0; t < D / 32; ++t) {
            _tile_loadd(1, kp + t * 32, stride);
            _tile_loadd(2, w.q + t * 1024, 64);
            _tile_loadd(3, w.q + t * 1024 + 512, 64);
            _tile_dpbf16ps(0, 1, 2);
            _tile_dpbf16ps(0, 1, 3);
        }
        _tile_stored(0, w.c, 64);
        for (int u = 0; u < blk.n; ++u)  // column u of the tile: query u's scores for the block's keys
            take_scores(blk, ks, u, ab, _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(u)), w.c, 4),
                        vscale, vmax);
    }
    for (int u = 0; u < blk.n; ++u) mx[u] = _mm512_reduce_max_ps(vmax[u]);
}

// P (softmax weights, in blk.s) as hi / lo A tiles per pair of key blocks (positions a_lo2 + 32 kp ..); zero
// where a query does not attend the key.
void pack_weights(const Block<uint16_t>& blk, const Keys& ks, int64_t a_lo2, int64_t npair, uint16_t* pt) {
    for (int64_t kp = 0; kp < npair; ++kp) {
        uint16_t* tile = pt + kp * 1024;
        for (int h = 0; h < 2; ++h) {
            const int64_t ab = a_lo2 + 32 * kp + 16 * h;
            for (int u = 0; u < 16; ++u) {
                __m256i hi = _mm256_setzero_si256(), lo = _mm256_setzero_si256();
                const __mmask16 keep = u < blk.n ? keys_of(blk, ks, u, ab) : (__mmask16)0;
                if (keep) split16(_mm512_maskz_loadu_ps(keep, blk.s[u] + (ab - blk.start[u])), hi, lo);
                _mm256_storeu_si256((__m256i*)(tile + u * 32 + 16 * h), hi);
                _mm256_storeu_si256((__m256i*)(tile + 512 + u * 32 + 16 * h), lo);
            }
        }
    }
}

// 16-dim chunk dc of 16 key pairs (rows[0..31]) in VNNI layout: pair k, dim i = (v[2k][i], v[2k + 1][i]); null
// rows are zero.
inline void pack_values(const uint16_t* const* rows, int64_t dc, uint32_t* out) {
    for (int k = 0; k < 16; ++k) {
        const uint16_t* r0 = rows[2 * k];
        const uint16_t* r1 = rows[2 * k + 1];
        const __m512i x = r0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r0 + 16 * dc))) : _mm512_setzero_si512();
        const __m512i y = r1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(r1 + 16 * dc))) : _mm512_setzero_si512();
        _mm512_storeu_si512((void*)(out + k * 16), _mm512_or_si512(x, _mm512_slli_epi32(y, 16)));
    }
}

// One chunk step: C[c] += Phi V_c, then += Plo V_c, V_c the packed chunk at src (GCC's tile intrinsics paste their
// tile ids into the assembly text, so they must be literal numbers: hence a macro)
#define DW_AMX_VALUE_STEP(C, V, src) \
    do {                             \
        _tile_loadd(V, src, 64);     \
        _tile_dpbf16ps(C, 4, V);     \
        _tile_dpbf16ps(C, 5, V);     \
    } while (0)

// Chain calls: w.vr (and w.kr where w.packed) hold the value (key) blocks [ks.lo rounded down to 32, ks.hi) of
// (b, kv head) bg, packed; block pairs past w.hi are packed now, and a new (b, kv head), a range starting before
// w.lo_exact or one past w.cap starts over. Which rows hold zeros changes no result: a key a query does not attend
// is masked out of its scores, and its p is 0.
void pack_chain(const Block<uint16_t>& blk, const Keys& ks, int64_t bg, int64_t end, int64_t D, Work& w) {
    if (w.bg != bg || ks.lo < w.lo_exact || (ks.hi - w.lo + 31) / 32 * 2 > w.cap) {
        w.bg = bg;
        w.lo_exact = ks.lo;
        w.lo = w.hi = ks.lo - ks.lo % 32;
    }
    const uint16_t* rows[32];
    auto pair_rows = [&](const uint16_t* h) {  // the pair's 32 cache rows of K (h = Kh) or V (h = Vh)
        for (int r = 0; r < 32; ++r) {
            const int64_t p = w.hi + r;
            rows[r] = p >= w.lo_exact && p < end ? dwattn::at(h, blk.q[0], p) : nullptr;
        }
    };
    for (; w.hi < ks.hi; w.hi += 32) {
        const int64_t b0 = (w.hi - w.lo) / 16;  // the pair's first block
        if (w.packed) {
            pair_rows(blk.q[0].Kh);
            pack_keys(rows, D, w.kr + b0 * 256, w.cap * 256);
            pack_keys(rows + 16, D, w.kr + (b0 + 1) * 256, w.cap * 256);
        }
        pair_rows(blk.q[0].Vh);
        for (int64_t dc = 0; dc < D / 16; ++dc) pack_values(rows, dc, w.vr + (dc * w.cap + b0) * 128);
    }
}

// acc[u] (rows of stride dp floats from acc0) = sum over pairs of key blocks of P V, four 16-dim chunks a pass.
void values(const Block<uint16_t>& blk, const Keys& ks, int64_t D, int64_t a_lo2, int64_t npair, Work& w, float* acc0,
            int64_t dp) {
    const int64_t ndc = D / 16;
    const uint16_t* rows[32];
    for (int64_t c0 = 0; c0 < ndc; c0 += 4) {
        const int64_t nc = ndc - c0 < 4 ? ndc - c0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kp = 0; kp < npair; ++kp) {
            const int64_t ab = a_lo2 + 32 * kp;
            _tile_loadd(4, w.p + kp * 1024, 64);
            _tile_loadd(5, w.p + kp * 1024 + 512, 64);
            if (!ks.mask) {  // chain rows: the blocks packed once (pack_chain), chunk-major
                const int64_t cs = w.cap * 128;  // one chunk to the next
                const uint32_t* vb = w.vr + c0 * cs + (ab - w.lo) / 16 * 128;
                DW_AMX_VALUE_STEP(0, 6, vb);
                if (nc > 1) DW_AMX_VALUE_STEP(1, 7, vb + cs);
                if (nc > 2) DW_AMX_VALUE_STEP(2, 6, vb + 2 * cs);
                if (nc > 3) DW_AMX_VALUE_STEP(3, 7, vb + 3 * cs);
                continue;
            }
            block_rows(blk, ks, blk.q[0].Vh, ab, rows);  // a tree row's blocks: its own, packed here
            block_rows(blk, ks, blk.q[0].Vh, ab + 16, rows + 16);
            for (int64_t c = 0; c < nc; ++c) pack_values(rows, c0 + c, w.v + c * 256);
            DW_AMX_VALUE_STEP(0, 6, w.v);
            if (nc > 1) DW_AMX_VALUE_STEP(1, 7, w.v + 256);
            if (nc > 2) DW_AMX_VALUE_STEP(2, 6, w.v + 512);
            if (nc > 3) DW_AMX_VALUE_STEP(3, 7, w.v + 768);
        }
        const int64_t stride = dp * 4;
        _tile_stored(0, acc0 + 16 * c0, stride);
        if (nc > 1) _tile_stored(1, acc0 + 16 * (c0 + 1), stride);
        if (nc > 2) _tile_stored(2, acc0 + 16 * (c0 + 2), stride);
        if (nc > 3) _tile_stored(3, acc0 + 16 * (c0 + 3), stride);
    }
}

// One block of items [i0, i0 + n) of one (b, kv head) (a tree block: also one row t), start to end.
void attend_block(const DwAttnArgs* a, int64_t i0, int n, float* scratch, Work& w) {
    Block<uint16_t> blk;
    if (!dwattn::gather(a, i0, n, scratch, blk)) return;
    const int64_t D = a->D, dp = (D + 15) / 16 * 16;
    Keys ks{blk.start[0], blk.start[0] + blk.q[0].L, blk.q[0].first, 0, blk.start[0], blk.start[0] + blk.q[0].L};
    for (int u = 1; u < blk.n; ++u) {
        const int64_t st = blk.start[u], en = st + blk.q[u].L;
        ks.lo = st < ks.lo ? st : ks.lo;
        ks.hi = en > ks.hi ? en : ks.hi;
        ks.in_lo = st > ks.in_lo ? st : ks.in_lo;
        ks.in_hi = en < ks.in_hi ? en : ks.in_hi;
    }
    if (a->anc) {  // the row's own mask, before query() dropped the ancestors a sliding window skips
        const int64_t G = a->H / a->Hkv, t = (i0 / G) % a->T, b = i0 / (G * a->T * a->Hkv);
        ks.mask = a->anc[b * a->T + t];
    }
    const int64_t a_lo = ks.lo - ks.lo % 16, nblk = (ks.hi - a_lo + 15) / 16;
    const int64_t a_lo2 = ks.lo - ks.lo % 32, npair = (ks.hi - a_lo2 + 31) / 32;  // P V by absolute pairs of blocks
    float mx[QB], total[QB];
    if (!ks.mask) {
        const int64_t bg = i0 / (a->T * (a->H / a->Hkv)), b = bg / a->Hkv;
        pack_chain(blk, ks, bg, a->first[b] + a->ntok[b], D, w);
    }
    if (w.packed) {  // never a tree call (dw_attn_rows_amx)
        pack_queries<false>(blk, D, w.q);
        scores_packed(a, blk, ks, a_lo, nblk, w, mx);
    } else {
        pack_queries<true>(blk, D, w.q);
        scores_in_place(a, blk, ks, a_lo, nblk, w, mx);
    }
    for (int u = 0; u < blk.n; ++u) total[u] = Steps::softmax_weights(blk.s[u], blk.q[u].L, mx[u]);
    pack_weights(blk, ks, a_lo2, npair, w.p);
    float* acc0 = scratch + QB * dp;  // gather's accumulators: blk.acc[u] = acc0 + u * dp (QB rows of room)
    values(blk, ks, D, a_lo2, npair, w, acc0, dp);
    for (int u = 0; u < blk.n; ++u) dwattn::store_row(a, blk.q[u].o, blk.acc[u], total[u]);
}

}  // namespace dwamx
}  // namespace

// Items [i0, i1) as query blocks: chain rows as the SIMD paths group them (dwattn::for_each_block), tree rows one
// row t at a time (the G heads of a kv head share its ancestor list). Bfloat16 K/V, D % 32 == 0, D <= 256 only.
extern "C" void dw_attn_rows_amx(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    const int64_t D = a->D;
    float* base = scratch + dw_attn_scratch_floats(a->max_len, D);  // past gather's part (dw_attn_amx_scratch_floats)
    const uintptr_t mis = (uintptr_t)base & 63u;
    base += mis ? (64 - mis) / 4 : 0;
    dw_configure_tiles();
    dwamx::Work w;
    w.c = base;
    w.q = (uint16_t*)(base + 768);
    w.k = w.q + D / 32 * 1024;
    w.v = (uint32_t*)(w.k + 16 * D);
    w.cap = (a->max_len + 15) / 16 + 4;
    w.cap += w.cap & 1;  // whole pairs of blocks
    w.p = (uint16_t*)(w.v + 1024);
    w.vr = (uint32_t*)(w.p + 512 * w.cap);
    w.kr = w.vr + 8 * D * w.cap;
    // keys packed where a (b, kv head) has more than one query block in the call: its packing then serves them all
    w.packed = !a->anc && a->T * (a->H / a->Hkv) > dwattn::QB;
    w.bg = -1;
    w.lo = w.lo_exact = w.hi = 0;
    const int64_t G = a->H / a->Hkv;
    if (a->anc) {
        for (int64_t i = i0; i < i1;) {
            const int64_t e0 = (i / G + 1) * G < i1 ? (i / G + 1) * G : i1;
            const int64_t e = e0 - i > dwattn::QB ? i + dwattn::QB : e0;
            dwamx::attend_block(a, i, (int)(e - i), scratch, w);
            i = e;
        }
    } else {
        dwattn::for_each_block(a, i0, i1, [&](int64_t j0, int n) { dwamx::attend_block(a, j0, n, scratch, w); });
    }
    _tile_release();
}

// Row-exact attention: the portable implementation of the float sequence documented in attention.h — the
// baseline path (compiled into the main unit without -m flags), the path for a head_dim that is not a multiple
// of 16, and the oracle of the SIMD paths. Owns also what those paths share: its helpers (load, store, exp_nonpos,
// fold), the driver they run their query blocks through (run_blocks: Block, gather, span, for_spans, attend_block,
// for_each_block), and the softmax and value steps written once over a path's vector lanes (LaneSteps,
// DW_ATTN_LANES), so each path supplies only its lanes and its score loop over 16-key blocks. Knows nothing of
// torch, threads or which path runs.
//
// Written lane by lane (arrays of 16 floats, every lane an independent chain), so -O3 may vectorize it at any
// width without reordering a single float operation (-ffp-contract=off: no fused multiply-add the source does not
// write; each product-accumulate is written as one, `fmadd`, exactly rounded wherever it runs: a VFMADD in the
// AVX2 / AVX-512 units, libm's fmaf in the baseline unit).
// Everything here has internal linkage and no C++ library header is included, so nothing compiled with
// AVX-512 flags can be merged into code that runs on an AVX2-only CPU.
#pragma once
#include <stdint.h>
#include "attention.h"
#include "cephes_exp.h"

namespace {
namespace dwattn {

constexpr int LANES = 16;

inline float bits_to_f32(uint32_t u) {
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    return u;
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bits_to_f32((uint32_t)p[i] << 16); }  // bf16: exact

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x);

// The output row o [D] (float32, or bfloat16 when the call's dtype is): acc[d] / div (div = 1: acc as it is).
inline void store_row(const DwAttnArgs* a, void* o, const float* acc, float div) {
    if (a->dtype == DW_ATTN_BF16)
        for (int64_t d = 0; d < a->D; ++d) store((uint16_t*)o, d, acc[d] / div);
    else
        for (int64_t d = 0; d < a->D; ++d) store((float*)o, d, acc[d] / div);
}
inline void store(uint16_t* p, int64_t i, float x) {  // fp32 -> bf16, round to nearest even (NaN stays NaN)
    uint32_t u = f32_to_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        p[i] = (uint16_t)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (uint16_t)(u >> 16);
}

// exp(x) for x <= 0: Cephes expf (n = round(x log2 e), two-step ln 2 reduction, degree-5 polynomial, 2^n
// through the exponent bits); below -80 it is 0 (e^-80 is 1.8e-35 next to the row's largest term, 1).
// Branch-free and lane-wise; rounding by adding and subtracting 1.5 * 2^23 (round to nearest even).
inline float exp_nonpos(float x) {
    const float e = dwexp::exp_poly(x < -80.0f ? -80.0f : x);  // 2^n, n in [-115, 0]
    return x < -80.0f ? 0.0f : e;
}

inline float fmadd(float x, float y, float acc) { return __builtin_fmaf(x, y, acc); }  // x * y + acc, one rounding

inline float fold(float* a) {  // a[16] -> one float: a[l] += a[l + w] for w = 8, 4, 2, 1
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) a[l] = a[l] + a[l + w];
    return a[0];
}

template <class E>
inline float dot(const float* q, const E* k, int64_t D) {
    float acc[LANES];
    for (int l = 0; l < LANES; ++l) acc[l] = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] = fmadd(q[i + l], load(k, i + l), acc[l]);
    for (int l = 0; i + l < D; ++l) acc[l] = fmadd(q[i + l], load(k, i + l), acc[l]);
    return fold(acc);
}

// The keys one query attends to and where its operands live. Every ISA path starts here, so the key range of
// the row-exact contract (keys [start, first_b + t], start = end - window on sliding layers) is written once.
template <class E>
struct Query {
    void* o;       // the output row [D], in the call's dtype (store_row)
    const E* Kh;   // this kv head's keys: position p at Kh + pages[p / bs] * ps + (p % bs) * sc (`at`)
    const E* Vh;   // its values, same layout
    const int64_t* pages;  // the sequence's block table row
    int64_t bs;    // positions per page
    int64_t ps;    // page stride
    int64_t L;     // keys attended
    int64_t sc;    // key / value stride within a page
    int64_t start; // absolute position of the first key; key j < Lp at position start + j
    int64_t Lp;    // keys at consecutive positions from start (L for a chain row)
    uint64_t anc;  // a tree row's keys Lp..L-1: the chunk rows of its set bits, in order (0 for a chain row)
    int64_t first; // a tree row's chunk: row i at position first + i
};

// The key (h = q.Kh) or value (h = q.Vh) at absolute position p of the query's sequence.
template <class E>
inline const E* at(const E* h, const Query<E>& q, int64_t p) {
    return h + q.pages[p / q.bs] * q.ps + (p % q.bs) * q.sc;
}

// false for a padding query (its output row is zeroed); otherwise its q row is loaded into qf[D] as float
template <class E>
inline bool query(const DwAttnArgs* a, int64_t b, int64_t t, int64_t h, float* qf, Query<E>& q) {
    const int64_t D = a->D;
    const int64_t osize = a->dtype == DW_ATTN_BF16 ? 2 : 4;
    q.o = (char*)a->out + ((b * a->T + t) * a->H + h) * D * osize;
    if (t >= a->ntok[b]) {
        for (int64_t d = 0; d < D; ++d) qf[d] = 0.0f;
        store_row(a, q.o, qf, 1.0f);
        return false;
    }
    const int64_t first = a->first[b];
    uint64_t anc = a->anc ? a->anc[b * a->T + t] : 0;
    // a chain row's keys end at its own position; a tree row's list is the prefix and then its ancestors
    const int64_t end = anc ? first + __builtin_popcountll(anc) : first + t + 1;
    const int64_t start = a->window > 0 && end > a->window ? end - a->window : 0;
    const int64_t g = h / (a->H / a->Hkv);
    q.Kh = (const E*)a->k + g * a->kv_sh;
    q.Vh = (const E*)a->v + g * a->kv_sh;
    q.pages = a->tables + b * a->nb;
    q.bs = a->bs;
    q.ps = a->kv_ss;
    q.first = first;
    q.L = end - start;
    q.sc = a->kv_sc;
    q.start = start;
    q.Lp = anc ? (start < first ? first - start : 0) : q.L;
    for (int64_t skip = start - first; anc && skip > 0; --skip) anc &= anc - 1;  // a window past the prefix
    q.anc = anc;
    const int64_t qoff = b * a->q_sb + h * a->q_sh + t * a->q_st;
    if (a->dtype == DW_ATTN_BF16)
        for (int64_t d = 0; d < D; ++d) qf[d] = load((const uint16_t*)a->q + qoff, d);
    else
        for (int64_t d = 0; d < D; ++d) qf[d] = load((const float*)a->q + qoff, d);
    return true;
}

// ---- Query blocks: the bookkeeping both SIMD paths share (attention_avx2.cpp, attention_avx512.cpp) ----
// Up to QB consecutive items of one (b, g) (queries t, heads h within g) are attended together: each pass over a
// block of 16 keys (or values) serves all of them while it sits in L1. Keys are addressed by absolute cache
// position, so queries with different window starts share the blocks. Each query still performs exactly its own
// float sequence: its scores are independent of the others', its max is exact in any order (only the sign of a
// zero max may differ, and s - m then gives the same exp), and its sum and value accumulation run over its own keys
// in j order; only which query's chain runs next changes.
constexpr int QB = DW_ATTN_QBLOCK;

template <class E>
struct Block {
    int n;                      // real (non-padding) queries
    Query<E> q[QB];
    int64_t start[QB];          // absolute position of each query's first key
    float *qf[QB], *s[QB], *acc[QB];  // q row, scores (16 floats of room on either side), accumulator [D]
    int64_t a_lo, a_hi;         // the absolute key range of the block: [min start rounded down to 16, max end)
};

// The first key (value: h = Vh) of the 16-position block at ab (a multiple of 16): the block's 16 positions lie in
// one page (attention.h: BS is a multiple of 16, or one page holds the sequence), at stride sc from it.
template <class E>
inline const E* block_at(const Block<E>& blk, const E* h, int64_t ab) {
    return at(h, blk.q[0], ab);
}

// Items [i0, i0 + n) of one (b, g), n <= QB, into blk: q rows loaded, padding rows zeroed and left out, scratch
// laid out as dw_attn_scratch_floats sizes it (q rows and accumulators [QB][dp], then the scores), accumulators
// zeroed. False when every item is padding.
template <class E>
bool gather(const DwAttnArgs* a, int64_t i0, int n, float* scratch, Block<E>& blk) {
    const int64_t G = a->H / a->Hkv, T = a->T, Hkv = a->Hkv, D = a->D, dp = (D + 15) / 16 * 16;
    blk.n = 0;
    blk.a_lo = blk.a_hi = 0;
    int64_t Lmax = 0;
    for (int k = 0; k < n; ++k) {  // i = ((b * Hkv + g) * T + t) * G + hg
        const int64_t i = i0 + k;
        const int64_t hg = i % G, t = (i / G) % T, g = (i / (G * T)) % Hkv, b = i / (G * T * Hkv);
        const int u = blk.n;
        blk.qf[u] = scratch + u * dp;
        if (!query(a, b, t, g * G + hg, blk.qf[u], blk.q[u])) continue;  // padding: zeroed
        const int64_t st = blk.q[u].start, en = st + blk.q[u].Lp;  // the consecutive keys (tree keys: tree_*)
        blk.start[u] = st;
        blk.a_lo = u == 0 || st < blk.a_lo ? st : blk.a_lo;
        blk.a_hi = u == 0 || en > blk.a_hi ? en : blk.a_hi;
        Lmax = blk.q[u].L > Lmax ? blk.q[u].L : Lmax;
        ++blk.n;
    }
    if (blk.n == 0) return false;
    blk.a_lo -= blk.a_lo % 16;  // 16-position blocks never straddle a page; a query's scores stay where they were
    const int64_t sstride = 32 + (Lmax + 15) / 16 * 16;
    for (int u = 0; u < blk.n; ++u) {
        blk.acc[u] = scratch + (QB + u) * dp;
        blk.s[u] = scratch + 2 * QB * dp + u * sstride + 16;
        for (int64_t d = 0; d < D; ++d) blk.acc[u][d] = 0.0f;
    }
    return true;
}

// Query u's keys in the key block [ab, ab + 16), as block offsets lo..hi-1 (none when lo >= hi).
template <class E>
inline void span(const Block<E>& blk, int u, int64_t ab, int& lo, int& hi) {
    const int64_t st = blk.start[u], en = st + blk.q[u].Lp;
    lo = st > ab ? (int)(st - ab) : 0;
    hi = en - ab < 16 ? (int)(en - ab) : 16;
}

// fn(xb, ab, u, lo, hi) for each 16-key block ab of the query block, in position order (xb: its first key, or its
// first value with h = Vh), and each query u with keys in it (block offsets lo..hi-1, lo < hi), in query order.
template <class E, class F>
inline void for_spans(const Block<E>& blk, const E* h, F&& fn) {
    for (int64_t ab = blk.a_lo; ab < blk.a_hi; ab += 16) {
        const E* xb = block_at(blk, h, ab);
        for (int u = 0; u < blk.n; ++u) {
            int lo, hi;
            span(blk, u, ab, lo, hi);
            if (lo < hi) fn(xb, ab, u, lo, hi);
        }
    }
}

// Items [i0, i1) (one thread's share) cut at (b, g) boundaries into blocks of even size <= QB: fn(first, count).
template <class F>
void for_each_block(const DwAttnArgs* a, int64_t i0, int64_t i1, F&& fn) {
    const int64_t run = a->T * (a->H / a->Hkv);  // items per (b, g)
    for (int64_t i = i0; i < i1;) {
        const int64_t e = (i / run + 1) * run < i1 ? (i / run + 1) * run : i1;  // the end of this (b, g) here
        const int64_t nb = (e - i + QB - 1) / QB;
        for (int64_t k = 0; k < nb; ++k) {
            const int64_t j0 = i + (e - i) * k / nb, j1 = i + (e - i) * (k + 1) / nb;
            fn(j0, (int)(j1 - j0));
        }
        i = e;
    }
}

// A tree row's keys past its consecutive ones (its ancestors in the chunk, in row order): scores s[Lp..L) and their
// max into m, one key at a time with the portable dot (bitwise the SIMD paths' dots); nothing for a chain row.
template <class E>
inline void tree_scores(const DwAttnArgs* a, const Query<E>& q, const float* qf, float* s, float& m) {
    int64_t j = q.Lp;
    for (uint64_t r = q.anc; r; r &= r - 1, ++j) {
        s[j] = dot(qf, at(q.Kh, q, q.first + __builtin_ctzll(r)), a->D) * a->scale;
        m = s[j] > m ? s[j] : m;
    }
}

// ... and their values, after the consecutive keys' (acc += p_j v_j in j order), through the path's `values`.
template <class Steps, class E>
inline void tree_values(const Query<E>& q, int64_t D, const float* p, float* acc) {
    int64_t j = q.Lp;
    for (uint64_t r = q.anc; r; r &= r - 1, ++j)
        Steps::values(at(q.Vh, q, q.first + __builtin_ctzll(r)), q.sc, D, p + j, 0, 1, acc);
}

// The two steps the SIMD paths share but for their vector width (attention_avx2.cpp: 8 lanes, attention_avx512.h:
// 16), written once over a path's lanes L (DW_ATTN_LANES): L::V a vector of W = sizeof(V) / 4 floats and its
// set1 / add / sub / fmadd / exp (exp_nonpos lane by lane) / ld (fp32, or bf16 widened exactly) / st. Every lane is
// an independent chain, so any width performs the very float operations of the portable steps.
template <class L>
struct LaneSteps {
    using V = typename L::V;
    static constexpr int W = sizeof(V) / 4, C = LANES / W;  // C vectors hold the 16 lanes of a sum

    // p_j = exp(s_j - m) and their sum in lanes j mod 16 (one query, s in place)
    static float softmax_weights(float* s, int64_t n, float m) {
        const V vm = L::set1(m);
        V vsum[C];
        for (int c = 0; c < C; ++c) vsum[c] = L::set1(0.0f);
        int64_t j = 0;
        for (; j + LANES <= n; j += LANES)
            for (int c = 0; c < C; ++c) {
                const V e = L::exp(L::sub(L::ld(s + j + W * c), vm));
                L::st(s + j + W * c, e);
                vsum[c] = L::add(vsum[c], e);
            }
        float sum[LANES];
        for (int c = 0; c < C; ++c) L::st(sum + W * c, vsum[c]);
        for (int l = 0; j + l < n; ++l) {
            const float e = exp_nonpos(s[j + l] - m);
            s[j + l] = e;
            sum[l] = sum[l] + e;
        }
        return fold(sum);
    }

    // every query's acc += p_j v_j over its keys, block by block of 16 in position order (values below), the
    // step attend_block takes after the softmax; a path may supply its own with the same float operations
    template <class E>
    static void block_values(const Block<E>& blk, int64_t D, int64_t sc) {
        for_spans(blk, blk.q[0].Vh, [&](const E* vb, int64_t ab, int u, int lo, int hi) {
            values(vb, sc, D, blk.s[u] + (ab - blk.start[u]), lo, hi, blk.acc[u]);
        });
    }

    // acc += p_j v_j for the query's keys lo..hi-1 of this block of 16, in j order; 8 vectors of dims at a time
    template <class E>
    static void values(const E* vb, int64_t sc, int64_t D, const float* p, int lo, int hi, float* accp) {
        for (int64_t d0 = 0; d0 < D; d0 += 8 * W) {
            const int nv = D - d0 >= 8 * W ? 8 : (int)((D - d0) / W);
            V acc[8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) acc[r] = r < nv ? L::ld(accp + d0 + W * r) : L::set1(0.0f);
            const E* vp = vb + lo * sc + d0;
            for (int kk = lo; kk < hi; ++kk, vp += sc) {
                const V pv = L::set1(p[kk]);
#pragma GCC unroll 8
                for (int r = 0; r < 8; ++r)
                    if (r < nv) acc[r] = L::fmadd(pv, L::ld(vp + W * r), acc[r]);
            }
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r)
                if (r < nv) L::st(accp + d0 + W * r, acc[r]);
        }
    }
};

// A SIMD path's lanes for LaneSteps, in the unit compiled for them: V_ its float vector, P its intrinsics' prefix
// (_mm256, _mm512), EXP its exp_nonpos on V_ and LD its loads (overloaded for fp32 and bf16).
#define DW_ATTN_LANES(V_, P, EXP, LD)                                      \
    struct Lanes {                                                        \
        using V = V_;                                                     \
        static V set1(float x) { return P##_set1_ps(x); }                 \
        static V add(V a, V b) { return P##_add_ps(a, b); }               \
        static V sub(V a, V b) { return P##_sub_ps(a, b); }               \
        static V fmadd(V a, V b, V c) { return P##_fmadd_ps(a, b, c); }   \
        static V exp(V x) { return EXP(x); }                              \
        template <class E>                                                \
        static V ld(const E* p) { return LD(p); }                         \
        static void st(float* p, V v) { P##_storeu_ps(p, v); }            \
    }

// One query block, start to end; Steps supplies a SIMD path's loops over 16-key blocks:
//   Steps::template scores<NC>(a, blk, mx)   every query's s_j into blk.s[u] and its max into mx[u]; NC = head_dim / 16
//                                            when head_dim is 128 or 64 (q held in registers), else 0 (any multiple of 16)
//   Steps::softmax_weights(s, L, m) -> sum   s_j -> p_j in place, and their folded sum
//   Steps::block_values(blk, D, sc)          every query's acc += p_j v_j over its keys (LaneSteps': values below
//                                            per 16-key block and query, in position order)
//   Steps::values(vb, sc, D, p, lo, hi, acc) acc += p_j v_j for block keys lo..hi-1, in j order
// then o = acc / sum per query (an IEEE division per element: the same bits at any vector width).
template <class Steps, class E>
void attend_block(const DwAttnArgs* a, int64_t i0, int n, float* scratch) {
    Block<E> blk;
    if (!gather(a, i0, n, scratch, blk)) return;
    const int64_t D = a->D, sc = blk.q[0].sc;
    float mx[QB], total[QB];
    if (D == 128)
        Steps::template scores<8>(a, blk, mx);
    else if (D == 64)
        Steps::template scores<4>(a, blk, mx);
    else
        Steps::template scores<0>(a, blk, mx);
    if (a->anc)
        for (int u = 0; u < blk.n; ++u) tree_scores(a, blk.q[u], blk.qf[u], blk.s[u], mx[u]);
    for (int u = 0; u < blk.n; ++u) total[u] = Steps::softmax_weights(blk.s[u], blk.q[u].L, mx[u]);
    Steps::block_values(blk, D, sc);
    if (a->anc)
        for (int u = 0; u < blk.n; ++u) tree_values<Steps>(blk.q[u], D, blk.s[u], blk.acc[u]);
    for (int u = 0; u < blk.n; ++u) {
        store_row(a, blk.q[u].o, blk.acc[u], total[u]);
    }
}

// A SIMD path's whole entry point: items [i0, i1) (one thread's share) as query blocks through attend_block with
// that path's Steps, for the call's dtype.
template <class Steps>
void run_blocks(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    if (a->kv_dtype == DW_ATTN_BF16)
        for_each_block(a, i0, i1, [&](int64_t j0, int n) { attend_block<Steps, uint16_t>(a, j0, n, scratch); });
    else
        for_each_block(a, i0, i1, [&](int64_t j0, int n) { attend_block<Steps, float>(a, j0, n, scratch); });
}

// The chunk row of a tree row's n-th ancestor key (its n-th set bit).
inline int64_t tree_row(uint64_t anc, int64_t n) {
    for (; n > 0; --n) anc &= anc - 1;
    return __builtin_ctzll(anc);
}

// One item: query t of sequence b, head h (see attention.h).
template <class E>
void one(const DwAttnArgs* a, int64_t b, int64_t t, int64_t h, float* scratch) {
    const int64_t D = a->D, dp = (D + 15) / 16 * 16;
    float* qf = scratch;       // [dp]
    float* acc = scratch + dp;  // [dp]
    float* s = scratch + 2 * dp;  // [L]
    Query<E> q;
    if (!query(a, b, t, h, qf, q)) return;
    const int64_t L = q.L, Lp = q.Lp, st = q.start;

    float m = -__builtin_inff();
    for (int64_t j = 0; j < Lp; ++j) {
        const float x = dot(qf, at(q.Kh, q, st + j), D) * a->scale;
        s[j] = x;
        m = x > m ? x : m;
    }
    tree_scores(a, q, qf, s, m);

    float sum[LANES];
    for (int l = 0; l < LANES; ++l) sum[l] = 0.0f;
    int64_t j = 0;
    for (; j + LANES <= L; j += LANES)
        for (int l = 0; l < LANES; ++l) {
            const float e = exp_nonpos(s[j + l] - m);
            s[j + l] = e;
            sum[l] = sum[l] + e;
        }
    for (int l = 0; j + l < L; ++l) {
        const float e = exp_nonpos(s[j + l] - m);
        s[j + l] = e;
        sum[l] = sum[l] + e;
    }
    const float total = fold(sum);

    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    j = 0;
    for (; j + 4 <= Lp; j += 4) {  // four keys per pass over acc: the same fused steps, in the same order
        const float p0 = s[j], p1 = s[j + 1], p2 = s[j + 2], p3 = s[j + 3];
        const E* v0 = at(q.Vh, q, st + j);
        const E* v1 = at(q.Vh, q, st + j + 1);
        const E* v2 = at(q.Vh, q, st + j + 2);
        const E* v3 = at(q.Vh, q, st + j + 3);
        for (int64_t d = 0; d < D; ++d)
            acc[d] = fmadd(p3, load(v3, d), fmadd(p2, load(v2, d), fmadd(p1, load(v1, d), fmadd(p0, load(v0, d), acc[d]))));
    }
    for (; j < L; ++j) {  // then a tree row's ancestors
        const float p = s[j];
        const E* v = at(q.Vh, q, j < Lp ? st + j : q.first + tree_row(q.anc, j - Lp));
        for (int64_t d = 0; d < D; ++d) acc[d] = fmadd(p, load(v, d), acc[d]);
    }
    store_row(a, q.o, acc, total);
}

template <class E>
void rows(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    const int64_t G = a->H / a->Hkv, T = a->T, Hkv = a->Hkv;
    for (int64_t i = i0; i < i1; ++i) {  // i = ((b * Hkv + g) * T + t) * G + hg
        const int64_t hg = i % G, t = (i / G) % T, g = (i / (G * T)) % Hkv, b = i / (G * T * Hkv);
        one<E>(a, b, t, g * G + hg, scratch);
    }
}

inline void run(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    if (a->kv_dtype == DW_ATTN_BF16)
        rows<uint16_t>(a, i0, i1, scratch);
    else
        rows<float>(a, i0, i1, scratch);
}

}  // namespace dwattn
}  // namespace

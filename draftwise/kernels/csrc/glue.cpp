// The decoder's per-layer glue as torch operators (torch.ops.draftwise_glue.*): RMSNorm (alone and fused with
// the residual add before it), RoPE on q and k (with the per-head q/k norm of qwen3 / gemma3 first; optionally
// storing k and v into the layer's KV cache), the gated activation act(gate) * up, and a mixture's router
// logits. One call each instead of the 5-15 small aten calls of the torch reference, which for a one-token
// decode step cost more than their arithmetic (kernels/glue.py is the Python side).
//
// Owns: the float sequence of each op, fixed here and the same for every row whatever M is, whichever rows
// share the call and however at::parallel_for splits rows among threads (each row is computed by one thread,
// start to end) — so the decoder stays row-exact (docs/ARCHITECTURE.md, Decoder contract). float32 only (the
// Python side keeps the torch reference for other dtypes and devices). Knows nothing of models.
//
// Against the torch reference (transformer.py):
//   rms_norm: glue.h's norm_row: the mean of squares summed in double in a fixed order and 1 / sqrt(mean + eps)
//     rounded once to float (the reference rounds the float mean, eps add and rsqrt): |difference| <= a few float
//     ulps of the output. The rest is the reference's sequence: y = w * (x * r), or (x * r) * (offset + w) (gemma).
//   add_rms_norm: s = x + h (bitwise the reference's add), then rms_norm(s).
//   rope_qk: out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin per head half, which with -ffp-contract=off
//     is bitwise the reference's x * cos + rotate_half(x) * sin (round(-a) = -round(a)).
//   rope_qk_cache: rope_qk, and k', v copied into the cache (bitwise KVCache.write).
//   glu: silu: glue.h's silu_mul (our Cephes exp in one pass over gate and up, long rows split across threads;
//     measured against at::silu + mul_ on the 1.5B's 8960 columns, 2 threads: 0.7x at 1 row, 0.9x at 9 rows),
//     within glue.GLU_TOLERANCE of the reference; gelu tanh: at::gelu then mul_, bitwise.
//   router_logits: a mixture's router, float32 x and weight, exact products summed in double in a fixed order
//     (glue.h's dot; transformer.py Router's reference: a float64 matmul, whose summation order is the BLAS's).
//   argmax: torch.argmax's index of each row (glue.h's argmax: first maximum, a NaN above all), in one pass of
//     compares (a 151,936-float row on a Zen 4: ~11 us against torch's ~150 us in cache, ~60 against ~340 cold).
//   route: softmax, top-k, renormalisation and the sort by expert of a mixture's routing in one call (transformers'
//     float32 softmax with libm's expf and a plain sum, so within a few ulps of torch's vectorised one).
// The row loops of rms_norm, add_rms_norm, the q/k norm, silu_mul, router_logits' dot and argmax run on the best ISA
// path of glue.h this CPU has (dispatch.h's rule; ISA below says what each glue unit needs), unless a test chose one
// with use_path; all paths are bitwise the portable oracle (glue_kernel.h), so the choice changes speed only.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>
#include "dispatch.h"
#include "gemv_rows.h"
#include "glue_kernel.h"

extern "C" void dw_glue_scalar(DwGlue* ops) { dwglue::Table<dwglue::Portable>::fill(ops); }

#ifndef DW_HAVE_X86
extern "C" void dw_glue_avx2(DwGlue* ops) { dw_glue_scalar(ops); }
extern "C" void dw_glue_avx512(DwGlue* ops) { dw_glue_scalar(ops); }
#endif

namespace {

// What glue_avx2.cpp and glue_avx512.cpp are compiled for (kernels/library.py `_units`).
constexpr dwisa::Isa ISA{"glue", {0, dwisa::F_AVX2, dwisa::F_AVX512F | dwisa::F_AVX512DQ | dwisa::F_AVX512VL}};

// The path every op runs, as requested (AUTO unless a test chose another with use_path), resolved by dispatch.h's
// rule at each call like the other ops' per-call path. Every path gives bitwise the same results, so switching
// changes speed only.
std::atomic<int64_t> requested_path{dwisa::AUTO};

DwGlue ops() {
    DwGlue k;
    dwisa::pick(dwisa::select(ISA, requested_path.load(std::memory_order_relaxed)), dw_glue_scalar, dw_glue_avx2,
                dw_glue_avx512)(&k);
    return k;
}

std::vector<int64_t> paths() { return dwisa::available_paths(ISA); }

// Run the ops on `path` (AUTO: the best here) from now on; returns the path requested before. For tests.
int64_t use_path(int64_t path) {
    dwisa::select(ISA, path);  // an error where this CPU cannot run it
    return requested_path.exchange(path);
}

constexpr int64_t ARGMAX_GRAIN = 2;  // rows per parallel task: a vocabulary row is ~15 us, a task's start a few
constexpr int64_t ROW_GRAIN = 16;  // rows per parallel task: decode calls (1-16 rows) stay on the calling thread
constexpr int64_t GLU_CHUNK = 4096, GLU_GRAIN_CHUNKS = 4;  // silu_mul: elements per task, tasks per thread at least

// x viewed as rows [R, N] with a constant row stride: the last dim contiguous and the leading dims collapsible
// (e.g. a column slice of the merged q/k/v output). Returns the row stride, or -1 when x is not like that.
int64_t row_stride(const at::Tensor& x) {
    if (x.dim() == 0 || x.stride(-1) != 1) return -1;
    const int64_t N = x.size(-1);
    int64_t stride = -1, expect = -1;
    for (int64_t i = x.dim() - 2; i >= 0; --i) {
        if (x.size(i) == 1) continue;
        if (stride < 0) {
            stride = x.stride(i);
            expect = stride * x.size(i);
            if (stride < N) return -1;
        } else {
            if (x.stride(i) != expect) return -1;
            expect *= x.size(i);
        }
    }
    return stride < 0 ? N : stride;
}

// x as the row loops read it: R rows of N floats, row r at p + r * stride (x itself where it has a row stride, else a
// contiguous copy, held in `held`).
struct Rows {
    at::Tensor held;
    const float* p;
    int64_t stride, N, R;
    const float* row(int64_t r) const { return p + r * stride; }
};

Rows rows_of(const at::Tensor& x) {
    int64_t stride = row_stride(x);
    const at::Tensor t = stride >= 0 ? x : x.contiguous();
    const int64_t N = t.size(-1);
    return {t, t.data_ptr<float>(), stride >= 0 ? stride : N, N, N ? t.numel() / N : 0};
}

// An op's output: float32 of x's sizes, contiguous.
at::Tensor dense_like(const at::Tensor& x) {
    return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

void check_f32_cpu(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
    check_f32_cpu(x, "x");
    check_f32_cpu(w, "weight");
    TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && x.dim() >= 1 && w.size(0) == x.size(-1),
                "weight must be [dim] for x [..., dim]");
}

// x [..., N] -> RMSNorm(x) [..., N] contiguous
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps, double offset) {
    check_norm(x_in, w);
    const Rows x = rows_of(x_in);
    at::Tensor y = dense_like(x_in);
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const DwGlue k = ops();
    at::parallel_for(0, x.R, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) k.norm_row(x.row(r), wp, yp + r * x.N, x.N, eps, (float)offset);
    });
    return y;
}

// (x + h, RMSNorm(x + h)): the residual add and the next norm in one pass; both outputs contiguous.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& h_in, const at::Tensor& w,
                                                double eps, double offset) {
    check_norm(x_in, w);
    check_f32_cpu(h_in, "h");
    TORCH_CHECK(x_in.sizes() == h_in.sizes(), "x and h must have the same shape");
    const Rows x = rows_of(x_in), h = rows_of(h_in);
    at::Tensor s = dense_like(x_in), y = dense_like(x_in);
    const float* wp = w.data_ptr<float>();
    float* sp = s.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const DwGlue k = ops();
    const int64_t N = x.N;
    at::parallel_for(0, x.R, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            k.add_norm_row(x.row(r), h.row(r), wp, sp + r * N, yp + r * N, N, eps, (float)offset);
    });
    return {s, y};
}

// One head of D values: optional norm (into tmp), then the rotation with this row's cos/sin halves [D / 2].
inline void rope_head(const float* x, float* out, const float* c, const float* s, int64_t D, const float* nw,
                      double eps, float offset, float* tmp, const DwGlue& k) {
    if (nw != nullptr) {
        k.norm_row(x, nw, tmp, D, eps, offset);
        x = tmp;
    }
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * c[i] - x2 * s[i];
        out[half + i] = x2 * c[i] + x1 * s[i];
    }
}

void rope_rows(const Rows& x, at::Tensor& out, const at::Tensor& cos, const at::Tensor& sin, int64_t D,
               const float* nw, double eps, float offset) {
    const int64_t N = x.N, H = N / D, half = D / 2;
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const DwGlue k = ops();
    at::parallel_for(0, x.R, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
        std::vector<float> tmp(nw ? D : 0);
        for (int64_t r = r0; r < r1; ++r)
            for (int64_t hd = 0; hd < H; ++hd)
                rope_head(x.row(r) + hd * D, op + r * N + hd * D, cp + r * half, sp + r * half, D, nw, eps, offset,
                          tmp.data(), k);
    });
}

// q [..., Hq * D], k [..., Hk * D] with the same leading dims (R rows in all); cos, sin [R, D / 2] (this row's
// position's angles, the first half of the reference's duplicated table); q_norm / k_norm [D] or None.
// -> (q', k'), contiguous, same shapes.
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& cos,
                                           const at::Tensor& sin, int64_t head_dim,
                                           const std::optional<at::Tensor>& q_norm,
                                           const std::optional<at::Tensor>& k_norm, double eps, double offset) {
    check_f32_cpu(q_in, "q");
    check_f32_cpu(k_in, "k");
    check_f32_cpu(cos, "cos");
    check_f32_cpu(sin, "sin");
    const int64_t D = head_dim;
    TORCH_CHECK(D > 0 && D % 2 == 0 && q_in.size(-1) % D == 0 && k_in.size(-1) % D == 0, "bad head_dim");
    const Rows q = rows_of(q_in), k = rows_of(k_in);
    const int64_t R = q.R;
    TORCH_CHECK(k.R == R, "q and k must have the same rows");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == R * (D / 2) && sin.numel() == cos.numel(),
                "cos and sin must be contiguous [rows, head_dim / 2]");
    const float* qn = nullptr;
    const float* kn = nullptr;
    if (q_norm.has_value() && q_norm->defined()) {
        check_f32_cpu(*q_norm, "q_norm");
        TORCH_CHECK(q_norm->dim() == 1 && q_norm->is_contiguous() && q_norm->size(0) == D, "q_norm must be [head_dim]");
        qn = q_norm->data_ptr<float>();
    }
    if (k_norm.has_value() && k_norm->defined()) {
        check_f32_cpu(*k_norm, "k_norm");
        TORCH_CHECK(k_norm->dim() == 1 && k_norm->is_contiguous() && k_norm->size(0) == D, "k_norm must be [head_dim]");
        kn = k_norm->data_ptr<float>();
    }
    at::Tensor qo = dense_like(q_in), ko = dense_like(k_in);
    rope_rows(q, qo, cos, sin, D, qn, eps, (float)offset);
    rope_rows(k, ko, cos, sin, D, kn, eps, (float)offset);
    return {qo, ko};
}

// rope_qk, then k' and v stored straight into one layer's paged KV cache (keys / values [P, Hkv, BS, D],
// contiguous, float32 or bfloat16 — rounded to nearest even as KVCache.write's cast — as kv_cache.py allocates them): position p of row b goes to page tables[b, p / BS], row p % BS —
// KVCache.write's index_put, without the ~12 small aten calls it takes per layer; the pages are the caller's
// (`KVCache.reserve` before, `KVCache.extend` after). Returns q' only.
at::Tensor rope_qk_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t head_dim, const std::optional<at::Tensor>& q_norm,
                         const std::optional<at::Tensor>& k_norm, double eps, double offset, const at::Tensor& keys,
                         const at::Tensor& values, const at::Tensor& tables, const at::Tensor& positions) {
    auto [qo, ko] = rope_qk(q, k, cos, sin, head_dim, q_norm, k_norm, eps, offset);
    check_f32_cpu(v, "v");
    const auto kvt = keys.scalar_type();
    TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu() && (kvt == at::kFloat || kvt == at::kBFloat16) &&
                    values.scalar_type() == kvt, "keys / values: float32 or bfloat16 CPU tensors of one dtype");
    const int64_t D = head_dim;
    TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.sizes() == keys.sizes() && values.is_contiguous() &&
                    keys.size(3) == D, "keys / values must be contiguous [pages, kv heads, page size, head_dim]");
    const int64_t P = keys.size(0), Hkv = keys.size(1), BS = keys.size(2);
    TORCH_CHECK(positions.dim() == 2 && positions.scalar_type() == at::kLong && tables.dim() == 2 &&
                    tables.scalar_type() == at::kLong && tables.size(0) == positions.size(0) && tables.size(1) >= 1,
                "tables [B, pages per sequence] and positions [B, T] must be int64");
    const int64_t B = positions.size(0), T = positions.size(1), nb = tables.size(1);
    TORCH_CHECK(ko.size(-1) == Hkv * D && ko.numel() == B * T * Hkv * D, "k must be [B, T, kv heads * head_dim]");
    TORCH_CHECK(v.size(-1) == Hkv * D && v.numel() == ko.numel(), "v must be shaped like k");
    const Rows vr = rows_of(v);
    const at::Tensor tb = tables.contiguous(), ps = positions.contiguous();
    const int64_t* tp = tb.data_ptr<int64_t>();
    const int64_t* pp = ps.data_ptr<int64_t>();
    std::vector<int64_t> page(B * T);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
            const int64_t p = pp[b * T + t];
            TORCH_CHECK(p >= 0 && p < nb * BS, "position ", p, " beyond the ", nb * BS, " positions of row ", b,
                        "'s pages");
            page[b * T + t] = tp[b * nb + p / BS];
            TORCH_CHECK(page[b * T + t] >= 0 && page[b * T + t] < P, "row ", b, ": page ", page[b * T + t],
                        " of position ", p, " out of range [0, ", P, ")");
        }
    const float* kp = ko.data_ptr<float>();
    if (kvt == at::kBFloat16) {  // rounded to nearest even, as tensor.to(torch.bfloat16) (c10::BFloat16)
        c10::BFloat16* K = keys.data_ptr<c10::BFloat16>();
        c10::BFloat16* V = values.data_ptr<c10::BFloat16>();
        for (int64_t r = 0; r < B * T; ++r)
            for (int64_t h = 0; h < Hkv; ++h) {
                const int64_t dst = ((page[r] * Hkv + h) * BS + pp[r] % BS) * D;
                const float* ks = kp + r * Hkv * D + h * D;
                const float* vs_ = vr.row(r) + h * D;
                for (int64_t d = 0; d < D; ++d) {
                    K[dst + d] = c10::BFloat16(ks[d]);
                    V[dst + d] = c10::BFloat16(vs_[d]);
                }
            }
        return qo;
    }
    float* K = keys.data_ptr<float>();
    float* V = values.data_ptr<float>();
    for (int64_t r = 0; r < B * T; ++r)
        for (int64_t h = 0; h < Hkv; ++h) {
            const int64_t dst = ((page[r] * Hkv + h) * BS + pp[r] % BS) * D;
            std::memcpy(K + dst, kp + r * Hkv * D + h * D, D * sizeof(float));
            std::memcpy(V + dst, vr.row(r) + h * D, D * sizeof(float));
        }
    return qo;
}

// act(gate) * up with act = silu (kind 0: glue.h's silu_mul, one pass) or gelu tanh (kind 1: aten's gelu, then mul_);
// with `up` None, gate is [..., 2 I] holding gate | up (a merged gate/up projection's output). -> [..., I] contiguous
at::Tensor glu(const at::Tensor& gate, const std::optional<at::Tensor>& up, int64_t kind) {
    check_f32_cpu(gate, "gate");
    at::Tensor g = gate, u;
    if (up.has_value() && up->defined()) {
        u = *up;
        check_f32_cpu(u, "up");
        TORCH_CHECK(u.sizes() == g.sizes(), "gate and up must have the same shape");
    } else {
        const int64_t I = gate.size(-1) / 2;
        TORCH_CHECK(gate.size(-1) == 2 * I, "a merged gate/up output must have an even last dim");
        g = gate.narrow(-1, 0, I);
        u = gate.narrow(-1, I, I);
    }
    TORCH_CHECK(kind == 0 || kind == 1, "kind: 0 = silu, 1 = gelu tanh");
    if (kind == 1) return at::gelu(g, "tanh").mul_(u);
    const Rows gr = rows_of(g), ur = rows_of(u);
    const int64_t N = gr.N;
    at::Tensor out = dense_like(g);
    float* op = out.data_ptr<float>();
    const DwGlue k = ops();
    // Elementwise, so any split is exact: tasks of GLU_CHUNK elements of one row, >= GLU_GRAIN_CHUNKS per thread
    // (a decode step's 1 x 8960 stays on the calling thread; a 9-row verification's 9 x 8960 uses both)
    const int64_t per_row = (N + GLU_CHUNK - 1) / GLU_CHUNK;
    at::parallel_for(0, gr.R * per_row, GLU_GRAIN_CHUNKS, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t r = t / per_row, c0 = (t % per_row) * GLU_CHUNK, n = std::min(GLU_CHUNK, N - c0);
            k.silu_mul(gr.row(r) + c0, ur.row(r) + c0, op + r * N + c0, n);
        }
    });
    return out;
}

}  // namespace

// glu's silu path on raw pointers (gemv_rows.h): the op's chunks of one row, on the calling thread
void dw_glu_silu_rows(const float* gu, int64_t R, int64_t I, float* out) {
    const DwGlue k = ops();
    for (int64_t r = 0; r < R; ++r)
        for (int64_t c0 = 0; c0 < I; c0 += GLU_CHUNK)
            k.silu_mul(gu + r * 2 * I + c0, gu + r * 2 * I + I + c0, out + r * I + c0, std::min(GLU_CHUNK, I - c0));
}

namespace {

// A mixture's router logits, exact products summed in double: logits[m, e] = glue.h's dot(x[m], w[e]) (each product
// exact: 24-bit mantissas; 8 lanes in h order, combined in one fixed order: norm_row's sum of squares with the
// router's row for the second factor). One fixed sequence per (row, expert), whatever M is, whichever ISA path
// (all bitwise the portable one) or thread runs it (split over experts, ROUTER_GRAIN per task), so a row's logits
// are row-exact. Reads the float32 weight itself (the torch reference multiplies a float64 copy, twice the bytes a
// decode step streams). x [M, H] float32, w [E, H] float32 -> [M, E] float64. A decode step's 1-16 rows are bound
// by the weight's bytes on every path (one row against a 128 x 2048 router out of cache: 46-96 us on the portable
// and AVX-512 paths alike, Zen 4, 1-2 threads: docs/PERFORMANCE.md, 2026-12-07 second session, issue 46): the paths
// share glue.h's dot so that the norm and the router have one lane loop each (transformer.py Router runs longer
// prompts through torch).
constexpr int64_t ROUTER_GRAIN = 32;  // experts per parallel task: 128 experts over 2 threads, 2 tasks each

at::Tensor router_logits(const at::Tensor& x_in, const at::Tensor& w_in) {
    check_f32_cpu(x_in, "x");
    check_f32_cpu(w_in, "weight");
    TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
                "router_logits: x [M, H] and weight [E, H]");
    const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
    const int64_t M = x.size(0), E = w.size(0), H = x.size(1);
    at::Tensor y = at::empty({M, E}, x.options().dtype(at::kDouble));
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    double* yp = y.data_ptr<double>();
    const DwGlue k = ops();
    at::parallel_for(0, E, ROUTER_GRAIN, [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e)  // an expert's row read once for all M rows (in cache after the first)
            for (int64_t m = 0; m < M; ++m) yp[m * E + e] = k.dot(xp + m * H, wp + e * H, H);
    });
    return y;
}

// A mixture's routing of each row from its router logits (transformer.py SparseMoE.route's definition, done here in
// one call where the torch reference takes ~8): logits [M, E] float64 (router_logits or the reference's matmul)
// rounded to float32; p = softmax in float32: m = the max, e_i = expf(l_i - m), s = the e_i summed in expert
// order, p_i = e_i / s; the k largest p (ties: the lower expert first); with `norm` each divided by their sum
// (summed largest first); returned by ascending expert: experts [M, k] int64, weights [M, k] float32. Each row is
// one fixed sequence of its own logits (row-exact for any M and thread split).
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits_in, int64_t k, bool norm) {
    TORCH_CHECK(logits_in.device().is_cpu() && logits_in.scalar_type() == at::kDouble && logits_in.dim() == 2,
                "route: logits must be [M, E] float64 on the CPU");
    const at::Tensor logits = logits_in.contiguous();
    const int64_t M = logits.size(0), E = logits.size(1);
    TORCH_CHECK(k >= 1 && k <= E, "route: k must be in [1, ", E, "]");
    at::Tensor experts = at::empty({M, k}, logits.options().dtype(at::kLong));
    at::Tensor weights = at::empty({M, k}, logits.options().dtype(at::kFloat));
    const double* lp = logits.data_ptr<double>();
    int64_t* ep = experts.data_ptr<int64_t>();
    float* wp = weights.data_ptr<float>();
    at::parallel_for(0, M, ROW_GRAIN, [&](int64_t m0, int64_t m1) {
        std::vector<float> p(E);
        std::vector<int64_t> idx(E);
        for (int64_t m = m0; m < m1; ++m) {
            const double* l = lp + m * E;
            float mx = (float)l[0];
            for (int64_t e = 1; e < E; ++e) mx = std::max(mx, (float)l[e]);
            float s = 0.0f;
            for (int64_t e = 0; e < E; ++e) {
                p[e] = std::exp((float)l[e] - mx);
                s = s + p[e];
            }
            for (int64_t e = 0; e < E; ++e) p[e] = p[e] / s;
            for (int64_t e = 0; e < E; ++e) idx[e] = e;
            // the k largest, largest first, ties to the lower expert
            std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                              [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
            float t = 0.0f;
            if (norm)
                for (int64_t j = 0; j < k; ++j) t = t + p[idx[j]];
            std::sort(idx.begin(), idx.begin() + k);
            for (int64_t j = 0; j < k; ++j) {
                ep[m * k + j] = idx[j];
                wp[m * k + j] = norm ? p[idx[j]] / t : p[idx[j]];
            }
        }
    });
    return {experts, weights};
}

// x [..., N] float32 -> [...] int64: each row's torch.argmax (glue.h's argmax), a row per thread
at::Tensor argmax(const at::Tensor& x_in) {
    check_f32_cpu(x_in, "x");
    TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) >= 1, "argmax: x must be [..., N] with N >= 1");
    const Rows x = rows_of(x_in);
    at::Tensor out = at::empty(x_in.sizes().slice(0, x_in.dim() - 1), x_in.options().dtype(at::kLong));
    int64_t* op = out.data_ptr<int64_t>();
    const DwGlue k = ops();
    at::parallel_for(0, x.R, ARGMAX_GRAIN, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) op[r] = k.argmax(x.row(r), x.N);
    });
    return out;
}

}  // namespace

TORCH_LIBRARY(draftwise_glue, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
    m.def("add_rms_norm(Tensor x, Tensor h, Tensor weight, float eps, float offset) -> (Tensor, Tensor)");
    m.def("rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, int head_dim, Tensor? q_norm, Tensor? k_norm, "
          "float eps, float offset) -> (Tensor, Tensor)");
    m.def("rope_qk_cache(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, int head_dim, Tensor? q_norm, "
          "Tensor? k_norm, float eps, float offset, Tensor(a!) keys, Tensor(b!) values, Tensor tables, "
          "Tensor positions) -> Tensor");
    m.def("glu(Tensor gate, Tensor? up, int kind) -> Tensor");
    m.def("router_logits(Tensor x, Tensor weight) -> Tensor");
    m.def("route(Tensor logits, int k, bool norm) -> (Tensor, Tensor)");
    m.def("argmax(Tensor x) -> Tensor");
    m.def("paths() -> int[]", &paths);
    m.def("use_path(int path) -> int", &use_path);
}

TORCH_LIBRARY_IMPL(draftwise_glue, CPU, m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("rope_qk", &rope_qk);
    m.impl("rope_qk_cache", &rope_qk_cache);
    m.impl("glu", &glu);
    m.impl("router_logits", &router_logits);
    m.impl("route", &route);
    m.impl("argmax", &argmax);
}

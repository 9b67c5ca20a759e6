// Grouped experts: one mixture-of-experts layer's expert MLPs in one call (torch.ops.draftwise_experts, the class
// ExpertSet). A row's k routed experts are given (the router ran before, transformer.py SparseMoE.route); this
// groups the rows by expert and, for each expert that has rows, runs its merged gate/up linear once over all of
// them (the block kernel's GEMV, or its wide kernel for many rows, exactly as the Python module would call it),
// the gated activation, the down linear, and adds each product, scaled by its routing weight, into its row.
//
// Owns: the grouping (experts in ascending order, each expert's rows in ascending order), the gather of an expert's
// rows and the weighted sum, and the per-kind call rule (an op `draftwise_<kind>::linear(x, <buffers>, bias, N,
// path)` of the block-type table's kernels; where the kind has `wide_takes(rows)`, its `wide` op for the rows it
// takes: q6k's rule in kernels/linear.py Q6KLinear). Knows nothing of any layout or arithmetic: the linears and
// the activation are the library's other ops (found through the dispatcher once), so every expert's output is
// bitwise what its Python module computes for the same rows.
//
// Threads: a call whose experts each have few rows (a decode or verification step: every expert at most
// SPLIT_MAX_ROWS rows) splits over its experts, each expert's gate/up, activation and down run whole by one thread
// (the linears then run single-threaded inside: at::parallel_for does not nest), so a step pays one thread fork /
// join per layer instead of one per linear (16 for a top-8 step), and no thread waits at a join after each small
// GEMV; a call with more rows per expert (a prompt) keeps the kernels' own split over column blocks (and rows),
// which balances uneven experts. The split changes no bit: each linear's outputs do not depend on the thread
// that runs it or on its thread count (block_op.h splits only over columns and rows), and the sum below is one
// thread's, in expert order, after every expert is done.
//
// Direct path: where every expert's gate/up and down are of a kind with a raw GEMV (csrc/gemv_rows.h: q4x8, q5x8,
// q6k) and the activation is silu, an expert whose linears would run their GEMV (not the wide side: the ops' own
// rule, per expert) runs them through those entry points on its thread (the split's, or the only one), with the
// rows gathered, quantized and held in the thread's scratch, the gate/up output, the activation and the down output
// in place: no dispatcher call, no tensor allocated per expert. A decode step at 2 threads spent ~20 us per expert on
// those (3 boxed calls, 9 tensors: ~7% of a 1-thread step on the 4-layer Qwen3-30B-A3B-shaped file, measured by perf).
// Bitwise the ops' outputs: the same quantizer, GEMV and silu functions on the same path, every column block by one
// thread (draftwise_experts::use_direct(false) runs the ops instead, for tests and A/Bs).
//
// Row-exact: each row's products come from row-exact kernels (a row's bits do not depend on the other rows of
// the call), and a row's sum is s = p_0, s = s + p_j for its experts j in ascending order, each p_j = y_j * w_j
// rounded to float32 (no contraction: -ffp-contract=off): bitwise SparseMoE's loop (slots summed in expert order),
// whichever other rows share its experts.
#include "experts.h"  // the class's declaration (csrc/stack.cpp runs it too)
#include "gemm_wide.h"  // dw_q4x8_check, dw_q6k_check, and (below) the wide sides' switches
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

namespace draftwise_experts {
namespace {

KindOps ops_of(const std::string& kind, size_t buffers) {
    auto& d = c10::Dispatcher::singleton();
    const std::string ns = "draftwise_" + kind + "::";
    KindOps k{d.findSchemaOrThrow((ns + "linear").c_str(), ""), std::nullopt, std::nullopt, buffers};
    auto takes = d.findSchema({ns + "wide_takes", ""});
    auto wide = d.findSchema({ns + "wide", ""});
    if (takes.has_value() && wide.has_value() && kind != "q4x8") {  // q4x8's linear takes its wide kernel itself
        k.wide_takes = takes;
        k.wide = wide;
    }
    return k;
}

// y [n, N] = the kind's linear of x [n, K] with one expert's buffers bufs[0 .. k.buffers)
at::Tensor run_linear(const KindOps& k, const at::Tensor* bufs, const at::Tensor& x, int64_t N, int64_t path) {
    torch::jit::Stack st;
    st.reserve(k.buffers + 4);
    bool wide = false;
    if (k.wide.has_value() && path == -1 && x.size(0) > 1) {
        torch::jit::Stack q{c10::IValue(x.size(0))};
        k.wide_takes->callBoxed(q);
        wide = q.at(0).toBool();
    }
    st.emplace_back(x);
    for (size_t i = 0; i < k.buffers; ++i) st.emplace_back(bufs[i]);
    st.emplace_back(c10::IValue());  // no bias (ExpertSet refuses experts with one)
    st.emplace_back(N);
    if (wide) {
        k.wide->callBoxed(st);
    } else {
        st.emplace_back(path);
        k.linear.callBoxed(st);
    }
    return st.at(0).toTensor();
}

// the most rows any expert of a call may have for the call to split over experts (module comment): a verification
// step of up to 16 tokens; past that the experts' uneven row counts are better balanced by the kernels' own split
constexpr int64_t SPLIT_MAX_ROWS = 16;

// whether calls may take the direct path (module comment); draftwise_experts::use_direct switches it, for A/Bs and
// tests that compare the two paths
std::atomic<bool> direct_enabled{true};


// the direct linears of kind `kind` over every expert's `buffers` tensors in `w` (K inputs, N outputs), checked as the
// op checks them; empty where the kind has no raw GEMV or a buffer fails the op's checks (the op then says why)
std::vector<DirectLinear> direct_of(const std::string& kind, size_t buffers, const std::vector<at::Tensor>& w,
                                    int64_t K, int64_t N) {
    std::vector<DirectLinear> out;
    if (kind != "q4x8" && kind != "q5x8" && kind != "q6k") return out;
    const at::Tensor x = at::empty({1, K}, at::TensorOptions().dtype(at::kFloat));  // the checks' shape only
    const int64_t G = K / 32, S = (G + 7) / 8;
    try {
        for (size_t i = 0; i + buffers <= w.size(); i += buffers) {
            const at::Tensor* b = &w[i];
            DirectLinear d{};
            if (kind == "q6k") {
                dw_q6k_check(x, b[0], b[1], b[2], b[3], std::nullopt, N);
                d.kernel = DirectLinear::Q6K;
                d.q6 = DwQ6{b[0].data_ptr<uint8_t>(), b[1].data_ptr<uint8_t>(), b[2].data_ptr<int8_t>(),
                            b[3].data_ptr<float>(), nullptr, N, K, G, K / 256, nullptr, nullptr, 6};
            } else {  // q4x8: packed, sc, mn, d, dmin; q5x8: packed, qh, sc, mn, d, dmin (kernels/linear.py PACKED)
                const bool plane = kind == "q5x8";
                const at::Tensor* r = plane ? b + 1 : b;  // sc, mn, d, dmin from r[1]
                dw_q4x8_check(x, b[0], r[1], r[2], r[3], r[4], std::nullopt, N, plane ? &b[1] : nullptr);
                d.kernel = DirectLinear::Q4X8;
                d.q4 = DwQ4{b[0].data_ptr<uint8_t>(), r[1].data_ptr<uint8_t>(), r[2].data_ptr<uint8_t>(),
                            r[3].data_ptr<float>(), r[4].data_ptr<float>(), nullptr, N, K, G, S,
                            plane ? b[1].data_ptr<uint8_t>() : nullptr};
            }
            out.push_back(d);
        }
    } catch (const c10::Error&) {
        return {};
    }
    return out;
}

}  // namespace
}  // namespace draftwise_experts

// The wide sides' switches (gemm_q4x8.cpp, gemm_q6k.cpp): whether a path-'auto' call of M rows goes there.
bool dw_wide_takes(int64_t M, bool plane);
bool dw_q6k_wide_takes(int64_t M);

namespace draftwise_experts {

bool DirectLinear::takes_wide(int64_t n, int64_t path) const {
    if (path != -1) return false;  // an explicit path runs the GEMV
    // q4x8 / q5x8: their linear's own test (q4x8.cpp); q6k: run_linear's, for more than one row
    return kernel == Q4X8 ? dw_wide_takes(n, q4.qh != nullptr) : n > 1 && dw_q6k_wide_takes(n);
}

void DirectLinear::run(const float* x, int64_t n, float* y, int64_t path, uint8_t* scratch) const {
    if (kernel == Q4X8) {
        dw_q4x8_gemv_rows(&q4, x, n, y, path, scratch);
    } else {
        dw_q6k_gemv_rows(&q6, x, n, y, path, scratch);
    }
}



ExpertSet::ExpertSet(std::string gu_kind, int64_t gu_buffers, std::vector<at::Tensor> gu, int64_t gu_width,
                     std::string down_kind, int64_t down_buffers, std::vector<at::Tensor> down, int64_t down_width,
                     int64_t activation, int64_t kernel_path)
    : gu_(ops_of(gu_kind, gu_buffers)), down_(ops_of(down_kind, down_buffers)), gu_w(std::move(gu)),
      down_w(std::move(down)), gu_N(gu_width), down_N(down_width), act(activation), path(kernel_path),
      glu(c10::Dispatcher::singleton().findSchemaOrThrow("draftwise_glue::glu", "")) {
    TORCH_CHECK(gu_buffers > 0 && down_buffers > 0, "ExpertSet: buffers per linear must be >= 1");
    E = (int64_t)gu_w.size() / gu_buffers;
    TORCH_CHECK(E >= 1 && (int64_t)gu_w.size() == E * gu_buffers && (int64_t)down_w.size() == E * down_buffers,
                "ExpertSet: ", gu_w.size(), " gate/up and ", down_w.size(), " down buffers for ", gu_buffers, " and ",
                down_buffers, " per expert");
    TORCH_CHECK(gu_N % 2 == 0, "ExpertSet: gate | up has an even width");
    if (act == 0) {  // silu: glue's raw rows (gemv_rows.h); gelu keeps the op
        gu_direct = direct_of(gu_kind, gu_buffers, gu_w, down_N, gu_N);
        down_direct = direct_of(down_kind, down_buffers, down_w, gu_N / 2, down_N);
    }
    if ((int64_t)gu_direct.size() != E || (int64_t)down_direct.size() != E) gu_direct.clear(), down_direct.clear();
}

// x [M, H] float32, experts [M, k] int64 ascending per row, weights [M, k] float32 -> out [M, down_N]
at::Tensor ExpertSet::run(const at::Tensor& x_in, const at::Tensor& experts_in, const at::Tensor& weights_in) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be [M, H] float32");
    TORCH_CHECK(experts_in.dim() == 2 && experts_in.size(0) == x_in.size(0) && experts_in.scalar_type() == at::kLong,
                "experts must be [M, k] int64");
    TORCH_CHECK(weights_in.sizes() == experts_in.sizes() && weights_in.scalar_type() == at::kFloat,
                "weights must be [M, k] float32");
    const at::Tensor x = x_in.contiguous(), ex = experts_in.contiguous(), wt = weights_in.contiguous();
    const int64_t M = x.size(0), H = x.size(1), k = ex.size(1);
    const int64_t* ep = ex.data_ptr<int64_t>();
    const float* wp = wt.data_ptr<float>();
    // rows of each expert, ascending; a row lists an expert at most once (top-k of distinct indices)
    std::vector<std::vector<int64_t>> rows(E);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < k; ++j) {
            const int64_t e = ep[m * k + j];
            TORCH_CHECK(e >= 0 && e < E, "expert index ", e, " out of range [0, ", E, ")");
            TORCH_CHECK(j == 0 || ep[m * k + j - 1] < e, "a row's experts must be ascending and distinct");
            rows[e].push_back(m * k + j);  // slot: row m's j-th expert
        }
    std::vector<int64_t> active;  // experts with rows, ascending
    int64_t most = 0;
    for (int64_t e = 0; e < E; ++e)
        if (!rows[e].empty()) {
            active.push_back(e);
            most = std::max(most, (int64_t)rows[e].size());
        }
    const int64_t A = (int64_t)active.size();
    const float* xp = x.data_ptr<float>();
    at::Tensor out = at::empty({M, down_N}, x.options());
    float* op = out.data_ptr<float>();
    std::vector<uint8_t> started(M, 0);
    // expert active[i]'s outputs y [n, down_N] for its rows, through the ops
    auto expert = [&](int64_t i) -> at::Tensor {
        const int64_t e = active[i];
        const auto& slots = rows[e];
        const int64_t n = (int64_t)slots.size();
        at::Tensor xe = at::empty({n, H}, x.options());  // this expert's rows, gathered
        float* xep = xe.data_ptr<float>();
        for (int64_t r = 0; r < n; ++r) std::memcpy(xep + r * H, xp + slots[r] / k * H, H * sizeof(float));
        at::Tensor gu = run_linear(gu_, &gu_w[e * gu_.buffers], xe, gu_N, path);  // [n, 2 I]
        at::Tensor h = glu.typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>()
                           .call(gu, std::nullopt, act);  // [n, I]
        at::Tensor y = run_linear(down_, &down_w[e * down_.buffers], h.contiguous(), down_N, path);  // [n, H]
        TORCH_CHECK(y.is_contiguous() && y.size(0) == n && y.size(1) == down_N, "expert output shape");
        return y;
    };
    // the same into y [n, down_N] through the raw GEMVs (gemv_rows.h) on the calling thread, its scratch the
    // thread's; false (nothing done) where the op would hand a linear's rows to its wide side
    const bool direct = direct_enabled.load(std::memory_order_relaxed) && !gu_direct.empty() && H == down_N;
    auto expert_direct = [&](int64_t i, float* y) -> bool {
        const int64_t e = active[i];
        const auto& slots = rows[e];
        const int64_t n = (int64_t)slots.size(), I = gu_N / 2;
        const DirectLinear &g = gu_direct[e], &d = down_direct[e];
        if (g.takes_wide(n, path) || d.takes_wide(n, path)) return false;
        // xe [n, H] (the rows gathered; one row is read where it is), gu [n, 2 I], h [n, I], then the quantized rows
        const int64_t xb = n > 1 ? dw_up64(n * H * 4) : 0, gb = dw_up64(n * gu_N * 4), hb = dw_up64(n * I * 4);
        // the thread's scratch (gemm_wide.h; the split's threads never share one, and nothing this calls takes it)
        uint8_t* s = dw_thread_scratch(xb + gb + hb + std::max(dw_gemv_rows_scratch(n, H), dw_gemv_rows_scratch(n, I)));
        const float* xe = xp + slots[0] / k * H;
        if (n > 1) {
            float* xg = (float*)s;
            for (int64_t r = 0; r < n; ++r) std::memcpy(xg + r * H, xp + slots[r] / k * H, H * sizeof(float));
            xe = xg;
        }
        float* gu = (float*)(s + xb);
        float* h = (float*)(s + xb + gb);
        uint8_t* q = s + xb + gb + hb;
        g.run(xe, n, gu, path, q);
        dw_glu_silu_rows(gu, n, I, h);
        d.run(h, n, y, path, q);
        return true;
    };
    // each row's weighted product of expert active[i] (y [n, down_N]) into its sum; called in ascending i
    auto add = [&](int64_t i, const float* yp) {
        const auto& slots = rows[active[i]];
        const int64_t n = (int64_t)slots.size();
        for (int64_t r = 0; r < n; ++r) {
            const int64_t m = slots[r] / k;
            const float w = wp[slots[r]];
            float* o = op + m * down_N;
            const float* yr = yp + r * down_N;
            if (!started[m]) {  // the row's first (lowest) expert: s = p_0
                for (int64_t c = 0; c < down_N; ++c) o[c] = yr[c] * w;
                started[m] = 1;
            } else {  // s = s + p_j, with p_j rounded first
                for (int64_t c = 0; c < down_N; ++c) {
                    const float p = yr[c] * w;
                    o[c] = o[c] + p;
                }
            }
        }
    };
    const bool alone = at::get_num_threads() == 1 || at::in_parallel_region();  // no kernel could split anyway
    if (most <= SPLIT_MAX_ROWS && A > 1 && at::get_num_threads() > 1 && !at::in_parallel_region()) {
        // every expert's outputs, kept until all are done (a few rows each): the direct path's in one buffer of the
        // calling thread's, at each expert's first slot; the others' tensors
        std::vector<int64_t> at_(A + 1, 0);
        for (int64_t i = 0; i < A; ++i) at_[i + 1] = at_[i] + (int64_t)rows[active[i]].size() * down_N;
        thread_local std::vector<float> ybuf;
        if (direct && (int64_t)ybuf.size() < at_[A]) ybuf.resize(at_[A]);
        float* yb = ybuf.data();
        std::vector<at::Tensor> ys(A);
        std::vector<uint8_t> done(A, 0);
        at::parallel_for(0, A, 1, [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i) {
                if (direct && expert_direct(i, yb + at_[i])) {
                    done[i] = 1;
                } else {
                    ys[i] = expert(i);
                }
            }
        });
        for (int64_t i = 0; i < A; ++i) add(i, done[i] ? yb + at_[i] : ys[i].data_ptr<float>());
    } else {  // one expert's outputs at a time (a prompt's would be [rows x k, H] held at once)
        std::vector<float> y1;
        for (int64_t i = 0; i < A; ++i) {
            const int64_t n = (int64_t)rows[active[i]].size();
            if (direct && alone) {  // no thread is lost: every kernel would run on this one
                if ((int64_t)y1.size() < n * down_N) y1.resize(n * down_N);
                if (expert_direct(i, y1.data())) {
                    add(i, y1.data());
                    continue;
                }
            }
            const at::Tensor y = expert(i);
            add(i, y.data_ptr<float>());
        }
    }
    return out;
}

}  // namespace draftwise_experts

using draftwise_experts::ExpertSet;

TORCH_LIBRARY(draftwise_experts, m) {
    m.class_<ExpertSet>("ExpertSet")
        .def(torch::init<std::string, int64_t, std::vector<at::Tensor>, int64_t, std::string, int64_t,
                         std::vector<at::Tensor>, int64_t, int64_t, int64_t>())
        .def("run", &ExpertSet::run)
        .def("num_experts", &ExpertSet::num_experts)
        .def("direct", [](const c10::intrusive_ptr<ExpertSet>& self) { return !self->gu_direct.empty(); });
    // whether calls may take the direct path (module comment); returns the setting before. For A/Bs and tests.
    m.def("use_direct(bool on) -> bool", [](bool on) { return draftwise_experts::direct_enabled.exchange(on); });
}

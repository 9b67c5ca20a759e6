// The decoder's layer loop as one torch operator (torch.ops.draftwise_stack.layers): every layer of a
// pre-norm decoder whose projections are our row-exact kernels (q4x8, q6k, q8_0, q8_1: each projection its own, as a
// faithful plan mixes them) and whose glue and attention are our ops, in one call from Python. A layer's
// feed-forward part is a dense MLP or a mixture of experts (transformer.py SparseMoE's grouped path: router logits,
// route, the layer's ExpertSet (csrc/experts.h), then qwen2_moe's sigmoid-gated shared expert where it has one).
//
// Owns: the order of the per-layer calls, which is transformer.py's fused path (DecoderLayer / Attention / MLP
// with merged q/k/v and gate/up, `num_tokens` given) call for call, on the same registered operators
// (draftwise_q4x8::linear / draftwise_q6k::linear / draftwise_q8_0::linear, draftwise_glue::*,
// draftwise_attn::decode) with the same arguments, views and
// shapes — so its output is bitwise the Python loop's (tests/test_kernels_stack.py checks that). What it saves
// is the Python between those calls (module dispatch, argument parsing, views), during which the other core sat
// idle: 3-8 ms of a 1- or 9-row forward of the 1.5B on 2 cores (docs/ARCHITECTURE.md, Kernels).
// Knows nothing of how the weights were made, of the KV cache's lengths (the caller's KVCache.extend), of the
// embedding (Python, before), of the final norm and LM head beyond what Packed.set_head hands it (run_last: each
// row's last token through them, in the same call), nor of when a mixture's router may take the few-row
// router_logits op (the caller sends a mixture layer here only for calls its Python path would run that op
// on: transformer.py Router.FUSED_MAX_ROWS).
//
// The weights arrive as one flat list, WEIGHTS_PER_LAYER entries per layer in Slot order (defined below, only here;
// kernels/stack.py builds the list and takes the count from weights_per_layer()); optional entries (biases, q/k
// norms, a kind's unused entries, the separate k / v projections of a merged q|k|v) may be None. Each projection's
// kernel arrives in `kinds`, KINDS_PER_LAYER per layer in Proj order (Kind ids; kernels/stack.py reads the names
// from linear_kinds()). Each layer's feed-forward shape arrives in `ffn`, FFN_PER_LAYER per layer (FfnField), and a
// mixture layer's experts in `experts` (one entry per layer: its ExpertSet, None for a dense layer).
#include "experts.h"
#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/index.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

// The flat list's layout, the one definition of it: kernels/stack.py reads the count (weights_per_layer, SLOTS
// there; the entries per projection: linear_entries) and builds each layer's entries in this order; every offset
// follows from the one before it.
// A projection's entries, by its kind (its module's buffers; unused entries None, the bias always last):
//   q4x8: packed, sc, mn, d, dmin, None, bias;  every other kind (a block kernel): its linear op's packed buffers in
//   order (kernels/linear.py PACKED: q6k ql, qh, sc, d; q8_0 qw, d; ...; q6m's and q5x8's six the most), None up to 6, the bias
constexpr int64_t LINEAR = 7;
constexpr int64_t BIAS = LINEAR - 1;  // a projection's bias entry

enum Kind : int64_t { ABSENT = -1, Q4X8 = 0, Q6K = 1, NUM_KINDS = 9 };  // ids past Q6K: the block kernels below
// kernels/linear.py's registry names; a kind past Q6K calls draftwise_<name>::linear with its packed buffers
const char* const KIND_NAMES[NUM_KINDS] = {"q4x8", "q6k", "q8_0", "q8_1", "q4c", "q5m", "q6m", "q5x8", "q3k"};

enum Proj : int64_t { P_QKV = 0, P_K, P_V, P_O, P_GATE_UP, P_DOWN, KINDS_PER_LAYER };

enum Slot : int64_t {
    IN_NORM = 0,                      // input_layernorm.weight [hidden]
    QKV = IN_NORM + 1,                // the merged q|k|v projection, or q_proj where they are separate (LINEAR)
    K_PROJ = QKV + LINEAR,            // k_proj and v_proj where q/k/v are separate (kinds differ), else ABSENT
    V_PROJ = K_PROJ + LINEAR,
    Q_NORM = V_PROJ + LINEAR,         // per-head q / k norm weights [head_dim] (qwen3), or None
    K_NORM = Q_NORM + 1,
    O = K_NORM + 1,                   // o_proj
    POST_NORM = O + LINEAR,           // post_attention_layernorm.weight (the pre-MLP norm)
    GATE_UP = POST_NORM + 1,          // the dense MLP's merged gate|up projection, or a mixture's shared expert's
    DOWN = GATE_UP + LINEAR,          // (kinds ABSENT where a mixture has none); then its down_proj
    ROUTER = DOWN + LINEAR,           // a mixture's router weight [experts, hidden] float32 (mlp.gate), else None
    SHARED_GATE = ROUTER + 1,         // its shared expert's gate weight [1, hidden] float32, else None
    WEIGHTS_PER_LAYER = SHARED_GATE + 1,
};

// A layer's feed-forward shape in `ffn`: the width of its dense MLP or of its mixture's shared expert (0: none),
// the mixture's experts per row (0: a dense layer) and whether their weights are renormalised (norm_topk_prob).
enum FfnField : int64_t { F_INTERMEDIATE = 0, F_TOP_K, F_NORM_TOPK, FFN_PER_LAYER };

using OptT = std::optional<at::Tensor>;
using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const OptT&, int64_t, int64_t);
using Q6KFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const OptT&, int64_t, int64_t);
using Q6KWideFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const OptT&, int64_t);
using TakesFn = bool(int64_t);
using NormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double, double);
using AddNormFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                     double);
using RopeCacheFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, int64_t, const OptT&, const OptT&, double, double,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using GluFn = at::Tensor(const at::Tensor&, const OptT&, int64_t);
using RouterFn = at::Tensor(const at::Tensor&, const at::Tensor&);
using RouteFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t, bool);
using AttnFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, at::IntArrayRef, double, int64_t, int64_t);
using TreeFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, at::IntArrayRef, const at::Tensor&, double, int64_t, int64_t);

template <class Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// The block kernels' linear ops (kinds past Q6K), by name.
std::vector<c10::OperatorHandle> block_ops() {
    std::vector<c10::OperatorHandle> v;
    for (int64_t k = Q6K + 1; k < NUM_KINDS; ++k)
        v.push_back(c10::Dispatcher::singleton().findSchemaOrThrow((std::string("draftwise_") + KIND_NAMES[k] + "::linear").c_str(), ""));
    return v;
}

struct Ops {  // the registered operators, resolved once (all live in this library)
    c10::TypedOperatorHandle<LinearFn> linear = op<LinearFn>("draftwise_q4x8::linear");
    c10::TypedOperatorHandle<Q6KFn> q6k = op<Q6KFn>("draftwise_q6k::linear");
    c10::TypedOperatorHandle<Q6KWideFn> q6k_wide = op<Q6KWideFn>("draftwise_q6k::wide");  // gemm_q6k.cpp
    c10::TypedOperatorHandle<TakesFn> q6k_wide_takes = op<TakesFn>("draftwise_q6k::wide_takes");
    std::vector<c10::OperatorHandle> blocks = block_ops();  // by kind - Q6K - 1
    c10::TypedOperatorHandle<NormFn> rms_norm = op<NormFn>("draftwise_glue::rms_norm");
    c10::TypedOperatorHandle<AddNormFn> add_rms_norm = op<AddNormFn>("draftwise_glue::add_rms_norm");
    c10::TypedOperatorHandle<RopeCacheFn> rope_qk_cache = op<RopeCacheFn>("draftwise_glue::rope_qk_cache");
    c10::TypedOperatorHandle<GluFn> glu = op<GluFn>("draftwise_glue::glu");
    c10::TypedOperatorHandle<RouterFn> router_logits = op<RouterFn>("draftwise_glue::router_logits");
    c10::TypedOperatorHandle<RouteFn> route = op<RouteFn>("draftwise_glue::route");
    c10::TypedOperatorHandle<AttnFn> attend = op<AttnFn>("draftwise_attn::decode");
    c10::TypedOperatorHandle<TreeFn> attend_tree = op<TreeFn>("draftwise_attn::tree");
};

const Ops& ops() {
    static const Ops o;
    return o;
}

at::Tensor w_at(const c10::List<OptT>& w, int64_t i) {
    const OptT t = w.get(i);
    TORCH_CHECK(t.has_value() && t->defined(), "stack: weight ", i, " (slot ", i % WEIGHTS_PER_LAYER, ") is missing");
    return *t;
}

OptT opt(const c10::List<OptT>& w, int64_t i) { return w.get(i); }

// A block kernel's linear through the boxed call: x, its packed buffers (the schema's count), bias, N, path auto.
at::Tensor block_linear(const c10::OperatorHandle& h, const c10::List<OptT>& w, int64_t at_, const at::Tensor& x2, int64_t N) {
    const int64_t packed = (int64_t)h.schema().arguments().size() - 4;
    torch::jit::Stack stack;
    stack.reserve(packed + 4);
    stack.emplace_back(x2);
    for (int64_t i = 0; i < packed; ++i) stack.emplace_back(w_at(w, at_ + i));
    stack.emplace_back(opt(w, at_ + BIAS));
    stack.emplace_back(N);
    stack.emplace_back((int64_t)-1);
    h.callBoxed(&stack);
    return stack[0].toTensor();
}

// Q4x8Linear.forward / Q6KLinear / Q80Linear / Q81Linear (_BlockLinear.forward), path auto, on rows:
// x2 [M, K] contiguous float32 -> [M, N]
at::Tensor linear_rows(const c10::List<OptT>& w, int64_t at_, int64_t kind, const at::Tensor& x2, int64_t N) {
    TORCH_CHECK(x2.is_contiguous() && x2.scalar_type() == at::kFloat, "stack: a projection's input must be float32");
    const Ops& o = ops();
    at::Tensor y;
    switch (kind) {
        case Q4X8:
            y = o.linear.call(x2, w_at(w, at_), w_at(w, at_ + 1), w_at(w, at_ + 2), w_at(w, at_ + 3), w_at(w, at_ + 4),
                              opt(w, at_ + BIAS), N, -1);
            break;
        case Q6K:  // Q6KLinear's path 'auto': wide calls take the AMX GEMM (rows bitwise the GEMV's), as in linear.py
            if (x2.size(0) > 1 && o.q6k_wide_takes.call(x2.size(0))) {
                y = o.q6k_wide.call(x2, w_at(w, at_), w_at(w, at_ + 1), w_at(w, at_ + 2), w_at(w, at_ + 3), opt(w, at_ + BIAS), N);
                break;
            }
            y = o.q6k.call(x2, w_at(w, at_), w_at(w, at_ + 1), w_at(w, at_ + 2), w_at(w, at_ + 3), opt(w, at_ + BIAS), N, -1);
            break;
        default:
            TORCH_CHECK(kind > Q6K && kind < NUM_KINDS, "stack: projection kind ", kind, " at weight ", at_,
                        " is not one of 0..", NUM_KINDS - 1);
            y = block_linear(o.blocks[kind - Q6K - 1], w, at_, x2, N);
    }
    return y;
}

// the same on x [B, T, K] -> [B, T, N] (x.reshape(-1, K) is contiguous float32 at every call site here)
at::Tensor linear(const c10::List<OptT>& w, int64_t at_, int64_t kind, const at::Tensor& x, int64_t N) {
    return linear_rows(w, at_, kind, x.reshape({-1, x.size(-1)}), N).view({x.size(0), x.size(1), N});
}

// A mixture layer's output for its normed input hn [B, T, hidden] (transformer.py SparseMoE.forward, grouped and
// fused, at most Router.FUSED_MAX_ROWS rows): router logits [M, E] float64, route -> each row's experts [M, k]
// ascending (appended to `routed`) and weights [M, k], the ExpertSet's run, then the shared expert's
// sigmoid(gate logits) (float64, rounded to float32) times its MLP, added; -> [B, T, hidden]
at::Tensor mixture(const c10::List<OptT>& w, int64_t base, const int64_t* kind, const int64_t* ffn,
                   draftwise_experts::ExpertSet& experts, const at::Tensor& hn, int64_t act,
                   std::vector<at::Tensor>& routed) {
    const Ops& o = ops();
    const int64_t B = hn.size(0), T = hn.size(1), hidden = hn.size(2);
    const at::Tensor rows = hn.reshape({B * T, hidden});  // [M, hidden]
    auto [chosen, weights] = o.route.call(o.router_logits.call(rows, w_at(w, base + ROUTER)), ffn[F_TOP_K],
                                          ffn[F_NORM_TOPK] != 0);
    routed.push_back(chosen);
    at::Tensor out = experts.run(rows, chosen, weights);  // [M, hidden]
    if (ffn[F_INTERMEDIATE] > 0) {  // the shared expert
        const at::Tensor scale = at::sigmoid(o.router_logits.call(rows, w_at(w, base + SHARED_GATE))).to(at::kFloat);
        const at::Tensor gu = linear_rows(w, base + GATE_UP, kind[P_GATE_UP], rows, 2 * ffn[F_INTERMEDIATE]);
        const at::Tensor sh = linear_rows(w, base + DOWN, kind[P_DOWN], o.glu.call(gu, OptT(), act), hidden);
        out = at::add(out, at::mul(scale, sh));
    }
    return out.view({B, T, hidden});
}

// x [B, T, hidden] float32 -> x after every layer. weights: WEIGHTS_PER_LAYER entries per layer (Slot);
// keys / values: each layer's page pool [P, Hkv, BS, D]; cos / sin: each layer's RoPE angles [B * T, D / 2];
// tables [B, pages per sequence] (each sequence's pages, kv_cache.py), positions [B, T] int64; num_tokens [B]: real tokens per row (the row-exact attention);
// windows: each layer's sliding window (0: none); dims = (num_heads, num_kv_heads, head_dim, activation: 0 silu /
// 1 gelu tanh); norm = (eps, offset) of the layer norms; qk_norm = (eps, offset) of the
// q / k norms; scale: the attention's softmax scale; ancestors: a token tree's [B, T] masks (draftwise_attn::tree),
// or none (the chunk is causal); kinds: KINDS_PER_LAYER per layer (Proj order), each projection's Kind (P_K and
// P_V ABSENT where q/k/v are merged; P_GATE_UP and P_DOWN ABSENT in a mixture layer without a shared expert);
// ffn: FFN_PER_LAYER per layer (FfnField); experts: per layer, a mixture's ExpertSet or None.
// Returns x after every layer and, for each mixture layer in order, its rows' experts [B * T, k] int64 (what the
// step read: transformer.py SparseMoE.touched).
std::tuple<at::Tensor, std::vector<at::Tensor>> layers(const at::Tensor& x_in, const c10::List<OptT>& weights, at::TensorList keys, at::TensorList values,
                  at::TensorList cos, at::TensorList sin, const at::Tensor& tables, const at::Tensor& positions,
                  at::IntArrayRef num_tokens, at::IntArrayRef windows, at::IntArrayRef dims, at::ArrayRef<double> norm,
                  at::ArrayRef<double> qk_norm, double scale, const OptT& ancestors, at::IntArrayRef kinds,
                  at::IntArrayRef ffn, const c10::List<c10::IValue>& experts) {
    const int64_t L = (int64_t)keys.size();
    TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat, "stack: x must be [B, T, hidden] float32");
    TORCH_CHECK((int64_t)weights.size() == L * WEIGHTS_PER_LAYER, "stack: ", weights.size(), " weights for ", L,
                " layers (", WEIGHTS_PER_LAYER, " each)");
    TORCH_CHECK((int64_t)values.size() == L && (int64_t)cos.size() == L && (int64_t)sin.size() == L &&
                    (int64_t)windows.size() == L, "stack: keys, values, cos, sin and windows need one entry per layer");
    TORCH_CHECK(dims.size() == 4 && norm.size() == 2 && qk_norm.size() == 2, "stack: dims (4), norm (2), qk_norm (2)");
    TORCH_CHECK((int64_t)kinds.size() == L * KINDS_PER_LAYER, "stack: ", kinds.size(), " projection kinds for ", L,
                " layers (", KINDS_PER_LAYER, " each)");
    TORCH_CHECK((int64_t)ffn.size() == L * FFN_PER_LAYER && (int64_t)experts.size() == L, "stack: ", ffn.size(),
                " ffn entries and ", experts.size(), " expert sets for ", L, " layers (", FFN_PER_LAYER, " and 1 each)");
    std::vector<draftwise_experts::ExpertSet*> sets(L, nullptr);  // held by `experts` for the call
    for (int64_t l = 0; l < L; ++l) {
        const int64_t* k = kinds.data() + l * KINDS_PER_LAYER;
        const int64_t* f = ffn.data() + l * FFN_PER_LAYER;
        TORCH_CHECK((k[P_K] == ABSENT) == (k[P_V] == ABSENT), "stack: layer ", l, ": k_proj and v_proj come together");
        const bool moe = f[F_TOP_K] > 0, mlp = f[F_INTERMEDIATE] > 0;  // a mixture; a dense MLP or shared expert
        TORCH_CHECK(moe || mlp, "stack: layer ", l, " has neither an MLP nor experts");
        TORCH_CHECK(moe == experts.get(l).isCustomClass(), "stack: layer ", l, (moe ? " routes to experts but has no "
                    "ExpertSet" : " is dense but has an expert set"));
        if (moe) sets[l] = experts.get(l).toCustomClass<draftwise_experts::ExpertSet>().get();
        for (int64_t p = 0; p < KINDS_PER_LAYER; ++p) {
            const bool may_lack = p == P_K || p == P_V || (!mlp && (p == P_GATE_UP || p == P_DOWN));
            TORCH_CHECK((k[p] == ABSENT && may_lack) || (k[p] >= 0 && k[p] < NUM_KINDS), "stack: layer ", l,
                        ": projection ", p, " has kind ", k[p]);
        }
    }
    const int64_t H = dims[0], Hkv = dims[1], D = dims[2], act = dims[3];
    const int64_t B = x_in.size(0), T = x_in.size(1), hidden = x_in.size(2);
    const int64_t Nq = H * D, Nkv = Hkv * D;
    const Ops& o = ops();
    at::Tensor x = x_in;
    std::vector<at::Tensor> routed;  // each mixture layer's experts
    for (int64_t l = 0; l < L; ++l) {
        const int64_t base = l * WEIGHTS_PER_LAYER;
        const int64_t* kind = kinds.data() + l * KINDS_PER_LAYER;
        // Attention (transformer.py Attention.forward, fused; q/k/v merged, or three calls q, k, v where not)
        const at::Tensor h = o.rms_norm.call(x, w_at(weights, base + IN_NORM), norm[0], norm[1]);
        std::vector<at::Tensor> parts;
        if (kind[P_K] == ABSENT) {
            parts = linear(weights, base + QKV, kind[P_QKV], h, Nq + 2 * Nkv).split_with_sizes({Nq, Nkv, Nkv}, -1);
        } else {
            parts.push_back(linear(weights, base + QKV, kind[P_QKV], h, Nq));
            parts.push_back(linear(weights, base + K_PROJ, kind[P_K], h, Nkv));
            parts.push_back(linear(weights, base + V_PROJ, kind[P_V], h, Nkv));
        }
        at::Tensor q = o.rope_qk_cache.call(parts[0], parts[1], parts[2], cos[l], sin[l], D, opt(weights, base + Q_NORM),
                                            opt(weights, base + K_NORM), qk_norm[0], qk_norm[1], keys[l], values[l],
                                            tables, positions);
        q = q.view({B, T, H, D}).transpose(1, 2);  // [B, H, T, D]
        const at::Tensor att =
            ancestors.has_value()
                ? o.attend_tree.call(q, keys[l], values[l], tables, positions, num_tokens, *ancestors, scale, windows[l], -1)
                : o.attend.call(q, keys[l], values[l], tables, positions, num_tokens, scale, windows[l], -1);
        const at::Tensor a = linear(weights, base + O, kind[P_O], att.transpose(1, 2).reshape({B, T, -1}), hidden);
        // DecoderLayer.forward (fused): x, h = add_rms_norm(x, a); x = x + mlp(h)
        auto [xs, hn] = o.add_rms_norm.call(x, a, w_at(weights, base + POST_NORM), norm[0], norm[1]);
        const int64_t* f = ffn.data() + l * FFN_PER_LAYER;
        at::Tensor m;
        if (sets[l] != nullptr) {
            m = mixture(weights, base, kind, f, *sets[l], hn, act, routed);
        } else {
            const at::Tensor gu = linear(weights, base + GATE_UP, kind[P_GATE_UP], hn, 2 * f[F_INTERMEDIATE]);
            m = linear(weights, base + DOWN, kind[P_DOWN], o.glu.call(gu, OptT(), act), hidden);
        }
        x = at::add(xs, m);
    }
    return {x, routed};
}

// A model's arguments of `layers` that do not change between forwards (the weights, kinds, feed-forward shapes,
// expert sets, windows, dims, norms and scale), converted from Python once: a decode step of the 4-layer MoE file
// spent ~0.25 ms of its ~9 ms (1 thread) turning the ~170-entry lists into the op's arguments again, time the
// other core idles. `layers` runs exactly the op above on them.
struct Packed : torch::CustomClassHolder {
    c10::List<OptT> weights;
    std::vector<int64_t> windows, dims, kinds, ffn;
    std::vector<double> norm, qk_norm;
    double scale;
    c10::List<c10::IValue> experts;

    Packed(c10::List<OptT> w, std::vector<int64_t> win, std::vector<int64_t> d, std::vector<double> n,
           std::vector<double> qk, double sc, std::vector<int64_t> k, std::vector<int64_t> f, c10::List<c10::IValue> e)
        : weights(std::move(w)), windows(std::move(win)), dims(std::move(d)), kinds(std::move(k)), ffn(std::move(f)),
          norm(std::move(n)), qk_norm(std::move(qk)), scale(sc), experts(std::move(e)) {}

    // The model's final norm and LM head (set_head), for `last`: a forward whose caller wants the logits of each
    // row's last token only (transformer.py Decoder.forward's last_only: x[:, -1:], model.norm, lm_head).
    c10::List<OptT> head;  // the head's LINEAR entries (its Kind's), then the final norm's weight [hidden]
    int64_t head_kind = ABSENT, head_n = 0;
    double head_eps = 0.0, head_off = 0.0;

    std::tuple<at::Tensor, std::vector<at::Tensor>> run(const at::Tensor& x, std::vector<at::Tensor> keys,
                                                        std::vector<at::Tensor> values, std::vector<at::Tensor> cos,
                                                        std::vector<at::Tensor> sin, const at::Tensor& tables,
                                                        const at::Tensor& positions, std::vector<int64_t> num_tokens,
                                                        const OptT& ancestors) {
        return layers(x, weights, keys, values, cos, sin, tables, positions, num_tokens, windows, dims, norm, qk_norm,
                      scale, ancestors, kinds, ffn, experts);
    }

    void set_head(c10::List<OptT> w, int64_t kind, int64_t n, double eps, double off) {
        TORCH_CHECK((int64_t)w.size() == LINEAR + 1, "stack: set_head takes the head's ", LINEAR,
                    " entries and the final norm's weight, not ", w.size());
        TORCH_CHECK(kind >= 0 && kind < NUM_KINDS && n > 0, "stack: set_head: kind ", kind, ", ", n, " outputs");
        w_at(w, LINEAR);  // (the norm's weight must be there)
        head = std::move(w);
        head_kind = kind, head_n = n, head_eps = eps, head_off = off;
    }

    // run, then each row's last token (or its `index` [B, J] rows: logit_index) through the final RMSNorm (glue rms_norm, eps / offset of set_head) and the
    // head (its kernel as `linear` calls a projection): -> logits [B, 1, N] and run's experts. Python's
    // x[:, -1:] -> norm -> lm_head, call for call on the same view, so bitwise; ~0.35 ms of Python and op dispatch
    // sooner a decode step of the 4-layer MoE file (the step's weights evict those objects from the caches).
    std::tuple<at::Tensor, std::vector<at::Tensor>> run_last(const at::Tensor& x, std::vector<at::Tensor> keys,
                                                             std::vector<at::Tensor> values, std::vector<at::Tensor> cos,
                                                             std::vector<at::Tensor> sin, const at::Tensor& tables,
                                                             const at::Tensor& positions,
                                                             std::vector<int64_t> num_tokens, const OptT& ancestors,
                                                             const OptT& index) {
        TORCH_CHECK(head_kind != ABSENT, "stack: Packed.last before set_head");
        auto [y, routed] = run(x, keys, values, cos, sin, tables, positions, num_tokens, ancestors);
        const int64_t B = y.size(0), T = y.size(1);
        at::Tensor rows;  // [B, J, hidden]: Python's x[torch.arange(B)[:, None], index], or x[:, -1:]
        if (index.has_value()) {
            TORCH_CHECK(index->dim() == 2 && index->size(0) == B, "stack: Packed.last's index must be [B, J]");
            rows = at::index(y, {c10::optional<at::Tensor>(at::arange(B, index->options()).unsqueeze(1)),
                                 c10::optional<at::Tensor>(*index)});
        } else {
            rows = y.slice(1, T - 1, T);
        }
        const at::Tensor h = ops().rms_norm.call(rows, w_at(head, LINEAR), head_eps, head_off);
        return {linear(head, 0, head_kind, h, head_n), routed};
    }
};

}  // namespace

TORCH_LIBRARY(draftwise_stack, m) {
    m.class_<Packed>("Packed")
        .def(torch::init<c10::List<OptT>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>,
                         std::vector<double>, double, std::vector<int64_t>, std::vector<int64_t>,
                         c10::List<c10::IValue>>())
        .def("layers", &Packed::run)
        .def("set_head", &Packed::set_head)
        .def("last", &Packed::run_last);
    m.def("layers(Tensor x, Tensor?[] weights, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor[] cos, Tensor[] sin, "
          "Tensor tables, Tensor positions, int[] num_tokens, int[] windows, int[] dims, float[] norm, "
          "float[] qk_norm, float scale, Tensor? ancestors, int[] kinds, int[] ffn, Any[] experts) -> (Tensor, Tensor[])");
    m.def("weights_per_layer() -> int", []() -> int64_t { return WEIGHTS_PER_LAYER; });
    m.def("ffn_per_layer() -> int", []() -> int64_t { return FFN_PER_LAYER; });
    m.def("kinds_per_layer() -> int", []() -> int64_t { return KINDS_PER_LAYER; });
    m.def("linear_entries() -> int", []() -> int64_t { return LINEAR; });
    m.def("linear_kinds() -> str[]", []() {  // Kind ids 0.. in order: kernels/stack.py maps modules to them
        return std::vector<std::string>(KIND_NAMES, KIND_NAMES + NUM_KINDS);
    });
}

TORCH_LIBRARY_IMPL(draftwise_stack, CPU, m) { m.impl("layers", &layers); }

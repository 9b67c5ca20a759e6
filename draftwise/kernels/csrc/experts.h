// Grouped experts' handle (csrc/experts.cpp): the class the Python side holds as
// torch.classes.draftwise_experts.ExpertSet, declared here so the layer loop (csrc/stack.cpp) can run a mixture
// layer's experts in the same call as the rest of the layer.
//
// Owns only the declaration: what an ExpertSet holds (each expert's packed buffers, views of the modules', the
// kinds' operators, and the raw GEMVs of its direct path) and its `run`, whose rule (grouping, threads, the row's sum in ascending expert order) is
// experts.cpp's. Knows nothing of routing or of models.
#pragma once
#pragma GCC diagnostic ignored "-Wstringop-overflow"  // torch's custom-class templates, instantiated here (not ours)
#include <torch/custom_class.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>
#include "gemv_rows.h"

namespace draftwise_experts {

struct KindOps {
    c10::OperatorHandle linear;
    std::optional<c10::OperatorHandle> wide, wide_takes;
    size_t buffers;  // packed buffers per linear, in the operator's argument order
};

// One expert's linear as the direct path calls it (gemv_rows.h's raw GEMVs): its kernel and weight struct.
struct DirectLinear {
    enum Kernel { Q4X8, Q6K } kernel;  // q4x8 / q5x8 (q4.qh set) through dw_q4x8_gemv_rows; q6k through dw_q6k_gemv_rows
    DwQ4 q4{};
    DwQ6 q6{};
    // whether the op, called on `path` with n rows, would hand them to its wide side (experts.cpp run_linear's rule)
    bool takes_wide(int64_t n, int64_t path) const;
    // y [n, N] = x [n, K] times the weights, on the calling thread (scratch: dw_gemv_rows_scratch(n, K) bytes)
    void run(const float* x, int64_t n, float* y, int64_t path, uint8_t* scratch) const;
};

struct ExpertSet : torch::CustomClassHolder {
    // gate_up: per expert, gu_buffers tensors of a merged gate | up linear [2 I, H] of kind gu_kind; down: per
    // expert, down_buffers tensors of a [H, I] linear of kind down_kind; gu_width 2 I, down_width H; activation:
    // glue.py ACTIVATIONS' id; kernel_path: the linears' path (library.PATHS)
    ExpertSet(std::string gu_kind, int64_t gu_buffers, std::vector<at::Tensor> gu, int64_t gu_width,
              std::string down_kind, int64_t down_buffers, std::vector<at::Tensor> down, int64_t down_width,
              int64_t activation, int64_t kernel_path);

    // x [M, H] float32, experts [M, k] int64 ascending per row, weights [M, k] float32 -> out [M, down_N]
    at::Tensor run(const at::Tensor& x_in, const at::Tensor& experts_in, const at::Tensor& weights_in);

    int64_t num_experts() const { return E; }

    KindOps gu_, down_;
    // per expert, its gate/up and down as raw GEMVs; empty where a kind has none (q4x8, q5x8, q6k have) or the
    // activation is not silu: then every expert runs through the ops (experts.cpp)
    std::vector<DirectLinear> gu_direct, down_direct;
    std::vector<at::Tensor> gu_w, down_w;
    int64_t gu_N, down_N, act, path, E = 0;
    c10::OperatorHandle glu;
};

}  // namespace draftwise_experts

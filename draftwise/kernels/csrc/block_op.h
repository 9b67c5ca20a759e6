// The shared torch-side driver of the block kernels' operators (q4x8.cpp, q6k.cpp, q8_0.cpp): the argument checks every
// operator repeats, and the two thread splits of a call. Included only by torch-facing units.
//
// Owns: bias_of (an optional [N] float32 bias, checked, as a pointer), check_weight (a packed buffer's dtype,
// contiguity and size), over_rows (activation quantization split over rows once the call is large enough to pay
// for threads) and over_blocks (the GEMV split over 16-column blocks, never over K: each block's outputs are
// computed by one thread alone, so a thread count changes no bit of them). Knows nothing of any layout.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <optional>

namespace {
namespace dwop {

inline const float* bias_of(const std::optional<at::Tensor>& bias, int64_t N) {
    if (!bias.has_value() || !bias->defined()) return nullptr;
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be [N] float32");
    return bias->data_ptr<float>();
}

inline void check_weight(const at::Tensor& t, at::ScalarType dtype, int64_t numel, const char* name) {
    TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == numel, name, ": bad shape");
}

template <class F>
inline void over_rows(int64_t M, int64_t K, F&& rows) {
    if (M * K >= (1 << 16)) {
        at::parallel_for(0, M, 1, rows);
    } else {
        rows(0, M);
    }
}

template <class F>
inline void over_blocks(int64_t NB, F&& blocks) {
    at::parallel_for(0, NB, 1, blocks);
}

}  // namespace dwop
}  // namespace

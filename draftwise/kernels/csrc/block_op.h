// The shared torch-side driver of the block kernels' operators (q4x8.cpp, q6k.cpp, q8_0.cpp): the argument checks every
// operator repeats, and the two thread splits of a call. Included only by torch-facing units.
//
// Owns: bias_of (an optional [N] float32 bias, checked, as a pointer), check_weight (a packed buffer's dtype,
// contiguity and size), Scratch (a call's activation buffers, each allocated and its pointer taken in one line),
// output (the call's y and its scratch),
// scalar_cells (the scalar paths' walk over outputs: a type supplies one output's float sum), over_rows (activation quantization split over rows once the call is large enough to pay
// for threads) and over_blocks (the GEMV split over 16-column blocks, never over K: each block's outputs are
// computed by one thread alone, so a thread count changes no bit of them). Knows nothing of any layout.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <optional>
#include <vector>

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

// The buffers one call quantizes its activations into: each `make` allocates [sizes] of `dtype` on x's device and
// returns its data; they live as long as the Scratch.
struct Scratch {
    const at::Tensor& like;
    std::vector<at::Tensor> keep;

    explicit Scratch(const at::Tensor& x) : like(x) {}

    template <class T>
    T* make(at::IntArrayRef sizes, at::ScalarType dtype) {
        keep.push_back(at::empty(sizes, like.options().dtype(dtype)));
        return keep.back().data_ptr<T>();
    }
};

// y [M, N] float32 for x [M, K]: body(scratch, y's data) fills it (quantizes x into the scratch, runs the GEMV);
// nothing runs for M = 0.
template <class Body>
inline at::Tensor output(const at::Tensor& x, int64_t N, Body&& body) {
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    if (x.size(0) > 0) {
        Scratch s(x);
        body(s, y.data_ptr<float>());
    }
    return y;
}

// The scalar paths' walk: out[m * N + n] = cell(b, j, m) + bias[n] for the live columns n = 16 b + j < N of the
// blocks [b0, b1), every row m < M (cell: the type's one output before its bias, in its float order).
template <class Cell>
inline void scalar_cells(int64_t N, int64_t M, int64_t b0, int64_t b1, const float* bias, float* out, Cell&& cell) {
    for (int64_t b = b0; b < b1; ++b)
        for (int j = 0; j < 16 && b * 16 + j < N; ++j)
            for (int64_t m = 0; m < M; ++m) out[m * N + b * 16 + j] = cell(b, j, m) + (bias ? bias[b * 16 + j] : 0.0f);
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

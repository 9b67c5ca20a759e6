// q8_0 wide side, the hooks the GEMV's operator (q8_0.cpp) calls: whether a path-'auto' call of M rows goes to the
// wide side of its kernel (q8_0, q8_1, q4c, q5m: each its own measured switch), and the wide side itself. Defined in
// gemm_q8_0.cpp; declared here for q8_0.cpp. Knows nothing of the layout (q8_0.h) or of the tile loop.
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include "q8_0.h"

// The kernel family's four kernels by their weight form: codes (lut set: q4c, q5m) or bytes, with a min (q8_1, q5m)
// or without. A path-'auto' call of M rows of that kernel takes the wide side when this is true.
bool dw_q80_wide_takes(bool codes, bool min, int64_t M);

// y [M, N] float32 (allocated) for x [M, K] float32 contiguous and the weights `w` (checked by the caller): every row
// bitwise the GEMV's row. Fails on a CPU without AVX-512 VNNI (or with a $DRAFTWISE_MAX_ISA cap below it).
void dw_q80_wide(const DwQ80* w, const float* x, int64_t M, int64_t K, int64_t N, float* y);

// draftwise_q8_0::linear and its siblings' operator (q8_0.cpp), arguments checked there: `wide` runs the wide side
// whatever M is (each kernel's `wide` op), else path-'auto' calls take it from the kernel's switch width on.
at::Tensor dw_q80_linear(const at::Tensor& x, const at::Tensor& qw, const std::optional<at::Tensor>& qh,
                         const std::optional<at::Tensor>& lut, const at::Tensor& d, const std::optional<at::Tensor>& m,
                         const std::optional<at::Tensor>& bias, int64_t N, int64_t path, bool wide);

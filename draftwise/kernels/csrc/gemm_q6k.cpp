// q6k wide side, torch-facing: the operator draftwise_q6k::wide (the AMX GEMM for Q6_K weights), the smallest row
// count from which path-'auto' callers hand a call to it (set from Python, which measures it:
// kernels/q4x8.py wide_min_rows), and the C++ entry points (dw_q6k_wide_takes, dw_q6k_wide) a C++ caller (the
// layer loop) uses the same way. Owns: argument checks, quantizing the activations tile-major (gemm_q6k.h's
// DwQ8Tiles, one row at a time with q4x8's dw_q8_rows_avx512: the GEMV's very values) and threading over 16-column
// blocks. Knows nothing of models; the arithmetic is q6k.h's, the tile loop gemm_q6k_amx.cpp's, whether AMX may
// run here gemm_q4x8.cpp's (dw_amx_usable). Every row is bitwise the Q6_K GEMV's row (tests/test_kernels_gemm_q6k.py),
// so which side serves a call changes speed only.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>
#include "gemm_q6k.h"
#include "q4x8.h"

bool dw_amx_usable();

namespace {

constexpr int64_t CHUNK_BYTES = 1536 * 1024;  // int8 activations per row chunk: most of a 2 MB L2

std::atomic<int64_t> min_rows{std::numeric_limits<int64_t>::max()};  // until Python sets it: never

}  // namespace

#ifndef DW_HAVE_X86
extern "C" int64_t dw_q6k_amx_scratch_bytes(int64_t, int64_t) { return 0; }
extern "C" void dw_q6k_gemm_amx(const DwQ6*, const DwQ8Tiles*, float*, int64_t, int64_t, uint8_t*) {}
#endif

// A path-'auto' Q6_K linear of M rows should call dw_q6k_wide when this is true.
bool dw_q6k_wide_takes(int64_t M) { return M >= min_rows.load(std::memory_order_relaxed) && dw_amx_usable(); }

// x [M, K] float32 -> y [M, N] float32; the weights as draftwise_q6k::linear takes them (ql [NB, G, 4, 64] uint8,
// qh [NB, G, 2, 64] uint8, sc [NB, G, 2, 16] int8, d [NB, S, 16] float32, bias [N] float32 or undefined).
at::Tensor dw_q6k_wide(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                       const at::Tensor& d, const std::optional<at::Tensor>& bias, int64_t N) {
    TORCH_CHECK(dw_amx_usable(), "q6k wide: this CPU or process cannot run AMX int8 tiles");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32 contiguous");
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK(K % 256 == 0, "Q6_K needs K a multiple of 256");
    TORCH_CHECK(N >= 1, "N must be >= 1");
    const int64_t G = K / 32, S = K / 256, NB = (N + 15) / 16;
    TORCH_CHECK(ql.scalar_type() == at::kByte && ql.is_contiguous() && ql.numel() == NB * G * 256, "ql: bad shape");
    TORCH_CHECK(qh.scalar_type() == at::kByte && qh.is_contiguous() && qh.numel() == NB * G * 128, "qh: bad shape");
    TORCH_CHECK(sc.scalar_type() == at::kChar && sc.is_contiguous() && sc.numel() == NB * G * 32, "sc: bad shape");
    TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == NB * S * 16, "d: bad shape");
    const float* bias_p = nullptr;
    if (bias.has_value() && bias->defined()) {
        TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias must be [N] float32");
        bias_p = bias->data_ptr<float>();
    }
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    const int64_t Mp = (M + 31) / 32 * 32;
    at::Tensor q = at::empty({Mp / 16, K / 64, 16, 64}, x.options().dtype(at::kChar));  // tile-major (gemm_q6k.h)
    at::Tensor dx = at::empty({Mp, S}, x.options());  // padding rows never read
    const float* xp = x.data_ptr<float>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* dxp = dx.data_ptr<float>();
    // one row at a time as a 1-row matrix ([G, 1, 32] is the row's K bytes in order): the GEMV's very values, then
    // its 64-byte pieces scattered to their tiles
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
        std::vector<int8_t> row(K);
        std::vector<int16_t> qsum(S * 8);  // written by the quantizer, not needed here
        for (int64_t r = r0; r < r1; ++r) {
            dw_q8_rows_avx512(xp + r * K, 1, K, row.data(), dxp + r * S, qsum.data(), 0, 1);
            int8_t* dst = qp + (r / 16) * K * 16 + (r % 16) * 64;
            for (int64_t j = 0; j < K / 64; ++j) std::memcpy(dst + j * 1024, row.data() + j * 64, 64);
        }
    });
    for (int64_t r = M; r < Mp; ++r) {  // padding rows of the last tile: zero (their outputs are never stored)
        int8_t* dst = qp + (r / 16) * K * 16 + (r % 16) * 64;
        for (int64_t j = 0; j < K / 64; ++j) std::memset(dst + j * 1024, 0, 64);
    }
    DwQ6 w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(), bias_p, N, K, G, S};
    float* yp = y.data_ptr<float>();
    // Rows in chunks whose activations stay in a core's L2 while every block passes over them; each block's tiles
    // are rebuilt per chunk. A row's arithmetic is the same in every chunk: bits unchanged.
    const int64_t chunk = std::max<int64_t>(128, std::min<int64_t>(1024, CHUNK_BYTES / K / 32 * 32));
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        DwQ8Tiles a{qp + m0 * K, dxp + m0 * S, std::min(chunk, M - m0), K};
        at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
            thread_local std::vector<uint8_t> scratch;
            scratch.resize(dw_q6k_amx_scratch_bytes(K, a.M) + 64);
            uint8_t* aligned = scratch.data() + (64 - (uintptr_t)scratch.data() % 64) % 64;
            dw_q6k_gemm_amx(&w, &a, yp + m0 * N, b0, b1, aligned);
        });
    }
    return y;
}

namespace {

bool wide_available() { return dw_amx_usable(); }

bool wide_takes(int64_t M) { return dw_q6k_wide_takes(M); }

void set_wide_min_rows(int64_t rows) {
    TORCH_CHECK(rows >= 1, "wide_min_rows must be >= 1");
    min_rows.store(rows, std::memory_order_relaxed);
}

int64_t get_wide_min_rows() { return min_rows.load(std::memory_order_relaxed); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftwise_q6k, m) {
    m.def("wide(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor? bias, int N) -> Tensor");
    m.def("wide_available() -> bool", &wide_available);
    m.def("wide_takes(int rows) -> bool", &wide_takes);
    m.def("set_wide_min_rows(int rows) -> ()", &set_wide_min_rows);
    m.def("wide_min_rows() -> int", &get_wide_min_rows);
}

TORCH_LIBRARY_IMPL(draftwise_q6k, CPU, m) { m.impl("wide", &dw_q6k_wide); }

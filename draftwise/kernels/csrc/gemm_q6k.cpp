// q6k wide side, torch-facing: the operator draftwise_q6k::wide (the AMX GEMM for Q6_K weights), the smallest row
// count from which path-'auto' callers hand a call to it (set from Python, which measures it:
// kernels/q4x8.py wide_min_rows), and the C++ entry points (dw_q6k_wide_takes, dw_q6k_wide) a C++ caller (the
// layer loop) uses the same way. Owns: threading over 16-column blocks of row chunks. The argument checks are the
// GEMV's (q6k.cpp's dw_q6k_check), the activations gemm_q4x8.cpp's tile-major quantization (gemm_q6k.h's
// DwQ8Tiles: the GEMV's very values), the switch and chunk size gemm_wide.h's. Knows nothing of models; the
// arithmetic is q6k.h's, the tile loop gemm_q6k_amx.cpp's, whether AMX may run here gemm_q4x8.cpp's
// (dw_amx_usable). Every row is bitwise the Q6_K GEMV's row (tests/test_kernels_gemm_q6k.py), so which side
// serves a call changes speed only.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include "gemm_q6k.h"
#include "gemm_wide.h"

bool dw_amx_usable();

namespace {

DwWideSwitch wide_switch;  // from how many rows path-'auto' calls come here (gemm_wide.h)

}  // namespace

#ifndef DW_HAVE_X86
extern "C" int64_t dw_q6k_amx_scratch_bytes(int64_t, int64_t) { return 0; }
extern "C" void dw_q6k_gemm_amx(const DwQ6*, const DwQ8Tiles*, float*, int64_t, int64_t, uint8_t*) {}
#endif

// A path-'auto' Q6_K linear of M rows should call dw_q6k_wide when this is true.
bool dw_q6k_wide_takes(int64_t M) { return wide_switch.takes(M) && dw_amx_usable(); }

// x [M, K] float32 -> y [M, N] float32; the weights as draftwise_q6k::linear takes them (ql [NB, G, 4, 64] uint8,
// qh [NB, G, 2, 64] uint8, sc [NB, G, 2, 16] int8, d [NB, S, 16] float32, bias [N] float32 or undefined).
at::Tensor dw_q6k_wide(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                       const at::Tensor& d, const std::optional<at::Tensor>& bias, int64_t N) {
    TORCH_CHECK(dw_amx_usable(), "q6k wide: this CPU or process cannot run AMX int8 tiles");
    const float* bias_p = dw_q6k_check(x, ql, qh, sc, d, bias, N);  // q6k.cpp: the GEMV's checks
    const int64_t M = x.size(0), K = x.size(1), S = K / 256, NB = (N + 15) / 16;
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    const int64_t Mp = (M + 31) / 32 * 32;
    at::Tensor q = at::empty({Mp / 16, K / 64, 16, 64}, x.options().dtype(at::kChar));  // tile-major (gemm_q6k.h)
    at::Tensor dx = at::empty({Mp, S}, x.options());  // padding rows never read
    int8_t* qp = q.data_ptr<int8_t>();
    float* dxp = dx.data_ptr<float>();
    dw_quantize_tiles(x.data_ptr<float>(), M, K, qp, dxp, nullptr);
    DwQ6 w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(), bias_p, N, K, K / 32, S};
    float* yp = y.data_ptr<float>();
    // Rows in chunks whose activations stay in a core's L2 while every block passes over them; each block's tiles
    // are rebuilt per chunk. A row's arithmetic is the same in every chunk: bits unchanged.
    const int64_t chunk = dw_wide_chunk_rows(K);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        DwQ8Tiles a{qp + m0 * K, dxp + m0 * S, std::min(chunk, M - m0), K};
        at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
            dw_q6k_gemm_amx(&w, &a, yp + m0 * N, b0, b1, dw_thread_scratch(dw_q6k_amx_scratch_bytes(K, a.M)));
        });
    }
    return y;
}

namespace {

bool wide_available() { return dw_amx_usable(); }

bool wide_takes(int64_t M) { return dw_q6k_wide_takes(M); }

void set_wide_min_rows(int64_t rows) { wide_switch.set(rows); }

int64_t get_wide_min_rows() { return wide_switch.get(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftwise_q6k, m) {
    m.def("wide(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor? bias, int N) -> Tensor");
    m.def("wide_available() -> bool", &wide_available);
    m.def("wide_takes(int rows) -> bool", &wide_takes);
    m.def("set_wide_min_rows(int rows) -> ()", &set_wide_min_rows);
    m.def("wide_min_rows() -> int", &get_wide_min_rows);
}

TORCH_LIBRARY_IMPL(draftwise_q6k, CPU, m) { m.impl("wide", &dw_q6k_wide); }

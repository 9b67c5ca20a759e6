// q8_0 wide side, torch-facing: what path-'auto' calls of many rows of the per-32 kernels (q8_0, q8_1, q4c, q5m:
// q8_0.h) take on an AVX-512 VNNI CPU (with AMX too: the family has no tile kernel), and each kernel's `wide` op.
// Owns: the four kernels' switches (gemm_wide.h's DwWideSwitch, set from Python, which measures each:
// kernels/library.py wide_min_rows), the row chunking (DW_VNNI_CHUNK_ROWS rows a chunk, each quantized into its own
// q8_0.h activation layout, then the AVX-512 GEMV's tile over every 16-column block of the chunk: a chunk's 32-byte
// group rows stay in L1/L2 while the blocks pass over them, where the GEMV's walk over a whole prompt strides
// [G, M, 32] across megabytes, a page a group, for every block) and the thread split (each thread its 16-column
// blocks, chunk after chunk). Measured on a Zen 4, one thread, 2,048 rows, thread CPU time, against the GEMV
// alternated in one process: q4c 1.36x at 2048 x 1536 (q|k|v), 1.49x at 1536 x 1536, 1.79x at 1536 x 8960, 1.06x at
// 17920 x 1536 (q5m 1.28x, 1.38x, 1.40x, 1.01x); at gate|up both sides run at ~0.7 VPDPBUSD a cycle, the bound of a
// group's 8 VPDPBUSD and its float steps (q8_0.h: a convert, a multiply and an FMA per row and 16 columns; three more
// with a min term), which no row order removes. Column panels of 16-64 blocks per thread, and chunks of 96 or 192
// rows, measured no faster. Knows nothing of models; the layout and arithmetic are q8_0.h's, the tile loop
// q8_0_avx512.cpp's, the quantizer's vector form gemm_q8_0_avx512.cpp's (bitwise the scalar one). Every row is
// bitwise the GEMV's row (tests/test_kernels_gemm_q8_0.py), so which side serves a call changes speed only.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include "block_op.h"
#include "gemm_q8_0.h"
#include "gemm_wide.h"

#ifndef DW_HAVE_X86
extern "C" void dw_q80_quantize_rows_avx512(const float*, int64_t, int64_t, int8_t*, float*, int32_t*, int32_t*,
                                            int64_t, int64_t) {}
#endif

namespace {

// from how many rows path-'auto' calls of each kernel come here (gemm_wide.h)
DwWideSwitch q8_0_switch, q8_1_switch, q4c_switch, q5m_switch;

DwWideSwitch& switch_of(bool codes, bool min) {
    return codes ? (min ? q5m_switch : q4c_switch) : (min ? q8_1_switch : q8_0_switch);
}

}  // namespace

bool dw_q80_wide_takes(bool codes, bool min, int64_t M) {
    return switch_of(codes, min).takes(M) && dw_vnni_only_side() != DwWideSide::NONE;
}

void dw_q80_wide(const DwQ80* w, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
    TORCH_CHECK(dw_vnni_only_side() != DwWideSide::NONE, "q8_0 wide: this CPU has no AVX-512 VNNI (or a $DRAFTWISE_MAX_ISA cap "
                "is below it)");
    const int64_t G = K / 32, NB = (N + 15) / 16;
    const int64_t chunk = DW_VNNI_CHUNK_ROWS, chunks = (M + chunk - 1) / chunk;
    // chunk c: q [G, Mc, 32], dx, qoff, qsum [G, Mc] (q8_0.h's layout for its Mc rows)
    const at::Tensor q_t = at::empty({chunks, G, chunk, 32}, at::kChar), dx_t = at::empty({chunks, G, chunk}, at::kFloat);
    const at::Tensor qoff_t = at::empty({chunks, G, chunk}, at::kInt), qsum_t = at::empty({chunks, G, chunk}, at::kInt);
    int8_t* q = q_t.data_ptr<int8_t>();
    float* dx = dx_t.data_ptr<float>();
    int32_t *qoff = qoff_t.data_ptr<int32_t>(), *qsum = qsum_t.data_ptr<int32_t>();
    auto rows_of = [&](int64_t c) { return std::min(chunk, M - c * chunk); };
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
            const int64_t o = c * G * chunk;
            dw_q80_quantize_rows_avx512(x + c * chunk * K, rows_of(c), K, q + o * 32, dx + o,
                                        qoff + o, qsum + o, 0, rows_of(c));
        }
    });
    // each thread its blocks, a group of them at a time (gemm_wide.h), chunk after chunk (one fork for the call); a
    // block's weights at most a byte a value (q4c / q5m's codes less: smaller groups than fit) and its scales
    const int64_t block_bytes = 16 * K + G * 128;
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
        dw_vnni_walk(b0, b1, chunks, block_bytes, [&](int64_t c, int64_t g0, int64_t g1) {
            const int64_t o = c * G * chunk;
            DwQ80Act a{q + o * 32, dx + o, qoff + o, qsum + o, rows_of(c)};
            dw_q80_gemm_avx512(w, &a, y + c * chunk * N, g0, g1);
        });
    });
}

namespace {

// Each kernel's wide op: x [M, K] float32 -> y [M, N] by the wide side whatever M is (tests, the switch's probe);
// the arguments as its linear takes them, checked by it.
at::Tensor wide_q8_0(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d,
                     const std::optional<at::Tensor>& bias, int64_t N) {
    return dw_q80_linear(x, qw, std::nullopt, std::nullopt, d, std::nullopt, bias, N, -1, true);
}

at::Tensor wide_q8_1(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& m,
                     const std::optional<at::Tensor>& bias, int64_t N) {
    return dw_q80_linear(x, qw, std::nullopt, std::nullopt, d, m, bias, N, -1, true);
}

at::Tensor wide_q4c(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& lut, const at::Tensor& d,
                    const std::optional<at::Tensor>& bias, int64_t N) {
    return dw_q80_linear(x, qs, std::nullopt, lut, d, std::nullopt, bias, N, -1, true);
}

at::Tensor wide_q5m(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& qh, const at::Tensor& lut,
                    const at::Tensor& d, const at::Tensor& m, const std::optional<at::Tensor>& bias, int64_t N) {
    return dw_q80_linear(x, qs, qh, lut, d, m, bias, N, -1, true);
}

// A kernel's wide(x, <its packed buffers>, bias, N) schema, wide_takes(rows) (whether its path-'auto' linear of that
// many rows takes the wide side) and the ops every wide kind defines (gemm_wide.h).
template <DwWideSwitch& SW>
void define(torch::Library& m, const std::string& packed) {
    m.def(("wide(Tensor x, Tensor " + packed + ", Tensor? bias, int N) -> Tensor").c_str());
    m.def("wide_takes(int rows) -> bool", [](int64_t rows) { return SW.takes(rows) && dw_vnni_only_side() != DwWideSide::NONE; });
    dw_def_wide_ops<SW, dw_vnni_only_side>(m);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftwise_q8_0, m) { define<q8_0_switch>(m, "qw, Tensor d"); }
TORCH_LIBRARY_IMPL(draftwise_q8_0, CPU, m) { m.impl("wide", &wide_q8_0); }
TORCH_LIBRARY_FRAGMENT(draftwise_q8_1, m) { define<q8_1_switch>(m, "qw, Tensor d, Tensor m"); }
TORCH_LIBRARY_IMPL(draftwise_q8_1, CPU, m) { m.impl("wide", &wide_q8_1); }
TORCH_LIBRARY_FRAGMENT(draftwise_q4c, m) { define<q4c_switch>(m, "qs, Tensor lut, Tensor d"); }
TORCH_LIBRARY_IMPL(draftwise_q4c, CPU, m) { m.impl("wide", &wide_q4c); }
TORCH_LIBRARY_FRAGMENT(draftwise_q5m, m) { define<q5m_switch>(m, "qs, Tensor qh, Tensor lut, Tensor d, Tensor m"); }
TORCH_LIBRARY_IMPL(draftwise_q5m, CPU, m) { m.impl("wide", &wide_q5m); }

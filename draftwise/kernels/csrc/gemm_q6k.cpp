// q6k and q6m wide sides, torch-facing: the operator draftwise_q6k::wide (the AMX GEMM for Q6_K weights; on an AVX-512 VNNI
// CPU without AMX the AVX-512 GEMV over row chunks, also callable alone as wide_vnni), the smallest row count from
// which path-'auto' callers hand a call to it (set from Python, which measures it: kernels/library.py wide_min_rows),
// and the C++ entry points (dw_q6k_wide_takes, dw_q6k_wide) a C++ caller (the layer loop) uses the same way.
// Owns: threading over 16-column blocks of row chunks. The argument checks are the GEMV's (q6k.cpp's dw_q6k_check),
// the activations the GEMV's (gemm_q4x8.cpp's tile-major copy for AMX, gemm_q6k.h's DwQ8Tiles; q6k.cpp's
// dw_q6k_quantize_rows per chunk for VNNI), the switch, chunk sizes and which side runs gemm_wide.h's. Knows nothing
// of models; the arithmetic is q6k.h's, the tile loop gemm_q6k_amx.cpp's. Every row is bitwise the Q6_K GEMV's row
// (tests/test_kernels_gemm_q6k.py), so which side serves a call changes speed only. q6m (Q2_K) has the VNNI side
// alone (draftwise_q6m::wide, with the GEMV's min term), its own switch, and q6k.cpp's linear hands 'auto' calls to it.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <string>
#include "block_op.h"
#include "dispatch.h"
#include "gemm_q6k.h"
#include "gemm_wide.h"
#include "q6k.h"

namespace {

DwWideSwitch wide_switch;  // from how many rows path-'auto' calls come here (gemm_wide.h)

}  // namespace

#ifndef DW_HAVE_X86
extern "C" int64_t dw_q6k_amx_scratch_bytes(int64_t, int64_t) { return 0; }
extern "C" void dw_q6k_gemm_amx(const DwQ6*, const DwQ8Tiles*, float*, int64_t, int64_t, uint8_t*) {}
#endif

// A path-'auto' Q6_K linear of M rows should call dw_q6k_wide when this is true.
bool dw_q6k_wide_takes(int64_t M) { return wide_switch.takes(M) && dw_wide_side() != DwWideSide::NONE; }

namespace {

// The AMX side (gemm_q6k_amx.cpp's tile loop); the arguments checked.
at::Tensor wide_amx(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                    const at::Tensor& d, const float* bias_p, int64_t N) {
    const int64_t M = x.size(0), K = x.size(1), S = K / 256, NB = (N + 15) / 16;
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    const int64_t Mp = (M + 31) / 32 * 32;
    dwop::Scratch s(x);
    int8_t* qp = s.make<int8_t>({Mp / 16, K / 64, 16, 64}, at::kChar);  // tile-major (gemm_q6k.h)
    float* dxp = s.make<float>({Mp, S}, at::kFloat);                     // padding rows never read
    dw_quantize_tiles(x.data_ptr<float>(), M, K, qp, dxp, nullptr);
    DwQ6 w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(), bias_p, N, K, K / 32, S, nullptr, nullptr, 6};
    float* yp = y.data_ptr<float>();
    // Rows in chunks whose activations stay in a core's L2 while every block passes over them; each block's tiles
    // are rebuilt per chunk. A row's arithmetic is the same in every chunk: bits unchanged.
    const int64_t chunk = dw_wide_chunk_rows(K);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        DwQ8Tiles a{qp + m0 * K, dxp + m0 * S, std::min(chunk, M - m0), K};
        dw_for_blocks(NB, [&](int64_t b0, int64_t b1) {
            dw_q6k_gemm_amx(&w, &a, yp + m0 * N, b0, b1, dw_thread_scratch(dw_q6k_amx_scratch_bytes(K, a.M)));
        });
    }
    return y;
}

// The VNNI side (gemm_wide.h): rows in chunks of DW_VNNI_CHUNK_ROWS, each quantized into its own GEMV layout by the
// GEMV's quantizer (q6k.cpp's dw_q6k_quantize_rows, AVX-512 path), then the AVX-512 GEMV's kernel over every block
// of the chunk. Each row is the GEMV's row: the same values and the same kernel, whose rows never depend on M.
// With mn and dmin (q6m: GGUF Q2_K) the GEMV's min term rides along: the same kernel, its MIN instantiation; with
// value_bits 3 (q3k: GGUF Q3_K) its 3-bit planes.
at::Tensor wide_vnni(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                     const at::Tensor& d, const at::Tensor* mn, const at::Tensor* dmin, const float* bias_p, int64_t N,
                     int64_t value_bits = 6) {
    const int64_t M = x.size(0), K = x.size(1), G = K / 32, S = K / 256, NB = (N + 15) / 16;
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    const int64_t chunk = DW_VNNI_CHUNK_ROWS, chunks = (M + chunk - 1) / chunk;
    dwop::Scratch s(x);  // chunk c: q [G, Mc, 32], dx [S, Mc], qsum [S, Mc, 8], qsum16 [S, Mc, 16]
    int8_t* qp = s.make<int8_t>({chunks, G, chunk, 32}, at::kChar);
    float* dxp = s.make<float>({chunks, S, chunk}, at::kFloat);
    int16_t* qsp = s.make<int16_t>({chunks, S, chunk, 8}, at::kShort);
    int16_t* q16 = s.make<int16_t>({chunks, S, chunk, 16}, at::kShort);
    const float* xp = x.data_ptr<float>();
    auto rows_of = [&](int64_t c) { return std::min(chunk, M - c * chunk); };
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c)
            dw_q6k_quantize_rows(dwisa::AVX512, xp + c * chunk * K, rows_of(c), K, qp + c * G * chunk * 32,
                                 dxp + c * S * chunk, qsp + c * S * chunk * 8, q16 + c * S * chunk * 16, 0,
                                 rows_of(c));
    });
    DwQ6 w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(), bias_p, N, K, G, S,
           mn ? mn->data_ptr<int8_t>() : nullptr, mn ? dmin->data_ptr<float>() : nullptr, value_bits};
    float* yp = y.data_ptr<float>();
    // each thread its blocks, a group of them at a time (gemm_wide.h), chunk after chunk (one fork for the call); a
    // block's weights: its value planes, sc (and q6m's mn), d (and dmin)
    const int64_t block_bytes = 16 * K * value_bits / 8 + G * 32 * (mn ? 2 : 1) + S * 64 * (mn ? 2 : 1);
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
        dw_vnni_walk(b0, b1, chunks, block_bytes, [&](int64_t c, int64_t g0, int64_t g1) {
            DwQ8K16 a{qp + c * G * chunk * 32, dxp + c * S * chunk, q16 + c * S * chunk * 16, rows_of(c)};
            dw_q6k_gemm_avx512(&w, &a, yp + c * chunk * N, g0, g1);
        });
    });
    return y;
}

}  // namespace

// x [M, K] float32 -> y [M, N] float32; the weights as draftwise_q6k::linear takes them (ql [NB, G, 4, 64] uint8,
// qh [NB, G, 2, 64] uint8, sc [NB, G, 2, 16] int8, d [NB, S, 16] float32, bias [N] float32 or undefined).
at::Tensor dw_q6k_wide(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                       const at::Tensor& d, const std::optional<at::Tensor>& bias, int64_t N) {
    const DwWideSide side = dw_wide_side();
    TORCH_CHECK(side != DwWideSide::NONE, "q6k wide: this CPU has neither AMX int8 tiles nor AVX-512 VNNI (or a "
                "$DRAFTWISE_MAX_ISA cap is below them)");
    const float* bias_p = dw_q6k_check(x, ql, qh, sc, d, bias, N);  // q6k.cpp: the GEMV's checks
    return side == DwWideSide::AMX ? wide_amx(x, ql, qh, sc, d, bias_p, N) : wide_vnni(x, ql, qh, sc, d, nullptr, nullptr, bias_p, N);
}

namespace {

// The VNNI side on its own, also where AMX runs (tests: both sides' rows are the GEMV's)
at::Tensor wide_vnni_op(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                        const at::Tensor& d, const std::optional<at::Tensor>& bias, int64_t N) {
    TORCH_CHECK(dw_wide_side() != DwWideSide::NONE, "q6k wide_vnni: this CPU has no AVX-512 VNNI (or a "
                "$DRAFTWISE_MAX_ISA cap is below it)");
    return wide_vnni(x, ql, qh, sc, d, nullptr, nullptr, dw_q6k_check(x, ql, qh, sc, d, bias, N), N);
}

bool wide_takes(int64_t M) { return dw_q6k_wide_takes(M); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftwise_q6k, m) {
    m.def("wide(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor? bias, int N) -> Tensor");
    m.def("wide_vnni(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor? bias, int N) -> Tensor");
    m.def("wide_takes(int rows) -> bool", &wide_takes);
    dw_def_wide_ops<wide_switch>(m);
}

TORCH_LIBRARY_IMPL(draftwise_q6k, CPU, m) {
    m.impl("wide", &dw_q6k_wide);
    m.impl("wide_vnni", &wide_vnni_op);
}

// q6m (GGUF Q2_K: q6k.h's min term) and q3k (GGUF Q3_K: its 3-bit planes): the VNNI side only, on AMX CPUs too
// (gemm_q6k_amx.cpp's tiles are built from Q6_K's planes and carry no min term: an AMX CPU's Q2_K and Q3_K prompts
// run on this side, not on tiles); each its own switch, measured like q6k's.
namespace {

DwWideSwitch q6m_switch, q3k_switch;  // from how many rows path-'auto' q6m / q3k calls come here

template <DwWideSwitch& SW>
bool vnni_only_takes(int64_t M) { return SW.takes(M) && dw_vnni_only_side() != DwWideSide::NONE; }

// `kernel`'s VNNI side, checked: with mn and dmin q6m's min term, value_bits its planes (q6k.h)
at::Tensor vnni_only(const char* kernel, const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh,
                     const at::Tensor& sc, const at::Tensor& d, const at::Tensor* mn, const at::Tensor* dmin,
                     const std::optional<at::Tensor>& bias, int64_t N, int64_t value_bits) {
    TORCH_CHECK(dw_vnni_only_side() != DwWideSide::NONE, kernel, " wide: this CPU has no AVX-512 VNNI (or a "
                "$DRAFTWISE_MAX_ISA cap is below it)");
    const float* bias_p = dw_q6k_check(x, ql, qh, sc, d, bias, N, mn, dmin, value_bits);
    return wide_vnni(x, ql, qh, sc, d, mn, dmin, bias_p, N, value_bits);
}

}  // namespace

bool dw_q6m_wide_takes(int64_t M) { return vnni_only_takes<q6m_switch>(M); }
bool dw_q3k_wide_takes(int64_t M) { return vnni_only_takes<q3k_switch>(M); }

// x [M, K] float32 -> y [M, N] float32; the weights as draftwise_q6m::linear takes them (q6k's, plus mn
// [NB, G, 2, 16] int8 and dmin [NB, S, 16] float32)
at::Tensor dw_q6m_wide(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                       const at::Tensor& d, const at::Tensor& mn, const at::Tensor& dmin,
                       const std::optional<at::Tensor>& bias, int64_t N) {
    return vnni_only("q6m", x, ql, qh, sc, d, &mn, &dmin, bias, N, 6);
}

// x [M, K] float32 -> y [M, N] float32; the weights as draftwise_q3k::linear takes them (ql [NB, G, 2, 64], qh
// [NB, G, 1, 64] uint8, sc and d as q6k's)
at::Tensor dw_q3k_wide(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                       const at::Tensor& d, const std::optional<at::Tensor>& bias, int64_t N) {
    return vnni_only("q3k", x, ql, qh, sc, d, nullptr, nullptr, bias, N, 3);
}

TORCH_LIBRARY_FRAGMENT(draftwise_q6m, m) {
    m.def("wide(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor mn, Tensor dmin, Tensor? bias, int N) "
          "-> Tensor");
    m.def("wide_vnni(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor mn, Tensor dmin, Tensor? bias, "
          "int N) -> Tensor");  // the same side: the schema q6k's tests call
    m.def("wide_takes(int rows) -> bool", &vnni_only_takes<q6m_switch>);
    dw_def_wide_ops<q6m_switch, dw_vnni_only_side>(m);
}

TORCH_LIBRARY_IMPL(draftwise_q6m, CPU, m) {
    m.impl("wide", &dw_q6m_wide);
    m.impl("wide_vnni", &dw_q6m_wide);
}

// q3k's: q6k's schemas (wide_vnni the same side), its own switch
TORCH_LIBRARY_FRAGMENT(draftwise_q3k, m) {
    for (const char* op : {"wide", "wide_vnni"}) {
        const std::string schema = std::string(op) + "(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor? bias, int N) -> Tensor";
        m.def(schema.c_str());
    }
    m.def("wide_takes(int rows) -> bool", &vnni_only_takes<q3k_switch>);
    dw_def_wide_ops<q3k_switch, dw_vnni_only_side>(m);
}

TORCH_LIBRARY_IMPL(draftwise_q3k, CPU, m) {
    for (const char* op : {"wide", "wide_vnni"}) m.impl(op, &dw_q3k_wide);
}

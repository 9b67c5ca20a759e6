// q4x8 wide side, torch-facing: the operator draftwise_q4x8::wide (the AMX GEMM) and the rule by which
// draftwise_q4x8::linear with path 'auto' hands a call of many rows to it (q4x8.cpp calls dw_wide_takes); q5x8 (q4x8.h's
// fifth-bit plane: GGUF Q5_K) has the VNNI side alone (draftwise_q5x8::wide; the AMX tiles carry no plane: not
// written, as no AMX CPU was at hand to test one) and its own switch.
// Owns: whether this process may run AMX (cpuid AMX-TILE + AMX-INT8 + the AVX-512 the epilogue uses, no
// $DRAFTWISE_MAX_ISA cap, and the kernel's permission for tile data: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), asked once per process), the smallest row count it takes (gemm_wide.h's switch, set from
// Python, which measures it: kernels/library.py wide_min_rows), quantizing the activations tile-major (gemm_q4x8.h;
// dw_quantize_tiles, which gemm_q6k.cpp calls too) and threading over 16-column blocks. Knows nothing of models; the arithmetic is q4x8.h's, the tile loop gemm_q4x8_amx.cpp's.
// Every row is bitwise the GEMV's row (tests/test_kernels_gemm.py), so which side serves a call changes speed only.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "block_op.h"
#include "dispatch.h"
#include "gemm_q4x8.h"
#include "gemm_wide.h"

namespace {

// AMX-INT8 tiles and the AVX-512 VNNI the wide side's quantizer and epilogue use (dispatch.h)
bool amx() {
    using namespace dwisa;
    static const bool ok = amx_usable(AMX_INT8, F_AVX512F | F_AVX512BW | F_AVX512VL | F_AVX512VNNI);  // asked once
    return ok;
}


DwWideSwitch wide_switch;  // from how many rows path-'auto' calls come here (gemm_wide.h)
DwWideSwitch q5x8_switch;  // the same for q5x8

}  // namespace

#ifndef DW_HAVE_X86
extern "C" int64_t dw_amx_scratch_bytes(int64_t, int64_t) { return 0; }
extern "C" void dw_gemm_amx(const DwQ4*, const DwQ8Rows*, float*, int64_t, int64_t, uint8_t*) {}
#endif

// Which wide side this process runs, for q4x8 and q6k alike (gemm_wide.h)
DwWideSide dw_wide_side() {
    if (amx()) return DwWideSide::AMX;
    constexpr uint32_t vnni = dwisa::F_AVX512F | dwisa::F_AVX512BW | dwisa::F_AVX512VL | dwisa::F_AVX512VNNI;
    return (dwisa::cpu_features() & vnni) == vnni ? DwWideSide::VNNI : DwWideSide::NONE;  // the avx512 GEMV units' needs
}

const char* dw_wide_side_name(DwWideSide side) {
    return side == DwWideSide::AMX ? "amx" : side == DwWideSide::VNNI ? "vnni" : "none";
}

// draftwise_q4x8::linear (draftwise_q5x8::linear: `plane`) with path 'auto' serves a call of M rows here when this is
// true.
bool dw_wide_takes(int64_t M, bool plane) {
    return plane ? q5x8_switch.takes(M) && dw_vnni_only_side() != DwWideSide::NONE
                 : wide_switch.takes(M) && dw_wide_side() != DwWideSide::NONE;
}

void dw_quantize_tiles(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum) {
    const int64_t Kp = (K + 63) / 64 * 64, S = (K / 32 + 7) / 8, Mp = (M + 31) / 32 * 32;
    // one row at a time as a 1-row matrix ([G, 1, 32] is the row's K bytes in order): the GEMV's very values, then
    // its 64-byte pieces scattered to their tiles
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
        std::vector<int8_t> row(Kp, 0);
        std::vector<int16_t> unused(qsum ? 0 : S * 8);
        for (int64_t r = r0; r < r1; ++r) {
            dw_q8_rows_avx512(x + r * K, 1, K, row.data(), dx + r * S, qsum ? qsum + r * S * 8 : unused.data(), 0, 1);
            int8_t* dst = q + (r / 16) * Kp * 16 + (r % 16) * 64;
            for (int64_t j = 0; j < Kp / 64; ++j) std::memcpy(dst + j * 1024, row.data() + j * 64, 64);
        }
    });
    for (int64_t r = M; r < Mp; ++r) {  // padding rows of the last tile: zero (their outputs are never stored)
        int8_t* dst = q + (r / 16) * Kp * 16 + (r % 16) * 64;
        for (int64_t j = 0; j < Kp / 64; ++j) std::memset(dst + j * 1024, 0, 64);
    }
}

namespace {

// The AMX side: x [M, K] float32 contiguous -> y [M, N] (gemm_q4x8_amx.cpp's tile loop)
at::Tensor wide_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn,
                    const at::Tensor& d, const at::Tensor& dmin, const float* bias, int64_t N) {
    const int64_t M = x.size(0), K = x.size(1), G = K / 32, S = (G + 7) / 8, NB = (N + 15) / 16;
    const int64_t Kp = (K + 63) / 64 * 64, Mp = (M + 31) / 32 * 32;
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    dwop::Scratch s(x);
    int8_t* qp = s.make<int8_t>({Mp / 16, Kp / 64, 16, 64}, at::kChar);  // tile-major (gemm_q4x8.h)
    float* dxp = s.make<float>({Mp, S}, at::kFloat);                      // padding rows never read
    int16_t* qsp = s.make<int16_t>({Mp, S, 8}, at::kShort);
    dw_quantize_tiles(x.data_ptr<float>(), M, K, qp, dxp, qsp);
    DwQ4 w{packed.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), mn.data_ptr<uint8_t>(), d.data_ptr<float>(),
           dmin.data_ptr<float>(), bias, N, K, G, S};
    float* yp = y.data_ptr<float>();
    // Rows in chunks whose activations stay in a core's L2 while every block of the chunk passes over them (a
    // prompt of 4k rows is 6-36 MB of int8 that each 16-column block would otherwise stream from memory again);
    // each block's tiles are rebuilt per chunk. A row's arithmetic is the same in every chunk: bits unchanged.
    const int64_t chunk = dw_wide_chunk_rows(Kp);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        DwQ8Rows a{qp + m0 * Kp, dxp + m0 * S, qsp + m0 * S * 8, std::min(chunk, M - m0), Kp};
        dw_for_blocks(NB, [&](int64_t b0, int64_t b1) {
            dw_gemm_amx(&w, &a, yp + m0 * N, b0, b1, dw_thread_scratch(dw_amx_scratch_bytes(Kp, a.M)));
        });
    }
    return y;
}

// The VNNI side: x [M, K] float32 contiguous -> y [M, N]. Rows in chunks of DW_VNNI_CHUNK_ROWS, each quantized into
// its own GEMV layout (q4x8.h: q [G, Mc, 32], dx [S, Mc], qsum [S, Mc, 8], by dw_q8_rows_avx512 like the GEMV's),
// then the AVX-512 GEMV's kernel (dw_gemm_avx512: 12 rows x 16 columns in zmm accumulators per weight unpack) over
// every 16-column block of the chunk: a chunk's activations stay in L1/L2 while the blocks pass over them instead of
// a whole prompt's streaming from memory once per block. Each row is the GEMV's row: the same values and the same
// kernel, whose rows never depend on M. With qh: q5x8's (the GEMV's kernel with the plane).
at::Tensor wide_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn,
                     const at::Tensor& d, const at::Tensor& dmin, const float* bias, int64_t N, const uint8_t* qh) {
    const int64_t M = x.size(0), K = x.size(1), G = K / 32, S = (G + 7) / 8, NB = (N + 15) / 16;
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    const int64_t chunk = DW_VNNI_CHUNK_ROWS, chunks = (M + chunk - 1) / chunk;
    at::Tensor q = at::empty({chunks, G, chunk, 32}, x.options().dtype(at::kChar));  // chunk c: [G, Mc, 32]
    at::Tensor dx = at::empty({chunks, S, chunk}, x.options());                      // [S, Mc]
    at::Tensor qsum = at::empty({chunks, S, chunk, 8}, x.options().dtype(at::kShort));  // [S, Mc, 8]
    const float* xp = x.data_ptr<float>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* dxp = dx.data_ptr<float>();
    int16_t* qsp = qsum.data_ptr<int16_t>();
    auto rows_of = [&](int64_t c) { return std::min(chunk, M - c * chunk); };
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c)
            dw_q8_rows_avx512(xp + c * chunk * K, rows_of(c), K, qp + c * G * chunk * 32, dxp + c * S * chunk,
                              qsp + c * S * chunk * 8, 0, rows_of(c));
    });
    DwQ4 w{packed.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), mn.data_ptr<uint8_t>(), d.data_ptr<float>(),
           dmin.data_ptr<float>(), bias, N, K, G, S, qh};
    float* yp = y.data_ptr<float>();
    auto run = [&](int64_t c, int64_t b0, int64_t b1) {
        DwQ8 a{qp + c * G * chunk * 32, dxp + c * S * chunk, qsp + c * S * chunk * 8, rows_of(c)};
        dw_gemm_avx512(&w, &a, yp + c * chunk * N, b0, b1);
    };
    // each thread its blocks, a group of them at a time, chunk after chunk (one fork for the call: a chunk costs a
    // few microseconds per block); a block's weights: the nibbles (and plane), sc and mn, d and dmin
    const int64_t block_bytes = 16 * K * (qh ? 5 : 4) / 8 + G * 32 + S * 128;
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) { dw_vnni_walk(b0, b1, chunks, block_bytes, run); });
    return y;
}

}  // namespace

// x [M, K] float32 contiguous -> y [M, N]; the weight buffers as q4x8.cpp's linear takes them (it checked them); with
// qh (q5x8) the VNNI side, whatever dw_wide_side says.
at::Tensor dw_q4x8_wide(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn,
                        const at::Tensor& d, const at::Tensor& dmin, const float* bias, int64_t N, const uint8_t* qh) {
    const DwWideSide kind = qh ? dw_vnni_only_side() : dw_wide_side();
    TORCH_CHECK(kind != DwWideSide::NONE, qh ? "q5x8" : "q4x8", " wide: this CPU has neither AMX int8 tiles nor "
                "AVX-512 VNNI (or a $DRAFTWISE_MAX_ISA cap is below them)");
    return kind == DwWideSide::AMX ? wide_amx(x, packed, sc, mn, d, dmin, bias, N)
                                   : wide_vnni(x, packed, sc, mn, d, dmin, bias, N, qh);
}

at::Tensor dw_q4x8_linear_checked(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc,
                                  const at::Tensor& mn, const at::Tensor& d, const at::Tensor& dmin,
                                  const std::optional<at::Tensor>& bias, int64_t N, int64_t path, bool wide,
                                  const at::Tensor* qh);

namespace {

// The wide kernel on its own (tests, benchmarks): the argument checks are linear's.
at::Tensor wide(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn,
                const at::Tensor& d, const at::Tensor& dmin, const std::optional<at::Tensor>& bias, int64_t N) {
    return dw_q4x8_linear_checked(x, packed, sc, mn, d, dmin, bias, N, -1, true, nullptr);
}

// q5x8's wide kernel (its VNNI side; also registered as wide_vnni, the name the kinds with two sides test)
at::Tensor q5x8_wide(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& qh, const at::Tensor& sc,
                     const at::Tensor& mn, const at::Tensor& d, const at::Tensor& dmin,
                     const std::optional<at::Tensor>& bias, int64_t N) {
    return dw_q4x8_linear_checked(x, packed, sc, mn, d, dmin, bias, N, -1, true, &qh);
}

// The VNNI side on its own, also where AMX runs (tests: both sides' rows are the GEMV's)
at::Tensor wide_vnni_op(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn,
                        const at::Tensor& d, const at::Tensor& dmin, const std::optional<at::Tensor>& bias, int64_t N) {
    TORCH_CHECK(dw_wide_side() != DwWideSide::NONE, "q4x8 wide_vnni: this CPU has no AVX-512 VNNI (or a $DRAFTWISE_MAX_ISA "
                "cap is below it)");
    return wide_vnni(x, packed, sc, mn, d, dmin, dw_q4x8_check(x, packed, sc, mn, d, dmin, bias, N), N, nullptr);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftwise_q4x8, m) {
    m.def("wide(Tensor x, Tensor packed, Tensor sc, Tensor mn, Tensor d, Tensor dmin, Tensor? bias, int N) -> Tensor");
    m.def("wide_vnni(Tensor x, Tensor packed, Tensor sc, Tensor mn, Tensor d, Tensor dmin, Tensor? bias, int N) -> Tensor");
    dw_def_wide_ops<wide_switch>(m);
}

TORCH_LIBRARY_IMPL(draftwise_q4x8, CPU, m) {
    m.impl("wide", &wide);
    m.impl("wide_vnni", &wide_vnni_op);
}

TORCH_LIBRARY_FRAGMENT(draftwise_q5x8, m) {
    m.def("wide(Tensor x, Tensor packed, Tensor qh, Tensor sc, Tensor mn, Tensor d, Tensor dmin, Tensor? bias, int N) "
          "-> Tensor");
    m.def("wide_vnni(Tensor x, Tensor packed, Tensor qh, Tensor sc, Tensor mn, Tensor d, Tensor dmin, Tensor? bias, "
          "int N) -> Tensor");
    m.def("wide_takes(int rows) -> bool", [](int64_t M) { return dw_wide_takes(M, true); });
    dw_def_wide_ops<q5x8_switch, dw_vnni_only_side>(m);
}

TORCH_LIBRARY_IMPL(draftwise_q5x8, CPU, m) {
    m.impl("wide", &q5x8_wide);
    m.impl("wide_vnni", &q5x8_wide);
}

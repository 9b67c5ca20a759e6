// q4x8: the torch operators (torch.ops.draftwise_q4x8.*; draftwise_q5x8.linear, the same with q4x8.h's fifth-bit
// plane: GGUF Q5_K) and the scalar path; also the library-wide ops that name the ISA paths (path_names, path_id:
// dispatch.h's names, for kernels/library.py).
// Owns: argument checks (dw_q4x8_check: the wide side's too; the thread splits over rows and output-column blocks are
// block_op.h's, torch's thread count) and which cpuid features each q4x8 ISA unit needs (ISA below; dispatch.h's rule picks the
// path: cpuid at run time, or the caller's explicit choice for tests). Knows nothing of models or of how weights were quantized; the layout and the
// arithmetic are defined in q4x8.h.
// The scalar path performs the exact float sequence of the SIMD paths (std::fma), so it is their oracle.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <cmath>
#include <string>
#include <vector>
#include "block_op.h"
#include "dispatch.h"
#include "gemm_wide.h"
#include "gemv_rows.h"
#include "q4x8.h"

namespace {

// What q4x8_avx2.cpp and q4x8_avx512.cpp are compiled for (kernels/library.py `_units`).
constexpr dwisa::Isa ISA{"q4x8", {0, dwisa::F_AVX2 | dwisa::F_FMA,
                                  dwisa::F_AVX512F | dwisa::F_AVX512BW | dwisa::F_AVX512VL | dwisa::F_AVX512VNNI}};

}  // namespace

extern "C" void dw_q8_rows_scalar(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum,
                                  int64_t r0, int64_t r1) {
    dwq8k::rows(x, M, K, q, dx, qsum, r0, r1,
        [](const float* p, int64_t n) {
            float amax = 0.0f;
            for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(p[i]));
            return amax;
        },
        [](const float* p, float id, int8_t* qg) {
            int32_t sum = 0;
            for (int i = 0; i < 32; ++i) {
                const int32_t v = (int32_t)std::nearbyint(p[i] * id);
                qg[i] = (int8_t)v;
                sum += v;
            }
            return sum;
        });
}

extern "C" void dw_gemm_scalar(const DwQ4* w, const DwQ8* a, float* out, int64_t b0, int64_t b1) {
    const int64_t G = w->G, S = w->S, N = w->N, M = a->M;
    dwop::scalar_cells(N, M, b0, b1, w->bias, out, [&](int64_t b, int j, int64_t m) {
        float acc = 0.0f;
        for (int64_t s = 0; s < S; ++s) {
            int32_t isc = 0, imn = 0;
            for (int64_t g = s * 8; g < s * 8 + 8 && g < G; ++g) {
                const uint8_t* P = w->packed + (b * G + g) * 256;
                const uint8_t* H = w->qh ? w->qh + (b * G + g) * 64 : nullptr;  // q5x8's plane (q4x8.h)
                const int8_t* xq = a->q + (g * M + m) * 32;
                int32_t isum = 0;
                for (int c = 0; c < 4; ++c)
                    for (int t = 0; t < 4; ++t) {
                        const int i = j * 4 + t;  // the byte of chunk c, and its bit in the chunk's two masks
                        const int32_t lo = (P[c * 64 + i] & 15) | (H ? ((H[c * 16 + i / 8] >> (i % 8)) & 1) << 4 : 0);
                        const int32_t hi = (P[c * 64 + i] >> 4) | (H ? ((H[c * 16 + 8 + i / 8] >> (i % 8)) & 1) << 4 : 0);
                        isum += lo * xq[c * 4 + t] + hi * xq[16 + c * 4 + t];
                    }
                isc += (int32_t)w->sc[(b * G + g) * 16 + j] * isum;
                imn += (int32_t)w->mn[(b * G + g) * 16 + j] * a->qsum[(s * M + m) * 8 + g % 8];
            }
            float t = (float)isc * w->d[(b * S + s) * 16 + j];
            t = std::fma(-(float)imn, w->dmin[(b * S + s) * 16 + j], t);  // = fnmadd((float) imn, dmin, t)
            acc = std::fma(t, a->dx[s * M + m], acc);
        }
        return acc;
    });
}

// The wide side (gemm_q4x8.cpp): whether 'auto' hands M rows to it (q5x8, with qh: its own switch), and the kernel
// (bitwise the same rows).
bool dw_wide_takes(int64_t M, bool plane);
at::Tensor dw_q4x8_wide(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn,
                        const at::Tensor& d, const at::Tensor& dmin, const float* bias, int64_t N, const uint8_t* qh);

const float* dw_q4x8_check(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn,
                           const at::Tensor& d, const at::Tensor& dmin, const std::optional<at::Tensor>& bias, int64_t N,
                           const at::Tensor* qh) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32 contiguous");
    const int64_t K = x.size(1);
    TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
    const int64_t G = K / 32, S = (G + 7) / 8, NB = (N + 15) / 16;
    dwop::check_weight(packed, at::kByte, NB * G * 256, "packed");
    dwop::check_weight(sc, at::kByte, NB * G * 16, "sc");
    dwop::check_weight(mn, at::kByte, NB * G * 16, "mn");
    dwop::check_weight(d, at::kFloat, NB * S * 16, "d");
    dwop::check_weight(dmin, at::kFloat, NB * S * 16, "dmin");
    if (qh) dwop::check_weight(*qh, at::kByte, NB * G * 64, "qh");  // q5x8's plane
    return dwop::bias_of(bias, N);
}

// x [M, K] float32 -> y [M, N] float32; `wide`: the wide kernel whatever M is (draftwise_q4x8::wide); with qh, q5x8
at::Tensor dw_q4x8_linear_checked(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc,
                                  const at::Tensor& mn, const at::Tensor& d, const at::Tensor& dmin,
                                  const std::optional<at::Tensor>& bias, int64_t N, int64_t path, bool wide,
                                  const at::Tensor* qh) {
    const float* bias_p = dw_q4x8_check(x, packed, sc, mn, d, dmin, bias, N, qh);
    const int64_t M = x.size(0), K = x.size(1), G = K / 32, S = (G + 7) / 8, NB = (N + 15) / 16;
    const uint8_t* qh_p = qh ? qh->data_ptr<uint8_t>() : nullptr;
    if (wide || (path == dwisa::AUTO && dw_wide_takes(x.size(0), qh != nullptr)))
        return dw_q4x8_wide(x, packed, sc, mn, d, dmin, bias_p, N, qh_p);
    path = dwisa::select(ISA, path);
    return dwop::output(x, N, [&](dwop::Scratch& s, float* yp) {
        int8_t* qp = s.make<int8_t>({G, M, 32}, at::kChar);
        float* dxp = s.make<float>({S, M}, at::kFloat);
        int16_t* qsp = s.make<int16_t>({S, M, 8}, at::kShort);
        const float* xp = x.data_ptr<float>();
        const auto quant = dwisa::pick(path, dw_q8_rows_scalar, dw_q8_rows_avx2, dw_q8_rows_avx512);
        const auto gemm = dwisa::pick(path, dw_gemm_scalar, dw_gemm_avx2, dw_gemm_avx512);
        dwop::over_rows(M, K, [&](int64_t r0, int64_t r1) { quant(xp, M, K, qp, dxp, qsp, r0, r1); });
        DwQ4 w{packed.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), mn.data_ptr<uint8_t>(), d.data_ptr<float>(),
               dmin.data_ptr<float>(), bias_p, N, K, G, S, qh_p};
        DwQ8 a{qp, dxp, qsp, M};
        dwop::over_blocks(NB, [&](int64_t b0, int64_t b1) { gemm(&w, &a, yp, b0, b1); });
    });
}

// dw_q4x8_linear_checked's GEMV path on the calling thread (gemv_rows.h)
void dw_q4x8_gemv_rows(const DwQ4* w, const float* x, int64_t M, float* y, int64_t path, uint8_t* scratch) {
    const int64_t K = w->K, NB = (w->N + 15) / 16;
    const auto s = DwGemvScratch(M, K).in(scratch);
    path = dwisa::select(ISA, path);
    dwisa::pick(path, dw_q8_rows_scalar, dw_q8_rows_avx2, dw_q8_rows_avx512)(x, M, K, s.q, s.dx, s.qsum, 0, M);
    DwQ8 a{s.q, s.dx, s.qsum, M};
    dwisa::pick(path, dw_gemm_scalar, dw_gemm_avx2, dw_gemm_avx512)(w, &a, y, 0, NB);
}

namespace {

at::Tensor q4x8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn,
                       const at::Tensor& d, const at::Tensor& dmin, const std::optional<at::Tensor>& bias, int64_t N,
                       int64_t path) {
    return dw_q4x8_linear_checked(x, packed, sc, mn, d, dmin, bias, N, path, false, nullptr);
}

// q5x8 (GGUF Q5_K): q4x8's buffers plus the fifth-bit plane qh, in kernels/linear.py's PACKED order
at::Tensor q5x8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& qh, const at::Tensor& sc,
                       const at::Tensor& mn, const at::Tensor& d, const at::Tensor& dmin,
                       const std::optional<at::Tensor>& bias, int64_t N, int64_t path) {
    return dw_q4x8_linear_checked(x, packed, sc, mn, d, dmin, bias, N, path, false, &qh);
}

std::vector<int64_t> paths() { return dwisa::available_paths(ISA); }

// The ISA path names by id (dispatch.h), and a name's id: kernels/library.py builds its PATHS from these.
std::vector<std::string> path_names() { return {dwisa::NAMES, dwisa::NAMES + dwisa::NUM_PATHS}; }

int64_t path_id(const std::string& name) { return dwisa::parse_path(name); }

}  // namespace

#ifndef DW_HAVE_X86
extern "C" void dw_q8_rows_avx2(const float*, int64_t, int64_t, int8_t*, float*, int16_t*, int64_t, int64_t) {}
extern "C" void dw_q8_rows_avx512(const float*, int64_t, int64_t, int8_t*, float*, int16_t*, int64_t, int64_t) {}
extern "C" void dw_gemm_avx2(const DwQ4*, const DwQ8*, float*, int64_t, int64_t) {}
extern "C" void dw_gemm_avx512(const DwQ4*, const DwQ8*, float*, int64_t, int64_t) {}
#endif

TORCH_LIBRARY(draftwise_q4x8, m) {
    m.def("linear(Tensor x, Tensor packed, Tensor sc, Tensor mn, Tensor d, Tensor dmin, Tensor? bias, int N, int path) -> Tensor");
    m.def("paths() -> int[]", &paths);
    m.def("path_names() -> str[]", &path_names);
    m.def("path_id(str name) -> int", &path_id);
}

TORCH_LIBRARY_IMPL(draftwise_q4x8, CPU, m) { m.impl("linear", &q4x8_linear); }

TORCH_LIBRARY(draftwise_q5x8, m) {
    m.def("linear(Tensor x, Tensor packed, Tensor qh, Tensor sc, Tensor mn, Tensor d, Tensor dmin, Tensor? bias, int N, "
          "int path) -> Tensor");
    m.def("paths() -> int[]", &paths);
}

TORCH_LIBRARY_IMPL(draftwise_q5x8, CPU, m) { m.impl("linear", &q5x8_linear); }

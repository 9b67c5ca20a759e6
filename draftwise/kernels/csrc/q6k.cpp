// q6k: the torch operators (torch.ops.draftwise_q6k.linear; draftwise_q6m.linear, the same with q6k.h's min term:
// GGUF Q2_K; draftwise_q3k.linear, the same code over Q3_K's 3-bit planes) and the scalar path of q6k.h's kernels.
// Owns: argument checks (dw_q6k_check, which the wide side gemm_q6k.cpp calls too), the activation quantization
// (q4x8's Q8_K rows, plus the per-16 sums Q6_K's offset needs; the thread splits are block_op.h's) and which cpuid features each ISA unit needs (dispatch.h's rule picks the path). Knows nothing of models or files; the layout and the arithmetic are defined in q6k.h.
// The scalar path performs the exact float sequence of the SIMD paths (std::fma), so it is their oracle.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <cmath>
#include "block_op.h"
#include "dispatch.h"
#include "gemm_wide.h"
#include "gemv_rows.h"
#include "q4x8.h"
#include "q6k.h"

namespace {

// What q6k_avx2.cpp and q6k_avx512.cpp are compiled for (kernels/blocktypes.py's units for q6k).
constexpr dwisa::Isa ISA{"q6k", {0, dwisa::F_AVX2 | dwisa::F_FMA,
                                 dwisa::F_AVX512F | dwisa::F_AVX512BW | dwisa::F_AVX512VL | dwisa::F_AVX512VNNI}};

}  // namespace

namespace {

// The scalar path of one layout (q6k.h's Planes P): the exact integers, then the float steps, in q6k.h's order.
template <class P>
void gemm_scalar(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1) {
    const int64_t G = w->G, S = w->S, N = w->N, M = a->M;
    dwop::scalar_cells(N, M, b0, b1, w->bias, out, [&](int64_t b, int j, int64_t m) {
        float acc = 0.0f;
        for (int64_t s = 0; s < S; ++s) {
            int32_t isc = 0, imn = 0, ib = 0;
            for (int64_t g = s * 8; g < s * 8 + 8; ++g) {
                const uint8_t* L = w->ql + (b * G + g) * P::LOW;
                const uint8_t* H = w->qh + (b * G + g) * P::HIGH;
                const int8_t* xq = a->q + (g * M + m) * 32;
                int32_t lo = 0, hi = 0;
                for (int c = 0; c < 4; ++c)
                    for (int t = 0; t < 4; ++t) {
                        lo += dwq6k::value_at<P>(L, H, 2 * c, j * 4 + t) * xq[c * 4 + t];
                        hi += dwq6k::value_at<P>(L, H, 2 * c + 1, j * 4 + t) * xq[16 + c * 4 + t];
                    }
                const int8_t* SC = w->sc + (b * G + g) * 32;
                const int16_t* qs = a->qsum16 + (s * M + m) * 16 + (g - s * 8) * 2;
                isc += (int32_t)SC[j] * lo + (int32_t)SC[16 + j] * hi;
                imn += (int32_t)SC[j] * qs[0] + (int32_t)SC[16 + j] * qs[1];
                const int8_t* MN = w->mn ? w->mn + (b * G + g) * 32 : nullptr;
                if (MN) ib += (int32_t)MN[j] * qs[0] + (int32_t)MN[16 + j] * qs[1];
            }
            const float t = (float)(isc - P::OFF * imn) * w->d[(b * S + s) * 16 + j];
            acc = std::fma(t, a->dx[s * M + m], acc);
            if (w->mn) acc = std::fma(-((float)ib * w->dmin[(b * S + s) * 16 + j]), a->dx[s * M + m], acc);
        }
        return acc;
    });
}

}  // namespace

extern "C" void dw_q6k_gemm_scalar(const DwQ6* w, const DwQ8K16* a, float* out, int64_t b0, int64_t b1) {
    dwq6k::by_layout(w, [&]<class P, bool MIN>() { gemm_scalar<P>(w, a, out, b0, b1); });
}

const float* dw_q6k_check(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                          const at::Tensor& d, const std::optional<at::Tensor>& bias, int64_t N, const at::Tensor* mn,
                          const at::Tensor* dmin, int64_t value_bits) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32 contiguous");
    const int64_t K = x.size(1);
    TORCH_CHECK(K % 256 == 0, "Q6_K needs K a multiple of 256");
    TORCH_CHECK(N >= 1, "N must be >= 1");
    const int64_t G = K / 32, S = K / 256, NB = (N + 15) / 16;
    const int64_t lb = value_bits == 3 ? 2 : 4;  // q6k.h's Planes: LB low bits, BITS - LB high ones
    dwop::check_weight(ql, at::kByte, NB * G * 64 * lb, "ql");
    dwop::check_weight(qh, at::kByte, NB * G * 64 * (value_bits - lb), "qh");
    dwop::check_weight(sc, at::kChar, NB * G * 32, "sc");
    dwop::check_weight(d, at::kFloat, NB * S * 16, "d");
    if (mn) {  // q6m's min term (q6k.h)
        dwop::check_weight(*mn, at::kChar, NB * G * 32, "mn");
        dwop::check_weight(*dmin, at::kFloat, NB * S * 16, "dmin");
    }
    return dwop::bias_of(bias, N);
}

void dw_q6k_quantize_rows(int64_t path, const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum,
                          int16_t* qsum16, int64_t r0, int64_t r1) {
    const int64_t G = K / 32;
    // q4x8's Q8_K rows (every path bitwise the same), then the per-16 sums from the int8 values
    dwisa::pick(path, dw_q8_rows_scalar, dw_q8_rows_avx2, dw_q8_rows_avx512)(x, M, K, q, dx, qsum, r0, r1);
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t g = 0; g < G; ++g) {
            const int8_t* v = q + (g * M + r) * 32;
            int32_t lo = 0, hi = 0;
            for (int i = 0; i < 16; ++i) {
                lo += v[i];
                hi += v[16 + i];
            }
            qsum16[((g / 8) * M + r) * 16 + (g % 8) * 2] = (int16_t)lo;
            qsum16[((g / 8) * M + r) * 16 + (g % 8) * 2 + 1] = (int16_t)hi;
        }
}

// q6k_linear's GEMV on the calling thread (gemv_rows.h: the scratch laid out as DwGemvScratch)
void dw_q6k_gemv_rows(const DwQ6* w, const float* x, int64_t M, float* y, int64_t path, uint8_t* scratch) {
    const int64_t K = w->K, NB = (w->N + 15) / 16;
    const auto s = DwGemvScratch(M, K).in(scratch);
    path = dwisa::select(ISA, path);
    dw_q6k_quantize_rows(path, x, M, K, s.q, s.dx, s.qsum, s.qsum16, 0, M);
    DwQ8K16 a{s.q, s.dx, s.qsum16, M};
    dwisa::pick(path, dw_q6k_gemm_scalar, dw_q6k_gemm_avx2, dw_q6k_gemm_avx512)(w, &a, y, 0, NB);
}

namespace {

// x [M, K] float32 -> y [M, N] float32; with mn and dmin (q6m) the min term, value_bits the planes (q6k.h)
at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                      const at::Tensor& d, const at::Tensor* mn, const at::Tensor* dmin,
                      const std::optional<at::Tensor>& bias, int64_t N, int64_t path, int64_t value_bits = 6) {
    const float* bias_p = dw_q6k_check(x, ql, qh, sc, d, bias, N, mn, dmin, value_bits);
    const int64_t M = x.size(0), K = x.size(1), G = K / 32, S = K / 256, NB = (N + 15) / 16;
    path = dwisa::select(ISA, path);
    return dwop::output(x, N, [&](dwop::Scratch& s, float* yp) {
        int8_t* qp = s.make<int8_t>({G, M, 32}, at::kChar);
        float* dxp = s.make<float>({S, M}, at::kFloat);
        int16_t* qsp = s.make<int16_t>({S, M, 8}, at::kShort);
        int16_t* q16 = s.make<int16_t>({S, M, 16}, at::kShort);
        const float* xp = x.data_ptr<float>();
        dwop::over_rows(M, K, [&](int64_t r0, int64_t r1) {
            dw_q6k_quantize_rows(path, xp, M, K, qp, dxp, qsp, q16, r0, r1);
        });
        const auto gemm = dwisa::pick(path, dw_q6k_gemm_scalar, dw_q6k_gemm_avx2, dw_q6k_gemm_avx512);
        DwQ6 w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(), bias_p, N, K, G, S,
               mn ? mn->data_ptr<int8_t>() : nullptr, mn ? dmin->data_ptr<float>() : nullptr, value_bits};
        DwQ8K16 a{qp, dxp, q16, M};
        dwop::over_blocks(NB, [&](int64_t b0, int64_t b1) { gemm(&w, &a, yp, b0, b1); });
    });
}

std::vector<int64_t> paths() { return dwisa::available_paths(ISA); }

}  // namespace

#ifndef DW_HAVE_X86
extern "C" void dw_q6k_gemm_avx2(const DwQ6*, const DwQ8K16*, float*, int64_t, int64_t) {}
extern "C" void dw_q6k_gemm_avx512(const DwQ6*, const DwQ8K16*, float*, int64_t, int64_t) {}
#endif

namespace {

// q6k's and q3k's linear: the same schema, their planes by value_bits (q6k.h). q3k's path 'auto' takes its wide
// side (gemm_q6k.cpp: the VNNI one, as q6m's; bitwise the same rows) from its switch width on.
constexpr const char* PLANES_LINEAR =
    "linear(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor? bias, int N, int path) -> Tensor";

template <int64_t BITS>
at::Tensor planes_linear(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                         const at::Tensor& d, const std::optional<at::Tensor>& bias, int64_t N, int64_t path) {
    if (BITS == 3 && path == dwisa::AUTO && x.dim() == 2 && x.size(0) > 1 && dw_q3k_wide_takes(x.size(0)))
        return dw_q3k_wide(x, ql, qh, sc, d, bias, N);
    return q6k_linear(x, ql, qh, sc, d, nullptr, nullptr, bias, N, path, BITS);
}

}  // namespace

// One library per kernel of kernels/blocktypes.py on these units, each linear's arguments its PACKED buffers in order.
TORCH_LIBRARY(draftwise_q6k, m) {
    m.def(PLANES_LINEAR);
    m.def("paths() -> int[]", &paths);
}

TORCH_LIBRARY_IMPL(draftwise_q6k, CPU, m) { m.impl("linear", &planes_linear<6>); }

// q3k: GGUF Q3_K at its own width (q6k.h's 3-bit planes)
TORCH_LIBRARY(draftwise_q3k, m) {
    m.def(PLANES_LINEAR);
    m.def("paths() -> int[]", &paths);
}

TORCH_LIBRARY_IMPL(draftwise_q3k, CPU, m) { m.impl("linear", &planes_linear<3>); }

TORCH_LIBRARY(draftwise_q6m, m) {
    m.def("linear(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, Tensor mn, Tensor dmin, Tensor? bias, int N, "
          "int path) -> Tensor");
    m.def("paths() -> int[]", &paths);
}

TORCH_LIBRARY_IMPL(draftwise_q6m, CPU, m) {
    m.impl("linear", [](const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                        const at::Tensor& d, const at::Tensor& mn, const at::Tensor& dmin,
                        const std::optional<at::Tensor>& bias, int64_t N, int64_t path) {
        // path 'auto' takes the wide side (gemm_q6k.cpp, bitwise the same rows) from the kernel's switch width on
        if (path == dwisa::AUTO && x.dim() == 2 && x.size(0) > 1 && dw_q6m_wide_takes(x.size(0)))
            return dw_q6m_wide(x, ql, qh, sc, d, mn, dmin, bias, N);
        return q6k_linear(x, ql, qh, sc, d, &mn, &dmin, bias, N, path);
    });
}

// q8_0: the torch operators of the per-32 block types x Q8_0 activations (torch.ops.draftwise_q8_0.linear; q8_1:
// the same kernel with a min term; q4c: its 4-bit codes form; q5m: codes, fifth-bit plane and min term, q8_0.h)
// and their scalar path.
// Owns: argument checks, the activation quantization per group of 32 (its scalar form, the scalar and AVX2 GEMVs';
// the AVX-512 GEMV and the wide side take its vector form, gemm_q8_0_avx512.cpp, bitwise it), which cpuid features
// each ISA unit needs (dispatch.h's rule picks the path) and handing path-'auto' calls from the kernel's switch width
// on (and the `wide` ops' calls) to the wide side (gemm_q8_0.cpp); the thread split is block_op.h's. Knows nothing of models or files; the layout and the arithmetic are
// defined in q8_0.h. The scalar path performs the exact float sequence of the SIMD paths.
#include <torch/library.h>
#include <ATen/ops/empty.h>
#include <cmath>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif
#include "block_op.h"
#include "dispatch.h"
#include "gemm_q8_0.h"
#include "q8_0.h"

namespace {

// What q8_0_avx2.cpp and q8_0_avx512.cpp are compiled for (kernels/blocktypes.py's units for q8_0).
constexpr dwisa::Isa ISA{"q8_0", {0, dwisa::F_AVX2 | dwisa::F_FMA | dwisa::F_F16C,
                                  dwisa::F_AVX512F | dwisa::F_AVX512BW | dwisa::F_AVX512VL | dwisa::F_AVX512VNNI}};

// x rounded to an int32 in the current rounding mode (round half to even), as (int32_t) nearbyint(x) and the SIMD
// conversions (CVTPS2DQ) give it, NaN included (INT32_MIN); on x86-64 one CVTSS2SI, where nearbyintf is a library
// call (the baseline ISA has no ROUNDSS) that cost a one-row call at K = 8960 ~30 us on a Zen 4.
inline int32_t round_even(float x) {
#if defined(__x86_64__)
    return _mm_cvtss_si32(_mm_set_ss(x));
#else
    return (int32_t)std::nearbyint(x);
#endif
}

}  // namespace

// x [M, K] -> q [G, M, 32], dx [G, M], qoff [G, M], qsum [G, M] for rows [r0, r1) (q8_0.h)
extern "C" void dw_q80_quantize_rows_scalar(const float* x, int64_t M, int64_t K, int8_t* q, float* dx,
                                            int32_t* qoff, int32_t* qsum, int64_t r0, int64_t r1) {
    const int64_t G = K / 32;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t g = 0; g < G; ++g) {
            const float* p = x + r * K + g * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; ++i) {  // fmax(amax, |x|), NaN ignored, as a compare (inlined; fmaxf is a call)
                const float a = std::fabs(p[i]);
                amax = a > amax ? a : amax;
            }
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t* o = q + (g * M + r) * 32;
            int32_t sum = 0;
            for (int i = 0; i < 32; ++i) {
                const int32_t v = round_even(p[i] * id);
                o[i] = (int8_t)v;
                sum += v;
            }
            dx[g * M + r] = amax / 127.0f;
            qoff[g * M + r] = -128 * sum;
            qsum[g * M + r] = sum;
        }
}

extern "C" void dw_q80_gemm_scalar(const DwQ80* w, const DwQ80Act* a, float* out, int64_t b0, int64_t b1) {
    const int64_t G = w->G, M = a->M;
    dwop::scalar_cells(w->N, M, b0, b1, w->bias, out, [&](int64_t b, int j, int64_t m) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
            const int8_t* xq = a->q + (g * M + m) * 32;
            int32_t isum = 0;
            for (int c = 0; c < 8; ++c)
                for (int t = 0; t < 4; ++t) isum += ((int32_t)dw_q80_byte(w, b, g, c, j, t) - 128) * xq[c * 4 + t];
            const float t = (float)isum * dw_q80_scale(w, w->d, b, g, j);
            acc = std::fma(t, a->dx[g * M + m], acc);
            if (w->m) {
                const float u = (float)a->qsum[g * M + m] * dw_q80_scale(w, w->m, b, g, j);
                acc = std::fma(u, a->dx[g * M + m], acc);
            }
        }
        return acc;
    });
}

namespace {

// A present optional tensor's data, checked as `numel` values of `dtype`; null when absent.
template <class T>
const T* optional_of(const std::optional<at::Tensor>& t, at::ScalarType dtype, int64_t numel, const char* name) {
    if (!t.has_value() || !t->defined()) return nullptr;
    dwop::check_weight(*t, dtype, numel, name);
    return t->data_ptr<T>();
}

// The scale form of d (q8_0.h) from its dtype: float32 F32, float16 F16, uint8 SUB8; d checked for NB blocks of G
// groups in that form (and m, when given, for the same form).
DwQ80Scales scales_of(const at::Tensor& d, const std::optional<at::Tensor>& m, int64_t NB, int64_t G) {
    const at::ScalarType t = d.scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kByte, "d must be float32, float16 or uint8 (SUB8)");
    TORCH_CHECK(!m.has_value() || !m->defined() || m->scalar_type() == t, "m must have d's scale form (dtype)");
    const DwQ80Scales s = t == at::kFloat ? DW_Q80_F32 : t == at::kHalf ? DW_Q80_F16 : DW_Q80_SUB8;
    TORCH_CHECK(s != DW_Q80_SUB8 || G % 8 == 0, "SUB8 scales need K a multiple of 256");
    const int64_t numel = s == DW_Q80_SUB8 ? NB * (G / 8) * 160 : NB * G * 16;
    dwop::check_weight(d, t, numel, "d");
    if (m.has_value() && m->defined()) dwop::check_weight(*m, t, numel, "m");
    return s;
}

// The checked weights of one call (q8_0.h's DwQ80) from the op's buffers, for K = 32 G: qw [NB, G, 8, 64] uint8
// (bytes) or [NB, G, 4, 64] (codes, with lut [NB, 16] uint8 and, for the fifth-bit plane, qh [NB, G, 8, 8]), d and m
// (or none) in one scale form ([NB, G, 16] float32 or float16, or SUB8's [NB, G / 8, 160] uint8), bias [N] or none.
// The one place a DwQ80 is built from tensors (the GEMV and the wide side, gemm_q8_0.cpp, take it opaque).
DwQ80 weights_of(const at::Tensor& qw, const std::optional<at::Tensor>& qh, const std::optional<at::Tensor>& lut,
                 const at::Tensor& d, const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& bias,
                 int64_t N, int64_t K) {
    TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
    const int64_t G = K / 32, NB = (N + 15) / 16;
    const uint8_t* lut_p = optional_of<uint8_t>(lut, at::kByte, NB * 16, "lut");
    const uint8_t* qh_p = optional_of<uint8_t>(qh, at::kByte, NB * G * 64, "qh");
    TORCH_CHECK(lut_p || !qh_p, "a fifth-bit plane goes with codes (lut)");
    dwop::check_weight(qw, at::kByte, NB * G * (lut_p ? 256 : 512), "qw");
    const DwQ80Scales scales = scales_of(d, m, NB, G);
    const void* m_p = m.has_value() && m->defined() ? m->data_ptr() : nullptr;
    return DwQ80{qw.data_ptr<uint8_t>(), d.data_ptr(), m_p, dwop::bias_of(bias, N), N, K, G, lut_p, qh_p, scales};
}

}  // namespace

// x [M, K] float32 -> y [M, N] float32, the weights as weights_of takes them; `wide`: the wide side
// (gemm_q8_0.cpp) whatever M is, else path 'auto' takes it from the kernel's switch width on (bitwise the same)
at::Tensor dw_q80_linear(const at::Tensor& x, const at::Tensor& qw, const std::optional<at::Tensor>& qh,
                         const std::optional<at::Tensor>& lut, const at::Tensor& d, const std::optional<at::Tensor>& m,
                         const std::optional<at::Tensor>& bias, int64_t N, int64_t path, bool wide) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32 contiguous");
    const int64_t M = x.size(0), K = x.size(1);
    const DwQ80 w = weights_of(qw, qh, lut, d, m, bias, N, K);
    const int64_t G = w.G, NB = (N + 15) / 16;
    wide = wide || (path == dwisa::AUTO && dw_q80_wide_takes(w.lut != nullptr, w.m != nullptr, M));
    path = dwisa::select(ISA, path);
    return dwop::output(x, N, [&](dwop::Scratch& s, float* yp) {
        if (wide) return dw_q80_wide(&w, x.data_ptr<float>(), M, K, N, yp);
        int8_t* qp = s.make<int8_t>({G, M, 32}, at::kChar);
        float* dxp = s.make<float>({G, M}, at::kFloat);
        int32_t* qop = s.make<int32_t>({G, M}, at::kInt);
        int32_t* qsp = s.make<int32_t>({G, M}, at::kInt);
        const float* xp = x.data_ptr<float>();
        const auto quantize = dwisa::pick(path, dw_q80_quantize_rows_scalar, dw_q80_quantize_rows_scalar,
                                          dw_q80_quantize_rows_avx512);
        dwop::over_rows(M, K, [&](int64_t r0, int64_t r1) { quantize(xp, M, K, qp, dxp, qop, qsp, r0, r1); });
        const auto gemm = dwisa::pick(path, dw_q80_gemm_scalar, dw_q80_gemm_avx2, dw_q80_gemm_avx512);
        DwQ80Act a{qp, dxp, qop, qsp, M};
        dwop::over_blocks(NB, [&](int64_t b0, int64_t b1) { gemm(&w, &a, yp, b0, b1); });
    });
}

namespace {

std::vector<int64_t> paths() { return dwisa::available_paths(ISA); }

// The GEMV's operator: path 'auto' takes the wide side from the switch width on.
at::Tensor linear(const at::Tensor& x, const at::Tensor& qw, const std::optional<at::Tensor>& qh,
                  const std::optional<at::Tensor>& lut, const at::Tensor& d, const std::optional<at::Tensor>& m,
                  const std::optional<at::Tensor>& bias, int64_t N, int64_t path) {
    return dw_q80_linear(x, qw, qh, lut, d, m, bias, N, path, false);
}

// A kernel's linear(x, <its packed buffers>, bias, N, path) and paths() schemas.
void define(torch::Library& m, const std::string& packed) {
    m.def(("linear(Tensor x, Tensor " + packed + ", Tensor? bias, int N, int path) -> Tensor").c_str());
    m.def("paths() -> int[]", &paths);
}

}  // namespace

#ifndef DW_HAVE_X86
extern "C" void dw_q80_gemm_avx2(const DwQ80*, const DwQ80Act*, float*, int64_t, int64_t) {}
extern "C" void dw_q80_gemm_avx512(const DwQ80*, const DwQ80Act*, float*, int64_t, int64_t) {}
#endif

// One library per kernel of kernels/blocktypes.py on this unit, each linear's arguments its PACKED buffers in order.
TORCH_LIBRARY(draftwise_q8_0, m) { define(m, "qw, Tensor d"); }
TORCH_LIBRARY_IMPL(draftwise_q8_0, CPU, m) {
    m.impl("linear", [](const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d,
                        const std::optional<at::Tensor>& bias, int64_t N, int64_t path) {
        return linear(x, qw, std::nullopt, std::nullopt, d, std::nullopt, bias, N, path);
    });
}

TORCH_LIBRARY(draftwise_q8_1, m) { define(m, "qw, Tensor d, Tensor m"); }
TORCH_LIBRARY_IMPL(draftwise_q8_1, CPU, m) {
    m.impl("linear", [](const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& m_,
                        const std::optional<at::Tensor>& bias, int64_t N, int64_t path) {
        return linear(x, qw, std::nullopt, std::nullopt, d, m_, bias, N, path);
    });
}

TORCH_LIBRARY(draftwise_q4c, m) { define(m, "qs, Tensor lut, Tensor d"); }
TORCH_LIBRARY_IMPL(draftwise_q4c, CPU, m) {
    m.impl("linear", [](const at::Tensor& x, const at::Tensor& qs, const at::Tensor& lut, const at::Tensor& d,
                        const std::optional<at::Tensor>& bias, int64_t N, int64_t path) {
        return linear(x, qs, std::nullopt, lut, d, std::nullopt, bias, N, path);
    });
}

TORCH_LIBRARY(draftwise_q5m, m) { define(m, "qs, Tensor qh, Tensor lut, Tensor d, Tensor m"); }
TORCH_LIBRARY_IMPL(draftwise_q5m, CPU, m) {
    m.impl("linear", [](const at::Tensor& x, const at::Tensor& qs, const at::Tensor& qh, const at::Tensor& lut,
                        const at::Tensor& d, const at::Tensor& m_, const std::optional<at::Tensor>& bias, int64_t N,
                        int64_t path) { return linear(x, qs, qh, lut, d, m_, bias, N, path); });
}

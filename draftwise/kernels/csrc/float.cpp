// The float kernel family's torch operator (torch.ops.draftwise_<type>.linear, one per type: this unit is compiled
// once per type with -DDW_FLOAT=<type> -DDW_FLOAT_HEADER="<type>.h", kernels/library.py) and its scalar path.
// Owns: argument checks, the partial-sum buffer of a wide call, which cpuid features each ISA unit needs
// (dispatch.h's rule picks the path); the thread split is block_op.h's (over 16-column blocks, never over K).
// Knows nothing of models or files; the layout and the arithmetic are defined in float.h, the type's bits in its
// header. The scalar path performs the exact float sequence of the SIMD paths.
#include <torch/library.h>
#include <cmath>
#include "block_op.h"
#include "dispatch.h"
#include "float.h"
#include DW_FLOAT_HEADER

namespace {

// What float_avx2.cpp and float_avx512.cpp are compiled for (kernels/blocktypes.py's units of the family).
constexpr dwisa::Isa ISA{"float", {0, dwisa::F_AVX2 | dwisa::F_FMA | dwisa::F_F16C,
                                   dwisa::F_AVX512F | dwisa::F_AVX512BW | dwisa::F_AVX512VL | dwisa::F_AVX512VNNI}};

}  // namespace

extern "C" void DW_FLOAT_GEMM(scalar)(const DwFloat* w, const DwFloatAct* a, float* out, int64_t b0, int64_t b1) {
    const int64_t K = w->K;
    dwop::scalar_cells(w->N, a->M, b0, b1, w->bias, out, [&](int64_t b, int j, int64_t m) {
        const uint16_t* col = w->w + b * K * 16 + j;
        const float* x = a->x + m * K;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) acc = std::fma(dwelem::to_float(col[k * 16]), x[k], acc);
        return acc;
    });
}

#ifndef DW_HAVE_X86
extern "C" void DW_FLOAT_GEMM(avx2)(const DwFloat*, const DwFloatAct*, float*, int64_t, int64_t) {}
extern "C" void DW_FLOAT_GEMM(avx512)(const DwFloat*, const DwFloatAct*, float*, int64_t, int64_t) {}
#endif

namespace {

// x [M, K] float32 -> y [M, N] float32; w [NB, K, 16] of a 16-bit dtype (the type's own: float16, bfloat16), read
// as the stored bits (the type's header converts them)
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t N,
                  int64_t path) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "x must be [M, K] float32 contiguous");
    const int64_t M = x.size(0), K = x.size(1), NB = (N + 15) / 16;
    TORCH_CHECK(w.element_size() == 2 && w.is_contiguous() && w.numel() == NB * K * 16, "w: bad shape");
    const float* bias_p = dwop::bias_of(bias, N);
    path = dwisa::select(ISA, path);
    return dwop::output(x, N, [&](dwop::Scratch& s, float* yp) {
        float* part = M > 1 ? s.make<float>({M, NB * 16}, at::kFloat) : nullptr;
        const auto gemm = dwisa::pick(path, DW_FLOAT_GEMM(scalar), DW_FLOAT_GEMM(avx2), DW_FLOAT_GEMM(avx512));
        DwFloat wt{(const uint16_t*)w.data_ptr(), bias_p, N, K};
        DwFloatAct a{x.data_ptr<float>(), M, part};
        dwop::over_blocks(NB, [&](int64_t b0, int64_t b1) { gemm(&wt, &a, yp, b0, b1); });
    });
}

std::vector<int64_t> paths() { return dwisa::available_paths(ISA); }

}  // namespace

#define DW_FLOAT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define DW_FLOAT_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
#define DW_FLOAT_NS DW_FLOAT_CAT(draftwise_, DW_FLOAT, )

DW_FLOAT_LIBRARY(DW_FLOAT_NS, m) {
    m.def("linear(Tensor x, Tensor w, Tensor? bias, int N, int path) -> Tensor");
    m.def("paths() -> int[]", &paths);
}
DW_FLOAT_LIBRARY_IMPL(DW_FLOAT_NS, m) { m.impl("linear", &linear); }

// Row-exact attention: the torch operator torch.ops.draftwise_attn.decode and the baseline path
// (attention_kernel.h compiled without -m flags, so this library still loads on any x86-64).
// Owns: argument checks, the output layout, threading over (b, kv head, t, head) items (at::parallel_for, torch's
// thread count) and which cpuid features each attention ISA unit needs (ISA below; dispatch.h's rule picks the
// path). The float sequence of one query is fixed in attention.h / attention_kernel.h; how items are split among
// threads cannot change any result. Also which calls take the AMX unit (attention_amx.cpp: 'auto' with bf16 K/V,
// head_dim a multiple of 32 up to 256, where this process may use AMX-BF16 tiles; 'amx' by name). Knows nothing of
// models or of speculation.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include <vector>
#include "attention_kernel.h"
#include "dispatch.h"

extern "C" void dw_attn_rows_scalar(const DwAttnArgs* a, int64_t i0, int64_t i1, float* scratch) {
    dwattn::run(a, i0, i1, scratch);
}

#ifndef DW_HAVE_X86
extern "C" void dw_attn_rows_avx2(const DwAttnArgs*, int64_t, int64_t, float*) {}
extern "C" void dw_attn_rows_avx512(const DwAttnArgs*, int64_t, int64_t, float*) {}
extern "C" void dw_attn_rows_amx(const DwAttnArgs*, int64_t, int64_t, float*) {}
#endif

namespace {

// The AMX path's id (attention only: csrc/dispatch.h's ids are shared by every op; kernels/attention.py names it).
constexpr int64_t AMX_PATH = 3;

// Whether this process may run attention_amx.cpp: cpuid AMX-TILE + AMX-BF16 and the AVX-512 its softmax uses, no
// $DRAFTWISE_MAX_ISA cap (any cap is a CPU without AMX), and the kernel's permission for tile data.
bool amx_bf16() {
    using namespace dwisa;
    static const bool ok = amx_usable(AMX_BF16, F_AVX512F | F_AVX512BW | F_AVX512VL | F_AVX512DQ);  // asked once
    return ok;
}

// What attention_avx2.cpp and attention_avx512.cpp are compiled for (kernels/library.py `_units`).
constexpr dwisa::Isa ISA{"attention", {0, dwisa::F_AVX2 | dwisa::F_FMA,
                                       dwisa::F_AVX512F | dwisa::F_AVX512BW | dwisa::F_AVX512VL | dwisa::F_AVX512DQ}};

// q [B, H, T, D] (D contiguous, any other strides; float32 or bfloat16, the output's dtype), keys/values: one
// layer's page pool [P, Hkv, BS, D] (float32 or bfloat16, whatever q's);
// tables [B, nb] int64: each sequence's pages in position order (position p: page tables[b, p / BS], row p % BS;
// BS a multiple of 16 unless nb == 1); positions [B, >=1] int64 (positions[b, 0]: the first query's position, the
// rest follow); num_tokens [B]: real queries per sequence. -> [B, H, T, D], a transposed view of a contiguous
// [B, T, H, D] (so the caller's transpose(1, 2).reshape(B, T, H * D) is free); rows t >= num_tokens[b] are zero.
// anc: null, or [B, T] int64 ancestor masks (tree rows, attention.h): bit t of row t set, no bit above it.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables_in,
                  const at::Tensor& positions, at::IntArrayRef num_tokens, double scale, int64_t window, int64_t path,
                  const at::Tensor* anc) {
    TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "q and the cache must be 4-d");
    const auto dt = q.scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "attention: float32 or bfloat16 only, got ", dt);
    const auto kvt = keys.scalar_type();
    TORCH_CHECK((kvt == at::kFloat || kvt == at::kBFloat16) && values.scalar_type() == kvt,
                "keys and values: one dtype, float32 or bfloat16, got ", kvt, " and ", values.scalar_type());
    TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() &&
                    tables_in.device().is_cpu() && positions.device().is_cpu(), "CPU tensors only");
    TORCH_CHECK(keys.sizes() == values.sizes() && keys.strides() == values.strides(), "keys and values differ in layout");
    const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
    const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
    const int64_t P = keys.size(0), Hkv = keys.size(1), BS = keys.size(2);
    TORCH_CHECK(keys.size(3) == D && keys.stride(3) == 1, "cache must be [pages, Hkv, BS, D] with D contiguous");
    TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
    TORCH_CHECK(tables_in.dim() == 2 && tables_in.size(0) == B && tables_in.size(1) >= 1 &&
                    tables_in.scalar_type() == at::kLong, "tables must be [B, pages per sequence] int64");
    const at::Tensor tables = tables_in.contiguous();
    const int64_t nb = tables.size(1);
    TORCH_CHECK(nb == 1 || BS % 16 == 0, "a paged cache needs pages of a multiple of 16 positions, got ", BS);
    TORCH_CHECK(positions.dim() == 2 && positions.size(0) == B && positions.size(1) >= 1 &&
                    positions.scalar_type() == at::kLong, "positions must be [B, T] int64");
    TORCH_CHECK((int64_t)num_tokens.size() == B, "num_tokens must have B entries");
    TORCH_CHECK(window >= 0, "window must be >= 0");

    std::vector<int64_t> first(B), ntok(B);
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int64_t* pp = positions.data_ptr<int64_t>();
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; ++b) {
        first[b] = pp[b * positions.stride(0)];
        ntok[b] = num_tokens[b];
        TORCH_CHECK(0 <= ntok[b] && ntok[b] <= T, "num_tokens[", b, "] = ", ntok[b], " outside 0..", T);
        if (ntok[b] == 0) continue;
        const int64_t len = first[b] + ntok[b];
        TORCH_CHECK(first[b] >= 0 && len <= nb * BS, "positions ", first[b], "..", len - 1,
                    " outside the ", nb * BS, " positions of sequence ", b, "'s pages");
        for (int64_t i = 0; i < (len + BS - 1) / BS; ++i)
            TORCH_CHECK(0 <= tp[b * nb + i] && tp[b * nb + i] < P, "sequence ", b, ": page ", tp[b * nb + i],
                        " (of position ", i * BS, ") outside the cache's ", P, " pages");
        max_len = std::max(max_len, window > 0 ? std::min(len, window) : len);
    }
    // 'auto' takes the AMX path wherever it can run (for every width: its rows agree with one another, not with the
    // other paths'); an explicit 'amx' must be able to
    const bool amx_fits = kvt == at::kBFloat16 && D % 32 == 0 && D <= 256;
    if (path == AMX_PATH) {
        TORCH_CHECK(amx_bf16(), "attention path amx cannot run on this CPU or process (no AMX-BF16 tiles, or capped)");
        TORCH_CHECK(amx_fits, "attention path amx: bfloat16 K/V and a head_dim that is a multiple of 32 up to 256 "
                    "only, got ", kvt, " and ", D);
    } else if (path == dwisa::AUTO && amx_fits && amx_bf16()) {
        path = AMX_PATH;
    } else {
        path = dwisa::select(ISA, path);
    }
    const uint64_t* masks = nullptr;
    if (anc != nullptr) {
        TORCH_CHECK(anc->dim() == 2 && anc->size(0) == B && anc->size(1) == T && anc->scalar_type() == at::kLong &&
                        anc->is_contiguous() && anc->device().is_cpu(), "ancestors must be a contiguous [B, T] int64");
        TORCH_CHECK(T <= 64, "a tree chunk has at most 64 rows, got ", T);
        masks = (const uint64_t*)anc->data_ptr<int64_t>();
        for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < ntok[b]; ++t) {
                const uint64_t m = masks[b * T + t];
                TORCH_CHECK(((m >> t) & 1u) && (t == 63 || (m >> (t + 1)) == 0),
                            "ancestors[", b, ", ", t, "] must hold row ", t, " itself and only rows before it");
            }
    }

    at::Tensor out = at::empty({B, T, H, D}, q.options());
    const int64_t items = B * H * T;
    if (items > 0 && D > 0) {
        DwAttnArgs a{qc.data_ptr(), qc.stride(0), qc.stride(1), qc.stride(2),
                     keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
                     out.data_ptr(), tp, nb, BS, first.data(), ntok.data(),
                     B, T, H, Hkv, D, (float)scale, window, dt == at::kBFloat16 ? DW_ATTN_BF16 : DW_ATTN_F32,
                     kvt == at::kBFloat16 ? DW_ATTN_BF16 : DW_ATTN_F32, masks, max_len};
        auto fn = dwisa::pick(path, dw_attn_rows_scalar, dw_attn_rows_avx2, dw_attn_rows_avx512);
        if (D % 16 != 0) fn = dw_attn_rows_scalar;  // the SIMD paths take whole 16-lane chunks of head_dim
        if (path == AMX_PATH) fn = dw_attn_rows_amx;
        const int64_t nscratch = path == AMX_PATH ? dw_attn_amx_scratch_floats(max_len, D) : dw_attn_scratch_floats(max_len, D);
        const int64_t grain = std::max<int64_t>(1, 32768 / (max_len * D));  // ~64k flops per chunk at least
        at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
            // this thread's scratch, kept across calls and not cleared: every path writes each float before it
            // reads it (checked once by filling it with NaN before every call: the attention tests all passed), and
            // clearing it cost a decode step at 4k positions ~2.4 MB of zeroing per thread and layer on the AMX path
            thread_local std::vector<float> scratch;
            if ((int64_t)scratch.size() < nscratch) scratch.resize(nscratch);
            fn(&a, i0, i1, scratch.data());
        });
    }
    return out.transpose(1, 2);
}

at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables,
                       const at::Tensor& positions, at::IntArrayRef num_tokens, double scale, int64_t window,
                       int64_t path) {
    return attend(q, keys, values, tables, positions, num_tokens, scale, window, path, nullptr);
}

// decode's token-tree form: row t of sequence b attends the keys before the chunk and the chunk rows of
// ancestors[b, t] (attention.h, tree rows).
at::Tensor attn_tree(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables,
                     const at::Tensor& positions, at::IntArrayRef num_tokens, const at::Tensor& ancestors, double scale,
                     int64_t window, int64_t path) {
    return attend(q, keys, values, tables, positions, num_tokens, scale, window, path, &ancestors);
}

std::vector<int64_t> paths() { return dwisa::available_paths(ISA); }

// Whether 'auto' takes the AMX path here for bfloat16 K/V (head_dim a multiple of 32 up to 256).
bool amx_path() { return amx_bf16(); }

}  // namespace

TORCH_LIBRARY(draftwise_attn, m) {
    m.def("decode(Tensor q, Tensor keys, Tensor values, Tensor tables, Tensor positions, int[] num_tokens, "
          "float scale, int window, int path) -> Tensor");
    m.def("tree(Tensor q, Tensor keys, Tensor values, Tensor tables, Tensor positions, int[] num_tokens, "
          "Tensor ancestors, float scale, int window, int path) -> Tensor");
    m.def("paths() -> int[]", &paths);
    m.def("amx() -> bool", &amx_path);
}

TORCH_LIBRARY_IMPL(draftwise_attn, CPU, m) {
    m.impl("decode", &attn_decode);
    m.impl("tree", &attn_tree);
}

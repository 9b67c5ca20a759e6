// The rows of an embedding table kept as a GGUF stores it, decoded to float32 (torch.ops.draftwise_embed.rows):
// models/quant.py's GGUFRowsEmbedding looks up a step's token rows here instead of through the `gguf` package's
// numpy dequantizer, whose per-call overhead (~46 us a Q6_K row of 2048) was a fixed cost of every decode step.
// kernels/embed_rows.py is the Python side.
//
// Owns: the decoding of one stored row per id, bitwise the row `gguf.quants.dequantize` gives for the same bytes,
// by repeating its float32 sequence (each product rounded to float32 once, in numpy's order; -ffp-contract=off
// keeps the compiler from fusing them):
//   Q6_K (210-byte blocks of 256): y = (f32(d) * f32(scale[i / 16])) * f32(q - 32), d fp16 at byte 208, scale
//     int8 at 192 + i / 16, q's low 4 bits from ql (bytes 0-127), high 2 from qh (128-191) in ggml's order;
//     (numpy's order; the other, d * (scale * (q - 32)), gives the same bits: f32(d) * scale has at most 11 + 8
//     significant bits, so it is exact and either order rounds the exact product once);
//   Q8_0 (34-byte blocks of 32): y = f32(q) * f32(d), d fp16 at byte 0, q int8 at 2 + i;
//   F16 / BF16 / F32 rows: each element widened exactly (f16.h's conversion; bf16 << 16; a copy).
// A row is decoded from its bytes alone, by one thread, whatever else the call holds (row-exact). Ids are checked
// against the table's rows (an IndexError). fp16 fields that are NaN decode as f16.h quiets them, which may differ
// from numpy's conversion in the NaN's payload bits; GGUF files hold finite scales. Knows nothing of models.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <cstdint>
#include <cstring>
#include <string>
#include "f16.h"

namespace {

constexpr int64_t ROW_GRAIN = 8;  // rows per parallel task: a decode step's few rows stay on the calling thread

inline uint16_t half_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h;
}

// One Q6_K block's 256 values: gguf's Q6_K.dequantize_blocks.
void q6_k_block(const uint8_t* b, float* y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = dwelem::to_float(half_at(b + 208));
    float ds[16];
    for (int s = 0; s < 16; ++s) ds[s] = d * (float)sc[s];
    for (int h = 0; h < 2; ++h) {  // 128 values a half: ql's 64 bytes give 2 x 64 nibbles, qh's 32 give 4 x 32 pairs
        const uint8_t *l = ql + 64 * h, *u = qh + 32 * h;
        const float* s = ds + 8 * h;
        float* o = y + 128 * h;
        for (int j = 0; j < 32; ++j) o[j] = s[j >> 4] * (float)(((l[j] & 15) | ((u[j] & 3) << 4)) - 32);
        for (int j = 0; j < 32; ++j)
            o[32 + j] = s[2 + (j >> 4)] * (float)(((l[32 + j] & 15) | (((u[j] >> 2) & 3) << 4)) - 32);
        for (int j = 0; j < 32; ++j)
            o[64 + j] = s[4 + (j >> 4)] * (float)(((l[j] >> 4) | (((u[j] >> 4) & 3) << 4)) - 32);
        for (int j = 0; j < 32; ++j) o[96 + j] = s[6 + (j >> 4)] * (float)(((l[32 + j] >> 4) | ((u[j] >> 6) << 4)) - 32);
    }
}

// One Q8_0 block's 32 values: gguf's Q8_0.dequantize_blocks (x * d).
void q8_0_block(const uint8_t* b, float* y) {
    const float d = dwelem::to_float(half_at(b));
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) y[i] = (float)q[i] * d;
}

void f16_row(const uint8_t* b, float* y, int64_t H) {
    for (int64_t i = 0; i < H; ++i) y[i] = dwelem::to_float(half_at(b + 2 * i));
}

void bf16_row(const uint8_t* b, float* y, int64_t H) {
    for (int64_t i = 0; i < H; ++i) {
        const uint32_t bits = (uint32_t)half_at(b + 2 * i) << 16;
        std::memcpy(y + i, &bits, 4);
    }
}

enum class Kind { Q6_K, Q8_0, F16, BF16, F32 };

struct Layout {
    Kind kind;
    int64_t values, bytes;  // per block (a float type: one element)
};

Layout layout_of(const std::string& type) {
    if (type == "Q6_K") return {Kind::Q6_K, 256, 210};
    if (type == "Q8_0") return {Kind::Q8_0, 32, 34};
    if (type == "F16") return {Kind::F16, 1, 2};
    if (type == "BF16") return {Kind::BF16, 1, 2};
    if (type == "F32") return {Kind::F32, 1, 4};
    TORCH_CHECK(false, "embed rows: no decoder for GGUF type ", type);
}

// raw [V, row bytes] uint8 (contiguous), ids [n] int64 -> [n, H] float32: row j is raw[ids[j]] decoded.
at::Tensor rows(const at::Tensor& raw, const at::Tensor& ids, const std::string& type, int64_t H) {
    const Layout L = layout_of(type);
    TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.device().is_cpu(),
                "embed rows: raw must be a contiguous CPU uint8 [V, row bytes] tensor");
    TORCH_CHECK(H > 0 && H % L.values == 0 && raw.size(1) == H / L.values * L.bytes,
                "embed rows: a ", type, " row of ", H, " values is not ", raw.size(1), " bytes");
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(),
                "embed rows: ids must be a CPU int64 [n] tensor");
    const at::Tensor idc = ids.contiguous();
    const int64_t n = idc.size(0), V = raw.size(0), row_bytes = raw.size(1);
    const int64_t* id = idc.data_ptr<int64_t>();
    for (int64_t j = 0; j < n; ++j)
        TORCH_CHECK_INDEX(id[j] >= 0 && id[j] < V, "token id ", id[j],
                          " out of range for an embedding of ", V, " rows");
    at::Tensor out = at::empty({n, H}, raw.options().dtype(at::kFloat));
    const uint8_t* base = raw.data_ptr<uint8_t>();
    float* y = out.data_ptr<float>();
    at::parallel_for(0, n, ROW_GRAIN, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
            const uint8_t* b = base + id[j] * row_bytes;
            float* yr = y + j * H;
            switch (L.kind) {
                case Kind::Q6_K:
                    for (int64_t k = 0; k < H / L.values; ++k) q6_k_block(b + k * L.bytes, yr + k * L.values);
                    break;
                case Kind::Q8_0:
                    for (int64_t k = 0; k < H / L.values; ++k) q8_0_block(b + k * L.bytes, yr + k * L.values);
                    break;
                case Kind::F16: f16_row(b, yr, H); break;
                case Kind::BF16: bf16_row(b, yr, H); break;
                case Kind::F32: std::memcpy(yr, b, H * 4); break;
            }
        }
    });
    return out;
}

}  // namespace

TORCH_LIBRARY(draftwise_embed, m) {
    m.def("rows(Tensor raw, Tensor ids, str type, int H) -> Tensor", rows);
}

// The torch-facing pieces the wide sides share (gemm_q4x8.cpp, gemm_q6k.cpp; gemm_q8_0.cpp: the switch, the VNNI
// chunk and the ops): the measured switch width, the
// tile-major activation quantization, the row chunking and the per-thread scratch.
//
// Owns: the switch's storage (`DwWideSwitch`: the smallest row count path-'auto' calls hand to the wide kernel,
// set from Python, which measures it: kernels/library.py wide_min_rows; until then never), the AMX sides' row chunk
// size (a chunk's int8 activations stay in a core's L2 while every 16-column block passes over them) and the
// GEMVs' argument checks (q4x8.cpp and q6k.cpp define them; each kind's GEMV and wide operators call them), the
// names of the wide sides and the operators every kind's wide side defines alike (dw_def_wide_ops). Knows nothing of the tile loops or of how the side is chosen (gemm_q4x8.cpp's
// dw_wide_side); the quantized values are the GEMVs' own (q4x8.h's dw_q8_rows_*), so a row's arithmetic never
// depends on the call's width or chunking.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

// The smallest row count from which path-'auto' calls take a wide kernel (never until set).
class DwWideSwitch {
   public:
    bool takes(int64_t M) const { return M >= rows_.load(std::memory_order_relaxed); }
    int64_t get() const { return rows_.load(std::memory_order_relaxed); }
    void set(int64_t rows) {
        TORCH_CHECK(rows >= 1, "wide_min_rows must be >= 1");
        rows_.store(rows, std::memory_order_relaxed);
    }

   private:
    std::atomic<int64_t> rows_{std::numeric_limits<int64_t>::max()};
};

// x [M, K] float32 -> q [Mp / 16, Kp / 64, 16, 64] int8 tile-major (Kp = K rounded up to 64, Mp = M rounded up to 32;
// K values past K and the padding rows zero), dx [Mp, S] and, unless null, qsum [Mp, S, 8] (padding rows of dx and
// qsum not written: never read). Threads over rows (at::parallel_for). Defined in gemm_q4x8.cpp.
void dw_quantize_tiles(const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum);

// Rows per chunk for activations of Kp bytes a row (a multiple of 32, 128..384): a chunk's int8 activations stay in
// most of a 2 MB L2, and a block's float accumulators for the chunk (64 bytes a row: 24 KiB at 384 rows) in half of a
// 48 KiB L1 beside the block's B tiles and the streaming A tiles (measured on Sapphire Rapids, one core, calls
// alternated in one process as scripts/ab_amx_gemm.sh does: 256- to 512-row chunks took ~0.85x the time of
// 1,024-row ones at N 17920, K 1536).
inline int64_t dw_wide_chunk_rows(int64_t Kp) {
    constexpr int64_t CHUNK_BYTES = 1536 * 1024;  // int8 activations per row chunk
    constexpr int64_t ACC_ROWS = 384;             // float accumulator rows per block
    return std::max<int64_t>(128, std::min<int64_t>(ACC_ROWS, CHUNK_BYTES / Kp / 32 * 32));
}

// fn(b0, b1) over the 16-column blocks [0, NB), in groups of DW_BLOCK_GROUP taken from a shared counter by each of
// torch's threads: a thread slowed by a neighbour on a shared host takes fewer groups instead of holding the others
// at the join (a static split waits for the slowest half). Columns are independent, so which thread computes a
// block changes no bit.
constexpr int64_t DW_BLOCK_GROUP = 4;
template <class F>
inline void dw_for_blocks(int64_t NB, const F& fn) {
    const int64_t groups = (NB + DW_BLOCK_GROUP - 1) / DW_BLOCK_GROUP;
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), groups);
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
        for (int64_t g = next.fetch_add(1); g < groups; g = next.fetch_add(1))
            fn(g * DW_BLOCK_GROUP, std::min(NB, (g + 1) * DW_BLOCK_GROUP));
    });
}

// The VNNI sides' walk of one thread's 16-column blocks [b0, b1) over a call's row chunks: run(c, g0, g1) for groups
// of blocks whose weights (block_bytes each) fit DW_VNNI_GROUP_BYTES of a core's L2, every chunk passing over a
// group before the next group starts, so a group's weights are read from L3 or memory once per call and the
// chunks' activations (a chunk's 48 rows: 74-430 KiB at K 1536-8960) stream past them, where chunk after chunk
// over every block read a gate|up's 19 MB of weights again for each 48 rows (measured on a Zen 4, one thread, q5x8
// at 2,048 rows: gate|up 1536 -> 17920 137 -> 145 GMAC/s, 1536 -> 2048 and 8960 -> 1536 unchanged). Which chunk
// or group runs first changes no bit: every (chunk, block) is the same kernel call on the same rows.
constexpr int64_t DW_VNNI_GROUP_BYTES = 768 * 1024;
template <class F>
inline void dw_vnni_walk(int64_t b0, int64_t b1, int64_t chunks, int64_t block_bytes, const F& run) {
    const int64_t group = std::max<int64_t>(1, DW_VNNI_GROUP_BYTES / std::max<int64_t>(1, block_bytes));
    for (int64_t g0 = b0; g0 < b1; g0 += group)
        for (int64_t c = 0; c < chunks; ++c) run(c, g0, std::min(b1, g0 + group));
}

// This thread's scratch of at least `bytes`, 64-byte aligned (kept across calls; it only grows, so a smaller call
// after a larger one neither shrinks it nor zero-fills it again when the larger size comes back)
inline uint8_t* dw_thread_scratch(int64_t bytes) {
    thread_local std::vector<uint8_t> scratch;
    if ((int64_t)scratch.size() < bytes + 64) scratch.resize(bytes + 64);
    return scratch.data() + (64 - (uintptr_t)scratch.data() % 64) % 64;
}

// draftwise_q6k::linear's argument checks (x [M, K] float32 contiguous, K a multiple of 256, the weight buffers'
// dtypes and sizes for N columns; with mn and dmin, q6m's min-term buffers too); returns the bias pointer (null
// without one). Defined in q6k.cpp.
const float* dw_q6k_check(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                          const at::Tensor& d, const std::optional<at::Tensor>& bias, int64_t N,
                          const at::Tensor* mn = nullptr, const at::Tensor* dmin = nullptr, int64_t value_bits = 6);

// draftwise_q4x8::linear's argument checks (x [M, K] float32 contiguous, K a multiple of 32, the packed buffers'
// dtypes and sizes for N columns; with qh, q5x8's plane too); returns the bias pointer (null without one). Defined in
// q4x8.cpp.
const float* dw_q4x8_check(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sc, const at::Tensor& mn,
                           const at::Tensor& d, const at::Tensor& dmin, const std::optional<at::Tensor>& bias, int64_t N,
                           const at::Tensor* qh = nullptr);

// Q6_K's activations for rows [r0, r1) of x [M, K] on ISA path `path` (dispatch.h ids): q [G, M, 32], dx [S, M],
// qsum [S, M, 8] (q4x8's Q8_K rows) and qsum16 [S, M, 16] (q6k.h's DwQ8K16). Defined in q6k.cpp.
void dw_q6k_quantize_rows(int64_t path, const float* x, int64_t M, int64_t K, int8_t* q, float* dx, int16_t* qsum,
                          int16_t* qsum16, int64_t r0, int64_t r1);

// q6m (GGUF Q2_K): whether a path-'auto' linear of M rows takes the VNNI side, and that side (q6k's VNNI side with
// the min term; x [M, K] float32 -> [M, N]). Defined in gemm_q6k.cpp; q6k.cpp's q6m linear calls them.
bool dw_q6m_wide_takes(int64_t M);
at::Tensor dw_q6m_wide(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                       const at::Tensor& d, const at::Tensor& mn, const at::Tensor& dmin,
                       const std::optional<at::Tensor>& bias, int64_t N);

// q3k (GGUF Q3_K on q6k.h's 3-bit planes): the same pair for its VNNI side (x [M, K] float32 -> [M, N]; the weights
// as draftwise_q3k::linear takes them). Defined in gemm_q6k.cpp; q6k.cpp's q3k linear calls them.
bool dw_q3k_wide_takes(int64_t M);
at::Tensor dw_q3k_wide(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                       const at::Tensor& d, const std::optional<at::Tensor>& bias, int64_t N);

// The wide side this process runs (gemm_q4x8.cpp decides, for both kinds): AMX int8 tiles; else, on an AVX-512 VNNI
// CPU (or with AMX capped off by $DRAFTWISE_MAX_ISA=avx512), the AVX-512 GEMV's register tile over chunks of
// DW_VNNI_CHUNK_ROWS rows (each chunk's activations stay in L1/L2 while every 16-column block passes over them);
// else none.
enum class DwWideSide { NONE, VNNI, AMX };
DwWideSide dw_wide_side();
const char* dw_wide_side_name(DwWideSide side);  // "none", "vnni", "amx"

// The side of a kind whose only wide side is the VNNI one (the per-32 family, gemm_q8_0.cpp; q6m, gemm_q6k.cpp; q5x8,
// gemm_q4x8.cpp: the AMX tiles carry none of them): VNNI wherever dw_wide_side finds a wide side (AMX CPUs have AVX-512 VNNI), else none.
inline DwWideSide dw_vnni_only_side() {
    return dw_wide_side() == DwWideSide::NONE ? DwWideSide::NONE : DwWideSide::VNNI;
}
constexpr int64_t DW_VNNI_CHUNK_ROWS = 48;  // 4 of the GEMV's 12-row tiles (measured: 24-48 best at K 1536-8960)

// The operators every wide kind's library defines beside its own wide (and wide_vnni where it has two sides: the
// schemas Python's kernels/library.py and tests call): wide_available, wide_kind (the side this process runs for the
// kind: SIDE, dw_wide_side unless the kind has fewer sides, as q8_0's has only VNNI), and its switch SW's
// set_wide_min_rows / wide_min_rows.
template <DwWideSwitch& SW, DwWideSide (*SIDE)() = dw_wide_side>
inline void dw_def_wide_ops(torch::Library& m) {
    m.def("wide_available() -> bool", [] { return SIDE() != DwWideSide::NONE; });
    m.def("wide_kind() -> str", []() -> std::string { return dw_wide_side_name(SIDE()); });
    m.def("set_wide_min_rows(int rows) -> ()", [](int64_t rows) { SW.set(rows); });
    m.def("wide_min_rows() -> int", [] { return SW.get(); });
}


// q6k wide side, AMX path: the int8 tile multiply (TDPBSUD + TDPBSSD) for calls of many rows (prefill chunks,
// wide verification), row-exact with the Q6_K GEMV (q6k.cpp, q6k_avx512.cpp): every output is the same integer tot
// per super-block followed by the same float operations in the same super-block order, so each row is bitwise the
// row the GEMV computes alone, whatever M is.
// Owns: rebuilding one 16-column block's 6-bit weights into B tiles (gemm_q6k.h: the scale and the -32 offset
// folded into a 13-bit weight split into a low unsigned byte and a high signed one), the loop order (32 rows x 16
// columns x one super-block per pass: amx_tiles.h's tile pass, the high-byte tile signed) and the epilogue. Knows nothing of torch, threads or when it runs (gemm_q6k.cpp decides); called only after
// gemm_q4x8.cpp's AMX check. Compiled with -mamx-tile -mamx-int8 -mavx512f -mavx512bw -mavx512vl -mavx512vnni;
// includes no C++ library header.
#include "amx_tiles.h"
#include "gemm_q6k.h"

namespace {

// 64 weights q (0..63, bytes) with their 64 scales (int8 bytes): the low and high bytes of sc * (q - 32)
inline void split(__m512i q, __m512i scl, uint8_t* lo, uint8_t* hi) {
    const __m512i off = _mm512_set1_epi16(32);
    for (int half = 0; half < 2; ++half) {
        const __m256i qb = half ? _mm512_extracti64x4_epi64(q, 1) : _mm512_castsi512_si256(q);
        const __m256i sb = half ? _mm512_extracti64x4_epi64(scl, 1) : _mm512_castsi512_si256(scl);
        const __m512i w = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(qb), off), _mm512_cvtepi8_epi16(sb));
        _mm256_storeu_si256((__m256i*)(lo + half * 32), _mm512_cvtepi16_epi8(w));                         // w & 255
        _mm256_storeu_si256((__m256i*)(hi + half * 32), _mm512_cvtepi16_epi8(_mm512_srai_epi16(w, 8)));  // w >> 8
    }
}

// Block b's weights as B tiles: step j (groups 2j, 2j + 1) at scratch + 2048 j: lo tile, then hi tile (gemm_q6k.h).
// The 6-bit q of chunk c are rebuilt as the AVX-512 GEMV does (q6k.h's dwq6k::values over Q6_K's planes).
void prepare(const DwQ6* w, int64_t b, int64_t steps, uint8_t* scratch) {
    const int64_t G = w->G;
    const uint8_t* L = w->ql + b * G * 256;
    const uint8_t* H = w->qh + b * G * 128;
    const int8_t* SC = w->sc + b * G * 32;
    for (int64_t j = 0; j < steps; ++j) {
        uint8_t* lo = scratch + j * 2048;
        uint8_t* hi = lo + 1024;
        for (int h = 0; h < 2; ++h) {
            const int64_t g = 2 * j + h;
            const __m512i scl = dwamx::sc_lanes(SC + g * 32), sch = dwamx::sc_lanes(SC + g * 32 + 16);
            dwq6k::each_chunk([&]<int C>() {  // chunk C: K values 4C..4C+3 of the group (half 0), 16 + 4C.. (half 1)
                using P = dwq6k::Q6Planes;
                split(dwq6k::values<P, 2 * C, __m512i>(L + g * 256, H + g * 128), scl, lo + (h * 8 + C) * 64,
                      hi + (h * 8 + C) * 64);
                split(dwq6k::values<P, 2 * C + 1, __m512i>(L + g * 256, H + g * 128), sch, lo + (h * 8 + 4 + C) * 64,
                      hi + (h * 8 + 4 + C) * 64);
            });
        }
    }
}

// One pass's float epilogue (rows m0 .. m0 + rows - 1, super-block s): the GEMV's two float steps per row.
struct Epilogue {
    __m512 dv;        // d of the super-block, columns 0-15
    const float* DX;  // dx of row m0, super-block s (row stride S)
    float* acc;       // rows m0 .. of the block's accumulators [.., 16]
    int64_t S;
    int rows;
    void operator()(int32_t (*C)[16][16], int r0, int r1) const {
        // locals: the accumulator stores (vector types may alias anything) would otherwise reload every member
        const __m512 d = dv;
        const float* dx = DX;
        float* y = acc;
        const int64_t stride = S;
        const int end = r1 < rows ? r1 : rows;
        for (int m = r0; m < end; ++m) {
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dwamx::row_sum<8>(C, m)), d);
            _mm512_store_ps(y + m * 16, _mm512_fmadd_ps(t, _mm512_set1_ps(dx[m * stride]), _mm512_load_ps(y + m * 16)));
        }
    }
};

}  // namespace

extern "C" int64_t dw_q6k_amx_scratch_bytes(int64_t K, int64_t M) { return dwamx::scratch_bytes(K / 64, M); }

// Loop order: per block, per super-block, every 32-row tile: the block's B tiles of that super-block (8 KiB) stay in
// L1 while the row tiles stream past them; each row's accumulator waits in scratch between super-blocks (the same
// fma sequence per row, in super-block order, as the GEMV's register accumulator). Each pass's epilogue runs inside
// the next pass (amx_tiles.h's Pipeline).
extern "C" void dw_q6k_gemm_amx(const DwQ6* w, const DwQ8Tiles* a, float* out, int64_t b0, int64_t b1, uint8_t* scratch) {
    dw_configure_tiles();  // amx_config.h: 8 tiles of 16 x 64 bytes
    const int64_t S = w->S, N = w->N, M = a->M, steps = a->K / 64;
    float* accs = (float*)(scratch + steps * 2048);  // [M rounded up to 32, 16]
    dwamx::Pipeline<true, Epilogue> pipe;
    for (int64_t b = b0; b < b1; ++b) {
        prepare(w, b, steps, scratch);
        const float* D = w->d + b * S * 16;
        const dwamx::BlockCols cols(b, N, w->bias);
        dwamx::zero_accs(accs, M);
        Epilogue epi;
        epi.S = S;
        for (int64_t s = 0; s < S; ++s) {
            epi.dv = _mm512_loadu_ps(D + s * 16);
            for (int64_t m0 = 0; m0 < M; m0 += 32) {  // q and dx are padded to whole 32-row tiles
                const int8_t* A0 = a->q + (m0 / 16) * steps * 1024;  // rows m0 .. m0 + 15
                epi.DX = a->dx + m0 * S + s;
                epi.acc = accs + m0 * 16;
                epi.rows = M - m0 < 32 ? (int)(M - m0) : 32;
                pipe.pass(A0, A0 + steps * 1024, scratch, s * 4, s * 4 + 4, epi);
            }
        }
        pipe.flush();
        cols.store(accs, M, out, N);
    }
    dwamx::finish();
}

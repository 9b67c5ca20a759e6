// q4x8 wide side, AMX path: the int8 tile multiply (TDPBSUD) for calls of many rows (prefill chunks, wide
// verification), row-exact with the GEMV (q4x8.cpp, q4x8_avx512.cpp): every output is the same integer isc and
// imn per super-block followed by the same three float operations in the same super-block order, so each row is
// bitwise the row the GEMV computes alone, whatever M is.
// Owns: rebuilding one 16-column block's packed nibbles into B tiles (gemm_q4x8.h: sc split into two 4-bit
// halves so that sc-weighted int4 weights fit unsigned bytes), the loop order (32 rows x 16 columns x one
// super-block per pass: amx_tiles.h's tile pass, both weight tiles unsigned) and the epilogue.
// Knows nothing of torch, threads or when it runs (gemm_q4x8.cpp decides); called only after a cpuid check for
// AMX-TILE, AMX-INT8 and AVX-512 and with the process's permission for tile data. Compiled with -mamx-tile
// -mamx-int8 -mavx512f -mavx512bw -mavx512vl -mavx512vnni; includes no C++ library header.
#include "amx_tiles.h"
#include "gemm_q4x8.h"

namespace {

typedef int32_t __attribute__((may_alias)) i32_alias;  // a row's qsum pairs (int16 x 2) read as one int32

// bytewise a * b where every byte of both is <= 15 (so every product is <= 225 and fits its byte)
inline __m512i mul_u4(__m512i a, __m512i b) {
    const __m512i even = _mm512_and_si512(_mm512_mullo_epi16(a, b), _mm512_set1_epi16(0x00FF));
    const __m512i odd = _mm512_mullo_epi16(_mm512_srli_epi16(a, 8), _mm512_and_si512(b, _mm512_set1_epi16((short)0xFF00)));
    return _mm512_or_si512(even, odd);
}

// Block b's weights as B tiles: step j (groups 2j, 2j + 1) at scratch + 2048 j: lo tile, then hi tile (gemm_q4x8.h).
void prepare(const DwQ4* w, int64_t b, int64_t steps, uint8_t* scratch) {
    const int64_t G = w->G;
    const uint8_t* P = w->packed + b * G * 256;
    const uint8_t* SC = w->sc + b * G * 16;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t j = 0; j < steps; ++j) {
        uint8_t* lo = scratch + j * 2048;
        uint8_t* hi = lo + 1024;
        for (int h = 0; h < 2; ++h) {
            const int64_t g = 2 * j + h;
            if (g >= G) {
                for (int r = 0; r < 8; ++r) {
                    _mm512_storeu_si512((void*)(lo + (h * 8 + r) * 64), _mm512_setzero_si512());
                    _mm512_storeu_si512((void*)(hi + (h * 8 + r) * 64), _mm512_setzero_si512());
                }
                continue;
            }
            const __m512i scv = dwamx::sc_lanes(SC + g * 16);
            const __m512i slo = _mm512_and_si512(scv, low4);
            const __m512i shi = _mm512_and_si512(_mm512_srli_epi16(scv, 4), low4);
            for (int c = 0; c < 4; ++c) {  // chunk c: low nibbles = K values 4c..4c+3 of the group, high = 16 + 4c..
                const __m512i raw = _mm512_loadu_si512((const void*)(P + g * 256 + c * 64));
                const __m512i ql = _mm512_and_si512(raw, low4);
                const __m512i qh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                _mm512_storeu_si512((void*)(lo + (h * 8 + c) * 64), mul_u4(ql, slo));
                _mm512_storeu_si512((void*)(lo + (h * 8 + 4 + c) * 64), mul_u4(qh, slo));
                _mm512_storeu_si512((void*)(hi + (h * 8 + c) * 64), mul_u4(ql, shi));
                _mm512_storeu_si512((void*)(hi + (h * 8 + 4 + c) * 64), mul_u4(qh, shi));
            }
        }
    }
}

// Columns 0-15 of groups g, g + 1 as int16 pairs (q4x8_avx512.cpp's mn_pair: the same operand, the same sums)
inline __m512i mn_pair(const uint8_t* MN, int64_t g, int64_t G) {
    const __m128i a = _mm_loadu_si128((const __m128i*)(MN + g * 16));
    const __m128i b = g + 1 < G ? _mm_loadu_si128((const __m128i*)(MN + (g + 1) * 16)) : _mm_setzero_si128();
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
}

// One pass's float epilogue (rows m0 .. m0 + rows - 1, super-block s): per row, isc and imn, then the GEMV's three
// float steps into the row's accumulator.
struct Epilogue {
    __m512i mnp[4];  // mn_pair of the super-block's group pairs
    __m512 dv, dmv;  // d and dmin of the super-block, columns 0-15
    const DwQ8Rows* a;
    float* acc;  // rows m0 .. of the block's accumulators [.., 16]
    int64_t m0, s, S;
    int rows;
    void operator()(int32_t (*C)[16][16], int r0, int r1) const {
        // locals: the accumulator stores (vector types may alias anything) would otherwise reload every member
        const __m512i mn0 = mnp[0], mn1 = mnp[1], mn2 = mnp[2], mn3 = mnp[3];
        const __m512 d = dv, dm = dmv;
        const int16_t* QS = a->qsum + (m0 * S + s) * 8;
        const float* DX = a->dx + m0 * S + s;
        float* y = acc;
        const int64_t stride = S;
        const int end = r1 < rows ? r1 : rows;
        for (int m = r0; m < end; ++m) {
            const __m512i isc = dwamx::row_sum<4>(C, m);
            const i32_alias* qs = (const i32_alias*)(QS + m * stride * 8);
            __m512i imn = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mn0, _mm512_set1_epi32(qs[0]));
            imn = _mm512_dpwssd_epi32(imn, mn1, _mm512_set1_epi32(qs[1]));
            imn = _mm512_dpwssd_epi32(imn, mn2, _mm512_set1_epi32(qs[2]));
            imn = _mm512_dpwssd_epi32(imn, mn3, _mm512_set1_epi32(qs[3]));
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isc), d);
            t = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imn), dm, t);
            _mm512_store_ps(y + m * 16, _mm512_fmadd_ps(t, _mm512_set1_ps(DX[m * stride]), _mm512_load_ps(y + m * 16)));
        }
    }
};

}  // namespace

extern "C" int64_t dw_amx_scratch_bytes(int64_t Kp, int64_t M) { return dwamx::scratch_bytes(Kp / 64, M); }

// Loop order: per block, per super-block, every 32-row tile: the block's B tiles of that super-block (8 KiB) stay in
// L1 while the row tiles (tile-major: each A tile 1 KiB of consecutive bytes) stream past them; each row's
// accumulator waits in scratch between super-blocks (the same fma sequence per row, in super-block order, as the
// GEMV's register accumulator). Each pass's epilogue runs inside the next pass (amx_tiles.h's Pipeline).
extern "C" void dw_gemm_amx(const DwQ4* w, const DwQ8Rows* a, float* out, int64_t b0, int64_t b1, uint8_t* scratch) {
    dw_configure_tiles();  // amx_config.h: 8 tiles of 16 x 64 bytes
    const int64_t G = w->G, S = w->S, N = w->N, M = a->M, Kp = a->Kp, steps = Kp / 64;
    float* accs = (float*)(scratch + steps * 2048);  // [M rounded up to 32, 16]
    dwamx::Pipeline<false, Epilogue> pipe;
    for (int64_t b = b0; b < b1; ++b) {
        prepare(w, b, steps, scratch);
        const uint8_t* MN = w->mn + b * G * 16;
        const float* D = w->d + b * S * 16;
        const float* DM = w->dmin + b * S * 16;
        const dwamx::BlockCols cols(b, N, w->bias);
        dwamx::zero_accs(accs, M);
        Epilogue epi;
        epi.a = a;
        epi.S = S;
        for (int64_t s = 0; s < S; ++s) {
            const int64_t g0 = s * 8, g1 = g0 + 8 < G ? g0 + 8 : G, j0 = g0 / 2, j1 = (g1 + 1) / 2;
            for (int p = 0; p < 4; ++p) epi.mnp[p] = g0 + 2 * p < g1 ? mn_pair(MN, g0 + 2 * p, G) : _mm512_setzero_si512();
            epi.dv = _mm512_loadu_ps(D + s * 16);
            epi.dmv = _mm512_loadu_ps(DM + s * 16);
            epi.s = s;
            for (int64_t m0 = 0; m0 < M; m0 += 32) {  // q, dx, qsum are padded to whole 32-row tiles
                const int8_t* A0 = a->q + (m0 / 16) * steps * 1024;  // rows m0 .. m0 + 15
                epi.m0 = m0;
                epi.rows = M - m0 < 32 ? (int)(M - m0) : 32;
                epi.acc = accs + m0 * 16;
                pipe.pass(A0, A0 + steps * 1024, scratch, j0, j1, epi);
            }
        }
        pipe.flush();
        cols.store(accs, M, out, N);
    }
    dwamx::finish();
}

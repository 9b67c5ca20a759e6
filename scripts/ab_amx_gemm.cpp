// Two builds of the q4x8 AMX GEMM (gemm_q4x8_amx.cpp from two source trees, symbols renamed at compile time) in one
// process, called alternately on the same random Q4_K-shaped weights and activations: on a shared host whose speed
// swings from one second to the next, only ratios taken call by call carry. Driven by scripts/ab_amx_gemm.sh, which
// builds it; not part of the library and not a test.
//
// Usage: ab_amx_gemm N K M CHUNK_A CHUNK_B REPEATS   (each side runs M rows in chunks of its CHUNK, as its caller
// would; prints min and median ms per side and the median of the per-repeat ratios B / A, and whether the two
// outputs are bitwise equal)
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "gemm_q4x8.h"
#include "q4x8.h"

extern "C" void a_dw_gemm_amx(const DwQ4*, const DwQ8Rows*, float*, int64_t, int64_t, uint8_t*);
extern "C" void b_dw_gemm_amx(const DwQ4*, const DwQ8Rows*, float*, int64_t, int64_t, uint8_t*);
using Kernel = void (*)(const DwQ4*, const DwQ8Rows*, float*, int64_t, int64_t, uint8_t*);

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <class T>
static T* buffer(size_t n) {
    return (T*)aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
}

int main(int argc, char** argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s N K M CHUNK_A CHUNK_B REPEATS\n", argv[0]);
        return 2;
    }
    const int64_t N = atol(argv[1]), K = atol(argv[2]), M = atol(argv[3]), chunk[2] = {atol(argv[4]), atol(argv[5])};
    const int reps = atoi(argv[6]);
    if (N % 16 || K % 256 || M < 1 || chunk[0] < 1 || chunk[1] < 1 || reps < 1) {
        fprintf(stderr, "N must be a multiple of 16, K of 256; M, chunks and repeats positive\n");
        return 2;
    }
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        fprintf(stderr, "no permission for AMX tile data\n");
        return 2;
    }
    const int64_t G = K / 32, S = G / 8, NB = N / 16, Kp = K, Mp = (M + 31) / 32 * 32;
    std::mt19937 rng(0);
    auto bytes = [&](size_t n, int mod) {
        uint8_t* p = buffer<uint8_t>(n);
        for (size_t i = 0; i < n; ++i) p[i] = (uint8_t)(rng() % mod);
        return p;
    };
    auto floats = [&](size_t n, float unit) {
        float* p = buffer<float>(n);
        for (size_t i = 0; i < n; ++i) p[i] = unit * (1 + rng() % 100);
        return p;
    };
    DwQ4 w{bytes(NB * G * 256, 256), bytes(NB * G * 16, 64), bytes(NB * G * 16, 64), floats(NB * S * 16, 1e-3f),
           floats(NB * S * 16, 1e-3f), nullptr, N, K, G, S};
    int16_t* qsum = buffer<int16_t>(Mp * S * 8);
    for (int64_t i = 0; i < Mp * S * 8; ++i) qsum[i] = (int16_t)((int)(rng() % 8001) - 4000);
    const DwQ8Rows all{(const int8_t*)bytes(Mp * Kp, 255), floats(Mp * S, 1e-2f), qsum, M, Kp};
    const Kernel kernel[2] = {a_dw_gemm_amx, b_dw_gemm_amx};
    float* out[2] = {buffer<float>(M * N), buffer<float>(M * N)};
    std::vector<double> t[2], ratio;
    for (int r = 0; r < reps; ++r) {
        double took[2];
        for (int side = 0; side < 2; ++side) {
            const int64_t c = chunk[side];
            uint8_t* scratch = buffer<uint8_t>((Kp / 64) * 2048 + (c + 31) / 32 * 32 * 64 + 64);
            const double t0 = now();
            for (int64_t m0 = 0; m0 < M; m0 += c) {  // the caller's row chunks (tile-major rows: 16-row tiles)
                const DwQ8Rows part{all.q + m0 * Kp, all.dx + m0 * S, all.qsum + m0 * S * 8, std::min(c, M - m0), Kp};
                kernel[side](&w, &part, out[side] + m0 * N, 0, NB, scratch);
            }
            took[side] = now() - t0;
            free(scratch);
        }
        t[0].push_back(took[0]);
        t[1].push_back(took[1]);
        ratio.push_back(took[1] / took[0]);
    }
    const bool same = memcmp(out[0], out[1], M * N * sizeof(float)) == 0;
    for (auto* v : {&t[0], &t[1], &ratio}) std::sort(v->begin(), v->end());
    printf("N=%ld K=%ld M=%ld chunks %ld/%ld, %d repeats: A min %.1f med %.1f ms | B min %.1f med %.1f ms | B/A median %.3f "
           "[%.3f..%.3f] | outputs %s\n",
           (long)N, (long)K, (long)M, (long)chunk[0], (long)chunk[1], reps, t[0][0] * 1e3, t[0][reps / 2] * 1e3,
           t[1][0] * 1e3, t[1][reps / 2] * 1e3, ratio[reps / 2], ratio[0], ratio[reps - 1], same ? "bitwise equal" : "DIFFER");
    return same ? 0 : 1;
}

/* The machine probe's streaming read (kernels/probe.py measure_stream_bandwidth): every 64-bit word of a buffer
   summed once, the buffer cut into `threads` contiguous parts (OpenMP), so the only cost is reading memory
   in order, as a decode step reads its weights. Plain C, no intrinsics: built with -O3 -march=native the
   compiler vectorizes the four independent sums at the widest loads this CPU has. Not part of the kernel
   library (kernels/library.py): it computes nothing a model uses. */
#include <stddef.h>
#include <stdint.h>

uint64_t draftwise_stream_read(const uint64_t *words, size_t n, int threads) {
    uint64_t total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
    for (size_t c = 0; c < n / 4; ++c) {
        const uint64_t *p = words + 4 * c;
        total += (p[0] + p[1]) + (p[2] + p[3]);
    }
    for (size_t i = n / 4 * 4; i < n; ++i) total += words[i];
    return total;
}

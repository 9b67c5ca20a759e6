// The x86 SIMD intrinsics (<immintrin.h>) for the ISA units and the headers they share, and nothing else.
//
// Owns: one targeted silencing. GCC 12's AVX-512 intrinsic headers build their "undefined" vectors as `__m512 __Y =
// __Y;`, which -Wall reports as '__Y' may be used uninitialized wherever an intrinsic using one is inlined
// (_mm512_reduce_max_ps, _mm512_cvtepu8_epi32, ...): a false positive in the compiler's own headers (GCC bug 105593).
// -Wuninitialized and -Wmaybe-uninitialized are off for the lines of <immintrin.h> only, so our own code keeps both.
// Knows nothing of any kernel; changes no generated code (diagnostics only).
#pragma once
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif

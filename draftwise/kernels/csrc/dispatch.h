// ISA dispatch for the library's ops: which paths (portable, AVX2, AVX-512) this CPU can run, what a requested
// path means, and which one runs. q4x8.cpp, attention.cpp and glue.cpp all select through here, one rule for all.
// Also whether AMX tiles are usable here (amx_usable: the wide GEMMs' int8 tiles, attention's bf16 tiles).
//
// Owns: the path ids and names (the Python side reads the names from here, through the path_names / path_id ops
// that q4x8.cpp registers: kernels/library.py PATHS), cpuid detection (once per process) and the selection rule:
// AUTO runs the best path this CPU has for the op (the last of available_paths), an explicit path runs only where
// the CPU has every feature the op declares for it, and anything else is a clear error.
// Knows nothing of any op's arithmetic or of which flags its ISA units were compiled with: each op declares an Isa
// (per path, the cpuid features its unit for that path needs, matching the -m flags in kernels/library.py `_units`) and
// takes its functions with pick(). Every path of an op computes bitwise the same results, so the choice changes
// speed only.
// Included only by the torch-facing units (it uses <vector> and TORCH_CHECK): the ISA units never see a C++ library
// header, so nothing inline compiled with AVX-512 flags can be merged into code that runs on other CPUs.
#pragma once
#include <stdint.h>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>
#include <c10/util/Exception.h>
#if defined(DW_HAVE_X86) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
namespace dwisa {

enum Path : int64_t { AUTO = -1, PORTABLE = 0, AVX2 = 1, AVX512 = 2 };
constexpr int64_t NUM_PATHS = 3;                                        // PORTABLE .. AVX512, slowest first
constexpr const char* NAMES[NUM_PATHS] = {"scalar", "avx2", "avx512"};  // by id: the names tests and Python use

// The cpuid features an ISA unit may be compiled for.
enum Feature : uint32_t {
    F_AVX2 = 1u << 0, F_FMA = 1u << 1, F_AVX512F = 1u << 2, F_AVX512BW = 1u << 3, F_AVX512VL = 1u << 4,
    F_AVX512DQ = 1u << 5, F_AVX512VNNI = 1u << 6, F_F16C = 1u << 7,
};

// One op's paths: needs[p] = the features path p's unit needs (PORTABLE: none, it is compiled without -m flags).
struct Isa {
    const char* op;  // for messages
    uint32_t needs[NUM_PATHS];
};

// DRAFTWISE_MAX_ISA=avx2|scalar runs this CPU as one without the features above that level (what a Zen 3, or a
// CPU without AVX2, would run), the same cap kernels/probe.py applies to its flags; "avx512" or unset: no cap.
inline uint32_t cap_features(uint32_t f) {
    const char* cap = std::getenv("DRAFTWISE_MAX_ISA");
    if (cap == nullptr || *cap == '\0' || std::strcmp(cap, "avx512") == 0) return f;
    return std::strcmp(cap, "avx2") == 0 ? f & (F_AVX2 | F_FMA | F_F16C) : 0;
}

inline uint32_t detect_features() {
    uint32_t f = 0;
#if defined(DW_HAVE_X86) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) f |= F_AVX2;
    if (__builtin_cpu_supports("fma")) f |= F_FMA;
    if (__builtin_cpu_supports("avx512f")) f |= F_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= F_AVX512BW;
    if (__builtin_cpu_supports("avx512vl")) f |= F_AVX512VL;
    if (__builtin_cpu_supports("avx512dq")) f |= F_AVX512DQ;
    if (__builtin_cpu_supports("avx512vnni")) f |= F_AVX512VNNI;
    if (__builtin_cpu_supports("f16c")) f |= F_F16C;
#endif
    return cap_features(f);  // no x86 units in this build: only the portable paths run
}

inline uint32_t cpu_features() {
    static const uint32_t f = detect_features();
    return f;
}

// AMX tiles (cpuid leaf 7 EDX: AMX-TILE bit 24, plus `amx_bit`: AMX_BF16 or AMX_INT8), the AVX-512 features
// `avx512_needs` the AMX unit also uses, no $DRAFTWISE_MAX_ISA cap (any cap is a CPU without AMX), and the kernel's
// permission for tile data (it may refuse). Detected by each caller once (a static) before its first tile.
enum AmxBit : unsigned { AMX_BF16 = 22, AMX_INT8 = 25 };
inline bool amx_usable(AmxBit amx_bit, uint32_t avx512_needs) {
#if defined(DW_HAVE_X86) && defined(__linux__)
    const char* cap = std::getenv("DRAFTWISE_MAX_ISA");
    if (cap != nullptr && *cap != '\0') return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(((d >> 24) & 1u) && ((d >> amx_bit) & 1u)) || (avx512_needs & ~cpu_features()) != 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    (void)amx_bit;
    (void)avx512_needs;
    return false;
#endif
}

inline bool runs(const Isa& isa, int64_t path) {
    return path >= 0 && path < NUM_PATHS && (isa.needs[path] & ~cpu_features()) == 0;
}

// The paths this CPU runs for the op, slowest first (always PORTABLE; the last is what AUTO picks).
inline std::vector<int64_t> available_paths(const Isa& isa) {
    std::vector<int64_t> p;
    for (int64_t i = 0; i < NUM_PATHS; ++i)
        if (runs(isa, i)) p.push_back(i);
    return p;
}

inline int64_t best_path(const Isa& isa) {
    for (int64_t i = NUM_PATHS - 1; i > PORTABLE; --i)
        if (runs(isa, i)) return i;
    return PORTABLE;
}

inline const char* path_name(int64_t path) {
    return path == AUTO ? "auto" : path >= 0 && path < NUM_PATHS ? NAMES[path] : "unknown";
}

inline std::string path_list(const std::vector<int64_t>& paths) {
    std::string s;
    for (const int64_t p : paths) s += (s.empty() ? "" : ", ") + std::string(path_name(p));
    return s;
}

inline std::string known_names() {
    std::string s = "auto, portable";
    for (const char* n : NAMES) s += std::string(", ") + n;
    return s;
}

// "auto", a name of NAMES, or "portable" (the scalar path's other name) -> its id; anything else is an error.
inline int64_t parse_path(std::string_view name) {
    int64_t id = name == "auto" ? AUTO : name == "portable" ? PORTABLE : AUTO - 1;
    for (int64_t i = 0; i < NUM_PATHS; ++i)
        if (name == NAMES[i]) id = i;
    TORCH_CHECK(id >= AUTO, "no ISA path named '", name, "' (", known_names(), ")");
    return id;
}

// The selection rule: AUTO -> the best path here; an explicit path -> itself where this CPU runs it, else an error.
inline int64_t select(const Isa& isa, int64_t requested) {
    if (requested == AUTO) return best_path(isa);
    TORCH_CHECK(runs(isa, requested), isa.op, " path ", path_name(requested), " (", requested,
                ") cannot run on this CPU (it runs ", path_list(available_paths(isa)), ")");
    return requested;
}

// The op's function for a selected path. Without x86 units (DW_HAVE_X86 undefined) only the portable one exists.
template <class F>
inline F pick(int64_t path, F portable, [[maybe_unused]] F avx2, [[maybe_unused]] F avx512) {
#ifdef DW_HAVE_X86
    return path == AVX512 ? avx512 : path == AVX2 ? avx2 : portable;
#else
    (void)path;
    return portable;
#endif
}

}  // namespace dwisa
}  // namespace

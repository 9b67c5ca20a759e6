"""The GGUF block types as one table, in the manner of ggml's type_traits: one row (`BlockType`) per ggml type,
and one row (`Kernel`) per C++ kernel family of the library that holds some of them exactly.

A BlockType row says what a type is (ggml's id and name, values per block, bytes per block: bits per weight) and
what draftwise does with it: the kernel that holds its blocks exactly (kernels/linear.py's registry name; None:
the fp32 fallback over the exactly dequantized weight), and, through that kernel's row, the activation
quantization it pairs with (GGUF's Q8_K for the K-quants' 256-blocks, Q8_0 / Q8_1 per 32), the bits per weight
it is held in (`draftwise memory`: the kernel's packed layout, with the 32-block kernels' scales in the type's own
scale form, `scales`), whether it has a wide (prompt) kernel, and the C++ units it brings to the
library (kernels/library.py compiles them). Everything that lists types reads them here: the faithful plan
(kernels/plan.py FAITHFUL_KERNELS), the loader (models/quant.py: which kernels are built from blocks),
kernels/ggml_blocks.py (block sizes), bench/memory.py (a tensor's stored bytes) and the reports (`fallbacks`:
the types a file stores that take the fp32 path, with what that costs).

Knows nothing of torch, files or models; imports nothing of draftwise (the lowest layer of kernels/).
"""
from __future__ import annotations

from dataclasses import dataclass

# ISA levels a unit is compiled for (kernels/library.py maps each to its compiler flags; csrc/dispatch.h's Isa
# declares the same features at run time)
MAIN, AVX2, AVX512_VNNI, AMX_INT8 = "main", "avx2", "avx512vnni", "amx-int8"


@dataclass(frozen=True)
class Kernel:
    """One C++ kernel family: a registry name (kernels/linear.py LINEARS), the activation quantization it pairs
    with, its packed layout's bits per weight (for N % 16 == 0, K a whole number of its blocks; the exact bytes
    are the linear class's `nbytes`; with `scale_terms`, the per-32 scale terms d (and m) it holds in a scale form
    of csrc/q8_0.h, the bits with them as float32, the form a float weight's quantization takes), whether 'auto' calls past a measured width take a wide kernel, and its
    C++ units (file, ISA level). A float type's row (`element` set: the torch dtype of its 16-bit values) takes
    the float family's shared units (FLOAT_UNITS: csrc/float.h), which the library compiles once per such row
    with the row's own header, csrc/<name>.h (how its 16-bit values become float32); kernels/linear.py registers
    a linear per such row."""

    name: str
    activation: str  # "Q8_K": int8 per row and 256 K values; "Q8_0": per 32; "Q8_1": per 32 with its sum; "F32"
    bits: float
    wide: bool
    units: tuple[tuple[str, str], ...]
    element: str = ""  # a float row's torch dtype name ("float16"); "" for a block kernel
    scale_terms: int = 0  # per-32 scale terms in a csrc/q8_0.h scale form: 1 (d) or 2 (d and m); 0: none
    # (a row's name is its kernels/linear.py registry name: never one of the dense ones, "fp32" and "bf16")


@dataclass(frozen=True)
class BlockType:
    """One GGUF tensor type (ggml's type_traits row): `values` per block of `block_bytes` bytes; `kernel` the
    Kernel row holding its blocks exactly, None where the fp32 fallback computes with its dequantized weight."""

    name: str
    type_id: int
    values: int
    block_bytes: int
    kernel: str | None = None
    quantized: bool = True  # False: a float type (F32, F16, BF16, F64), nothing stored to honour beyond its values
    scales: str = ""  # on a kernel with scale_terms: the scale form (SCALE_BITS) that holds its d and m exactly

    @property
    def bits(self) -> float:
        """Bits per weight as the file stores it."""
        return 8.0 * self.block_bytes / self.values

    def stored_bytes(self, numel: int) -> int:
        """Bytes of `numel` values as the file stores them (whole blocks)."""
        return numel // self.values * self.block_bytes


# bits per weight of one per-32 scale term (d, or m) in each scale form of csrc/q8_0.h: a float32 or fp16 per group
# of 32, or SUB8's int8 per group plus an fp16 per 8 groups (kernels/ggml_blocks.py packs them)
SCALE_BITS = {"f32": 32 / 32, "f16": 16 / 32, "sub8": (8 + 16 / 8) / 32}

# the float family's units (csrc/float.h): compiled once per float row, with -DDW_FLOAT=<name> and its header
FLOAT_UNITS = (("float.cpp", MAIN), ("float_avx2.cpp", AVX2), ("float_avx512.cpp", AVX512_VNNI))

KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("q4x8", "Q8_K", 4.75, True, (("q4x8.cpp", MAIN), ("gemm_q4x8.cpp", MAIN), ("q4x8_avx2.cpp", AVX2),
                                         ("q4x8_avx512.cpp", AVX512_VNNI), ("gemm_q4x8_amx.cpp", AMX_INT8))),
    # csrc/q4x8.h's fifth-bit plane: q4x8's units serve it (q4x8.cpp registers it); wide: gemm_q4x8.cpp's VNNI side
    # only (no AMX tiles for the plane: no AMX CPU here to test them)
    Kernel("q5x8", "Q8_K", 5.75, True, ()),
    Kernel("q6k", "Q8_K", 6.625, True, (("q6k.cpp", MAIN), ("gemm_q6k.cpp", MAIN), ("q6k_avx2.cpp", AVX2),
                                         ("q6k_avx512.cpp", AVX512_VNNI), ("gemm_q6k_amx.cpp", AMX_INT8))),
    # csrc/q6k.h's min term: q6k's units serve it (q6k.cpp registers it); wide: gemm_q6k.cpp's VNNI side only
    Kernel("q6m", "Q8_K", 7.25, True, ()),
    # csrc/q6k.h's 3-bit planes (Q3_K at its own width): q6k's units serve it (q6k.cpp registers it); wide:
    # gemm_q6k.cpp's VNNI side only (on AMX CPUs too: q6k's AMX tiles are built from Q6_K's planes)
    Kernel("q3k", "Q8_K", 3.625, True, ()),
    Kernel("q8_0", "Q8_0", 9.0, True, (("q8_0.cpp", MAIN), ("gemm_q8_0.cpp", MAIN), ("q8_0_avx2.cpp", AVX2),
                                        ("q8_0_avx512.cpp", AVX512_VNNI), ("gemm_q8_0_avx512.cpp", AVX512_VNNI)),
           scale_terms=1),
    # csrc/q8_0.h's min term: q8_0's units serve it (q8_0.cpp registers it)
    Kernel("q8_1", "Q8_1", 10.0, True, (), scale_terms=2),
    Kernel("q4c", "Q8_0", 5.0, True, (), scale_terms=1),  # csrc/q8_0.h's 4-bit codes form (q8_0's units)
    # csrc/q8_0.h's codes, fifth-bit plane and min term (q8_0's units)
    Kernel("q5m", "Q8_1", 7.0, True, (), scale_terms=2),
    Kernel("f16", "F32", 16.0, False, FLOAT_UNITS, "float16"),  # csrc/f16.h: IEEE half, as stored
    Kernel("bf16w", "F32", 16.0, False, FLOAT_UNITS, "bfloat16"),  # csrc/bf16w.h: bfloat16, as stored
)}

TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("F32", 0, 1, 4, quantized=False),
    BlockType("F16", 1, 1, 2, "f16", quantized=False),
    BlockType("Q4_0", 2, 32, 18, "q4c", scales="f16"),
    BlockType("Q4_1", 3, 32, 20, "q5m", scales="f16"),
    BlockType("Q5_0", 6, 32, 22, "q8_0", scales="f16"),
    BlockType("Q5_1", 7, 32, 24, "q5m", scales="f16"),
    BlockType("Q8_0", 8, 32, 34, "q8_0", scales="f16"),
    BlockType("Q8_1", 9, 32, 40),
    BlockType("Q2_K", 10, 256, 84, "q6m"),  # q + 32 with d * sc per 16, and the min term: q6k's arithmetic
    BlockType("Q3_K", 11, 256, 110, "q3k"),  # q3 + 4 in 3-bit planes, a signed 6-bit scale per 16: q6k's arithmetic
    BlockType("Q4_K", 12, 256, 144, "q4x8"),
    BlockType("Q5_K", 13, 256, 176, "q5x8"),  # Q4_K's scales and mins, q in 0..31: q4x8 with a fifth-bit plane
    BlockType("Q6_K", 14, 256, 210, "q6k"),
    BlockType("Q8_K", 15, 256, 292),
    BlockType("IQ2_XXS", 16, 256, 66),
    BlockType("IQ2_XS", 17, 256, 74),
    BlockType("IQ3_XXS", 18, 256, 98),
    BlockType("IQ1_S", 19, 256, 50),
    BlockType("IQ4_NL", 20, 32, 18, "q4c", scales="f16"),
    BlockType("IQ3_S", 21, 256, 110),
    BlockType("IQ2_S", 22, 256, 82),
    BlockType("IQ4_XS", 23, 256, 136, "q4c", scales="sub8"),
    BlockType("I8", 24, 1, 1, quantized=False),
    BlockType("I16", 25, 1, 2, quantized=False),
    BlockType("I32", 26, 1, 4, quantized=False),
    BlockType("I64", 27, 1, 8, quantized=False),
    BlockType("F64", 28, 1, 8, quantized=False),
    BlockType("IQ1_M", 29, 256, 56),
    BlockType("BF16", 30, 1, 2, "bf16w", quantized=False),
    BlockType("TQ1_0", 34, 256, 54),
    BlockType("TQ2_0", 35, 256, 66),
    BlockType("MXFP4", 39, 32, 17),
)}

FALLBACK = "fp32"  # what a type without a kernel computes with: its exactly dequantized weight, float32
FALLBACK_BITS = 32.0
FLOAT_TYPES = tuple(t.name for t in TYPES.values() if not t.quantized and t.name.startswith(("F", "BF")))


def row(name: str) -> BlockType:
    """The table row of a ggml type name; KeyError naming the known ones."""
    try:
        return TYPES[name]
    except KeyError:
        raise KeyError(f"no GGUF type {name!r} in the block-type table ({', '.join(TYPES)})") from None


def kernel_of(name: str) -> str:
    """The registry name of the kernel that holds a type's blocks exactly; FALLBACK for one without (an unknown
    name too: the loader dequantizes what it cannot hold)."""
    t = TYPES.get(name)
    return t.kernel if t is not None and t.kernel else FALLBACK


def faithful_kernels() -> dict[str, str]:
    """ggml type -> kernel, for every type with one (kernels/plan.py FAITHFUL_KERNELS)."""
    return {t.name: t.kernel for t in TYPES.values() if t.kernel}


def block_kernels() -> tuple[str, ...]:
    """The kernels built straight from a tensor's raw blocks (kernels/linear.py `from_blocks`): every kernel but
    q4x8, which takes Q4_K through its own exact parts (kernels/q4x8.py q4k_from_blocks; q5x8, on q4x8's units, is a
    block kernel)."""
    return tuple(k for k in KERNELS if k != "q4x8")


def types_of(kernel: str) -> tuple[str, ...]:
    """The types a kernel holds exactly, in table order."""
    return tuple(t.name for t in TYPES.values() if t.kernel == kernel)


def fallbacks(stored_types: dict[str, int] | None) -> dict[str, int]:
    """Of a census of stored types (type -> tensor count), the quantized ones no kernel holds: each takes the
    fp32 fallback (FALLBACK_BITS per weight instead of its own bits, and its speed)."""
    return {t: n for t, n in sorted((stored_types or {}).items())
            if kernel_of(t) == FALLBACK and (t not in TYPES or TYPES[t].quantized)}


def float_kernels(stored_types: dict[str, int] | None) -> dict[str, str]:
    """Of a census of stored types, the float types held on a kernel of their own (F16 -> f16), type -> kernel."""
    return {t: kernel_of(t) for t in sorted(stored_types or {}) if t in FLOAT_TYPES and kernel_of(t) != FALLBACK}


def scale_form(name: str | None) -> str:
    """The scale form (SCALE_BITS) a 32-block kernel holds a type's d and m in; "f32" for none (a float weight's
    quantization: `name` None) or a type without one."""
    t = TYPES.get(name or "")
    return t.scales if t is not None and t.scales else "f32"


def kernel_bits(name: str) -> float:
    """Bits per weight a type is held in once loaded: its kernel's packed layout with its scales in the type's
    scale form, or the fp32 fallback's."""
    k = kernel_of(name)
    if k not in KERNELS:
        return FALLBACK_BITS
    row_k = KERNELS[k]
    return row_k.bits + row_k.scale_terms * (SCALE_BITS[scale_form(name)] - SCALE_BITS["f32"])


def describe(name: str) -> str:
    """One line for a type: 'Q6_K: 6.56 bits stored -> q6k (Q8_K activations, 6.62 bits, wide kernel)'."""
    t = row(name)
    k = KERNELS.get(t.kernel or "")
    held = (f"{k.name} ({k.activation} activations, {kernel_bits(name):.2f} bits{', wide kernel' if k.wide else ''})" if k
            else f"{FALLBACK} fallback ({FALLBACK_BITS:.0f} bits)" if t.quantized else "dense")
    return f"{t.name}: {t.bits:.2f} bits stored -> {held}"

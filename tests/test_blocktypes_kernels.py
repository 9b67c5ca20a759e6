"""Every GGUF type the block-type table (kernels/blocktypes.py) gives a kernel, on that kernel, with no download:
random block bytes (any bytes are a valid block once the fp16 scale fields are finite; a float type: random finite
values) are read bitwise as the `gguf` package's dequantizer reads them; the kernel computes that weight times the
int8 activations it quantizes (a float kernel: the float32 activations, bitwise its one FMA chain per output)
(against a float64 reference of the gguf-dequantized weight times the same quantized activations: only the float
steps' rounding remains), every ISA path bitwise the scalar one; every row bitwise that row alone at widths 1..96
and thread counts 1 and 2 on every path, and a planted width-dependent reduction fails that check; the 32-block
types' narrow scale forms (csrc/q8_0.h) compute bitwise what float32 scales compute, and a rounding narrowing
fails that. The types and
kernels come from the table, so a new row is tested here by adding it to TYPES' parameter list. No timing
asserted. A few minutes on 2 busy cores."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.kernels import autotune, blocktypes, ggml_blocks, library
from draftwise.kernels.linear import LINEARS, available, block_paths
from draftwise.kernels.probe import probe

# the types the table gives a block kernel, each with the byte offsets of its fp16 scale fields (d, and m / dmin;
# none for a float type: its values are random finite numbers of the type)
TYPES = {"Q8_0": (0,), "Q5_0": (0,), "Q4_0": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
         "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "F16": (), "BF16": ()}
FLOATS = sorted(t for t in TYPES if not blocktypes.row(t).quantized)
WIDTHS = range(1, 97)
THREADS = [1, 2]


@pytest.fixture(scope="module")
def machine() -> dict:
    return probe(bandwidth=False)


def _kernel(kind: str, machine: dict):
    name = blocktypes.kernel_of(kind)
    if name not in available(machine):
        pytest.skip(f"{name} cannot run here (no C++ compiler)")
    return LINEARS[name]


def _on(mod, path: str):
    """`mod` run on ISA path `path` (checked: one this CPU runs)."""
    library.check_path(path)
    mod.path = path
    return mod


def _random_blocks(kind: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """Random raw blocks of a type with finite, moderate fp16 scale fields."""
    rng = np.random.default_rng(seed)
    t = blocktypes.row(kind)
    if not t.quantized:  # a float type: finite values of the type, as its bytes
        element = getattr(torch, blocktypes.KERNELS[t.kernel].element)
        values = torch.from_numpy(rng.standard_normal((N, K), dtype=np.float32)).to(element)
        return values.view(torch.int16).numpy().view(np.uint8).reshape(N, -1)
    raw = rng.integers(0, 256, size=(N * K // t.values, t.block_bytes), dtype=np.uint8)
    for at in TYPES[kind]:
        raw[:, at:at + 2] = rng.uniform(0.001, 0.01, size=raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind == "Q8_0":
        raw[:, 2:] = np.where(raw[:, 2:] == 128, 129, raw[:, 2:])  # -128: never written by ggml, refused
    return raw.reshape(N, -1)


def _gguf_dense(kind: str, raw: np.ndarray, N: int, K: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(N, K).astype(np.float32))


def _quantized_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [M, K] -> the values the kernel of `kind` computes with, float64: per row and block of its activation
    quantization (the table's: Q8_K 256 values, Q8_0 / Q8_1 32), dx * round_half_even(x * 127 / amax)."""
    M, K = x.shape
    activation = blocktypes.KERNELS[blocktypes.kernel_of(kind)].activation
    if activation == "F32":  # the float kernels: the activations as they are
        return x.double()
    per = 256 if activation == "Q8_K" else 32
    g = x.view(M, K // per, per)
    amax = g.abs().amax(-1, keepdim=True)
    # 127 / amax as one correctly rounded float32 division, as the kernels compute it: torch's `127.0 / amax` is
    # amax.reciprocal() * 127 (two roundings), 1 ulp off for some amax, and then a value 1 ulp from a .5 tie
    # rounds the other way (x = torch.randn(13, 512) from seed 2348, Q2_K: relative error 1.7e-3)
    q = torch.where(amax > 0, torch.round(g * (torch.full_like(amax, 127.0) / amax)), torch.zeros_like(g))
    return (q.double() * (amax / 127.0).double()).view(M, K)


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_the_table_names_a_kernel_for_the_type(kind):
    assert blocktypes.kernel_of(kind) in blocktypes.block_kernels()
    assert kind in LINEARS[blocktypes.kernel_of(kind)].GGUF_TYPES


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_blocks_are_read_as_the_gguf_package_dequantizes_them(kind):
    N, K = 20, 512
    raw = _random_blocks(kind, N, K)
    cls = LINEARS[blocktypes.kernel_of(kind)]
    parts = cls.parts_from_blocks(kind, raw, N, K)
    assert torch.equal(cls._dense(cls._pack(parts), 0, -(-N // 16))[:N], _gguf_dense(kind, raw, N, K))


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_every_path_is_the_dequantized_weight_times_the_quantized_activations(kind, machine):
    cls = _kernel(kind, machine)
    N, K = 40, 512
    raw = _random_blocks(kind, N, K, seed=1)
    g = torch.Generator().manual_seed(2348)  # row 9 holds a value 1 ulp below a .5 tie of x * (127 / amax)
    bias = torch.randn(N, generator=g)
    x = torch.randn(13, K, generator=g)
    ref = _quantized_activations(x, kind) @ _gguf_dense(kind, raw, N, K).double().T + bias.double()
    ys = {p: _on(cls.from_blocks(kind, raw, N, K, bias), p)(x) for p in block_paths(cls.name)}
    for p, y in ys.items():
        assert torch.equal(y, ys["scalar"]), p
    err = float((ys["scalar"].double() - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, err  # float32 steps over exact integer sums: only their rounding remains


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])  # csrc/q8_0.h's bytes; codes; codes, plane and min
def test_a_nan_activation_is_quantized_alike_on_every_path(kind, machine):
    """The per-32 activation quantizer's two forms (q8_0.cpp's scalar one, the scalar and AVX2 GEMVs'; the vector one
    of the AVX-512 GEMV and the wide side) pass a NaN value over as fmax does (the group's scale from the rest): a
    row with NaNs gives every path, and path 'auto' at the wide side's widths, the scalar path's output (NaN where
    it is NaN, else bitwise)."""
    cls = _kernel(kind, machine)
    N, K = 40, 512
    raw = _random_blocks(kind, N, K, seed=6)
    x = torch.randn(20, K)
    x[1, 5] = x[3, 40] = x[3, 300] = float("nan")
    x[4, 32:64] = float("nan")  # a whole group
    ref = _on(cls.from_blocks(kind, raw, N, K), "scalar")(x)
    assert ref[0].isfinite().all()
    for p in [*block_paths(cls.name), "auto"]:
        y = _on(cls.from_blocks(kind, raw, N, K), p)(x)
        assert torch.equal(y.isnan(), ref.isnan()), p
        assert torch.equal(torch.nan_to_num(y, nan=0.0), torch.nan_to_num(ref, nan=0.0)), p


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c) elementwise, exactly (one rounding), from float64: a * b is exact in float64, s = a * b
    + c rounds once more, e (TwoSum) is what that rounding lost; rounding s to float32 is then the one rounding of
    a * b + c except where s is a float32 tie that e breaks."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = s.float()
    other = torch.nextafter(r, torch.where(s > r.double(), torch.tensor(float("inf")), torch.tensor(float("-inf"))))
    tie = (s == (r.double() + other.double()) / 2) & (e != 0)
    return torch.where(tie, torch.where(e > 0, torch.maximum(r, other), torch.minimum(r, other)), r)


@pytest.mark.parametrize("kind", FLOATS)
def test_a_float_kernel_is_bitwise_the_gguf_weight_times_x_in_one_fma_chain(kind, machine):
    """csrc/float.h's arithmetic, emulated exactly: per output, acc = fma(w, x, acc) over K in order, then + bias,
    with w the gguf package's dequantized value: every path bitwise that, nothing left to a tolerance."""
    cls = _kernel(kind, machine)
    N, K, M = 37, 300, 5
    raw = _random_blocks(kind, N, K, seed=5)
    w, x, bias = _gguf_dense(kind, raw, N, K), torch.randn(M, K), torch.randn(N)
    acc = torch.zeros(M, N)
    for k in range(K):
        acc = _fma32(w[:, k].expand(M, N), x[:, k:k + 1].expand(M, N), acc)
    ref = acc + bias
    for p in block_paths(cls.name):
        assert torch.equal(_on(cls.from_blocks(kind, raw, N, K, bias), p)(x), ref), p


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_rows_are_exact_at_every_width_and_thread_count_on_every_path(kind, machine):
    cls = _kernel(kind, machine)
    N, K = 40, 512 if blocktypes.row(kind).quantized else 700  # a float kernel's wide calls pass over K in 512s
    for path in block_paths(cls.name):
        mod = _on(cls.from_blocks(kind, _random_blocks(kind, N, K, seed=2), N, K, torch.randn(N)), path)
        assert autotune.rows_exact(mod, K, WIDTHS, THREADS) is None, path


class _WidthDependent(torch.nn.Module):
    """Planted: for calls wider than 32 rows, the K reduction is split in two halves whose outputs are added (the
    same weights and activations, another float order): what a blocked wide path that reduces across K does."""

    def __init__(self, whole, lo, hi, K: int):
        super().__init__()
        self.whole, self.lo, self.hi, self.K = whole, lo, hi, K

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
        if x.shape[0] <= 32:
            return self.whole(x)
        return self.lo(x[:, : self.K // 2].contiguous()) + self.hi(x[:, self.K // 2:].contiguous())


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_K", "Q2_K", "Q3_K", "F16", "BF16"])
def test_a_planted_width_dependent_reduction_fails_the_check(kind, machine):
    cls = _kernel(kind, machine)
    N, K = 48, 512
    parts = cls.parts_from_blocks(kind, _random_blocks(kind, N, K, seed=3), N, K)
    half = {k: (v[:, : v.shape[1] // 2], v[:, v.shape[1] // 2:]) for k, v in parts.items()}
    path = block_paths(cls.name)[-1]
    whole = cls(parts=parts, path=path)
    lo = cls(parts={k: v[0].contiguous() for k, v in half.items()}, path=path)
    hi = cls(parts={k: v[1].contiguous() for k, v in half.items()}, path=path)
    assert autotune.rows_exact(whole, K, WIDTHS, THREADS) is None
    got = autotune.rows_exact(_WidthDependent(whole, lo, hi, K), K, WIDTHS, THREADS)
    assert got is not None and got.startswith("row ") and " of 33 " in got, got


# the compact kernels and the byte form of the same parts (csrc/q8_0.h: every form computes bitwise the same row)
BYTE_FORM = {"q4c": "q8_0", "q5m": "q8_1"}


@pytest.mark.parametrize("kind", sorted(t for t in TYPES if blocktypes.kernel_of(t) in BYTE_FORM))
def test_codes_compute_bitwise_what_bytes_compute_in_fewer_bytes(kind, machine):
    cls = _kernel(kind, machine)
    wide = LINEARS[BYTE_FORM[cls.name]]
    N, K = 37, 512
    parts = ggml_blocks.FROM_BLOCKS[kind](_random_blocks(kind, N, K, seed=4), N, K)
    bias, x = torch.randn(N), torch.randn(9, K)
    for path in block_paths(cls.name):
        assert torch.equal(_on(cls(parts=parts, bias=bias), path)(x), _on(wide(parts=parts, bias=bias), path)(x)), path
    assert cls.nbytes(N, K, kind=kind) == sum(t.numel() * t.element_size() for t in cls._pack(parts).values())
    assert cls.nbytes(4096, 4096, kind=kind) * 8 / 4096**2 <= blocktypes.kernel_bits(kind) + 0.01
    assert cls.nbytes(N, K, kind=kind) < wide.nbytes(N, K, kind=kind)


# csrc/q8_0.h's scale forms: each 32-block type is held with its d (and m) as narrow as the file's (fp16, or SUB8:
# an int8 per 32 times an fp16 per 256), bitwise the float32 scales it had before
SCALED = sorted(t for t in TYPES if blocktypes.KERNELS[blocktypes.kernel_of(t)].scale_terms)
FORM_DTYPES = {"f32": torch.float32, "f16": torch.float16, "sub8": torch.uint8}
HELD_BITS = {"Q8_0": 8.5, "Q5_0": 8.5, "Q4_0": 4.5, "IQ4_NL": 4.5, "IQ4_XS": 4.3125, "Q4_1": 6.0,
             "Q5_1": 6.0}  # bits per weight held (the file's: 8.5, 5.5, 4.5, 4.5, 4.25, 5.0, 6.0)


def _signed_blocks(kind: str, N: int, K: int, seed: int) -> np.ndarray:
    """_random_blocks with signed scale fields too: some negative, some +0 and some -0 (the signs a narrowing
    must keep)."""
    raw = _random_blocks(kind, N, K, seed).reshape(-1, blocktypes.row(kind).block_bytes)
    for at in TYPES[kind]:
        h = raw[:, at:at + 2].copy().view(np.uint16)
        h[1::3] |= 0x8000
        h[::5], h[2::7] = 0x0000, 0x8000
        raw[:, at:at + 2] = h.view(np.uint8)
    return raw.reshape(N, -1)


def _f32_form(cls, parts: dict, bias: torch.Tensor | None, path: str):
    """The module holding `parts` with float32 scales (the layout before the narrow forms), on `path`."""
    packed = getattr(ggml_blocks, f"pack_{cls.name}")(parts, "f32")
    return _on(cls.from_state({**packed, "bias": bias}, parts["v"].shape[0]), path)


@pytest.mark.parametrize("kind", SCALED)
def test_the_narrow_scale_form_computes_bitwise_what_float32_scales_compute(kind, machine):
    cls = _kernel(kind, machine)
    N, K = 37, 512
    parts = cls.parts_from_blocks(kind, _signed_blocks(kind, N, K, seed=6), N, K)
    bias, x = torch.randn(N), torch.randn(13, K)
    form = blocktypes.scale_form(kind)
    for path in block_paths(cls.name):
        narrow = _on(cls(parts=parts, bias=bias), path)
        assert narrow.d.dtype == FORM_DTYPES[form], narrow.d.dtype
        assert torch.equal(narrow(x), _f32_form(cls, parts, bias, path)(x)), path
    ops = getattr(torch.ops, f"draftwise_{cls.name}")
    if ops.wide_available():  # the wide side (csrc/gemm_q8_0.cpp) reads the same forms through the GEMV's tile
        b = narrow._buffers
        wide = ops.wide(x, *(b[n] for n in cls.PACKED), b["bias"], N)
        assert torch.equal(wide, _f32_form(cls, parts, bias, "scalar")(x))
    packed = cls._pack(parts)
    for name, t in packed.items():  # the parts back from the narrow form, bit for bit (signed zeros too)
        if name in ("d", "m"):
            back = ggml_blocks._unpack_scales(t)[:N]
            assert torch.equal(back.view(torch.int32), parts[name].view(torch.int32)), name
    held = sum(t.numel() * t.element_size() for t in packed.values())
    assert held == cls.nbytes(N, K, kind=kind) == narrow.weight_bytes < cls.nbytes(N, K)
    bits = cls.nbytes(4096, 4096, kind=kind) * 8 / 4096**2
    assert abs(bits - blocktypes.kernel_bits(kind)) < 0.01 and abs(bits - HELD_BITS[kind]) < 0.01, bits


@pytest.mark.parametrize("kind", ["IQ4_XS", "Q4_0", "Q5_1"])
def test_an_inexact_narrowing_is_refused_and_a_planted_one_fails_the_check(kind, machine):
    """pack refuses a form that would not hold the scales bitwise (f16 for SUB8's products; a SUB8 whose super
    is not its factor), and the check above catches a narrowing that rounds: d rounded to bf16 (planted, through
    the float32 form) computes other bits."""
    cls = _kernel(kind, machine)
    N, K = 37, 512
    parts = cls.parts_from_blocks(kind, _signed_blocks(kind, N, K, seed=7), N, K)
    pack = getattr(ggml_blocks, f"pack_{cls.name}")
    if blocktypes.scale_form(kind) == "sub8":
        with pytest.raises(ValueError, match="fp16"):
            pack(parts, "f16")
        with pytest.raises(ValueError, match="sub \\*"):
            pack({**parts, "d_super": parts["d_super"] * 2}, "sub8")
    else:
        with pytest.raises(ValueError, match="sub8"):
            pack(parts, "sub8")
    x, path = torch.randn(13, K), block_paths(cls.name)[-1]
    want = _f32_form(cls, parts, None, path)(x)
    rounded = {**parts, "d": parts["d"].bfloat16().float()}
    assert not torch.equal(_f32_form(cls, rounded, None, path)(x), want)

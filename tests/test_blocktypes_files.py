"""Whole files of the types the block-type table newly holds (kernels/blocktypes.py): a tiny random GGUF whose
projections are stored as Q4_1, Q5_1 and Q4_0 (the gguf package quantizes these; the embedding and head as Q8_0), or
as Q2_K, Q3_K or Q5_K (simple quantizers here), loads under `auto` as the faithful plan with each tensor on its table row's kernel (no fp32 fallback
for a quantized tensor), says row-exact, and greedy speculation (ngram, suffix, a draft model) equals plain
decoding bitwise. No download."""
from __future__ import annotations

import pytest

from draftwise import LLM, SamplingParams
from draftwise.kernels import blocktypes
from draftwise.kernels.linear import LINEARS, available
from draftwise.kernels.probe import probe
from tests.tiny_checkpoints import Q4K_DIMS, write_tiny_gguf


def _q2k(w):
    """w [N, K] float32 (numpy, K % 256 == 0) -> Q2_K blocks [N, K / 256 * 84] uint8 (the gguf package has no Q2_K
    quantizer): ggml_blocks.quantize_q6m's values, scales and mins in ggml's block layout, d and dmin rounded to fp16
    (the blocks are valid Q2_K whatever their fidelity; the loader reads them back exactly)."""
    import numpy as np
    import torch

    from draftwise.kernels import ggml_blocks

    N, K = w.shape
    p = ggml_blocks.quantize_q6m(torch.from_numpy(np.array(w, dtype=np.float32)))
    nb = N * K // 256
    q = (p["q"].reshape(nb, 2, 4, 32).to(torch.int32) - 32) << (2 * torch.arange(4, dtype=torch.int32)).view(1, 1, 4, 1)
    scales = (p["sc"].to(torch.uint8) | (p["mn"].to(torch.uint8) << 4)).reshape(nb, 16)
    half = lambda t: t.reshape(nb, 1).half().view(torch.uint8)  # noqa: E731
    blocks = torch.cat([scales, q.sum(2).to(torch.uint8).reshape(nb, 64), half(p["d"]), half(p["dmin"])], 1)
    return blocks.reshape(N, -1).numpy()


def _q5k(w):
    """w [N, K] float32 (numpy, K % 256 == 0) -> Q5_K blocks [N, K / 256 * 176] uint8 (the gguf package has no Q5_K
    quantizer): ggml_blocks.quantize_q5x8's values with its 8-bit sub-scales and mins cut to Q5_K's 6 bits (d and
    dmin times 4, rounded to fp16), in ggml's block layout (valid Q5_K whatever their fidelity; read back exactly)."""
    import numpy as np
    import torch

    from draftwise.kernels import ggml_blocks

    N, K = w.shape
    p = ggml_blocks.quantize_q5x8(torch.from_numpy(np.array(w, dtype=np.float32)))
    nb = N * K // 256
    sc, mn = (((t.to(torch.int32) + 2) >> 2).clamp(max=63).reshape(nb, 8) for t in (p["sc"], p["mn"]))
    lo6 = lambda t: (t[:, :4] & 63) | ((t[:, 4:] >> 4) << 6)  # noqa: E731  bytes 0-3 (sc) and 4-7 (mn)
    scales = torch.cat([lo6(sc), lo6(mn), (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], 1).to(torch.uint8)
    q = p["q"].to(torch.int32).reshape(nb, 8, 32)  # [block, sub-block, l]
    qh = ((q >> 4) << torch.arange(8, dtype=torch.int32).view(1, 8, 1)).sum(1).to(torch.uint8)  # [block, 32]
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).to(torch.uint8).reshape(nb, 128)
    half = lambda t: (t * 4).reshape(nb, 1).half().view(torch.uint8)  # noqa: E731
    return torch.cat([half(p["d"]), half(p["dmin"]), scales, qh, qs], 1).reshape(N, -1).numpy()


def _q3k(w):
    """w [N, K] float32 (numpy, K % 256 == 0) -> Q3_K blocks [N, K / 256 * 110] uint8 (the gguf package has no Q3_K
    quantizer): ggml_blocks.quantize_q3k's values and scales in ggml's block layout (q3k_from_blocks' docstring), d
    rounded to fp16."""
    import numpy as np
    import torch

    from draftwise.kernels import ggml_blocks

    N, K = w.shape
    p = ggml_blocks.quantize_q3k(torch.from_numpy(np.array(w, dtype=np.float32)))
    nb = N * K // 256
    q = p["q"].reshape(nb, 256).to(torch.int32)
    hmask = ((q >> 2).view(nb, 8, 32) << torch.arange(8, dtype=torch.int32).view(1, 8, 1)).sum(1)  # [nb, 32]
    qs = ((q & 3).view(nb, 2, 4, 32) << (2 * torch.arange(4, dtype=torch.int32)).view(1, 1, 4, 1)).sum(2)
    s = p["sc"].reshape(nb, 16).to(torch.int32) + 32  # 6 bits
    low = (s[:, :8] & 15) | ((s[:, 8:] & 15) << 4)
    top = ((s >> 4).view(nb, 4, 4) << (2 * torch.arange(4, dtype=torch.int32)).view(1, 4, 1)).sum(1)  # scale 4j + i
    d = p["d"].reshape(nb, 1).half().view(torch.uint8)
    parts = [t.to(torch.uint8) for t in (hmask, qs.reshape(nb, 64), low, top)]
    return torch.cat([*parts, d], 1).reshape(N, -1).numpy()


QUANTIZERS = {"Q2_K": _q2k, "Q3_K": _q3k, "Q5_K": _q5k}  # the types the gguf package cannot quantize


def _requantized(src, dst, kinds: dict[str, str]) -> None:
    """`src` GGUF rewritten as `dst` with each 2-D float tensor whose name ends with a key of `kinds` quantized to
    that ggml type by the gguf package (Q2_K, Q5_K by QUANTIZERS; metadata and other tensors copied as they are)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # [rows, K]
        kind = next((k for s, k in kinds.items() if t.name.endswith(s)), None)
        if kind and len(shape) == 2 and t.tensor_type == gguf.GGMLQuantizationType.F32:
            qt, w = gguf.GGMLQuantizationType[kind], np.asarray(t.data).reshape(shape)
            writer.add_tensor(t.name, QUANTIZERS[kind](w) if kind in QUANTIZERS else gguf.quants.quantize(w, qt),
                              raw_dtype=qt)
        else:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape) if t.tensor_type ==
                              gguf.GGMLQuantizationType.F32 else np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_file(tmp_path_factory, kernel: str, kinds: dict[str, str]):
    """The tiny qwen2 GGUF requantized per `kinds` (_requantized), skipped where `kernel` cannot run here."""
    if kernel not in available(probe(bandwidth=False)):
        pytest.skip("our kernels cannot run here (no C++ compiler)")
    root = tmp_path_factory.mktemp(kernel)
    write_tiny_gguf(root / "src.gguf", "qwen2", dims=Q4K_DIMS)
    _requantized(root / "src.gguf", root / "m.gguf", kinds)
    return root / "m.gguf"


@pytest.fixture(scope="module")
def new_types_gguf(tmp_path_factory):
    return _tiny_file(tmp_path_factory, "q8_1", {
        "attn_q.weight": "Q4_1", "attn_k.weight": "Q4_1", "attn_v.weight": "Q4_1", "attn_output.weight": "Q5_1",
        "ffn_gate.weight": "Q5_1", "ffn_up.weight": "Q5_1", "ffn_down.weight": "Q4_0", "token_embd.weight": "Q8_0",
        "output.weight": "Q8_0"})


def test_every_quantized_tensor_is_on_its_rows_kernel(new_types_gguf, tmp_path):
    llm = LLM(str(new_types_gguf), max_num_seqs=1, max_model_len=64, cache_dir=str(tmp_path / "c"))
    plan = llm.model.plan
    assert plan.faithful and plan.row_exact and not plan.fallback_types, plan.describe()
    assert set(plan.stored_types) == {"Q4_1", "Q5_1", "Q4_0", "Q8_0"}
    for t in ("Q4_1", "Q5_1", "Q4_0"):
        assert f"{t}->{blocktypes.kernel_of(t)}" in plan.describe()
    kinds = {getattr(type(m), "name", None) for m in llm.model.modules()} & set(blocktypes.block_kernels())
    assert kinds == {blocktypes.kernel_of(t) for t in plan.stored_types} and all(k in LINEARS for k in kinds)


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    {"method": "suffix", "num_speculative_tokens": 4},
    {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 3, "draft_weights": "faithful"},
])
def test_greedy_speculation_equals_plain(new_types_gguf, tmp_path, spec):
    from draftwise.equivalence import run_engine

    path = str(new_types_gguf)
    spec = {**spec, "model": path} if spec.get("model") == "SELF" else spec
    llm = LLM(path, max_num_seqs=3, max_model_len=160, k_max=4, cache_dir=str(tmp_path / "c"))
    assert llm.model.plan.faithful and llm.model.plan.row_exact
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [12, 13, 14, 15, 16, 12, 13, 14]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    assert run_engine(llm, spec, prompts, params) == run_engine(llm, None, prompts, params)


def test_q3k_writes_blocks_the_gguf_package_reads_back_exactly():
    """_q3k's blocks (the test file's Q3_K) dequantize, by the gguf package, to what its parts represent."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from draftwise.kernels import ggml_blocks

    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    raw = _q3k(w)
    parts = ggml_blocks.q3k_from_blocks(raw, 4, 512)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q3_K).reshape(4, 512).astype(np.float32))
    assert torch.equal(ggml_blocks.dequantize_q3k(parts), ref)
    p = ggml_blocks.quantize_q3k(torch.from_numpy(w))
    assert torch.equal(parts["q"], p["q"]) and torch.equal(parts["sc"], p["sc"])


# whole files of one K-quant type on its own kernel (the projections; embedding and head Q8_0)
KQUANT_FILES = ["Q2_K", "Q3_K", "Q5_K"]


@pytest.fixture(scope="module", params=KQUANT_FILES)
def kquant_gguf(request, tmp_path_factory):
    kind = request.param
    return kind, _tiny_file(tmp_path_factory, blocktypes.kernel_of(kind), {**{s: kind for s in (
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
        "ffn_down.weight")}, "token_embd.weight": "Q8_0", "output.weight": "Q8_0"})


def test_a_k_quant_file_is_the_faithful_plan_on_its_rows_kernel(kquant_gguf, tmp_path):
    """Q2_K (q6m), Q3_K (q3k) and Q5_K (q5x8) projections load on their row's kernel (no fp32 fallback),
    row-exact, and greedy speculation (ngram, suffix) equals plain decoding bitwise."""
    from draftwise.equivalence import run_engine

    kind, path = kquant_gguf
    kernel = blocktypes.kernel_of(kind)
    llm = LLM(str(path), max_num_seqs=3, max_model_len=160, k_max=4, cache_dir=str(tmp_path / "c"))
    plan = llm.model.plan
    assert plan.faithful and plan.row_exact and not plan.fallback_types, plan.describe()
    assert f"{kind}->{kernel}" in plan.describe() and "SLOW PATH" not in plan.describe()
    assert kernel in {getattr(type(m), "name", None) for m in llm.model.modules()}
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [12, 13, 14, 15, 16, 12, 13, 14]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    plain = run_engine(llm, None, prompts, params)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                 {"method": "suffix", "num_speculative_tokens": 4}):
        assert run_engine(llm, spec, prompts, params) == plain, spec


# the float types the table gives a kernel of their own: a file whose 2-D tensors are all stored as one of them
FLOAT_FILES = ["F16", "BF16"]


@pytest.fixture(scope="module", params=FLOAT_FILES)
def float_gguf(request, tmp_path_factory):
    kind = request.param
    if blocktypes.kernel_of(kind) not in available(probe(bandwidth=False)):
        pytest.skip("our kernels cannot run here (no C++ compiler)")
    root = tmp_path_factory.mktemp(kind.lower())
    write_tiny_gguf(root / "src.gguf", "qwen2", dims=Q4K_DIMS)
    _requantized(root / "src.gguf", root / "m.gguf", {s: kind for s in (
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
        "ffn_down.weight", "token_embd.weight", "output.weight")})
    return kind, root / "m.gguf"


def test_a_float_file_is_the_faithful_plan_on_its_rows_kernel(float_gguf, tmp_path):
    """A dense file stored as a float type with a kernel: `auto` keeps it as stored (no fp32 fallback, no
    requantization), every projection on the row's kernel, row-exact, and the same greedy tokens as --weights fp32
    (the same weights; the float kernel's fp32 chain against the dense sgemm: compared by tokens, not bits)."""
    kind, path = float_gguf
    llm = LLM(str(path), max_num_seqs=1, max_model_len=64, cache_dir=str(tmp_path / "c"))
    plan = llm.model.plan
    assert plan.faithful and plan.row_exact and not plan.fallback_types, plan.describe()
    assert f"{kind}->{blocktypes.kernel_of(kind)}" in plan.describe() and "SLOW PATH" not in plan.describe()
    kinds = {getattr(type(m), "name", None) for m in llm.model.modules()} & set(LINEARS)
    assert kinds == {blocktypes.kernel_of(kind)}, kinds
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    dense = LLM(str(path), max_num_seqs=1, max_model_len=64, cache_dir=str(tmp_path / "d"), weights="fp32")
    prompt = [[5, 6, 7, 8, 9]]
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == dense.generate(prompt, params)[0].outputs[0].token_ids

"""models/quant.py with the kernels wired in: every weight format / kernel plan on a tiny decoder keeps greedy
speculative output identical to greedy plain output (ngram and draft_model, k = 1..8) and its logits within the
implementation's documented tolerance of fp32; `weights="auto"` takes what an injected timing table says (no
timing asserts); the GGUF-direct path maps Q4_K blocks exactly; the prepared cache round-trips."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftwise.api import LLM, load_model
from draftwise.kernels import linear
from draftwise.kernels.linear import LINEARS, Q4x8Linear
from draftwise.kernels.plan import resolve_plan
from draftwise.kernels.probe import probe
from draftwise.kv_cache import KVCache
from draftwise.models import quant, sources
from draftwise.models import safetensors as st
from draftwise.sampling import SamplingParams
from tests.harness import PROMPTS, VOCAB, fixed_tune, tiny_tokenizer
from tests.tiny_checkpoints import Q4K_DIMS, write_tiny_gguf
from tests.tiny_models import tiny_decoder

LONG_PROMPT = " ".join(f"w{i % 7 + 1}" for i in range(20))  # > STEP_MAX_TOKENS tokens: runs the prefill kernel

# (label, step, prefill, model dtype): every plan kind `--weights` names (kernels/plan.py), dense ones included
PLANS = [
    ("q4x8", "q4x8", "q4x8", torch.float32),
    ("q4x8+fp32", "q4x8", "fp32", torch.float32),
    ("q4x8+bf16", "q4x8", "bf16", torch.float32),
    ("int4", "int4", "int4", torch.bfloat16),
    ("int4+bf16", "int4", "bf16", torch.bfloat16),
    ("int8", "int8", "int8", torch.bfloat16),
    ("bf16", "bf16", "bf16", torch.bfloat16),
    ("fp32", "fp32", "fp32", torch.float32),
]


def _available(step: str, prefill: str) -> bool:
    p = probe(bandwidth=False)
    return all(LINEARS[n].available(p) for n in (step, prefill))


def _quantized(step: str, prefill: str, dtype: torch.dtype, noise: float = 0.0) -> torch.nn.Module:
    model = tiny_decoder("qwen2", 0, VOCAB, dtype=dtype)
    if noise:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_((noise * torch.randn(p.shape, generator=g)).to(p.dtype))
    dt = "bfloat16" if dtype == torch.bfloat16 else "float32"
    quant.build_linears(model, resolve_plan(step if step == prefill else f"{step}+{prefill}", dt, None))
    return model


def _greedy(llm: LLM, spec_config) -> list[list[int]]:
    llm.set_speculation(spec_config)
    outs = llm.generate([PROMPTS[0], PROMPTS[2], LONG_PROMPT], SamplingParams(temperature=0.0, max_tokens=12,
                                                                               ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("label,step,prefill,dtype", PLANS, ids=[p[0] for p in PLANS])
def test_greedy_speculation_equals_plain_for_every_kernel(label, step, prefill, dtype):
    if not _available(step, prefill):
        pytest.skip(f"{label} cannot run here")
    tok = tiny_tokenizer()
    target = _quantized(step, prefill, dtype)
    draft = _quantized(step, prefill, dtype, noise=0.05)
    llm = LLM.from_parts(target, tok, speculative_config=None, k_max=8, max_num_seqs=5,
                         load_draft=lambda name, d, w: (draft, tok, {"name": name}))
    plain = _greedy(llm, None)
    for k in range(1, 9):
        for method in ("ngram", "draft_model"):
            spec_config = {"method": method, "num_speculative_tokens": k, **({"model": "noisy"} if method == "draft_model" else {})}
            assert _greedy(llm, spec_config) == plain, (label, method, k)


def _logits(model, ids: list[int]) -> torch.Tensor:
    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, 64, c.head_dim, model.dtype, model.device)
    t = torch.tensor([ids])
    return model(t, torch.arange(len(ids))[None], cache, torch.tensor([0]))[0].float()  # [T, V]


@pytest.mark.parametrize("label,step,prefill,dtype", PLANS, ids=[p[0] for p in PLANS])
def test_logits_stay_within_the_kernels_tolerance_of_fp32(label, step, prefill, dtype):
    """Relative error of the logits (decode widths and a prefill width) against the fp32 model, bounded by the
    implementation's documented per-projection tolerance (kernels/linear.py) compounded over the decoder's
    projections in sequence (2 layers: q/k/v, o, gate/up, down, then the head: 9 in a row)."""
    if not _available(step, prefill):
        pytest.skip(f"{label} cannot run here")
    ref_model = tiny_decoder("qwen2", 0, VOCAB)
    model = _quantized(step, prefill, dtype)
    bound = 9 * max(LINEARS[step].tolerance, LINEARS[prefill].tolerance)
    for ids in ([5, 9, 17], list(range(1, 21))):  # 3 tokens: step kernel; 20 tokens: prefill kernel
        ref, got = _logits(ref_model, ids), _logits(model, ids)
        err = float((got - ref).norm() / ref.norm())
        assert err <= bound, (label, len(ids), err, bound)


# ---- auto: resolution with an injected timing table ------------------------------------------------------

@pytest.mark.parametrize("step,prefill,dtype", [("q4x8", "q4x8", "float32"), ("q4x8", "bf16", "float32"),
                                                ("int4", "int4", "bfloat16"),
                                                ("fp32", "fp32", "float32")])
def test_auto_takes_what_the_timing_table_says(step, prefill, dtype, tiny_gguf_path, draftwise_cache_dir):
    if not _available(step, prefill):
        pytest.skip(f"{step}/{prefill} cannot run here")
    tune = fixed_tune(step, prefill)
    assert (tune(None)["choice"]["step"], tune(None)["choice"]["prefill"]) == (step, prefill)
    model, _, info = load_model(str(tiny_gguf_path), "auto", weights="auto", cache_dir=str(draftwise_cache_dir),
                                tune=tune)
    assert info["plan"]["step"] == step and info["plan"]["prefill"] == prefill and model.plan.source == "tuned"
    assert info["dtype"] == dtype and model.dtype == getattr(torch, dtype)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear" not in kinds  # every projection went to a kernel
    if step != prefill:
        assert "SplitLinear" in kinds
    # every kernel plan, torch int4 included, is built from the GGUF into the prepared cache: no dense copy on disk
    files = {p.name for p in Path(info["converted_path"]).iterdir()}
    assert not {f for f in files if f.startswith("model.")} and any(f.startswith("prepared-") for f in files)
    for f in Path(info["converted_path"]).glob("prepared-*.safetensors"):  # each records a key this code reaches
        assert not sources.unreachable(json.loads(st.read_metadata(f)["key_inputs"]), info["sha256"]), f
    assert ("Q4x8Embedding" in kinds) == bool({step, prefill} & set(quant.COMPACT_EMBEDDING_KERNELS))
    if step == "q4x8" and prefill in ("fp32", "bf16"):  # the dense half is derived from the q4x8 one, not stored
        from safetensors import safe_open

        from draftwise.kernels.q4x8 import Q4x8Embedding

        prepared = next(Path(info["converted_path"]).glob("prepared-*.safetensors"))
        with safe_open(str(prepared), "pt") as f:
            assert not [k for k in f.keys() if ".prefill." in k]
        splits = [m for m in model.modules() if isinstance(m, linear.SplitLinear) and isinstance(m.step, Q4x8Linear)
                  and hasattr(m.prefill, "weight")]
        assert splits
        for m in splits:
            rows = Q4x8Embedding.from_linear(m.step)(torch.arange(m.step.out_features))  # the q4x8 weight, dequantized
            assert torch.equal(m.prefill.weight, rows.to(m.prefill.weight.dtype))
    again, _, _ = load_model(str(tiny_gguf_path), "auto", weights="auto", cache_dir=str(draftwise_cache_dir),
                             tune=tune)  # read back from the prepared cache
    ids = list(range(3, 30))
    assert torch.equal(_logits(again, ids), _logits(model, ids))


def test_explicit_values_win_and_bad_values_are_named():
    from draftwise.config import ConfigError, EngineConfig, parse_spec_config

    cfg = tiny_decoder("qwen2", 0, VOCAB).config
    boom = lambda shapes: pytest.fail("explicit formats must not run the autotuner")  # noqa: E731
    plan = resolve_plan("q4x8", "auto", cfg, tune=boom)
    assert (plan.label, plan.step, plan.prefill, plan.dtype, plan.source) == ("q4x8", "q4x8", "q4x8", "float32",
                                                                            "pinned")
    plan = resolve_plan("int4+dense", "auto", cfg, tune=boom)
    assert (plan.label, plan.dtype) == ("int4+bf16", "bfloat16")  # "+dense": the dense kernel of the dtype
    assert resolve_plan("fp32", "auto", cfg, tune=boom).label == "fp32"  # the reference: dense float32 weights
    assert resolve_plan("q4x8+dense", "bfloat16", cfg, tune=boom).label == "q4x8+bf16"
    plan = resolve_plan("auto", "bfloat16", cfg, tune=fixed_tune("q4x8", "q4x8"))
    assert plan.dtype == "bfloat16" and plan.step == "q4x8" and plan.source == "tuned"  # a named dtype wins
    # validated once, where parsed: the engine config and the speculative config, each naming the bad value
    for bad, match in (("int3", "unknown kernel 'int3'"), ("q4x8+int4+fp32", "at most two"), ("dense", "unknown")):
        with pytest.raises(ConfigError, match=match):
            EngineConfig(model="m", weights=bad)
        with pytest.raises(ConfigError, match=match):
            parse_spec_config({"method": "draft_model", "model": "d", "num_speculative_tokens": 2,
                               "draft_weights": bad})
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineConfig(model="m", dtype="float16")
    with pytest.raises(ConfigError, match="q4x8 does not run on cuda"):
        EngineConfig(model="m", device="cuda", weights="q4x8")


def test_auto_on_a_gpu_asks_the_autotuner_for_that_device(monkeypatch):
    """--device cuda --weights auto: the same autotuner, timing the GPU's kernels (its choice is the plan); our CPU
    kernel named explicitly on a GPU is a clear error. Injected timings: runs without a GPU."""
    from draftwise.config import ConfigError
    from draftwise.kernels import autotune

    cfg = tiny_decoder("qwen2", 0, VOCAB).config
    asked = []
    fixed = fixed_tune("int4", "bf16")
    monkeypatch.setattr(autotune, "autotune", lambda shapes, **kw: asked.append(kw) or fixed(shapes))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = resolve_plan("auto", "auto", cfg, device="cuda")
    assert asked and asked[0]["device"] == "cuda" and asked[0]["fast"] is True
    assert (plan.step, plan.prefill, plan.dtype, plan.label) == ("int4", "bf16", "bfloat16", "int4+bf16")
    assert plan.device == "cuda" and plan.attention == "sdpa" and not plan.row_exact
    for weights in ("q4x8", "q4x8+dense"):
        with pytest.raises(ValueError, match="does not run on cuda"):
            resolve_plan(weights, "auto", cfg, device="cuda")
    from draftwise.api import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        check_device("cuda")
    assert len(asked) == 1


# ---- the GGUF-direct path and its cache -------------------------------------------------------------------

@pytest.fixture(scope="module")
def q4k_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4k") / "tiny-q4k.gguf"
    hf = write_tiny_gguf(path, "llama", dims=Q4K_DIMS, q4k=("_proj.weight", "lm_head.weight"),
                         quantize=("embed_tokens.weight",))
    return path, hf


def test_q4k_tensors_load_exactly_and_the_cache_round_trips(q4k_gguf, tmp_path, monkeypatch):
    """Each Q4_K projection becomes a q4x8 module whose weights are bitwise what the GGUF dequantizes to (llama's
    Q/K rows un-permuted with their blocks); a second load reads the packed cache without opening the GGUF and
    gives bitwise the same logits; no float32 copy of the weights is written."""
    if not _available("q4x8", "q4x8"):
        pytest.skip("q4x8 cannot run here")
    from draftwise.kernels import q4x8
    from draftwise.models import gguf as gguf_module
    from draftwise.models.sources import load_checkpoint

    path, hf = q4k_gguf
    user = tmp_path / "m.gguf"
    shutil.copy(path, user)
    cache = tmp_path / "cache"
    model, _, info = load_model(str(user), "auto", weights="q4x8", cache_dir=str(cache))
    assert info["weights"] == "q4x8" and (info["plan"]["step"], info["plan"]["prefill"]) == ("q4x8", "q4x8")
    assert model.plan.source == "pinned" and model.plan.label == "q4x8"
    linears = dict(model.named_modules())
    for name, want in hf.items():
        owner = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") and name != "lm_head.weight":
            continue
        mod, rows = _merged_rows(linears, owner)
        assert isinstance(mod, Q4x8Linear)
        parts = {k: v[rows] for k, v in _unpack(mod).items()}
        assert torch.equal(q4x8.dequantize_q4(parts), torch.from_numpy(want)), name
    ids = list(range(3, 40))
    first = _logits(model, ids)
    folder = load_checkpoint(str(user), cache, progress=False).info["converted_path"]
    files = {p.name for p in Path(folder).iterdir()}
    assert "model.safetensors" not in files and any(f.startswith("prepared-") for f in files)

    monkeypatch.setattr(gguf_module, "GGUFFile", lambda *a: pytest.fail("reopened the GGUF"))
    again, _, _ = load_model(str(user), "auto", weights="q4x8", cache_dir=str(cache))
    assert torch.equal(_logits(again, ids), first)


MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _merged_rows(modules: dict, owner: str) -> tuple[torch.nn.Module, slice]:
    """The module holding HF linear `owner` and its output rows there: itself, or its slice of the merged q/k/v
    or gate/up module (Decoder.merge_projections)."""
    if owner in modules:
        return modules[owner], slice(None)
    parent, _, leaf = owner.rpartition(".")
    merged_name, index = MERGED[leaf]
    block = modules[parent]
    sizes = block.qkv_sizes if merged_name == "qkv_proj" else (block.intermediate,) * 2
    start = sum(sizes[:index])
    return modules[f"{parent}.{merged_name}"], slice(start, start + sizes[index])


@pytest.fixture(scope="module")
def tied_q4k_gguf(tmp_path_factory):
    """A llama with tied embeddings (no output.weight) whose table, and so its LM head, is Q4_K."""
    path = tmp_path_factory.mktemp("q4k") / "tiny-tied-q4k.gguf"
    hf = write_tiny_gguf(path, "llama", tie=True, dims=Q4K_DIMS, q4k=("_proj.weight", "embed_tokens.weight"))
    return path, hf


def test_a_tied_q4k_table_is_exact_shared_with_the_head_and_stored_once(tied_q4k_gguf, tmp_path, monkeypatch):
    """A 4-bit plan keeps the embedding table in q4x8's packed form: from Q4_K blocks its rows are bitwise the
    GGUF's float32 table; the tied LM head and the embedding hold one copy (the same buffers) and the prepared
    cache stores it once (no embed_tokens tensor at all); a reload from the cache shares again and gives the same
    logits; greedy speculation over it equals plain decoding."""
    if not _available("q4x8", "q4x8"):
        pytest.skip("q4x8 cannot run here")
    from draftwise.kernels.q4x8 import Q4x8Embedding
    from draftwise.models import gguf as gguf_module
    from draftwise.models.safetensors import header_specs

    path, hf = tied_q4k_gguf
    cache = str(tmp_path / "cache")
    model, tok, info = load_model(str(path), "auto", weights="q4x8", cache_dir=cache)
    emb, head = model.model.embed_tokens, model.lm_head
    assert isinstance(emb, Q4x8Embedding) and isinstance(head, Q4x8Linear)
    assert emb.packed.data_ptr() == head.packed.data_ptr() and emb.d.data_ptr() == head.d.data_ptr()
    table = torch.from_numpy(hf["model.embed_tokens.weight"])  # what the GGUF's Q4_K blocks dequantize to
    assert torch.equal(emb(torch.arange(table.shape[0])), table)
    prepared = next(Path(info["converted_path"]).glob("prepared-*.safetensors"))
    names = [n for n, _ in header_specs(prepared)]
    assert "lm_head.packed" in names and not [n for n in names if n.startswith("model.embed_tokens")]

    monkeypatch.setattr(gguf_module, "GGUFFile", lambda *a: pytest.fail("reopened the GGUF"))
    again, _, _ = load_model(str(path), "auto", weights="q4x8", cache_dir=cache)
    assert again.model.embed_tokens.packed.data_ptr() == again.lm_head.packed.data_ptr()
    ids = list(range(3, 40))
    assert torch.equal(_logits(again, ids), _logits(model, ids))

    llm = LLM.from_parts(model, tok, k_max=4, max_num_seqs=3,
                         load_draft=lambda name, d, w: (again, tok, {"name": name}))
    plain = _greedy(llm, None)
    for k in (1, 4):
        for spec_config in ({"method": "ngram", "num_speculative_tokens": k},
                     {"method": "draft_model", "model": "same", "num_speculative_tokens": k}):
            assert _greedy(llm, spec_config) == plain, spec_config


def test_a_requantized_table_stays_within_its_documented_tolerance(q4k_gguf, tmp_path):
    """A table stored in another GGUF type (here Q8_0; the real 0.5B draft's is Q5_0) is dequantized once and
    quantized to q4x8: its rows are bitwise dequantize_q4(quantize_q4(table)), within the per-group bound
    test_kernels checks, and an untied head keeps its own buffers."""
    if not _available("q4x8", "q4x8"):
        pytest.skip("q4x8 cannot run here")
    from draftwise.kernels import q4x8
    from draftwise.models.gguf import GGUFFile

    path, _ = q4k_gguf
    model, _, _ = load_model(str(path), "auto", weights="q4x8", cache_dir=str(tmp_path / "cache"))
    emb = model.model.embed_tokens
    assert isinstance(emb, q4x8.Q4x8Embedding) and emb.packed.data_ptr() != model.lm_head.packed.data_ptr()
    ref = GGUFFile(path).items()["model.embed_tokens.weight"].dense()  # the float32 reference
    got = emb(torch.arange(ref.shape[0]))
    assert torch.equal(got, q4x8.dequantize_q4(q4x8.quantize_q4(ref)))
    assert float((got - ref).norm() / ref.norm()) < LINEARS["q4x8"].tolerance


def _unpack(mod) -> dict:
    """A Q4x8Linear's packed buffers back to q4x8 parts (the inverse of q4x8.pack, for the test)."""
    from draftwise.kernels.q4x8 import COLS

    NB, G = mod.packed.shape[:2]
    N = mod.out_features
    b = mod.packed.view(NB, G, 4, COLS, 4)  # [b, g, c, col, t] holding (half 0 | half 1 << 4)
    q = torch.stack([b & 15, b >> 4], dim=-1)  # [b, g, c, col, t, half]
    q = q.permute(0, 3, 1, 5, 2, 4).reshape(NB * COLS, G * 32)[:N]  # [N, K]
    cols = lambda t: t.transpose(1, 2).reshape(NB * COLS, -1)[:N]  # noqa: E731
    return {"q": q, "sc": cols(mod.sc), "mn": cols(mod.mn), "d": cols(mod.d), "dmin": cols(mod.dmin)}


def test_the_fp32_reference_is_dense_float32(tiny_gguf_path, draftwise_cache_dir):
    """--weights fp32: every projection dense float32, the reference `draftwise verify` and HF parity use; its
    logits equal the plain torch decoder's on the same dequantized weights."""
    from draftwise.kernels.linear import DenseF32
    from draftwise.models.sources import load_checkpoint

    model, _, info = load_model(str(tiny_gguf_path), "auto", weights="fp32", cache_dir=str(draftwise_cache_dir))
    assert info["weights"] == "fp32" and info["dtype"] == "float32" and model.plan.label == "fp32"
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert not heads and isinstance(model.lm_head, DenseF32) and model.lm_head.weight.dtype == torch.float32
    ckpt = load_checkpoint(str(tiny_gguf_path), draftwise_cache_dir, progress=False)
    from draftwise.models.transformer import Decoder

    plain = Decoder.from_tensors(ckpt.config, ckpt.tensors(torch.float32))
    ids = list(range(3, 30))
    assert torch.allclose(_logits(model, ids), _logits(plain, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_verification_rows_equal_single_steps_bit_for_bit(arch):
    """The invariant greedy exactness rests on with int8 activations: a (k + 1)-row verification forward gives
    each row the very logits a one-token decode step gives at that position (row-exact kernels + attention
    one query at a time), and a padded batch gives each sequence what it gets alone."""
    from draftwise.kv_cache import KVCache
    from draftwise.models.quant import build_linears
    from tests.tiny_models import tiny_decoder

    m = tiny_decoder(arch, 0, 64)
    build_linears(m, resolve_plan("q4x8", "auto", None))
    c = m.config
    cache = KVCache(c.num_layers, 3, c.num_kv_heads, 128, c.head_dim, m.dtype, m.device)
    g = torch.Generator().manual_seed(3)
    prompt, chunk = torch.randint(1, 64, (1, 20), generator=g), torch.randint(1, 64, (1, 6), generator=g)
    for s in range(3):
        m(prompt, torch.arange(20)[None], cache, torch.tensor([s]), num_tokens=[20])
    single = torch.cat([m(chunk[:, t:t + 1], torch.tensor([[20 + t]]), cache, torch.tensor([0]), num_tokens=[1])
                        for t in range(6)], 1)
    verify_logits = m(chunk, 20 + torch.arange(6)[None], cache, torch.tensor([1]), num_tokens=[6])
    assert torch.equal(single, verify_logits)
    # slot 2 verifies 3 of the tokens beside slot 1's 6 (padded to 6): slot 2's rows are unchanged by the batch
    for s in (1, 2):
        cache.truncate(s, 20)
    both = m(torch.cat([chunk, torch.cat([chunk[:, :3], torch.zeros(1, 3, dtype=torch.int64)], 1)]),
             20 + torch.arange(6)[None].expand(2, 6), cache, torch.tensor([1, 2]), num_tokens=[6, 3])
    assert torch.equal(both[0], single[0]) and torch.equal(both[1, :3], single[0, :3])


# ---- merged projections (Decoder.merge_projections, linear.merge) --------------------------------------------

@pytest.mark.parametrize("step,prefill", [("q4x8", "q4x8"), ("q4x8", "fp32")])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_merged_projections_are_bitwise_the_separate_calls(arch, step, prefill, monkeypatch):
    """q/k/v and gate/up merged into one q4x8 call each give bitwise the logits of the separate calls, for a
    prompt (the prefill kernel: a merged q4x8, or the dense parts side by side), a decode step and a verification."""
    if not _available(step, prefill):
        pytest.skip(f"{step}/{prefill} cannot run here")

    merged, separate = tiny_decoder(arch, 0, 64), tiny_decoder(arch, 0, 64)
    monkeypatch.setattr(separate, "merge_projections", lambda merge=None: 0)
    plan = resolve_plan(f"{step}+{prefill}", "auto", None)
    quant.build_linears(merged, plan)
    quant.build_linears(separate, plan)
    attn, mlp = merged.model.layers[0].self_attn, merged.model.layers[0].mlp
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    if step == prefill:
        assert isinstance(attn.qkv_proj, Q4x8Linear) and isinstance(mlp.gate_up_proj, Q4x8Linear)
    else:
        assert isinstance(attn.qkv_proj.step, Q4x8Linear) and isinstance(attn.qkv_proj.prefill, linear.ConcatLinear)
    assert separate.model.layers[0].self_attn.qkv_proj is None
    c = merged.config
    outs = []
    for m in (merged, separate):
        cache = KVCache(c.num_layers, 1, c.num_kv_heads, 64, c.head_dim, m.dtype)
        ids = torch.arange(3, 33)[None]
        outs.append(torch.cat([m(ids[:, :20], torch.arange(20)[None], cache, torch.tensor([0]), num_tokens=[20]),
                               m(ids[:, 20:21], torch.tensor([[20]]), cache, torch.tensor([0]), num_tokens=[1]),
                               m(ids[:, 21:], torch.arange(21, 30)[None], cache, torch.tensor([0]), num_tokens=[9])],
                              1))
    assert torch.equal(outs[0], outs[1])


def test_merge_merges_only_where_exact():
    if not _available("q4x8", "q4x8"):
        pytest.skip("q4x8 cannot run here")
    from draftwise.kernels.linear import make_linear

    g = torch.Generator().manual_seed(9)
    K = 64
    lin = lambda N, bias=True, K=K: Q4x8Linear(torch.randn(N, K, generator=g),  # noqa: E731
                                               torch.randn(N, generator=g) if bias else None)
    x = torch.randn(5, K, generator=g)
    parts = [lin(32), lin(16, bias=False), lin(20)]  # the last may be ragged; a missing bias is zeros
    merged = linear.merge(parts)
    assert merged.out_features == 68 and torch.equal(merged(x), torch.cat([p(x) for p in parts], -1))
    assert linear.merge([lin(20), lin(16)]) is None  # padding columns would sit in the middle
    assert linear.merge([lin(16), lin(16, K=96)]) is None  # different inputs
    dense = [make_linear("fp32", torch.randn(16, K, generator=g)) for _ in range(2)]
    assert linear.merge(dense) is None  # a GEMM's blocking may depend on N: not exact by construction
    assert linear.merge([torch.nn.Linear(K, 16), torch.nn.Linear(K, 16)]) is None
    assert linear.merge([linear.SplitLinear(dense[0], lin(16)), linear.SplitLinear(dense[1], lin(16))]) is None

"""models/quant.py with the kernels wired in: every weight format / kernel plan on a tiny decoder keeps greedy
speculative output identical to greedy plain output (ngram and draft_model, k = 1..8) and its logits within the
implementation's documented tolerance of fp32; `weights="auto"` takes what an injected timing table says (no
timing asserts); the GGUF-direct path maps Q4_K blocks exactly; the prepared cache round-trips."""
from __future__ import annotations

import shutil

import pytest
import torch

from draftwise.api import LLM, load_model
from draftwise.kernels import autotune
from draftwise.kernels.linear import IMPLS
from draftwise.kernels.probe import probe
from draftwise.kv_cache import KVCache
from draftwise.models import quant
from draftwise.sampling import SamplingParams
from tests.harness import PROMPTS, VOCAB, tiny_tokenizer
from tests.tiny_checkpoints import Q4K_DIMS, write_tiny_gguf
from tests.tiny_models import tiny_decoder

LONG_PROMPT = " ".join(f"w{i % 7 + 1}" for i in range(20))  # > DENSE_ABOVE_ROWS tokens: runs the prefill kernel

# (label, step, prefill, model dtype): kernel plans as resolve_formats makes them, and the legacy formats
PLANS = [
    ("q4x8", "q4x8", "q4x8", torch.float32),
    ("q4x8+dense_fp32", "q4x8", "dense_fp32", torch.float32),
    ("q4x8+dense_bf16", "q4x8", "dense_bf16", torch.float32),
    ("int4_torch", "int4_torch", "int4_torch", torch.bfloat16),
    ("dense_bf16", "dense_bf16", "dense_bf16", torch.bfloat16),
    ("legacy int4+dense", "int4+dense", None, torch.bfloat16),
    ("legacy int4", "int4", None, torch.bfloat16),
]


def _available(step: str, prefill: str | None) -> bool:
    p = probe(bandwidth=False)
    return all(n in quant.KERNEL_FORMATS or n in ("int4", "int4+dense") or IMPLS[n].available(p)
               for n in (step, prefill) if n)


def _quantized(step: str, prefill: str | None, dtype: torch.dtype, noise: float = 0.0) -> torch.nn.Module:
    model = tiny_decoder("qwen2", 0, VOCAB, dtype=dtype)
    if noise:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_((noise * torch.randn(p.shape, generator=g)).to(p.dtype))
    if prefill is None:
        quant.quantize_decoder(model, step)
    else:
        quant.build_linears(model, step, prefill)
    return model


def _greedy(llm: LLM, spec) -> list[list[int]]:
    llm.set_speculation(spec)
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
    llm = LLM.from_parts(target, tok, speculative_config=None, max_lookahead=8, max_num_seqs=5,
                         load_draft=lambda name, d, w: (draft, tok, {"name": name}))
    plain = _greedy(llm, None)
    for k in range(1, 9):
        for method in ("ngram", "draft_model"):
            spec = {"method": method, "num_speculative_tokens": k, **({"model": "noisy"} if method == "draft_model" else {})}
            assert _greedy(llm, spec) == plain, (label, method, k)


def _logits(model, ids: list[int]) -> torch.Tensor:
    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, 64, c.head_dim, model.dtype, model.device)
    t = torch.tensor([ids])
    return model(t, torch.arange(len(ids))[None], cache, torch.tensor([0]))[0].float()  # [T, V]


@pytest.mark.parametrize("label,step,prefill,dtype", [p for p in PLANS if p[2]], ids=[p[0] for p in PLANS if p[2]])
def test_logits_stay_within_the_kernels_tolerance_of_fp32(label, step, prefill, dtype):
    """Relative error of the logits (decode widths and a prefill width) against the fp32 model, bounded by the
    implementation's documented per-projection tolerance (kernels/linear.py) compounded over the decoder's
    projections in sequence (2 layers: q/k/v, o, gate/up, down, then the head: 9 in a row)."""
    if not _available(step, prefill):
        pytest.skip(f"{label} cannot run here")
    ref_model = tiny_decoder("qwen2", 0, VOCAB)
    model = _quantized(step, prefill, dtype)
    bound = 9 * max(IMPLS[step].tolerance, IMPLS[prefill].tolerance)
    for ids in ([5, 9, 17], list(range(1, 21))):  # 3 tokens: step kernel; 20 tokens: prefill kernel
        ref, got = _logits(ref_model, ids), _logits(model, ids)
        err = float((got - ref).norm() / ref.norm())
        assert err <= bound, (label, len(ids), err, bound)


# ---- auto: resolution with an injected timing table ------------------------------------------------------

def _fake_tune(step: str, prefill: str):
    ms = {n: {1: 1.0, 9: 1.0, 128: 1.0} for n in {step, prefill}}
    ms[step] = {1: 0.5, 9: 0.6, 128: 5.0}
    ms[prefill] = {**ms.get(prefill, {}), 128: 0.1, 1: ms[prefill].get(1, 1.0), 9: ms[prefill].get(9, 1.0)}
    table = {"rows": [1, 9, 128], "prefill_rows": 128, "ms": ms, "row_independent": {n: True for n in ms}}
    return lambda shapes: {"key": "injected", "probe": probe(bandwidth=False), "table": table,
                           "choice": autotune.choose(table)}


@pytest.mark.parametrize("step,prefill,dtype", [("q4x8", "q4x8", "float32"), ("q4x8", "dense_bf16", "float32"),
                                                ("int4_torch", "int4_torch", "bfloat16"),
                                                ("dense_fp32", "dense_fp32", "float32")])
def test_auto_takes_what_the_timing_table_says(step, prefill, dtype, tiny_gguf_path, draftwise_cache_dir):
    if not _available(step, prefill):
        pytest.skip(f"{step}/{prefill} cannot run here")
    tune = _fake_tune(step, prefill)
    assert (tune(None)["choice"]["step"], tune(None)["choice"]["prefill"]) == (step, prefill)
    model, _, info = load_model(str(tiny_gguf_path), "auto", weights="auto", cache_dir=str(draftwise_cache_dir),
                                tune=tune)
    assert info["kernels"]["step"] == step and info["kernels"]["prefill"] == prefill
    assert info["dtype"] == dtype and model.dtype == getattr(torch, dtype)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear" not in kinds  # every projection went to a kernel
    if step != prefill:
        assert "SplitLinear" in kinds


def test_explicit_values_win_and_bad_values_are_named():
    cfg = tiny_decoder("qwen2", 0, VOCAB).config
    boom = lambda shapes: pytest.fail("explicit formats must not run the autotuner")  # noqa: E731
    assert quant.resolve_formats("q4x8", "auto", cfg, tune=boom) == quant.Plan("q4x8", "float32", "q4x8", "q4x8")
    assert quant.resolve_formats("int4+dense", "auto", cfg, tune=boom).dtype == "bfloat16"
    assert quant.resolve_formats(None, "float32", cfg, tune=boom) == quant.Plan("fp32", "float32")
    plan = quant.resolve_formats("auto", "bfloat16", cfg, tune=_fake_tune("q4x8", "q4x8"))
    assert plan.dtype == "bfloat16" and plan.step == "q4x8"  # an explicit dtype wins over auto's
    from draftwise.config import ConfigError

    with pytest.raises(ConfigError, match="weights must be one of"):
        quant.resolve_formats("int3", "auto", cfg)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        quant.resolve_formats("auto", "float16", cfg)


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
    assert info["weights"] == "q4x8" and info["kernels"] == {"step": "q4x8", "prefill": "q4x8"}
    linears = dict(model.named_modules())
    for name, want in hf.items():
        owner = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") and name != "lm_head.weight":
            continue
        mod = linears[owner]
        assert isinstance(mod, q4x8.Q4x8Linear)
        parts = _unpack(mod)
        assert torch.equal(q4x8.dequantize_q4(parts), torch.from_numpy(want)), name
    ids = list(range(3, 40))
    first = _logits(model, ids)
    folder = load_checkpoint(str(user), cache, progress=False).info["converted_path"]
    from pathlib import Path

    files = {p.name for p in Path(folder).iterdir()}
    assert "model.safetensors" not in files and any(f.startswith("prepared-") for f in files)

    monkeypatch.setattr(gguf_module, "GGUFFile", lambda *a: pytest.fail("reopened the GGUF"))
    again, _, _ = load_model(str(user), "auto", weights="q4x8", cache_dir=str(cache))
    assert torch.equal(_logits(again, ids), first)


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


def test_dense_requests_still_get_the_dense_cache(tiny_gguf_path, draftwise_cache_dir):
    model, _, info = load_model(str(tiny_gguf_path), "float32", weights=None, cache_dir=str(draftwise_cache_dir))
    assert info["weights"] == "fp32" and "kernels" not in info
    assert isinstance(model.lm_head, torch.nn.Linear)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_verification_rows_equal_single_steps_bit_for_bit(arch):
    """The invariant greedy exactness rests on with int8 activations: a (k + 1)-row verification forward gives
    each row the very logits a one-token decode step gives at that position (row-exact kernels + attention
    one query at a time), and a padded batch gives each sequence what it gets alone."""
    from draftwise.kv_cache import KVCache
    from draftwise.models.quant import build_linears
    from tests.tiny_models import tiny_decoder

    m = tiny_decoder(arch, 0, 64)
    build_linears(m, "q4x8", "q4x8")
    c = m.config
    cache = KVCache(c.num_layers, 3, c.num_kv_heads, 128, c.head_dim, m.dtype, m.device)
    g = torch.Generator().manual_seed(3)
    prompt, chunk = torch.randint(1, 64, (1, 20), generator=g), torch.randint(1, 64, (1, 6), generator=g)
    for s in range(3):
        m(prompt, torch.arange(20)[None], cache, torch.tensor([s]), num_tokens=[20])
    single = torch.cat([m(chunk[:, t:t + 1], torch.tensor([[20 + t]]), cache, torch.tensor([0]), num_tokens=[1])
                        for t in range(6)], 1)
    verify = m(chunk, 20 + torch.arange(6)[None], cache, torch.tensor([1]), num_tokens=[6])
    assert torch.equal(single, verify)
    # slot 2 verifies 3 of the tokens beside slot 1's 6 (padded to 6): slot 2's rows are unchanged by the batch
    for s in (1, 2):
        cache.truncate(s, 20)
    both = m(torch.cat([chunk, torch.cat([chunk[:, :3], torch.zeros(1, 3, dtype=torch.int64)], 1)]),
             20 + torch.arange(6)[None].expand(2, 6), cache, torch.tensor([1, 2]), num_tokens=[6, 3])
    assert torch.equal(both[0], single[0]) and torch.equal(both[1, :3], single[0, :3])

"""The faithful plan (kernels/plan.py, models/quant.py): `--weights auto` on a quantized GGUF gives each tensor the
kernel of its stored type, built from its blocks (Q4_K -> q4x8, Q8_0 -> q8_0, the Q8_0 embedding table kept as
stored), is row-exact, close to the file's dense model, cached and reloaded bitwise; greedy speculation (n-gram,
suffix, a draft model) equals plain decoding under it, with the draft faithful or on its default plan (the fastest,
lossy allowed: a draft's precision cannot reach the output); a plan that requantizes a stored type says LOSSY (a
draft's says the output is unaffected). A GGUF of float tensors only keeps the autotuner's auto. About 25 s."""
from __future__ import annotations

import shutil

import pytest
import torch

from draftwise.api import LLM, load_model
from draftwise.kernels.linear import Q4x8Linear, Q80Linear, available
from draftwise.kernels.probe import probe
from draftwise.models.quant import GGUFRowsEmbedding
from draftwise.sampling import SamplingParams
from tests.harness import fixed_tune
from tests.tiny_checkpoints import Q4K_DIMS, write_tiny_gguf


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    if "q8_0" not in available(probe(bandwidth=False)):
        pytest.skip("our C++ kernels do not build here")
    path = tmp_path_factory.mktemp("faithful") / "tiny-mixed.gguf"
    write_tiny_gguf(path, "qwen2", dims=Q4K_DIMS, q4k=("_proj.weight",),
                    quantize=("lm_head.weight", "embed_tokens.weight"))
    return path


def _logits(model, ids: list[int]) -> torch.Tensor:
    from draftwise.equivalence import next_logits

    return next_logits(model, [ids])[0]


def test_auto_is_the_faithful_plan_and_each_tensor_keeps_its_type(mixed_gguf, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    model, _, info = load_model(str(mixed_gguf), weights="auto", cache_dir=cache)
    plan = model.plan
    assert plan.faithful and plan.label == "faithful" and info["weights"] == "faithful" and plan.source == "file"
    assert plan.stored_types == {"Q4_K": 14, "Q8_0": 2} and plan.row_exact and not plan.lossy_types
    assert "Q4_K->q4x8 x14" in plan.describe() and "Q8_0->q8_0 x2" in plan.describe()
    mods = dict(model.named_modules())
    assert isinstance(mods["model.layers.0.self_attn.qkv_proj"], Q4x8Linear)
    assert isinstance(mods["model.layers.1.mlp.down_proj"], Q4x8Linear)
    assert isinstance(mods["lm_head"], Q80Linear) and isinstance(mods["model.embed_tokens"], GGUFRowsEmbedding)

    dense, _, _ = load_model(str(mixed_gguf), weights="fp32", cache_dir=cache)
    assert dense.plan.stored_types == plan.stored_types and not dense.plan.lossy_types
    ids = list(range(3, 60))
    ref, got = _logits(dense, ids), _logits(model, ids)
    assert float((got - ref).norm() / ref.norm()) < 0.02  # the same weights: int8 activations only
    # the table's rows are the dense model's rows bitwise (the gguf package's own dequantizer)
    assert torch.equal(model.model.embed_tokens(torch.tensor(ids)), dense.model.embed_tokens.weight[ids].float())

    lossy, _, _ = load_model(str(mixed_gguf), weights="q4x8", cache_dir=cache)
    assert lossy.plan.lossy_types == ["Q8_0"] and "LOSSY" in lossy.plan.describe()
    assert lossy.plan.to_dict()["lossy"] is True

    from draftwise.models import gguf as gguf_module

    monkeypatch.setattr(gguf_module, "GGUFFile", lambda *a: pytest.fail("reopened the GGUF"))
    again, _, _ = load_model(str(mixed_gguf), weights="auto", cache_dir=cache)
    assert again.plan.faithful and torch.equal(_logits(again, ids), got)


def test_a_gguf_of_float_tensors_keeps_the_autotuners_auto(tiny_gguf_path, tmp_path):
    model, _, _ = load_model(str(tiny_gguf_path), weights="auto", cache_dir=str(tmp_path / "c"),
                             tune=fixed_tune("fp32", "fp32"))
    assert not model.plan.faithful and model.plan.label == "fp32" and model.plan.source == "tuned"


def test_faithful_needs_a_gguf(tiny_hf_dir, tmp_path):
    with pytest.raises(ValueError, match="needs a GGUF"):
        load_model(str(tiny_hf_dir), weights="faithful", cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    {"method": "suffix", "num_speculative_tokens": 4},
    {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 3, "draft_weights": "faithful"},
])
def test_greedy_speculation_equals_plain_under_the_faithful_plan(mixed_gguf, tmp_path, spec):
    from draftwise.equivalence import run_engine

    shutil.copy(mixed_gguf, tmp_path / "m.gguf")
    path = str(tmp_path / "m.gguf")
    spec = {**spec, "model": path} if spec.get("model") == "SELF" else spec
    llm = LLM(path, max_num_seqs=3, max_model_len=160, k_max=4, cache_dir=str(tmp_path / "c"))
    assert llm.model.plan.faithful
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [12, 13, 14, 15, 16, 12, 13, 14]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    assert run_engine(llm, spec, prompts, params) == run_engine(llm, None, prompts, params)


def test_a_draft_gets_the_fastest_plan_lossy_allowed_and_the_output_stays_the_targets(mixed_gguf, tmp_path,
                                                                                     monkeypatch):
    """No draft_weights: the draft's `auto` is the autotuner's choice (here injected: q4x8, which requantizes the
    file's Q8_0 head and table) even under a faithful target; the plan says so, and greedy speculation with that
    lossy draft still equals plain decoding (verification is exact). A named draft_weights is honoured."""
    from draftwise.equivalence import run_engine
    from draftwise.kernels import autotune

    tuned = fixed_tune("q4x8", "q4x8")
    monkeypatch.setattr(autotune, "autotune", lambda shapes, **kw: tuned(shapes))
    shutil.copy(mixed_gguf, tmp_path / "m.gguf")
    path = str(tmp_path / "m.gguf")
    llm = LLM(path, max_num_seqs=3, max_model_len=160, k_max=4, cache_dir=str(tmp_path / "c"))
    assert llm.model.plan.faithful and llm.model.plan.role == "target"
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [12, 13, 14, 15, 16, 12, 13, 14]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    plain = run_engine(llm, None, prompts, params)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    assert run_engine(llm, spec, prompts, params) == plain
    plan = llm.draft_info["plan"]
    assert plan["weights"] == "q4x8" and plan["role"] == "draft" and plan["lossy_types"] == ["Q8_0"]
    assert "output unaffected: verification is exact" in plan["summary"] and "LOSSY" not in plan["summary"]
    assert run_engine(llm, {**spec, "draft_weights": "faithful"}, prompts, params) == plain
    assert llm.draft_info["plan"]["weights"] == "faithful" and not llm.draft_info["plan"]["lossy"]

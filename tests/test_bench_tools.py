"""`draftwise memory` (shapes from metadata only, the KV formula by hand) and `draftwise tune` (conservative
winner, our and vLLM's command lines)."""
import json

import pytest

from draftwise.bench import memory, tune
from draftwise.config import ModelConfig


def test_kv_bytes_by_hand():
    cfg = ModelConfig("qwen2", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=28, num_heads=12,
                      num_kv_heads=2, head_dim=128)
    # 2 (K, V) x 28 layers x 2 kv heads x 128 dims x 2 bytes (bf16) x 1000 tokens x 4 slots
    assert memory.kv_bytes(cfg, "bfloat16", 1000, 4) == 2 * 28 * 2 * 128 * 2 * 1000 * 4


def test_shapes_from_gguf_metadata_match_the_loaded_model(tiny_gguf_path):
    from draftwise.models.gguf import GGUFFile

    s = memory.model_shapes(str(tiny_gguf_path))
    g = GGUFFile(tiny_gguf_path)
    assert s.config == g.config
    assert s.num_params == sum(t.numel() for _, t in g.tensors())
    assert 0 < s.num_linear_params < s.num_params
    assert memory.weight_bytes(s, "bfloat16", None) == 2 * s.num_params
    assert memory.weight_bytes(s, "float32", "int4") < memory.weight_bytes(s, "float32", "int8") < 4 * s.num_params


def test_safetensors_header_only(tiny_hf_dir):
    from draftwise.models.safetensors import header_specs, weight_files

    specs = [x for f in weight_files(tiny_hf_dir) for x in header_specs(f)]
    assert specs and all(isinstance(shape, tuple) for _, shape in specs)
    s = memory.model_shapes(str(tiny_hf_dir))
    assert s.num_params > 0


def test_estimate_phases(tiny_gguf_path, monkeypatch):
    e = memory.estimate(str(tiny_gguf_path), str(tiny_gguf_path), 512, 4, "bfloat16")
    rows = e["bytes"]
    assert set(rows) == {"target_weights", "target_kv_cache", "draft_weights", "draft_kv_cache", "runtime_overhead"}
    assert e["serving_bytes"] == sum(rows.values())
    assert e["total_bytes"] == max(e["serving_bytes"], *e["loading_peak_bytes"].values())
    monkeypatch.setattr(memory, "available_memory", lambda device="cpu": (1, "test"))
    assert not memory.estimate(str(tiny_gguf_path), None, 512, 4)["fits"]
    assert "WARNING" in memory.format_estimate(memory.estimate(str(tiny_gguf_path), None, 512, 4))


def _report(per_prompt: dict[str, list[float]]) -> dict:
    return {"segments": {"s@c1": {"speedups": {c: {"tok_s": {"per_prompt": dict(enumerate(v))}}
                                               for c, v in per_prompt.items()}}}}


def test_tune_picks_conservatively():
    pick = tune.choose(_report({
        "ngram-k8": [1.0, 1.0, 1.0, 3.0, 3.0, 0.9, 1.0, 3.0],  # higher mean, but a typical prompt gains nothing
        "ngram-k3": [1.2, 1.25, 1.3, 1.2, 1.25, 1.3, 1.2, 1.25],
    }))
    assert pick["winner"] == "ngram-k3"
    assert pick["scores"]["ngram-k3"]["score"] == pytest.approx(1.25 - 0.05)
    assert tune.choose(_report({"ngram-k2": [0.9, 1.0, 1.1, 0.95]}))["winner"] == "none"


def test_command_lines():
    spec = tune.spec_config_for({"method": "draft_model", "k": 4, "draft": "qwen2.5-coder-0.5b-instruct"})
    assert spec == {"method": "draft_model", "num_speculative_tokens": 4, "model": "qwen2.5-coder-0.5b-instruct"}
    line = tune.vllm_line("qwen2.5-coder-1.5b-instruct", spec)
    assert line.startswith("vllm serve Qwen/Qwen2.5-Coder-1.5B-Instruct --speculative-config '")
    cfg = json.loads(line.split("'")[1])
    assert cfg == {"method": "draft_model", "num_speculative_tokens": 4, "model": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
    ngram = json.loads(tune.vllm_line("x", {"method": "ngram", "num_speculative_tokens": 5}).split("'")[1])
    assert ngram["prompt_lookup_max"] == 3 and ngram["prompt_lookup_min"] == 1
    assert tune.vllm_line("some/model", None) == "vllm serve some/model"
    assert tune.spec_config_for({"method": "none", "k": 0, "draft": None}) is None

"""A checkpoint written out as a Hugging Face directory another engine (vLLM) can load: config.json from the
ModelConfig (itself from the GGUF's key-values), generation_config.json, the converted tokenizer files, and the
weights as one bfloat16 model.safetensors.

Owns the ModelConfig -> transformers config.json mapping (the inverse of safetensors.config_from_hf, and tested
as such) and the export folder under cache_dir/hf/<sha256[:16]>/, written once into a temporary folder and renamed
into place. The bf16 weights are the Checkpoint's own dense bf16 cache (sources.py writes it from the GGUF on first
use), hard-linked (copied across filesystems), so no conversion code is duplicated here.
It does not read GGUFs (gguf.py), resolve names (sources.py) or know anything of vLLM beyond "a HF directory".
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from draftwise.config import ConfigError, ModelConfig
from draftwise.models import catalog

EXPORT_VERSION = 2  # bump when the folder's layout changes; older folders are then written again
_DONE = "draftwise_export.json"  # written last: its presence marks a finished export
_HF_TYPES = {  # our architecture -> (transformers model_type, its causal-LM class)
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}


def hf_config(config: ModelConfig, dtype: str = "bfloat16") -> dict:
    """transformers' config.json for `config` (safetensors.config_from_hf reads it back to the same ModelConfig)."""
    if config.architecture not in _HF_TYPES:  # the mixtures of experts: their expert tensors have no export yet
        raise ConfigError(f"{config.architecture}: a GGUF of this family cannot be exported for vLLM yet (exported: "
                          f"{', '.join(_HF_TYPES)}); give vLLM the model's HF checkpoint directory instead")
    model_type, cls = _HF_TYPES[config.architecture]
    eos = list(config.eos_token_ids)
    out = {
        "architectures": [cls], "model_type": model_type, "torch_dtype": dtype,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": config.hidden_act, "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    if config.architecture in ("llama", "mistral", "qwen3"):
        out["attention_bias"] = config.attention_bias
    if config.architecture in ("qwen2", "qwen3", "mistral"):
        out["use_sliding_window"] = config.sliding_window is not None
    out["sliding_window"] = config.sliding_window
    if config.architecture == "gemma3":
        scalar = config.query_pre_attn_scalar  # transformers' Gemma3TextConfig types it int
        out.update(hidden_activation=config.hidden_act,
                   query_pre_attn_scalar=int(scalar) if scalar is not None and scalar == int(scalar) else scalar,
                   rope_local_base_freq=config.rope_local_theta, layer_types=list(config.layer_types))
    return out


def export_dir(sha256: str, cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / "hf" / sha256[:16]


def is_exported(folder: Path) -> bool:
    try:
        return json.loads((folder / _DONE).read_text()).get("version") == EXPORT_VERSION
    except (OSError, ValueError):
        return False


def export_hf(checkpoint, cache_dir: str | os.PathLike) -> Path:
    """The HF directory of a GGUF-backed Checkpoint (packaged or .gguf), written once; returns its path."""
    info = checkpoint.info
    if not info.get("sha256") or "converted_path" not in info:
        raise ConfigError(f"{info.get('name')}: only a GGUF or packaged model needs an HF export (pass its directory)")
    target = export_dir(info["sha256"], cache_dir)
    if is_exported(target):
        return target
    with catalog.file_lock(target.with_name(target.name + ".lock")):
        if is_exported(target):
            return target
        print(f"writing {info['name']} as a Hugging Face directory (bf16) once into {target} ...", file=sys.stderr)
        # the Checkpoint's own bf16 cache, written from the GGUF on first use; iterating it is cheap (mmap)
        for _ in checkpoint.tensors(torch.bfloat16):
            break
        converted = Path(info["converted_path"])
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _link_or_copy(converted / "model.bfloat16.safetensors", tmp / "model.safetensors")
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(converted / name, tmp / name)
            config = checkpoint.config
            (tmp / "config.json").write_text(json.dumps(hf_config(config), indent=1))
            generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1))
            (tmp / _DONE).write_text(json.dumps({"version": EXPORT_VERSION, "source": info.get("path"),
                                                 "sha256": info["sha256"], "name": info.get("name")}, indent=1))
            shutil.rmtree(target, ignore_errors=True)
            catalog.replace_durably(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (no second copy on disk, and it survives a rebuild of the source folder), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)

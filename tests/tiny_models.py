"""Tiny random-weight models of every supported family, built both in HF transformers and in draftwise
from one set of hyper-parameters, for logit-parity and engine invariants. Test-only (needs transformers)."""
from __future__ import annotations

import math

import torch

from draftwise.config import ModelConfig
from draftwise.models.transformer import Decoder

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256)


def hf_model(family: str, seed: int = 0, vocab_size: int = 96, num_layers: int | None = None,
             sizes: dict | None = None):
    """An HF transformers causal LM of `family` with random weights (fp32, eval mode); `sizes` overrides _COMMON's
    (e.g. hidden_size=256 for kernels that need K % 256 == 0)."""
    import transformers as tf

    kw = dict(_COMMON, vocab_size=vocab_size, **(sizes or {}))
    if num_layers:
        kw["num_hidden_layers"] = num_layers
    if family == "llama":
        cfg = tf.LlamaConfig(**kw, rope_theta=10000.0, tie_word_embeddings=False)
        cls = tf.LlamaForCausalLM
    elif family == "mistral":
        cfg = tf.MistralConfig(**kw, sliding_window=5, rope_theta=10000.0, tie_word_embeddings=False)
        cls = tf.MistralForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**kw, rope_theta=1000000.0, tie_word_embeddings=True)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**kw, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True)
        cls = tf.Qwen3ForCausalLM
    elif family == "gemma3":
        kw["num_hidden_layers"] = num_layers or 6
        kw["num_key_value_heads"] = 1
        cfg = tf.Gemma3TextConfig(**kw, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                  rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                  hidden_activation="gelu_pytorch_tanh")
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1 (or 0 for gemma): randomise them too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def model_config_for(hf) -> ModelConfig:
    """ModelConfig from an HF model built by hf_model (the same hyper-parameters, written out)."""
    c = hf.config
    family = {"gemma3_text": "gemma3"}.get(c.model_type, c.model_type)
    gemma = family == "gemma3"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    if gemma:
        theta, local = rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]
    else:
        theta, local = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)), None
    return ModelConfig(
        architecture=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=theta, rope_local_theta=local, max_position_embeddings=c.max_position_embeddings,
        attention_bias=family == "qwen2", qk_norm=family in ("qwen3", "gemma3"), sandwich_norm=gemma,
        norm_weight_offset=1.0 if gemma else 0.0, embed_scale=math.sqrt(c.hidden_size) if gemma else 1.0,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        query_pre_attn_scalar=c.query_pre_attn_scalar if gemma else None,
        sliding_window=getattr(c, "sliding_window", None) if family in ("mistral", "gemma3") else None,
        layer_types=tuple(c.layer_types) if gemma else (),
        tie_word_embeddings=bool(c.tie_word_embeddings),
    )


def draftwise_from_hf(hf, dtype=torch.float32) -> Decoder:
    return Decoder.from_tensors(model_config_for(hf), hf.state_dict().items(), dtype=dtype)


def tiny_decoder(family: str = "llama", seed: int = 0, vocab_size: int = 96, num_layers: int | None = None,
                 dtype=torch.float32, sizes: dict | None = None) -> Decoder:
    return draftwise_from_hf(hf_model(family, seed, vocab_size, num_layers, sizes), dtype)

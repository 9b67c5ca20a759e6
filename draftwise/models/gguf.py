"""GGUF files → the checkpoint contract: a ModelConfig from the key-values and float32 tensors with HF names.

This module owns reading GGUF metadata and tensors (with the `gguf` package's reader and dequantizer) and
undoing llama.cpp's conversion quirks so tensors follow HF transformers' conventions:
  * llama/mistral: llama.cpp permutes Q/K rows for interleaved (GPT-J style) RoPE; we un-permute them back
    to HF's rotate-half layout.
  * gemma3: llama.cpp stores RMSNorm weights as (1 + w); we subtract 1 (ModelConfig.norm_weight_offset=1).
  * mixtures of experts (qwen2moe, qwen3moe, llama with experts = mixtral): llama.cpp stacks each layer's experts in
    one 3-D tensor (ffn_{gate,up,down}_exps [experts, out, in]); each expert is handed out as its own 2-D tensor
    under transformers' name (mlp.experts.{e}.gate_proj.weight), a view of the file read or dequantized alone.
Configuration comes only from the file's key-values and tensor table, never from its path.

`GGUFFile.items()` hands out lazy per-tensor handles (GGUFTensor) so a loader can take a Q4_K tensor's raw
blocks as they are (models/quant.py maps them onto the q4x8 kernel exactly) and dequantize only the rest.
It does not build tokenizers (tokenizer.py), cache conversions (sources.py) or run models.
"""
from __future__ import annotations

import math
import os
from typing import Iterator

import numpy as np
import torch

from draftwise.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from draftwise.tokenizer import END_OF_TURN_TOKENS

# GGUF per-layer tensor stem -> HF per-layer name (the part after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router [experts, hidden]
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # qwen2moe: the shared expert's gate [1, hidden]
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Stacked experts [experts, out, in]: one HF tensor per expert, model.layers.{i}.mlp.experts.{e}.<linear>.weight
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# GGUF architecture -> ours, where they differ (a "llama" GGUF with experts is a mixtral: GGUFFile.family)
_GGUF_FAMILIES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# gemma3's sandwich norms: its ffn_norm is the *pre*-feed-forward norm (llama.cpp's gemma3 mapping).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = {"rope_freqs.weight"}  # llama3 rope factors: folded into ModelConfig.rope_scaling instead
_INTERLEAVED_ROPE_ARCHS = ("llama", "mistral")
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer is global (HF Gemma3TextConfig default)
GEMMA3_ROPE_LOCAL_THETA = 10000.0  # HF Gemma3TextConfig rope_local_base_freq


def hf_tensor_name(gguf_name: str, architecture: str) -> str | None:
    """HF transformers' name for a GGUF tensor name, or None for tensors we deliberately skip; a stacked experts
    tensor's name has a "{}" where the expert's index goes."""
    if gguf_name in _SKIPPED:
        return None
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    table = _GEMMA3_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in table:
        return f"model.layers.{int(parts[1])}.{table[parts[2]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES:
        return f"model.layers.{int(parts[1])}.mlp.experts.{{}}.{_EXPERT_NAMES[parts[2]]}.{suffix}"  # per expert
    raise ConfigError(f"GGUF tensor {gguf_name!r} has no known HF name for architecture {architecture!r}")


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate-half halves).

    llama.cpp reshapes rows [H, 2, D/2] -> [H, D/2, 2]; we apply the inverse. weight: [H*D, in] or [H*D]."""
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _scalar(value):
    """Float32-stored metadata (eps 9.99999997e-07) back to the decimal the author wrote (1e-06)."""
    if isinstance(value, float):
        return float(f"{value:.7g}")
    return value


class GGUFFile:
    """One GGUF file: its metadata, ModelConfig and HF-named tensors."""

    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader

        self.path = str(path)
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError) as e:
            raise ConfigError(f"{self.path} is not a readable GGUF file: {e}") from None
        self.architecture = self.field("general.architecture")  # the GGUF's name (its key-values' prefix)
        self.family = _GGUF_FAMILIES.get(self.architecture, self.architecture)  # ours (ModelConfig.architecture)
        if self.family == "llama" and self.arch_field("expert_count", 0):
            self.family = "mixtral"
        if self.family == "olmoe":  # its q/k norms span the whole projection; the GGUF mapping is not written yet
            raise ConfigError(f"{self.path}: GGUF architecture 'olmoe' is not supported yet (an olmoe transformers "
                              f"checkpoint directory is)")
        if self.family not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"GGUF architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._build_config()

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else _scalar(f.contents())

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.architecture}.{key}", default)

    @property
    def metadata(self) -> dict:
        """Every key-value except the big tokenizer arrays (for info/debugging)."""
        big = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
        return {k: self.field(k) for k in self.reader.fields if k not in big and not k.startswith("GGUF.")}

    def _build_config(self) -> ModelConfig:
        hidden = self.arch_field("embedding_length")
        num_heads = self.arch_field("attention.head_count")
        num_layers = self.arch_field("block_count")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        embed = self._tensors["token_embd.weight"]
        vocab_size = int(embed.shape[1])  # GGUF shapes are [ne0=hidden, ne1=vocab]
        if tokens is not None and len(tokens.data) != vocab_size:
            raise ConfigError(f"{self.path}: {len(tokens.data)} tokens but embedding has {vocab_size} rows")
        cfg = dict(
            architecture=self.family,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=self.arch_field("feed_forward_length"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=self.arch_field("attention.head_count_kv", num_heads),
            head_dim=self.arch_field("attention.key_length", hidden // num_heads),
            rms_norm_eps=self.arch_field("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=float(self.arch_field("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=self.arch_field("context_length", 4096),
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
            tie_word_embeddings="output.weight" not in self._tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=self._eos_token_ids(),
        )
        if self.architecture == "gemma3":
            cfg.update(self._gemma3_fields(cfg))
        if self.family in ("qwen2_moe", "qwen3_moe", "mixtral"):
            cfg.update(self._moe_fields())
        return ModelConfig(**cfg)

    def _moe_fields(self) -> dict:
        """Expert counts and widths from llama.cpp's keys. Renormalised top-k weights: `expert_weights_norm` where
        the file says, else llama.cpp's choice for the family (qwen3moe and mixtral yes, qwen2moe no). A layer
        without a router (ffn_gate_inp) is dense (mlp_only_layers)."""
        experts = self.arch_field("expert_count")
        width = self.arch_field("expert_feed_forward_length")
        if width is None:  # mixtral: the experts' width is the feed-forward length, or the stacked tensor's
            width = int(self._tensors["blk.0.ffn_gate_exps.weight"].shape[1])
        return dict(
            num_experts=experts,
            num_experts_per_tok=self.arch_field("expert_used_count"),
            moe_intermediate_size=width,
            shared_expert_intermediate_size=self.arch_field("expert_shared_feed_forward_length", 0)
            if "blk.0.ffn_gate_shexp.weight" in self._tensors else 0,
            norm_topk_prob=bool(self.arch_field("expert_weights_norm", self.family != "qwen2_moe")),
            mlp_only_layers=tuple(i for i in range(self.arch_field("block_count"))
                                  if f"blk.{i}.ffn_gate_inp.weight" not in self._tensors),
        )

    def _gemma3_fields(self, cfg: dict) -> dict:
        # Attention scale: llama.cpp uses head_dim for every size but 27B, whose scalar is hidden/heads;
        # HF's gemma3 configs say the same (query_pre_attn_scalar 256 for 270M..12B, 168 for 27B).
        window = self.arch_field("attention.sliding_window")
        return dict(
            layer_types=self._gemma3_layer_types(cfg["num_layers"], window),
            sandwich_norm=True,
            qk_norm=True,
            norm_weight_offset=1.0,
            embed_scale=math.sqrt(cfg["hidden_size"]),
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=float(cfg["head_dim"]),
            sliding_window=window,
            rope_local_theta=float(self.arch_field("rope.freq_base_swa", GEMMA3_ROPE_LOCAL_THETA)),
        )

    def _gemma3_layer_types(self, num_layers: int, window: int | None) -> tuple[str, ...]:
        """Newer files state the pattern (a period, or one bool per layer, true = sliding); older ones don't."""
        pattern = self.arch_field("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
        if isinstance(pattern, list):
            sliding = [bool(p) for p in pattern]
        else:
            sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
        return tuple("sliding_attention" if s and window else "full_attention" for s in sliding)

    def _rope_scaling(self) -> dict | None:
        kind = self.arch_field("rope.scaling.type")
        factor = self.arch_field("rope.scaling.factor")
        if "rope_freqs.weight" in self._tensors:
            # llama3-style: llama.cpp stores per-frequency divisors; the largest is the factor. Meta's
            # low/high frequency factors (1, 4) are the same for every llama 3.x release.
            freqs = self._dequantize(self._tensors["rope_freqs.weight"])
            original = self.arch_field("rope.scaling.original_context_length", 8192)
            return {"rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": original}
        if kind in (None, "none") or not factor:
            return None
        if kind != "linear":
            raise ConfigError(f"GGUF rope scaling type {kind!r} is not supported (only linear and llama3)")
        return {"rope_type": "linear", "factor": float(factor)}

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = []
        eos = self.field("tokenizer.ggml.eos_token_id")
        if eos is not None:
            ids.append(int(eos))
        eot = self.field("tokenizer.ggml.eot_token_id")
        if eot is not None:
            ids.append(int(eot))
        tokens_field = self.reader.fields.get("tokenizer.ggml.tokens")
        types = self.field("tokenizer.ggml.token_type")  # llama.cpp's token types: 3 = control
        if tokens_field is not None:
            wanted = set(END_OF_TURN_TOKENS)
            for i, idx in enumerate(tokens_field.data):
                if len(tokens_field.parts[idx]) <= 20:  # cheap filter before decoding bytes
                    text = bytes(tokens_field.parts[idx]).decode("utf-8", "replace")
                    # "</s>" is ordinary text in Qwen's vocabulary and a user-defined tag in Gemma's: only control
                    # tokens end a turn (as transformers' generation config has it)
                    if text in wanted and (types is None or int(types[i]) == 3):
                        ids.append(i)
        return tuple(dict.fromkeys(ids))

    @staticmethod
    def _dequantize(t) -> np.ndarray:
        from gguf.quants import dequantize

        # GGUF shape lists ne0 (the contiguous dim) first; torch wants it last.
        return dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """(HF name, shape) of every tensor `tensors()` yields, in the same order, without reading data."""
        return [(name, item.shape) for name, item in self.items().items()]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, float32 tensor) one at a time, dequantized and in HF conventions."""
        for name, item in self.items().items():
            yield name, item.dense()

    def items(self) -> dict[str, "GGUFTensor"]:
        """HF name -> a lazy handle on that tensor (nothing is read or dequantized until asked), in file order."""
        out = {}
        for t in self.reader.tensors:
            name = hf_tensor_name(t.name, self.architecture)
            if name is None:
                continue
            if "{}" in name:  # stacked experts: one handle per expert, a view of the stacked tensor
                for e in range(int(t.shape[-1])):
                    out[name.format(e)] = GGUFTensor(self, name.format(e), t, e)
            else:
                out[name] = GGUFTensor(self, name, t)
        return out

    def _rope_heads(self, name: str) -> int | None:
        """How many heads llama.cpp permuted this tensor's rows over (None: not permuted)."""
        if self.architecture in _INTERLEAVED_ROPE_ARCHS:
            if ".self_attn.q_proj." in name:
                return self.config.num_heads
            if ".self_attn.k_proj." in name:
                return self.config.num_kv_heads
        return None


class GGUFTensor:
    """One tensor of a GGUF file under its HF name: `shape` (torch order), `type` (ggml type name), `dense()` the
    float32 tensor in HF conventions, `blocks()` the raw blocks of any quantized type, `q4k_blocks()` its raw Q4_K blocks [N, K / 256 * 144] uint8 with the same
    row order as dense() (llama's Q/K rows un-permuted; a row permutation moves whole blocks, so it is exact),
    or None when the tensor is not Q4_K."""

    def __init__(self, file: GGUFFile, name: str, t, expert: int | None = None):
        self.file, self.name, self._t, self.expert = file, name, t, expert  # expert: its index in a stacked tensor
        shape = tuple(int(d) for d in reversed(t.shape))
        self.shape = shape if expert is None else shape[1:]
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp's [hidden] (or [hidden, 1]) -> HF's [1, hidden]
            self.shape = (1, math.prod(shape))
        self.type = t.tensor_type.name

    def _data(self) -> np.ndarray:
        """The stored bytes or values (a view of the mapped file): the whole tensor, or one expert's slice."""
        return self._t.data if self.expert is None else self._t.data[self.expert]

    def dense(self) -> torch.Tensor:
        from gguf.quants import dequantize

        cfg = self.file.config
        values = dequantize(self._data(), self._t.tensor_type).reshape(self.shape)  # this tensor (expert) alone
        weight = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
        heads = self.file._rope_heads(self.name)
        if heads:
            weight = unpermute_rope(weight, heads)
        if cfg.norm_weight_offset and self.name.endswith("norm.weight"):
            weight = weight - cfg.norm_weight_offset
        return weight.contiguous()

    def q4k_blocks(self) -> torch.Tensor | None:
        if self.type != "Q4_K" or len(self.shape) != 2:
            return None
        return self.raw_rows()

    def blocks(self) -> torch.Tensor | None:
        """The raw blocks of a 2-D tensor [N, row bytes] uint8 (a quantized type's blocks, or a 16-bit float
        type's values as stored: the float kernels hold them), rows as dense() orders them (llama's Q/K rows
        un-permuted: whole rows move, exact), or None for an F32 / F64 or 1-D tensor."""
        if self.type in ("F32", "F64") or len(self.shape) != 2:
            return None
        return self.raw_rows()

    def raw_rows(self) -> torch.Tensor:
        """The tensor's bytes as stored, one row [row bytes] per output row ([N, row bytes] uint8, a copy), rows in
        dense()'s order."""
        N = self.shape[0]
        raw = torch.from_numpy(np.array(self._data()).view(np.uint8).reshape(N, -1))  # a copy  # [N, row bytes]
        heads = self.file._rope_heads(self.name)
        return unpermute_rope(raw, heads).contiguous() if heads else raw

    def __repr__(self) -> str:
        return f"GGUFTensor({self.name!r}, {self.type}, {self.shape})"

"""Tiny random checkpoints for loader/tokenizer tests: GGUF files written with the `gguf` package the way
llama.cpp writes them (llama Q/K permuted), an HF checkpoint directory, and a tiny byte-level BPE vocabulary
trained on the spot. Test-only; no downloads."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_CORPUS = [
    "def hello(name):\n    return 'hello ' + name\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "print(sum(range(10)))  # numbers 0123456789",
    "héllo wörld, naïve café — ünïcödé",
] * 4
TINY_DIMS = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, layers=2)


def _train_tiny_bpe() -> tuple[list[str], list[str]]:
    """(tokens by id, merges 'a b') of a byte-level BPE with ~300 entries, trained in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=TINY_SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama Q/K rows: [H, 2, D/2] -> [H, D/2, 2] (interleaved RoPE)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def random_q4k_blocks(N: int, K: int, rng) -> np.ndarray:
    """A valid GGUF Q4_K tensor [N, K / 256 * 144] uint8 with random contents (the Python gguf package cannot
    quantize to Q4_K): small positive fp16 d / dmin, random 6-bit scales and mins (any 12 bytes are valid), random
    nibbles."""
    nb = N * K // 256
    blocks = rng.integers(0, 256, size=(nb, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 3e-4, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    blocks[:, 2:4] = rng.uniform(1e-4, 3e-4, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(N, K // 256 * 144)


Q4K_DIMS = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256, layers=2)  # K % 256 == 0 everywhere


def _hf_tensors(arch: str, vocab_size: int, tie: bool, seed: int, dims: dict | None = None,
                scale: float = 0.1) -> dict[str, np.ndarray]:
    """Random weights in HF layout ([out, in]) for a decoder of `arch` (tiny unless `dims` says otherwise)."""
    rng = np.random.default_rng(seed)
    d = dims or TINY_DIMS
    q_out, kv_out = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32) * np.float32(scale)  # noqa: E731
    out = {"model.embed_tokens.weight": r(vocab_size, d["hidden"]), "model.norm.weight": 1 + r(d["hidden"])}
    if not tie:
        out["lm_head.weight"] = r(vocab_size, d["hidden"])
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": 1 + r(d["hidden"]),
            p + "self_attn.q_proj.weight": r(q_out, d["hidden"]),
            p + "self_attn.k_proj.weight": r(kv_out, d["hidden"]),
            p + "self_attn.v_proj.weight": r(kv_out, d["hidden"]),
            p + "self_attn.o_proj.weight": r(d["hidden"], q_out),
            p + "mlp.gate_proj.weight": r(d["intermediate"], d["hidden"]),
            p + "mlp.up_proj.weight": r(d["intermediate"], d["hidden"]),
            p + "mlp.down_proj.weight": r(d["hidden"], d["intermediate"]),
            p + "post_attention_layernorm.weight": 1 + r(d["hidden"]),
        })
        if arch == "qwen2":
            out.update({p + "self_attn.q_proj.bias": r(q_out), p + "self_attn.k_proj.bias": r(kv_out),
                        p + "self_attn.v_proj.bias": r(kv_out)})
    return out


_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    _, _, layer, rest = hf.split(".", 3)
    stem, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_TO_GGUF[stem]}.{suffix}"


def write_tiny_gguf(path: Path, arch: str = "qwen2", tie: bool = False, seed: int = 0,
                    quantize: tuple[str, ...] = (), q4k: tuple[str, ...] = (),
                    dims: dict | None = None, q5_0: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Write a tiny random GGUF as llama.cpp would (llama Q/K permuted); return the HF-layout weights.

    Tensors whose HF name ends with a string in `quantize` are stored as Q8_0, in `q5_0` as Q5_0; with one in
    `q4k`, as random Q4_K blocks (needs K % 256 == 0: dims=Q4K_DIMS), and the returned weight is what those blocks
    dequantize to."""
    import gguf

    tokens, merges = _train_tiny_bpe()
    hf = _hf_tensors(arch, len(tokens), tie, seed, dims)
    d = dims or TINY_DIMS
    rng = np.random.default_rng(seed + 1000)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny random {arch}")
    w.add_block_count(d["layers"])
    w.add_context_length(256)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["intermediate"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in TINY_SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_CHAT_TEMPLATE)
    for name, value in list(hf.items()):
        heads = None
        if arch == "llama" and ".self_attn.q_proj." in name:
            heads = d["heads"]
        elif arch == "llama" and ".self_attn.k_proj." in name:
            heads = d["kv_heads"]
        if q4k and name.endswith(q4k) and value.ndim == 2:
            blocks = random_q4k_blocks(*value.shape, rng)  # rows in HF order
            hf[name] = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(value.shape)
            if heads:
                blocks = llama_cpp_permute(blocks, heads)  # whole rows move: the blocks travel with them
            w.add_tensor(_gguf_name(name), blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            continue
        if heads:
            value = llama_cpp_permute(value, heads)
        if name.endswith(quantize) and value.ndim == 2:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif q5_0 and name.endswith(q5_0) and value.ndim == 2:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q5_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q5_0)
        else:
            w.add_tensor(_gguf_name(name), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def tiny_byte_level_backend():
    """A `tokenizers.Tokenizer` over the tiny vocabulary, as an HF tokenizer.json would describe it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = _train_tiny_bpe()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    return tok


def write_tiny_hf_dir(directory: Path, model_type: str = "llama", seed: int = 0, dims: dict | None = None,
                      scale: float = 0.1) -> dict[str, np.ndarray]:
    """config.json + sharded model-0000X-of-00002.safetensors + index + tokenizer files; returns the weights.
    `dims` (TINY_DIMS' keys) gives real-sized layers around the tiny vocabulary (scripts/gpu_check.py)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    backend = tiny_byte_level_backend()
    vocab_size = backend.get_vocab_size()
    d = dims or TINY_DIMS
    hf = _hf_tensors("qwen2" if model_type == "qwen2" else "llama", vocab_size, tie=False, seed=seed, dims=d,
                     scale=scale)
    config = {
        "model_type": model_type, "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
        "hidden_size": d["hidden"], "intermediate_size": d["intermediate"], "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"], "head_dim": d["head_dim"],
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": [2], "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config))
    names = list(hf)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: torch.from_numpy(hf[k]).to(torch.bfloat16) for k in keys}, str(directory / shard))
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    backend.save(str(directory / "tokenizer.json"))
    tok_config = {"bos_token": {"content": "<|endoftext|>"}, "eos_token": "<|im_end|>", "chat_template": TINY_CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return hf



# ---- mixtures of experts: tiny random Qwen3-MoE, Qwen2-MoE and Mixtral made with transformers ------------------

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
MOE_DIMS = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, layers=3, experts=8, top_k=4,
                moe_intermediate=16, shared_intermediate=24)
MOE_Q4K_DIMS = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=256, layers=2, experts=8, top_k=2,
                    moe_intermediate=256, shared_intermediate=256)  # K % 256 == 0 for every linear


def hf_moe_model(family: str, vocab_size: int, seed: int = 0, dims: dict | None = None):
    """A transformers causal LM of `family` (MOE_FAMILIES) with random weights, fp32, eval mode. Norms are
    randomised and the router's weights drawn wide (std 0.5), so routing is decisive rather than a near-uniform tie;
    qwen3_moe gets norm_topk_prob and one dense layer (mlp_only_layers=[1]) so both layer kinds run."""
    import torch
    import transformers as tf

    d = dims or MOE_DIMS
    kw = dict(vocab_size=vocab_size, hidden_size=d["hidden"], num_hidden_layers=d["layers"],
              num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"], num_experts_per_tok=d["top_k"],
              rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
              eos_token_id=2)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**kw, intermediate_size=d["intermediate"], moe_intermediate_size=d["moe_intermediate"],
                                num_experts=d["experts"], head_dim=d["head_dim"], norm_topk_prob=True,
                                mlp_only_layers=[1] if d["layers"] > 2 else [], rope_theta=1000000.0)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**kw, intermediate_size=d["intermediate"], moe_intermediate_size=d["moe_intermediate"],
                                shared_expert_intermediate_size=d["shared_intermediate"], num_experts=d["experts"],
                                rope_theta=1000000.0)
        cls = tf.Qwen2MoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**kw, intermediate_size=d["moe_intermediate"], num_local_experts=d["experts"],
                               head_dim=d["head_dim"], rope_theta=1000000.0)
        cls = tf.MixtralForCausalLM
    elif family == "olmoe":  # q/k norms over the whole projection
        cfg = tf.OlmoeConfig(**kw, intermediate_size=d["moe_intermediate"], num_experts=d["experts"],
                             rope_theta=10000.0)
        cls = tf.OlmoeForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)
    return model


def write_tiny_moe_hf_dir(directory: Path, family: str, seed: int = 0, dims: dict | None = None):
    """A tiny random MoE checkpoint directory as transformers saves it (fp32 safetensors under the checkpoint's own
    per-expert names, config.json) with the tiny byte-level BPE tokenizer; returns the transformers model."""
    directory.mkdir(parents=True, exist_ok=True)
    backend = tiny_byte_level_backend()
    model = hf_moe_model(family, backend.get_vocab_size(), seed, dims)
    model.save_pretrained(str(directory))
    backend.save(str(directory / "tokenizer.json"))
    tok_config = {"bos_token": {"content": "<|endoftext|>"}, "eos_token": "<|im_end|>", "chat_template": TINY_CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return model


_MOE_TO_GGUF = {**_TO_GGUF, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
                "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_GGUF_MOE_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}


def write_tiny_moe_gguf(path: Path, family: str, seed: int = 0, dims: dict | None = None,
                        types: dict[str, str] | None = None):
    """The transformers model of hf_moe_model written as llama.cpp's convert_hf_to_gguf writes it: experts stacked
    per layer (ffn_{gate,up,down}_exps [experts, out, in]), the router ffn_gate_inp, qwen2moe's shared expert
    (ffn_*_shexp, ffn_gate_inp_shexp [hidden]), llama's (mixtral's) Q/K permuted. `types` maps a GGUF tensor stem
    (e.g. "ffn_gate_exps", "attn_q") to "Q8_0" (quantized by the gguf package) or "Q4_K" / "Q6_K" (random valid
    blocks: needs K % 256 == 0, MOE_Q4K_DIMS); the rest is F32. Returns (the transformers model, HF-layout weights
    as the file holds them: what --weights fp32 loads)."""
    import gguf
    import torch

    tokens, merges = _train_tiny_bpe()
    d = dims or MOE_DIMS
    hf = hf_moe_model(family, len(tokens), seed, d)
    from draftwise.models.safetensors import hf_name, split_fused_experts

    weights = {hf_name(k): v.detach().float().numpy() for k, v in split_fused_experts(hf.state_dict().items())}
    types = types or {}
    rng = np.random.default_rng(seed + 1000)
    arch = _GGUF_MOE_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny random {family}")
    w.add_block_count(d["layers"])
    w.add_context_length(256)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["moe_intermediate"] if family == "mixtral" else d["intermediate"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_expert_count(d["experts"])
    w.add_expert_used_count(d["top_k"])
    if family != "mixtral":
        w.add_expert_feed_forward_length(d["moe_intermediate"])
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(d["shared_intermediate"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in TINY_SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_CHAT_TEMPLATE)

    def store(stem: str, gname: str, value: np.ndarray, hf_names: list[str], heads: int | None = None) -> None:
        """value [..., out, in] in HF row order; writes it in `stem`'s type and puts back into `weights` what the
        file holds (the dequantized blocks) under hf_names (one per expert, or one). A bias stays F32 (as
        llama.cpp's files keep it)."""
        kind = types.get(stem, "F32") if value.ndim >= 2 else "F32"
        if kind in ("Q4_K", "Q6_K"):
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            *lead, N, K = value.shape
            blocks = np.stack([_random_blocks(kind, N, K, rng) for _ in range(math.prod(lead))]).reshape(
                *lead, N, -1)
            value = gguf.quants.dequantize(blocks, qtype).reshape(value.shape)
            data = llama_cpp_permute(blocks, heads) if heads else blocks
        elif kind == "Q8_0":
            qtype = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(llama_cpp_permute(value, heads) if heads else value, qtype)
            value = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).reshape(value.shape)
        else:
            qtype, data = None, llama_cpp_permute(value, heads) if heads else value
        for i, name in enumerate(hf_names):
            weights[name] = value[i] if len(hf_names) > 1 else value
            written.add(name)
        if qtype is None:
            w.add_tensor(gname, np.ascontiguousarray(data))
        else:
            w.add_tensor(gname, np.ascontiguousarray(data), raw_dtype=qtype)

    written: set[str] = set()
    glob = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    for name, stem in glob.items():
        store(stem, f"{stem}.weight", weights[name], [name])
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        for hf_stem, stem in _MOE_TO_GGUF.items():
            for suffix in ("weight", "bias"):
                name = f"{p}{hf_stem}.{suffix}"
                if name not in weights:
                    continue
                heads = None
                if arch == "llama" and hf_stem == "self_attn.q_proj":
                    heads = d["heads"]
                elif arch == "llama" and hf_stem == "self_attn.k_proj":
                    heads = d["kv_heads"]
                value = weights[name]
                if stem == "ffn_gate_inp_shexp":
                    value = value.reshape(-1)  # llama.cpp's [hidden]
                store(stem, f"blk.{i}.{stem}.{suffix}", value, [name], heads)
        if f"{p}mlp.experts.0.gate_proj.weight" in weights:
            for linear, stem in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                 ("down_proj", "ffn_down_exps")):
                names = [f"{p}mlp.experts.{e}.{linear}.weight" for e in range(d["experts"])]
                store(stem, f"blk.{i}.{stem}.weight", np.stack([weights[n] for n in names]), names)
    if written != set(weights):
        raise ValueError(f"no GGUF name for {sorted(set(weights) - written)}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    weights = {k: v.reshape(1, -1) if k.endswith("shared_expert_gate.weight") else v for k, v in weights.items()}
    return hf, weights


def _random_blocks(kind: str, N: int, K: int, rng) -> np.ndarray:
    """Random valid Q4_K or Q6_K blocks [N, K / 256 * bytes per block] uint8 (small fp16 scales)."""
    if kind == "Q4_K":
        return random_q4k_blocks(N, K, rng)
    nb = N * K // 256  # Q6_K: ql[128] qh[64] scales[16] (int8) d (fp16): 210 bytes
    blocks = rng.integers(0, 256, size=(nb, 210), dtype=np.uint8)
    blocks[:, 192:208] = rng.integers(-32, 32, size=(nb, 16), dtype=np.int8).view(np.uint8)
    blocks[:, 208:210] = rng.uniform(1e-4, 3e-4, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(N, K // 256 * 210)

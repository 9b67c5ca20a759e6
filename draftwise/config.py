"""Configuration: frozen dataclasses for the model, speculation and engine, and the vLLM-style
speculative-config parser.

This module owns every knob a user can turn and validates it once. It does not load models or touch
tensors; the rest of the package receives slices of these objects (docs/ARCHITECTURE.md, Layers). `--weights` names
are kernels/plan.py's; check_weights asks it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any


class ConfigError(ValueError):
    """A configuration the user can fix; the CLI prints it without a traceback. `param`: the request field it is
    about, where that is not the prompt (the server's 400 names it)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(ConfigError):
    """The prompt plus the requested output does not fit the context length (raised when a request is added)."""


SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen2_moe", "qwen3_moe", "mixtral",
                           "olmoe")
# mixture-of-experts families: a layer's MLP is a router over num_experts MLPs (models/transformer.py SparseMoE)
MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")

# --kv-cache-dtype: how K/V is stored (auto: auto_kv_cache_dtype). bfloat16 halves the pool per token; the attention
# op widens it exactly (fp32 accumulation); float16 runs only where the decoder takes its torch path (not our ops).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def auto_kv_cache_dtype(activations: str, widens_exactly: bool) -> str:
    """What --kv-cache-dtype auto stores K/V in, for a model with these activations ("float32" / "bfloat16"):
    bfloat16 where our C++ attention reads K/V (`widens_exactly`: the CPU kernels path, float32 activations),
    since there it is widened exactly and accumulated in float32, so speculation and plain decoding read the same
    bits by construction, and on the packaged models its quality was measured within the bar `quality` holds a
    plan to against llama.cpp on the same GGUF, as float32 K/V's is (bench/quality.py kv_dtype_quality;
    docs/PERFORMANCE.md, "K/V dtype"); elsewhere the activation dtype."""
    return "bfloat16" if widens_exactly else activations

# --kv-cache-memory: the K/V pool's budget (kv_cache.py pages it; memory is committed only as blocks are used).
# Default as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE=4 GiB), never more than every slot at full context.
DEFAULT_KV_CACHE_MEMORY = 4 * 2**30
SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
              "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}
SIZE_HELP = "a bare K/M/G/T is binary (8G = 8GiB); KB/MB/GB are decimal"


def parse_size(value: str | int, what: str = "size") -> int:
    """"8G" / "8GiB" -> 8589934592, "8GB" -> 8000000000, "6000MiB", "1.5GiB", "123456" or 123456 (bytes): the one
    size reader of the package (SIZE_UNITS). ConfigError naming `what` for anything else, or a size not above 0."""
    raw = str(value).strip()
    t = raw.lower().replace(" ", "")
    i = len(t)
    while i and t[i - 1].isalpha():
        i -= 1
    try:
        number, unit = float(t[:i]), t[i:]
    except ValueError:
        raise ConfigError(f"{what}: expected a size such as 8GiB, 8GB or 6000MiB ({SIZE_HELP}), got {raw!r}") from None
    if unit not in SIZE_UNITS:
        raise ConfigError(f"{what}: unknown unit {unit!r} in {raw!r} (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB; "
                          f"{SIZE_HELP})")
    nbytes = int(number * SIZE_UNITS[unit])
    if nbytes <= 0:
        raise ConfigError(f"{what}: expected a size above 0, got {raw!r}")
    return nbytes


def parse_kv_cache_memory(value: str | int | float | None, what: str = "kv_cache_memory") -> int | float:
    """kv_cache_memory: bytes (an int, or a size as parse_size reads it: "2GiB", "2G", "4GB") or a fraction of the
    RAM available at load (a float in (0, 1], or its text with a point and no unit: 0.25, "0.25").
    None: DEFAULT_KV_CACHE_MEMORY."""
    if value is None:
        return DEFAULT_KV_CACHE_MEMORY
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be bytes or a fraction, got {value!r}")
    text = str(value).strip()
    if isinstance(value, float) or ("." in text and text and not text[-1].isalpha()):
        try:
            fraction = float(text)
        except ValueError:
            raise ConfigError(f"{what}: expected a size (e.g. 2GiB, 512MiB) or a fraction of the RAM available "
                              f"(e.g. 0.25), got {value!r}") from None
        if not 0 < fraction <= 1:
            raise ConfigError(f"{what}: a fraction of the RAM available must be in (0, 1], got {value!r}")
        return fraction
    return parse_size(text, what)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder, read from checkpoint metadata (config.json or GGUF key-values)."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None  # gemma3: sliding-window layers use another base
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # qwen2: bias on q/k/v
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm on q and k per head
    qk_norm_full: bool = False  # olmoe: RMSNorm over the whole q and k projections (all heads at once) instead
    sandwich_norm: bool = False  # gemma3: post-attention and pre/post feed-forward norms
    norm_weight_offset: float = 0.0  # gemma: RMSNorm multiplies by (offset + weight)
    embed_scale: float = 1.0  # gemma: embeddings scaled by sqrt(hidden_size)
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh"
    query_pre_attn_scalar: float | None = None  # gemma3: attention scale = scalar ** -0.5
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # mixture of experts (MOE_ARCHITECTURES; 0 experts: every layer's MLP is dense, of intermediate_size). A sparse
    # layer routes each token to its num_experts_per_tok likeliest experts (softmax over the router's logits, top-k,
    # renormalised to sum 1 where norm_topk_prob), each an MLP of moe_intermediate_size; qwen2_moe adds a shared
    # expert (shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate . x). Which layers are sparse
    # is transformers' rule: not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0 (is_moe_layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ConfigError(f"a mixture of experts needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) "
                                  f"<= num_experts ({self.num_experts}) and moe_intermediate_size >= 1 "
                                  f"({self.moe_intermediate_size})")
            if self.decoder_sparse_step < 1:
                raise ConfigError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        elif self.architecture in MOE_ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} needs num_experts >= 1")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (transformers' rule for qwen2_moe / qwen3_moe; every
        layer of a mixtral)."""
        return bool(self.num_experts) and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["layer_types"] = tuple(d.get("layer_types") or ())
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["mlp_only_layers"] = tuple(d.get("mlp_only_layers") or ())
        return cls(**d)


SPEC_METHODS = ("none", "ngram", "draft_model", "grammar", "suffix")
DRAFT_P_MIN = 0.5  # a draft model's default draft_p_min (docs/PERFORMANCE.md, "Chat speculation")
THEN_METHODS = ("ngram", "draft_model")  # what may fill the rest of k after the grammar's forced tokens
# "auto": the activation dtype the chosen kernels want (float32 for q4x8, bfloat16 for torch's int4 and dense bf16)
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


def check_weights(weights: str, device: str | None = None) -> str:
    """A `--weights` value (auto, a kernel of kernels/linear.py's registry, or STEP+PREFILL; kernels/plan.py reads
    it), as given, or a ConfigError naming what is wrong; `device`: also check it runs there."""
    from draftwise.kernels.plan import parse_weights

    try:
        parse_weights(weights, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return weights


@dataclass(frozen=True)
class SpecConfig:
    """Parsed `--speculative-config` (vLLM's JSON keys)."""

    method: str = "none"
    num_speculative_tokens: int | str = 0  # int >= 1, or "auto"
    model: str | None = None  # draft model for method=draft_model
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    draft_dtype: str | None = None
    draft_weights: str | None = None
    # method draft_model: the draft's output head covers only ids [0, draft_vocab_size) plus the EOS ids
    # (FR-Spec, spec_decode/draft_model.py); None = the draft's whole vocabulary
    draft_vocab_size: int | None = None
    # method draft_model: a row stops guessing after a guess its draft gave less than this probability (llama.cpp's
    # speculative p_min; spec_decode/draft_model.py); None = DRAFT_P_MIN, 0 = always guess k
    draft_p_min: float | None = None
    # method grammar: the proposer that fills the rest of k after the forced tokens (its own keys, no k)
    then: SpecConfig | None = None
    # method suffix (spec_decode/suffix.py), vLLM's keys and defaults: the tries' depth (match + guesses), earlier
    # outputs kept (0: none), guesses' depth per matched token, the least estimated probability a guess may have
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_cache_max_bytes: int = 256 << 20  # ours: the earlier outputs' tries' memory bound (oldest evicted first)
    suffix_tree: bool = True  # ours: False = the most likely branch only (a chain; measures what the tree adds)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def k_max(self) -> int:
        """Upper bound on k per step (for cache sizing); 'auto' searches up to 8 (suffix: 16 tree nodes)."""
        if not self.enabled:
            return 0
        if self.adaptive:
            return 16 if self.method == "suffix" else 8
        return int(self.num_speculative_tokens)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
             and (self.method == "suffix" or f.name not in _SUFFIX_KEYS)}
        if self.then is not None:
            d["then"] = {k: v for k, v in self.then.to_dict().items() if k != "num_speculative_tokens"}
        return d


_SPEC_KEYS = {f.name for f in fields(SpecConfig)}


def parse_spec_config(value: str | dict | SpecConfig | None) -> SpecConfig:
    """Parse and validate a speculative config given as JSON text, a dict, or None (= no speculation).

    Unknown keys and bad values raise ConfigError naming the key, as vLLM does."""
    if value is None or value == "":
        return SpecConfig()
    if isinstance(value, SpecConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError("--speculative-config must be a JSON object")
    unknown = sorted(set(value) - _SPEC_KEYS)
    if unknown:
        raise ConfigError(f"unknown speculative-config key(s) {unknown}; allowed: {sorted(_SPEC_KEYS)}")
    d: dict[str, Any] = dict(value)
    method = d.get("method", "none")
    if method not in SPEC_METHODS:
        raise ConfigError(f"speculative-config method {method!r} is not one of {list(SPEC_METHODS)}")
    if d.get("then") is not None:
        d["then"] = _parse_then(d["then"], method)
    k = d.get("num_speculative_tokens", 0 if method == "none" else None)
    if method != "none":
        if k is None:
            raise ConfigError("speculative-config needs num_speculative_tokens (an integer >= 1 or \"auto\")")
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 32):
            raise ConfigError(f"num_speculative_tokens must be an integer in 1..32 or \"auto\", got {k!r}")
    if method == "draft_model" and not d.get("model"):
        raise ConfigError("method draft_model needs \"model\" (a draft model name or path)")
    if method != "draft_model":
        for key in ("model", "draft_dtype", "draft_weights", "draft_vocab_size", "draft_p_min"):
            if d.get(key) is not None:
                raise ConfigError(f"speculative-config key {key!r} only applies to method draft_model")
    lo, hi = d.get("prompt_lookup_min", 1), d.get("prompt_lookup_max", 3)
    for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {v!r}")
    if lo > hi:
        raise ConfigError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
    if d.get("draft_dtype") is not None and d["draft_dtype"] not in DTYPE_CHOICES:
        raise ConfigError(f"draft_dtype must be one of {list(DTYPE_CHOICES)}, got {d['draft_dtype']!r}")
    if d.get("draft_weights") is not None:
        check_weights(d["draft_weights"])
    n = d.get("draft_vocab_size")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        # the upper bound (the draft's vocabulary) is checked when the draft is loaded (spec_decode/builders.py)
        raise ConfigError(f"draft_vocab_size must be an integer >= 1 (ids kept in the draft's head), got {n!r}")
    pm = d.get("draft_p_min")
    if pm is not None and (isinstance(pm, bool) or not isinstance(pm, (int, float)) or not 0 <= pm < 1):
        raise ConfigError(f"draft_p_min must be a number in [0, 1) (0: always guess k), got {pm!r}")
    _check_suffix_keys(d, method)
    d["method"] = method
    d["num_speculative_tokens"] = 0 if method == "none" else k
    return SpecConfig(**d)


_SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "suffix_cache_max_bytes",
                "suffix_tree")


def _check_suffix_keys(d: dict, method: str) -> None:
    given = [key for key in _SUFFIX_KEYS if key in d]
    if method != "suffix":
        if given:
            raise ConfigError(f"speculative-config key {given[0]!r} only applies to method suffix")
        return
    ints = (("suffix_decoding_max_tree_depth", 2, "an integer >= 2 (a matched token and a guess)"),
            ("suffix_decoding_max_cached_requests", 0, "an integer >= 0 (0: earlier outputs are not kept)"),
            ("suffix_cache_max_bytes", 0, "an integer >= 0 (bytes of earlier outputs' tries)"))
    for key, low, what in ints:
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ConfigError(f"{key} must be {what}, got {v!r}")
    if not isinstance(d.get("suffix_tree", True), bool):
        raise ConfigError(f"suffix_tree must be true or false, got {d['suffix_tree']!r}")
    v = d.get("suffix_decoding_max_spec_factor")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        raise ConfigError(f"suffix_decoding_max_spec_factor must be a number > 0 (guessed depth per matched token), got {v!r}")
    v = d.get("suffix_decoding_min_token_prob")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1):
        raise ConfigError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {v!r}")


def _parse_then(then: Any, method: str) -> SpecConfig | None:
    """The `then` of method grammar: {"method": "ngram" | "draft_model", ...its keys} (or just the method
    name); it shares the outer num_speculative_tokens, filling what the forced tokens leave of k."""
    if method != "grammar":
        raise ConfigError(f"speculative-config key 'then' only applies to method grammar, not {method!r} "
                          '(e.g. {"method": "grammar", "num_speculative_tokens": 6, "then": {"method": "ngram"}})')
    if isinstance(then, str):
        then = {"method": then}
    if not isinstance(then, dict):
        raise ConfigError('speculative-config "then" must be an object like {"method": "ngram"} or a method name')
    if "num_speculative_tokens" in then:
        raise ConfigError('speculative-config "then" takes no num_speculative_tokens: it fills the rest of the '
                          "outer config's k after the grammar's forced tokens")
    inner = then.get("method")
    if inner == "none":
        return None
    if inner not in THEN_METHODS:
        raise ConfigError(f'speculative-config "then".method must be one of {list(THEN_METHODS)}, got {inner!r}')
    try:
        parsed = parse_spec_config({**then, "num_speculative_tokens": 1})
    except ConfigError as e:
        raise ConfigError(f'speculative-config "then": {e}') from None
    return SpecConfig(**{**{f.name: getattr(parsed, f.name) for f in fields(parsed)}, "num_speculative_tokens": 0})


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to run one target (and optionally a proposer)."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    weights: str = "auto"  # "auto" = measured per machine; a kernel name or STEP+PREFILL (kernels/plan.py)
    threads: int | None = None
    max_num_seqs: int = 8
    max_model_len: int | None = None  # None = the model's context, within the K/V pool (kv_cache_memory)
    spec_config: SpecConfig = field(default_factory=SpecConfig)
    seed: int = 0
    # fewer torch threads while other processes hold cores (kernels/threads.py); only where results can't change
    thread_guard: bool = True
    # keep recent prompts' K/V and reuse their longest common prefix (prefix_cache.py); None = where it is exact
    enable_prefix_caching: bool | None = None
    # the K/V pool's budget: bytes, or a fraction (0, 1] of the RAM available at load (parse_kv_cache_memory)
    kv_cache_memory: int | float = DEFAULT_KV_CACHE_MEMORY
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES

    def __post_init__(self):
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        check_weights(self.weights, self.device)
        if self.spec_config.draft_weights is not None:
            check_weights(self.spec_config.draft_weights, self.device)
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads must be >= 1")
        object.__setattr__(self, "kv_cache_memory", parse_kv_cache_memory(self.kv_cache_memory))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


def hub_offline() -> bool:
    """True when the user asked for no hub access (HF_HUB_OFFLINE=1), as huggingface_hub reads it."""
    import os

    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")

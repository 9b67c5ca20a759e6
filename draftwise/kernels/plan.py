"""Where a kernel is chosen: the KernelPlan a model is built with, and `resolve_plan`, the one function that turns
`--weights` / `--dtype` into one.

A plan names two implementations of kernels/linear.py's registry (LINEARS): the step kernel, for every call with
at most STEP_MAX_TOKENS tokens per sequence (a plain decode step and a verification of k + 1 tokens run the SAME
kernel, so greedy speculative output can equal plain output), and the prefill kernel above that; the activation
dtype (also the KV cache's); the device; the attention (our row-exact op or torch's SDPA); where the plan came
from; and, for `auto`, the autotuner's evidence.

`--weights` takes:
  auto          for a GGUF on the CPU: the faithful plan (below); otherwise the autotuner's choice for this model's shapes on this machine (kernels/autotune.py: timed on
                the real projection shapes, step score (cost(1) + cost(9)) / 2 and prefill cost at 128 rows, both
                among implementations whose rows were found bitwise independent of the other rows; cached per
                machine, torch version, threads and shapes)
  NAME          one implementation for every call (q4x8, int4, int8, bf16, fp32, int8_dynamic)
  STEP+PREFILL  two, e.g. q4x8+bf16; `+dense` is the dense implementation of the activation dtype
  faithful      every tensor at the precision its GGUF stores: each linear (and the embedding table) by the kernel
                of its stored block type (FAITHFUL_KERNELS, from kernels/blocktypes.py's table: Q4_K -> q4x8, Q6_K ->
                q6k, Q8_0 / Q5_0 -> q8_0, ...; float and other types -> fp32 over the exactly dequantized weights). What `auto` is for a GGUF source: a
                file's quantization is the user's trade of size against quality, and no plan should spend more of
                it. A plan that requantizes a stored tensor to another format (e.g. q4x8 over Q6_K) is labelled
                LOSSY in its summary (`lossy_types`).
A draft model's plan (role "draft") is chosen for speed: its precision never changes the output (every guess is
verified exactly against the target), so `auto` for a draft is the autotuner's fastest plan even over a GGUF (lossy
allowed: e.g. q4x8 over the file's Q5_0 / Q6_K / Q8_0), and the summary says the loss does not reach the output;
`draft_weights: faithful` (or any other name) is honoured as given.
`--dtype auto` follows the step kernel's activation dtype (kernels/linear.py: float32 for q4x8 and fp32).

The engine, the prefix cache, the thread guard and in-prefill speculation ask the plan one question,
`row_exact`: does a row's result never depend on how many rows share the forward, how a prompt is cut into
forwards, or how many threads run it? That holds where both kernels are row-exact by construction and our
attention op serves every forward. Knows nothing of checkpoints or decoders: it sees shapes (any object with the
usual config fields) and names.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from draftwise.kernels import blocktypes
from draftwise.kernels.linear import LINEARS, dense_for

ACTIVATION_DTYPES = ("float32", "bfloat16")
SOURCES = ("pinned", "tuned", "cached", "default", "file")
ROLES = ("target", "draft")  # what a plan's model is for: a draft's precision never reaches the output
# GGUF block type -> the kernel that holds it exactly (kernels/blocktypes.py's table); other types -> fp32,
# dequantized exactly
FAITHFUL_KERNELS = blocktypes.faithful_kernels()
EXACT_DENSE = blocktypes.FALLBACK
FLOAT_TYPES = blocktypes.FLOAT_TYPES  # a GGUF holding only these has no quantization to honour


def faithful_by_default(stored_types: dict | None) -> bool:
    """Whether `auto` is the faithful plan for a census of stored types: it holds a quantized tensor, or a float
    type with a kernel of its own in the table (F16 -> f16: the file's 16 bits per weight as stored, where the
    tuner's plans would widen them to fp32 or requantize them)."""
    return any(t not in FLOAT_TYPES for t in stored_types or {}) or bool(blocktypes.float_kernels(stored_types))


def faithful_kernel(gguf_type: str) -> str:
    """The kernel a faithful plan gives a tensor stored as `gguf_type` (a ggml type name: "Q6_K", "F32", ...)."""
    return FAITHFUL_KERNELS.get(gguf_type, EXACT_DENSE)


def holds_exactly(kernel: str, gguf_type: str) -> bool:
    """Whether `kernel` computes with exactly the weights a tensor stored as `gguf_type` holds."""
    return kernel == EXACT_DENSE or FAITHFUL_KERNELS.get(gguf_type) == kernel


@dataclass(frozen=True)
class KernelPlan:
    step: str  # LINEARS name for calls of at most STEP_MAX_TOKENS tokens per sequence (decode, verification)
    prefill: str  # LINEARS name for longer calls (prompts)
    dtype: str  # activations and the KV cache: "float32" | "bfloat16"
    device: str = "cpu"
    attention: str = "sdpa"  # "ours": kernels/attention.py's row-exact op takes every forward; "sdpa": torch's
    source: str = "default"  # "pinned" (--weights named it), "tuned" (measured now), "cached" (the autotune
    # cache), "default" (a decoder built without a plan: its nn.Linear layers, dense in its dtype)
    provisional: bool = False  # timed while other processes kept cores busy (autotune.py): re-tuned at a quiet start
    tuning: dict | None = None  # the autotuner's evidence (key, probe summary, scores)
    faithful: bool = False  # each tensor by the kernel of its stored GGUF type (faithful_kernel), step and prefill
    stored_types: dict | None = None  # a GGUF source's linears and embedding table: ggml type -> tensor count
    role: str = "target"  # ROLES: "draft" = a speculation draft's plan (auto: fastest, lossy allowed)

    def __post_init__(self):
        for name in (self.step, self.prefill):
            if name not in LINEARS:
                raise ValueError(f"unknown linear implementation {name!r} (known: {', '.join(LINEARS)})")
        if self.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"a plan's dtype is one of {ACTIVATION_DTYPES}, got {self.dtype!r}")
        if self.source not in SOURCES:
            raise ValueError(f"a plan's source is one of {SOURCES}, got {self.source!r}")
        if self.role not in ROLES:
            raise ValueError(f"a plan's role is one of {ROLES}, got {self.role!r}")

    @property
    def label(self) -> str:
        """What `--weights` would name this plan: "faithful", "q4x8", or "q4x8+bf16" for a split."""
        if self.faithful:
            return "faithful"
        return self.step if self.step == self.prefill else f"{self.step}+{self.prefill}"

    @property
    def row_exact(self) -> bool:
        """Every row of every forward is bitwise independent of the other rows, of the forward's width and of
        the thread count: both kernels row-exact by construction and our attention op. Then a verified row equals
        the plain step's row, a prompt prefilled after a cached prefix equals the prompt prefilled whole, and a
        thread count can change no token — where the prefix cache is on by default, guesses ride in the prefill
        and the thread guard may run."""
        return all(LINEARS[n].row_exact for n in self.kernels()) and self.attention == "ours"

    def kernels(self) -> list[str]:
        """Every implementation the plan's linears use: the step and prefill kernels, or, faithful, the kernel of
        each stored type."""
        if self.faithful:
            return sorted({faithful_kernel(t) for t in self.stored_types or {}})
        return list(dict.fromkeys((self.step, self.prefill)))

    @property
    def fallback_types(self) -> dict[str, int]:
        """The stored quantized types a faithful plan gives no kernel of their own (kernels/blocktypes.py: no row's
        kernel holds them): type -> tensor count, each computed by the fp32 fallback over its dequantized weight
        ({} for other plans: they name their kernels)."""
        return blocktypes.fallbacks(self.stored_types) if self.faithful else {}

    def fallback_text(self) -> str:
        """What the fallback costs, predicted from the table: per type, fp32 holds FALLBACK_BITS per weight against
        the file's bits (memory x that ratio for those tensors), and decode, bound by the bytes it streams, slows by
        about the same ratio on them. '' when every stored type has its kernel."""
        parts = []
        for t, n in self.fallback_types.items():
            row = blocktypes.TYPES.get(t)
            if row is None:
                parts.append(f"{t} x{n} on the {EXACT_DENSE} fallback")
                continue
            ratio = blocktypes.FALLBACK_BITS / row.bits
            parts.append(f"{t} x{n} on the {EXACT_DENSE} fallback: {blocktypes.FALLBACK_BITS:.0f} bits per weight "
                         f"instead of {row.bits:.2f}, {ratio:.1f}x their memory and about {ratio:.1f}x slower decode "
                         "on them")
        return "; ".join(parts)

    @property
    def lossy_types(self) -> list[str]:
        """The stored GGUF types this plan computes with other weights than the file holds (requantized, or
        rounded to bf16): [] for a faithful plan, for fp32 and for a dense source (nothing stored to honour)."""
        if self.faithful or not self.stored_types:
            return []
        return sorted(t for t in self.stored_types
                      if not all(holds_exactly(k, t) for k in dict.fromkeys((self.step, self.prefill))))

    def types_text(self) -> str:
        """'Q4_K->q4x8 x197, Q6_K->q6k x29' (faithful) or the stored types with their counts."""
        types = self.stored_types or {}
        if self.faithful:
            return ", ".join(f"{t}->{faithful_kernel(t)} x{n}" for t, n in sorted(types.items()))
        return ", ".join(f"{t} x{n}" for t, n in sorted(types.items()))

    def describe(self) -> str:
        """One line for a load log: the kernels, where they came from, and when and under what load auto timed
        them."""
        text = f"kernels {self.label} ({self.dtype}, attention {self.attention}, {self.source}"
        if self.faithful:
            text += f"; every tensor as the file stores it: {self.types_text()}"
        t = self.tuning or {}
        if t.get("measured_at"):
            busy = [v for v in (t.get("busy_before"), t.get("busy_cores")) if v is not None]
            text += f", timed {t['measured_at']}" + (f" with {max(busy):.1f} other cores busy" if busy else "")
        text += ")" + ("; row-exact" if self.row_exact else "; not row-exact")
        if self.fallback_types:
            text += f"; SLOW PATH: no kernel of its own for {self.fallback_text()}"
        if self.lossy_types and self.role == "draft":
            text += (f"; lossy (requantizes the file's {', '.join(self.lossy_types)} tensors); output unaffected: "
                     "verification is exact (draft_weights faithful keeps them as stored)")
        elif self.lossy_types:
            text += (f"; LOSSY: requantizes the file's {', '.join(self.lossy_types)} tensors "
                     "(--weights auto keeps them as stored)")
        if self.provisional:
            text += "; PROVISIONAL: timed under load, re-tuned at the next quiet start (draftwise kernels --refresh)"
        return text

    def to_dict(self) -> dict:
        """The plan as JSON (load logs, /v1/models, generate --json, bench manifests)."""
        return {"weights": self.label, **asdict(self), "row_exact": self.row_exact, "lossy": bool(self.lossy_types),
                "lossy_types": self.lossy_types, "fallback_types": self.fallback_types, "summary": self.describe()}


def attention_for(dtype: str, device: str) -> str:
    """"ours" where kernels/attention.py's row-exact op runs this dtype on this device, else "sdpa"."""
    from draftwise.kernels import attention

    ours = device == "cpu" and dtype in ACTIVATION_DTYPES and attention.available()
    return "ours" if ours else "sdpa"


def parse_weights(weights: str, device: str | None = "cpu") -> tuple[str, str] | None:
    """(step, prefill) names of a `--weights` value, None for "auto"; "dense" is left for the dtype to resolve.
    ValueError naming what is wrong (an unknown name, or one that cannot run on `device`; None: any device)."""
    if not isinstance(weights, str) or not weights:
        raise ValueError(f"weights must be 'auto', a kernel name or STEP+PREFILL, got {weights!r}")
    if weights == "auto":
        return None
    if weights == "faithful":
        if device not in (None, "cpu"):
            raise ValueError(f"weights 'faithful': its kernels run on cpu, not {device}")
        return "faithful", "faithful"
    parts = weights.split("+")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2:
        raise ValueError(f"weights {weights!r}: at most two names, STEP+PREFILL (e.g. q4x8+bf16)")
    for i, name in enumerate(parts):
        if name == "dense" and i == 1:
            continue
        if name not in LINEARS:
            raise ValueError(f"weights {weights!r}: unknown kernel {name!r}; one of auto, faithful, {', '.join(LINEARS)}, "
                             "or STEP+PREFILL (e.g. q4x8+bf16, q4x8+dense)")
        if device is not None and device not in LINEARS[name].devices:
            raise ValueError(f"weights {weights!r}: {name} does not run on {device} (it runs on "
                             f"{', '.join(LINEARS[name].devices)}); use --weights auto to time what does")
    return parts[0], parts[1]


def weights_help() -> str:
    """One line per accepted `--weights` value, for --help."""
    names = "; ".join(f"{n}: {cls.description}" for n, cls in LINEARS.items())
    return (f"auto (a GGUF: faithful; else measured here), faithful (each tensor by the kernel of its stored GGUF type), "
            f"a kernel ({names}), or STEP+PREFILL (e.g. q4x8+bf16; +dense: the dtype's dense)")


def resolve_plan(weights: str, dtype: str, cfg, device: str = "cpu", tune=None, progress: bool = True,
                 stored_types: dict | None = None, role: str = "target") -> KernelPlan:
    """The plan to build `cfg`'s model with. `stored_types` (ggml type -> count of the linears and embedding
    table, models/quant.py type_census) is given for a GGUF source built from its blocks: then "auto" is the
    faithful plan (source "file"; where the C++ kernels build), and every plan carries the types (a lossy one
    says so). A named plan is used as it is ("pinned"); "auto" otherwise asks the autotuner for this model's
    shapes on `device` (`tune(shapes) -> autotune result` may be injected: tests). `dtype` "auto" follows the step
    kernel. `role` "draft": "auto" is the autotuner's fastest plan, never the faithful one (a draft's precision
    cannot change the output; the plan says so). `weights` and `dtype` were validated where they were parsed
    (config.py)."""
    if role not in ROLES:
        raise ValueError(f"a plan's role is one of {ROLES}, got {role!r}")
    names = parse_weights(weights, device)
    tuning, source, provisional = None, "pinned", False
    if names == ("faithful", "faithful") or (names is None and role == "target" and faithful_by_default(stored_types)
                                              and device == "cpu" and _kernels_build()):
        if not stored_types:
            raise ValueError("weights 'faithful' keeps a GGUF's stored types: it needs a GGUF model on the cpu")
        act = dtype if dtype != "auto" else "float32"
        return KernelPlan("q4x8", "q4x8", act, device, attention_for(act, device), "file" if names is None else
                          "pinned", faithful=True, stored_types=dict(stored_types), role=role)
    if names is None:
        from draftwise.kernels import autotune as at

        tune = tune or (lambda shapes: at.autotune(shapes, fast=True, progress=progress, device=device))
        result = tune(at.shapes_from_config(cfg))
        names = result["choice"]["step"], result["choice"]["prefill"]
        source = "cached" if result.get("cached") else "tuned"
        provisional = bool(result.get("provisional"))
        tuning = summary(result)
    step, prefill = names
    act = dtype if dtype != "auto" else LINEARS[step].dtype
    if prefill == "dense":
        prefill = dense_for(act)
    return KernelPlan(step, prefill, act, device, attention_for(act, device), source, provisional, tuning,
                      stored_types=dict(stored_types) if stored_types else None, role=role)


def _kernels_build() -> bool:
    """Whether our C++ kernels (kernels/blocktypes.py's KERNELS) build and load here: what a faithful plan runs."""
    from draftwise.kernels import library

    return library.loads()


def default_plan(dtype: str, device: str) -> KernelPlan:
    """The plan of a decoder built without one (plain nn.Linear layers): dense in its dtype, never row-exact."""
    dense = dense_for(dtype)
    return KernelPlan(dense, dense, dtype, device, attention_for(dtype, device), "default")


def summary(result: dict) -> dict:
    """The part of an autotune result a plan carries: the cache key, the machine and the scores (ms)."""
    choice, p = result["choice"], result.get("probe") or {}
    return {"autotune_key": result.get("key"), "gpu": p.get("gpu"), "cpu": p.get("cpu"),
            "torch_threads": p.get("torch_threads"), "flags": sorted(k for k, v in p.get("flags", {}).items() if v),
            "measured_at": result.get("measured_at"), "busy_before": result.get("busy_before"),
            "busy_cores": result.get("busy_cores"), "tie_band": choice.get("tie_band"),
            "step_tied": choice.get("step_tied"), "not_row_exact": {
                n: e["why"] for n, e in result["table"].get("row_exact", {}).items() if e.get("why")},
            "step_ms": {n: round(v, 3) for n, v in choice.get("step_score_ms", {}).items()},
            "prefill_ms": {n: round(v, 3) for n, v in choice.get("prefill_ms", {}).items()}}

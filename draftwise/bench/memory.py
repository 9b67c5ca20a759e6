"""The estimate behind `draftwise memory` (the command lives in bench/cli.py): will a target (and draft) fit? Weights + both KV caches + runtime overhead vs available.

Owns the estimate. Shapes come from checkpoint metadata only — the converted cache's draftwise_config.json and
safetensors header, or the GGUF's key-values and tensor table — never by loading weights. Terms:
  weights  = under the KernelPlan load_model resolves (kernels/plan.py resolve_plan, given a GGUF's stored types
             as load_model gives them: the target's auto is then the faithful plan, a draft's auto the fastest;
             elsewhere auto's cached choice for these shapes here, measured first if there is none), each linear's
             stored layout (kernels/linear.py `nbytes`: q4x8 4.75 bits per weight, kernels/q4x8.py packed_bytes;
             torch int4 4.5; int8 8 + a scale per row; dense 16 or 32; a SplitLinear both; a faithful plan: the
             kernel of each tensor's stored type by its kernels/blocktypes.py row, its scales in the type's scale
             form — Q4_K q4x8, Q6_K q6k 6.625, Q3_K q3k 3.625, Q2_K q6m 7.25, Q8_0 / Q5_0 q8_0 8.5, Q4_0 / IQ4_NL q4c 4.5,
             IQ4_XS q4c 4.3125, Q4_1 / Q5_1 q5m 6, Q5_K q5x8 5.75 — or fp32 where none holds it or it
             cannot take the shape), the embedding table as load_model keeps it (q4x8 packed for 4-bit plans,
             shared with a tied head; a faithful plan's non-Q4_K table as the file stores it; else dense), norms
             in the activation dtype — the bytes the loaded model holds (tests/test_bench_memory.py checks them
             against the module's tensors);
  KV cache = the paged pool as the engine sizes it (kv_cache.py: pool_blocks from --kv-cache-memory, at most
             `concurrency` slots at full context, in whole blocks of BLOCK_SIZE positions; a draft's pool from
             draft_pool_blocks — the same functions the engine and the draft's builder call), each position
             2 (K and V) × layers × kv_heads × head_dim × bytes of the K/V dtype --kv-cache-dtype resolves to
             (kv_dtype_name): what `concurrency` full-context sequences commit at most (committed as used); a
             prefix cache's entries are blocks of this pool (kv_cache.py `share`), so it adds no row of its own;
  overhead = the interpreter with torch and the tokenizer (measured, RUNTIME_BASE_BYTES) plus prefill
             activations for a full-context prompt (a few hidden-size and MLP-width buffers per token);
  loading  = a GGUF's modules are built one tensor at a time from its blocks (or read back packed), and a
             checkpoint folder's model is built in its dtype (then its kernels) from a dense cache read one tensor at a
             time (models/safetensors.py), so while loading a model costs its final weights (dense: its dtype
             weights) plus its largest tensor in float32; the peak is the max of (load target), (target + load
             draft), (serving).
Available memory: MemAvailable from /proc/meminfo, or free VRAM from torch.cuda.mem_get_info on GPU.
`predict_peak_rss` (`draftwise memory --rss`) predicts one run's peak RSS instead: a runtime baseline measured
once per machine and configuration in a child process that builds the engine with its weights mapped but unread
(`runtime_baseline`, cached in <cache>/memory-baseline.json), plus each model's resident weights
(`resident_weight_bytes`: the prepared file's tensors, an embedding table of its own by the rows a run looks up),
the K/V blocks the run's tokens commit and one prefill chunk's activations (tests/test_memory_rss.py holds it
within 10% of a measured `generate`).
Loads no weights (auto with no cached choice for the shapes times the kernels on random weights first, as a
first load would, and caches the choice for it); the cache sizes come from kv_cache.py, as the engine's do.
Also owns the step bytes, the one definition of the weight bytes a decode step reads (the roofline scripts/compare.py
and scripts/moe_vs_llamacpp.py print: bytes / streaming-read bandwidth): every weight tensor of the layers (linears,
biases, norms, routers) once, a mixture's experts for their top-k share, the output head whole (a tied head: the
embedding table) and one embedding row; the K/V cache left out. `file_step_bytes`: as a GGUF stores them (what
llama.cpp reads); `plan_step_bytes`: as a loaded model holds them (each linear's stored layout, a SplitLinear's step
half, a router's float64 copy where its forward is not fused), from the model it is given.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftwise.config import ConfigError, ModelConfig
from draftwise.config import DEFAULT_KV_CACHE_MEMORY
from draftwise.kv_cache import (BLOCK_SIZE, bytes_per_token, draft_cache_capacity, draft_pool_blocks, pool_blocks,
                                target_cache_capacity)
from draftwise.models.safetensors import header_specs

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RUNTIME_BASE_BYTES = 420 * 2**20  # python + torch + tokenizers + numpy, measured RSS after `import draftwise.api`
HEADROOM = 0.9  # warn when the estimate exceeds 90% of what is available


@dataclass
class Shapes:
    config: ModelConfig
    num_params: int
    num_linear_params: int  # parameters in the decoder layers' linear weights (what int8/int4 quantize)
    largest_tensor: int  # elements of the biggest single tensor (read in float32 while loading)
    source: str
    specs: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (name, shape) of every stored tensor
    gguf: bool = False  # a GGUF source: kernel plans load it through the prepared path (compact embedding)
    types: tuple[tuple[str, str], ...] = ()  # (name, ggml type) of a GGUF's tensors: what a faithful plan keeps


def model_shapes(name: str, cache_dir: str | None = None) -> Shapes:
    """Shapes of a catalog name, .gguf file or HF checkpoint dir, read from metadata only."""
    from draftwise.paths import default_cache_dir
    from draftwise.models import catalog

    cache = Path(cache_dir or default_cache_dir())
    if name in catalog.CATALOG:
        entry = catalog.get_entry(name)
        conv = cache / "converted" / entry.sha256[:16]
        types = _saved_types(conv / "tensor_types.json", entry.sha256)
        if (conv / "draftwise_config.json").is_file() and (conv / "model.safetensors").is_file() and types:
            cfg = ModelConfig.from_dict(json.loads((conv / "draftwise_config.json").read_text())["config"])
            return _from_specs(cfg, header_specs(conv / "model.safetensors"), str(conv), gguf=True, types=types)
        path = catalog.assembled_path(entry, cache)
        if not path.is_file():
            raise ConfigError(f"{name} is not assembled yet in {cache}; run `draftwise generate --model {name}` once")
        return _from_gguf(path)
    path = Path(name).expanduser()
    if path.is_file():
        return _from_gguf(path)
    if path.is_dir():
        from draftwise.models.safetensors import load_config, weight_files

        specs = [s for f in weight_files(path) for s in header_specs(f)]
        return _from_specs(load_config(path), specs, str(path))
    raise ConfigError(f"{name!r} is not a packaged model, a .gguf file or a checkpoint directory")


def _saved_types(path: Path, sha256: str) -> dict[str, str] | None:
    """The {HF name: ggml type} table a converted GGUF keeps beside its copy (models/sources.py tensor_types), if
    it is there and of this file."""
    try:
        saved = json.loads(path.read_text())
        return saved["types"] if saved.get("sha256") == sha256 else None
    except (OSError, ValueError, KeyError):
        return None


def _from_gguf(path: Path) -> Shapes:
    from draftwise.models.gguf import GGUFFile

    g = GGUFFile(path)
    types = {name: item.type for name, item in g.items().items()}
    return _from_specs(g.config, g.tensor_specs(), str(path), gguf=True, types=types)


def _from_specs(cfg: ModelConfig, specs, source: str, gguf: bool = False, types: dict | None = None) -> Shapes:
    total = linear = largest = 0
    for name, shape in specs:
        if cfg.tie_word_embeddings and name.endswith("lm_head.weight"):
            continue  # tied: the decoder shares the embedding's storage (transformer.py)
        numel = 1
        for d in shape:
            numel *= d
        total += numel
        largest = max(largest, numel)
        if ".layers." in name and name.endswith("proj.weight"):
            linear += numel
    return Shapes(cfg, total, linear, largest, source, tuple((name, tuple(shape)) for name, shape in specs), gguf,
                  tuple(sorted((types or {}).items())))


def resolve_plan(s: Shapes, dtype: str, weights: str, device: str = "cpu", tune=None, role: str = "target"):
    """The KernelPlan load_model would build this model with (kernels/plan.py resolve_plan, the same call, given
    a GGUF's stored types on the CPU as load_model gives them): a named plan as given; "auto" the faithful plan for
    a quantized GGUF target, else the autotuner's cached choice for these shapes here (measured now if none is
    cached)."""
    from draftwise.kernels import plan
    from draftwise.models import quant

    stored = quant.type_census(dict(s.types), s.config) if s.types and device == "cpu" else None
    return plan.resolve_plan(weights, dtype, s.config, device, tune=tune, stored_types=stored, role=role)


def _stored_bytes(gguf_type: str, shape) -> int:
    """Bytes of a tensor as the GGUF stores it (its row of kernels/blocktypes.py: values and bytes per block)."""
    from draftwise.kernels.blocktypes import row

    numel = 1
    for dim in shape:
        numel *= dim
    return row(gguf_type).stored_bytes(numel)


def weight_bytes(s: Shapes, plan) -> int:
    """Bytes of the weights a model loaded under `plan` (a KernelPlan) holds: each linear in its implementations'
    layouts (kernels/linear.py nbytes; a tied head built from the embedding's shape; a faithful plan: the kernel
    of the tensor's stored type, models/quant.py kernel_linear), the embedding as load_model keeps it (from a
    GGUF: q4x8 packed for 4-bit plans and a faithful plan's Q4_K table, nothing more when a tied head's q4x8
    buffers serve it; a faithful plan's other tables as the file stores them; else bf16 when large; from a
    checkpoint folder: dense in the activation dtype), every other tensor in the activation dtype."""
    import torch

    from draftwise.kernels.linear import LINEARS
    from draftwise.kernels.plan import EXACT_DENSE, faithful_kernel
    from draftwise.kernels.q4x8 import packed_bytes
    from draftwise.models import quant

    cfg = s.config
    specs, types = dict(s.specs), dict(s.types)
    if plan.faithful and not types:
        raise ConfigError(f"a faithful plan keeps a GGUF's stored types; {s.source} has none")
    embed = f"{quant.EMBED}.weight"
    linears = {path: name for name in specs if (path := quant.linear_path(name))}
    if cfg.tie_word_embeddings:
        linears["lm_head"] = embed
    total, head = 0, []
    for path, name in linears.items():
        N, K = specs[name]
        kind = None  # the GGUF type a kernel is built from, its scale form (kernels/blocktypes.py scale_form)
        if plan.faithful:  # kernel_linear: the stored type's kernel where it takes the shape, else exact fp32
            kernel, kind = faithful_kernel(types[name]), types[name]
            impls = [kernel if LINEARS[kernel].supports(N, K) else EXACT_DENSE]
        else:
            impls = quant.plan_impls(plan, N, K)
        bias = f"{path}.bias" in specs
        total += sum(LINEARS[i].nbytes(N, K, bias, kind) for i in impls)
        if bias and impls == ["q4x8", "fp32"]:  # one float32 bias serves both halves (linear.derived_split; merged:
            total -= 4 * N  # the step's a view of the prefill parts' in the mapped file, linear.cat_rows)
        head = impls if path == "lm_head" else head
    biases = {f"{path}.bias" for path in linears}
    for name, shape in specs.items():
        if name in biases or (quant.linear_path(name) is not None):
            continue
        numel = 1
        for dim in shape:
            numel *= dim
        if name == embed and plan.faithful and types[name] != "Q4_K":  # GGUFRowsEmbedding: the file's rows
            total += _stored_bytes(types[name], shape)
        elif name == embed and s.gguf and quant.compact_embedding(plan, cfg.hidden_size):
            total += 0 if cfg.tie_word_embeddings and "q4x8" in head else packed_bytes(*shape)
        elif name == embed and s.gguf:
            total += numel * torch.tensor([], dtype=quant.embed_storage_dtype(*shape, plan)).element_size()
        else:
            total += numel * BYTES[plan.dtype]
    return total


STEP_PARTS = ("attention", "dense ffn", "experts", "router and norms", "head")


@dataclass
class StepBytes:
    """The weight bytes one decode step reads (module docstring), by part (STEP_PARTS), and the types read."""

    parts: dict[str, float]
    what: str

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def file_step_bytes(path: str | Path) -> StepBytes:
    """The step bytes of a GGUF as it stores them: each tensor's stored bytes, the stacked experts' (`_exps`) for
    top-k / experts of them, token_embd.weight for one row (and whole as the head when there is no
    output.weight: a tied head)."""
    from collections import Counter

    from draftwise.models.gguf import GGUFFile

    g = GGUFFile(path)
    experts, used = g.arch_field("expert_count", 1) or 1, g.arch_field("expert_used_count", 1) or 1
    tensors = g.reader.tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    parts, kinds, head = dict.fromkeys(STEP_PARTS, 0.0), Counter(), None
    for t in tensors:
        n = float(t.n_bytes)
        if t.name == "token_embd.weight":
            parts["head"] += n / int(t.shape[-1])  # the one row a step looks up (ggml order: rows last)
            if tied:
                parts["head"] += n
                head = t
            continue
        if t.name == "output.weight":
            part, head = "head", t
        elif "_exps" in t.name:
            n, part = n * used / experts, "experts"
        elif ".attn_" in t.name and "norm" not in t.name:
            part = "attention"
        elif ".ffn_" in t.name and "norm" not in t.name and "gate_inp" not in t.name and "shexp" not in t.name:
            part = "dense ffn"  # a dense file's feed-forward (an MoE file's shared expert stays with the router)
        else:
            part = "router and norms"
        parts[part] += n
        if t.name.startswith("blk.") and len(t.shape) >= 2:
            kinds[t.tensor_type.name] += 1
    what = (f"{sum(kinds.values())} layer weights as stored ({', '.join(f'{k} x{v}' for k, v in kinds.most_common())})"
            f" + head {head.name} {head.tensor_type.name} [{', '.join(str(int(d)) for d in head.shape)}]")
    return StepBytes(parts, what)


def plan_step_bytes(model) -> float:
    """The step bytes of a loaded Decoder (models/transformer.py) as it holds them: a kernel linear's stored layout
    (LinearImpl.weight_bytes) and bias, a SplitLinear's step half (the one a decode step runs), a plain torch
    Linear's weight and bias, a Router's weight (fused: the float32 weight; else its float64 copy: what its
    forward reads for a step's rows), each SparseMoE's experts for top-k
    / experts, the embedding (nn.Embedding or a prepared table) for one row, every other module's own
    parameters and buffers (norms)."""
    import torch

    from draftwise.kernels.linear import LinearImpl, SplitLinear
    from draftwise.models.transformer import Router, SparseMoE

    embed = model.model.embed_tokens

    def own(m) -> int:
        return sum(t.nbytes for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)] if t is not None)

    def walk(m) -> float:
        if m is embed:
            return sum(t.nbytes for t in {id(t): t for t in [*m.parameters(), *m.buffers()]}.values()) / (
                model.config.vocab_size)
        if isinstance(m, LinearImpl):
            bias = getattr(m, "bias", None)
            return m.weight_bytes + (bias.nbytes if isinstance(bias, torch.Tensor) else 0)
        if isinstance(m, SplitLinear):
            return walk(m.step)
        if isinstance(m, Router):  # fused: a step's few rows read the float32 weight; else its float64 copy
            return m.weight.nbytes if m.fused else 2 * m.weight.nbytes
        if isinstance(m, SparseMoE):
            rest = sum(walk(c) for name, c in m.named_children() if name != "experts")
            return rest + sum(walk(e) for e in m.experts) * m.top_k / m.num_experts
        return own(m) + sum(walk(c) for c in m.children())

    return walk(model)


def loading_bytes(s: Shapes, plan) -> int:
    """A model's own peak while it loads: its final weights plus its largest tensor in float32 (a GGUF: modules
    built one tensor at a time); a dense build first holds every weight in the activation dtype."""
    if s.gguf and "int8_dynamic" not in (plan.step, plan.prefill):
        return weight_bytes(s, plan) + s.largest_tensor * BYTES["float32"]
    return s.num_params * BYTES[plan.dtype] + s.largest_tensor * BYTES["float32"]


def kv_blocks(cfg: ModelConfig, dtype: str, tokens_per_slot: int, slots: int,
              kv_cache_memory: int | float = DEFAULT_KV_CACHE_MEMORY) -> int:
    """Blocks of the pool the engine gives a target of this config (kv_cache.pool_blocks)."""
    per_token = bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BYTES[dtype])
    return pool_blocks(kv_cache_memory, per_token, slots, tokens_per_slot)


def kv_bytes(cfg: ModelConfig, dtype: str, tokens_per_slot: int, slots: int,
             kv_cache_memory: int | float = DEFAULT_KV_CACHE_MEMORY, blocks: int | None = None) -> int:
    """The K/V pool a model of this config gets: `blocks` (default: kv_blocks) of BLOCK_SIZE positions."""
    if blocks is None:
        blocks = kv_blocks(cfg, dtype, tokens_per_slot, slots, kv_cache_memory)
    return blocks * BLOCK_SIZE * bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BYTES[dtype])


def activation_bytes(cfg: ModelConfig, context: int) -> int:
    """Prefill of a full-context prompt: residual, q/k/v, attention output and two MLP-width buffers (fp32)."""
    per_token = 4 * (4 * cfg.hidden_size + 2 * cfg.num_kv_heads * cfg.head_dim + 3 * cfg.intermediate_size)
    return per_token * context


def kv_dtype_name(plan, kv_cache_dtype: str = "auto", device: str = "cpu") -> str:
    """The K/V dtype a model loaded under `plan` gets (kv_cache.kv_dtype, as LLM resolves it: auto is bfloat16
    where our C++ glue and attention run, float32 activations on the CPU)."""
    import torch

    from draftwise.kernels import glue
    from draftwise.kv_cache import kv_dtype

    act = getattr(torch, plan.dtype)
    fused = device == "cpu" and act == torch.float32 and glue.available()
    return str(kv_dtype(kv_cache_dtype, act, fused)).removeprefix("torch.")


def estimate(target: str, draft: str | None, max_model_len: int, concurrency: int, dtype: str = "auto",
             weights: str = "auto", draft_dtype: str | None = None, k: int = 8, cache_dir: str | None = None,
             device: str = "cpu", tune=None, kv_cache_memory: int | float = DEFAULT_KV_CACHE_MEMORY,
             kv_cache_dtype: str = "auto", draft_weights: str | None = None) -> dict:
    """Steady-state rows, and the peak over the three phases of LLM(...): load target, load draft, serve.

    Each model in the formats load_model resolves for it (`resolve_plan`; the draft as LLM loads it: in the draft
    role, `draft_weights` or auto — the fastest plan —, in `draft_dtype` or the target's dtype); `tune`
    injects the autotuner's result (tests). While a model loads it costs loading_bytes."""
    t = model_shapes(target, cache_dir)
    tp = resolve_plan(t, dtype, weights, device, tune)
    tkv = kv_dtype_name(tp, kv_cache_dtype, device)
    rows = {"target_weights": weight_bytes(t, tp),
            "target_kv_cache": kv_bytes(t.config, tkv, target_cache_capacity(max_model_len, k), concurrency,
                                        kv_cache_memory)}
    target_blocks = kv_blocks(t.config, tkv, target_cache_capacity(max_model_len, k), concurrency, kv_cache_memory)
    plans = {"target": _plan_dict(tp)}
    loading = {"target": RUNTIME_BASE_BYTES + loading_bytes(t, tp)}
    if draft:
        d = model_shapes(draft, cache_dir)
        dp = resolve_plan(d, draft_dtype or dtype, draft_weights or "auto", device, tune, role="draft")
        plans["draft"] = _plan_dict(dp)
        rows["draft_weights"] = weight_bytes(d, dp)
        draft_capacity = draft_cache_capacity(max_model_len, k)
        rows["draft_kv_cache"] = kv_bytes(d.config, kv_dtype_name(dp, kv_cache_dtype, device), draft_capacity, concurrency,
                                          blocks=draft_pool_blocks(target_blocks, concurrency, draft_capacity))
        loading["draft"] = RUNTIME_BASE_BYTES + rows["target_weights"] + loading_bytes(d, dp)
    rows["runtime_overhead"] = RUNTIME_BASE_BYTES + activation_bytes(t.config, max_model_len)
    serving = sum(rows.values())
    total = max(serving, *loading.values())
    avail, kind = available_memory()
    return {"target": target, "draft": draft, "max_model_len": max_model_len, "concurrency": concurrency,
            "dtype": dtype, "weights": weights, "plans": plans, "num_speculative_tokens": k, "bytes": rows,
            "serving_bytes": serving, "loading_peak_bytes": loading, "total_bytes": total,
            "available_bytes": avail, "available_kind": kind,
            "fits": avail is None or total <= HEADROOM * avail,
            "sources": {"target": t.source, **({"draft": d.source} if draft else {})}}


def _plan_dict(plan) -> dict:
    return {"weights": plan.label, "dtype": plan.dtype, "step": plan.step, "prefill": plan.prefill}


def available_memory(device: str = "cpu") -> tuple[int | None, str]:
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free), "free VRAM (torch.cuda.mem_get_info)"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable (/proc/meminfo)"
    except OSError:
        pass
    return None, "unknown"


def format_estimate(e: dict) -> str:
    gb = lambda x: f"{x / 2**30:7.2f} GiB"  # noqa: E731
    lines = [f"{what + ' plan':18s} weights {p['weights']}" + (f" (step {p['step']}, prefill {p['prefill']})"
             if p.get("step") else "") + f", {p['dtype']} activations" for what, p in e.get("plans", {}).items()]
    lines += [f"{k.replace('_', ' '):18s} {gb(v)}" for k, v in e["bytes"].items()]
    lines.append(f"{'serving':18s} {gb(e['serving_bytes'])}  (steady state, full-context prefill)")
    for what, v in e["loading_peak_bytes"].items():
        lines.append(f"{'loading ' + what:18s} {gb(v)}  (its weights + largest tensor in float32 during the load)")
    lines.append(f"{'peak':18s} {gb(e['total_bytes'])}")
    if e["available_bytes"] is not None:
        lines.append(f"{'available':18s} {gb(e['available_bytes'])}  ({e['available_kind']})")
    lines.append("fits" if e["fits"] else "WARNING: likely out of memory — lower --max-model-len or --concurrency, "
                 "use --dtype bfloat16 or --weights int8/int4")
    return "\n".join(lines)


# ---- peak RSS of one run (`draftwise memory --rss`): a measured runtime, predicted weights, K/V, activations ------

BASELINE_FILE = "memory-baseline.json"  # in the cache dir: runtime baselines measured here, by machine and config
ROW_FAULT_BYTES = 64 * 2**10  # a looked-up embedding row maps this much of a mapped file (the kernel's fault-around)

_BASELINE_CHILD = r"""
import json, re, sys
args = json.loads(sys.argv[1])
from draftwise.api import LLM
from draftwise.models.safetensors import mapped_file
llm = LLM(args["target"], speculative_config=args["spec"], max_num_seqs=args["concurrency"],
          kv_cache_dtype=args["kv_cache_dtype"], cache_dir=args["cache_dir"])
models = [llm.model] + ([llm.proposer.model] if getattr(llm.proposer, "model", None) is not None else [])
mapped = all(mapped_file(b) is not None for m in models for b in m.buffers() if b.numel() * b.element_size() > 2**20)
status = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS")}
weights, cur = 0, None
for line in open("/proc/self/smaps"):
    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
        cur = line.split()[-1] if len(line.split()) >= 6 else ""
    elif line.startswith("Rss:") and "prepared-" in (cur or ""):
        weights += int(line.split()[1]) * 1024
print(json.dumps({"rss": status["VmRSS"], "mapped_weights_resident": weights, "weights_mapped": mapped}))
"""


def _machine_key(parts: dict) -> str:
    import hashlib
    import platform
    import sys

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    what = {**parts, "cpu": cpu, "torch": torch.__version__, "python": sys.version.split()[0]}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def runtime_baseline(target: str, spec: dict | None = None, concurrency: int = 1, kv_cache_dtype: str = "auto",
                     cache_dir: str | None = None, refresh: bool = False) -> dict:
    """Measured, not guessed: the RSS of a fresh process that has imported the runtime (python, torch, our C++
    libraries), loaded the tokenizer(s) and built the engine (`LLM(target, spec)`) with its weights mapped but not
    yet read — everything but what a run then reads and writes. Measured once in a child process per machine (CPU
    model, torch and python versions) and configuration, cached in <cache>/memory-baseline.json. Returns
    {"bytes", "measured", "key"}. A load that had to prepare the weights first (built in memory) is measured again."""
    import datetime
    import os
    import subprocess
    import sys

    from draftwise.paths import default_cache_dir

    cache = Path(cache_dir or default_cache_dir())
    args = {"target": target, "spec": spec, "concurrency": concurrency, "kv_cache_dtype": kv_cache_dtype,
            "cache_dir": str(cache)}
    key = _machine_key({k: v for k, v in args.items() if k != "cache_dir"} | {"version": 1})
    store = cache / BASELINE_FILE
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known and not refresh:
        return known[key]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _BASELINE_CHILD, json.dumps(args)], capture_output=True,
                             text=True, env=env)
        if out.returncode != 0:
            raise ConfigError(f"measuring the runtime baseline failed: {out.stderr.strip()[-800:]}")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        if got["weights_mapped"]:
            break
    row = {"bytes": got["rss"] - got["mapped_weights_resident"], "key": key,
           "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "config": {k: v for k, v in args.items() if k != "cache_dir"}}
    known[key] = row
    cache.mkdir(parents=True, exist_ok=True)
    tmp = store.with_name(f"{store.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(store)
    return row


def resident_weight_bytes(name: str, weights: str = "auto", dtype: str = "auto", tokens: int = 0,
                          cache_dir: str | None = None, tune=None, role: str = "target") -> tuple[int, dict]:
    """Bytes of a model's weights a decoding process holds resident, and where the number comes from. A converted
    GGUF with its prepared file: that file's tensors (mapped, and every step reads them), less
    an embedding table of its own (a GGUFRowsEmbedding's raw rows, a Q4x8Embedding not shared with a head): a
    looked-up row is read alone, mapping about ROW_FAULT_BYTES around it in each of the table's arrays, so `tokens`
    distinct tokens at most; otherwise weight_bytes of the plan load_model resolves (built in memory). The plan is resolved as
    load_model resolves it (the GGUF's stored types: `auto` is the faithful plan; in `role` "draft" the fastest)."""
    from draftwise.kernels import plan as kplan
    from draftwise.models import quant
    from draftwise.models import safetensors as st
    from draftwise.models.sources import load_checkpoint, prepared_path

    ckpt = load_checkpoint(name, cache_dir=cache_dir, progress=False)
    cfg = ckpt.config
    types = ckpt.tensor_types() if "converted_path" in ckpt.info else None
    stored = quant.type_census(types, cfg) if types else None
    plan = kplan.resolve_plan(weights, dtype, cfg, "cpu", tune=tune, stored_types=stored, role=role)
    info = {"plan": plan.label, "dtype": plan.dtype}
    if types:
        path = prepared_path(ckpt, plan, quant.embed_storage_dtype(cfg.vocab_size, cfg.hidden_size, plan))
        if st.is_complete(path):
            with open(path, "rb") as f:
                entries, _ = st._read_header(f)
            total = table = arrays = 0
            for key, entry in entries:
                size = entry["data_offsets"][1] - entry["data_offsets"][0]
                if key.startswith(f"{quant.EMBED}."):  # a table of its own (not a head's): read row by row
                    table, arrays = table + size, arrays + 1
                else:
                    total += size
            rows = min(table, tokens * arrays * ROW_FAULT_BYTES)
            return total + rows, {**info, "source": str(path), "table_bytes": table, "rows_resident": rows}
    return weight_bytes(model_shapes(name, cache_dir), plan), {**info, "source": "weight_bytes (not prepared yet)"}


def predict_peak_rss(target: str, draft: str | None = None, prompt_tokens: int = 512, max_tokens: int = 64,
                     concurrency: int = 1, k: int = 4, kv_cache_dtype: str = "auto", cache_dir: str | None = None,
                     tune=None, refresh: bool = False) -> dict:
    """Peak RSS of serving `concurrency` requests of `prompt_tokens` + `max_tokens` tokens with the defaults of
    `generate` (weights auto, a draft model at k when `draft`): the measured runtime baseline + each model's
    resident weights + the K/V blocks those tokens commit (the target's and a draft's pool, kv_cache.py's
    block arithmetic, in the dtype --kv-cache-dtype resolves to) + one prefill chunk's activations per model."""
    import torch

    from draftwise.api import PREFILL_CHUNK_TOKENS
    from draftwise.kernels import glue
    from draftwise.kv_cache import MAX_BATCHED_CATCH_UP, blocks_for, kv_dtype

    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k} if draft else None
    base = runtime_baseline(target, spec, concurrency, kv_cache_dtype, cache_dir, refresh)
    rows = {"runtime (measured)": base["bytes"]}
    sources = {}
    tokens = prompt_tokens + max_tokens
    for role, name in (("target", target), ("draft", draft)):
        if name is None:
            continue
        resident, info = resident_weight_bytes(name, tokens=tokens, cache_dir=cache_dir, tune=tune, role=role)
        cfg = model_shapes(name, cache_dir).config
        act = getattr(torch, info["dtype"])
        kv = kv_dtype(kv_cache_dtype, act, act == torch.float32 and glue.available())
        lead = k + 1 + (MAX_BATCHED_CATCH_UP + 1 if role == "draft" else 0)
        blocks = concurrency * blocks_for(tokens + lead)
        rows[f"{role} weights"] = resident
        rows[f"{role} K/V"] = blocks * BLOCK_SIZE * bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                                    kv.itemsize)
        rows[f"{role} activations"] = activation_bytes(cfg, min(prompt_tokens, PREFILL_CHUNK_TOKENS))
        sources[role] = {**info, "kv_cache_dtype": str(kv).removeprefix("torch."), "kv_blocks": blocks}
    return {"target": target, "draft": draft, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "concurrency": concurrency, "bytes": rows, "peak_rss_bytes": sum(rows.values()),
            "baseline": base, "models": sources}


def format_rss(p: dict) -> str:
    mb = lambda x: f"{x / 1e9:7.3f} GB"  # noqa: E731
    lines = [f"{k:22s} {mb(v)}" for k, v in p["bytes"].items()]
    lines.append(f"{'peak RSS (predicted)':22s} {mb(p['peak_rss_bytes'])}  ({p['concurrency']} x {p['prompt_tokens']}"
                 f" prompt + {p['max_tokens']} output tokens; runtime measured {p['baseline']['measured']})")
    return "\n".join(lines)

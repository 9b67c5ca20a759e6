"""The estimate behind `draftwise memory` (the command lives in bench/cli.py): will a target (and draft) fit? Weights + both KV caches + runtime overhead vs available.

Owns the estimate. Shapes come from checkpoint metadata only — the converted cache's draftwise_config.json and
safetensors header, or the GGUF's key-values and tensor table — never by loading weights. Terms:
  weights  = under the KernelPlan load_model resolves (kernels/plan.py resolve_plan — auto's cached choice for
             these shapes here, measured first if there is none), each linear's stored layout (kernels/linear.py
             `nbytes`: q4x8 4.75 bits per weight, kernels/q4x8.py packed_bytes; torch int4 4.5; int8 8 + a
             scale per row; dense 16 or 32; a SplitLinear both), the embedding table as load_model keeps it (q4x8
             packed for 4-bit plans, shared with a tied head; else dense), norms in the activation dtype — the
             bytes the loaded model holds (tests/test_bench_memory.py checks them against the module's tensors);
  KV cache = the paged pool as the engine sizes it (kv_cache.py: pool_blocks from --kv-cache-memory, at most
             `concurrency` slots at full context, in whole blocks of BLOCK_SIZE positions; a draft's pool from
             draft_pool_blocks — the same functions the engine and the draft's builder call), each position
             2 (K and V) × layers × kv_heads × head_dim × bytes: what `concurrency` full-context sequences commit
             at most (blocks are committed as they are used);
  prefix cache = its byte budget (prefix_cache.py) per model, where it is on by default (a row-exact plan);
  overhead = the interpreter with torch and the tokenizer (measured, RUNTIME_BASE_BYTES) plus prefill
             activations for a full-context prompt (a few hidden-size and MLP-width buffers per token);
  loading  = a GGUF's modules are built one tensor at a time from its blocks (or read back packed), and a
             checkpoint folder's model is built in its dtype (then its kernels) from a dense cache read one tensor at a
             time (models/safetensors.py), so while loading a model costs its final weights (dense: its dtype
             weights) plus its largest tensor in float32; the peak is the max of (load target), (target + load
             draft), (serving).
Available memory: MemAvailable from /proc/meminfo, or free VRAM from torch.cuda.mem_get_info on GPU.
Loads no weights (auto with no cached choice for the shapes times the kernels on random weights first, as a
first load would, and caches the choice for it); the cache sizes come from kv_cache.py, as the engine's do.
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
from draftwise.prefix_cache import DEFAULT_BYTES as PREFIX_CACHE_BYTES

BYTES = {"float32": 4, "bfloat16": 2}
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


def model_shapes(name: str, cache_dir: str | None = None) -> Shapes:
    """Shapes of a catalog name, .gguf file or HF checkpoint dir, read from metadata only."""
    from draftwise.paths import default_cache_dir
    from draftwise.models import catalog

    cache = Path(cache_dir or default_cache_dir())
    if name in catalog.CATALOG:
        entry = catalog.get_entry(name)
        conv = cache / "converted" / entry.sha256[:16]
        if (conv / "draftwise_config.json").is_file() and (conv / "model.safetensors").is_file():
            cfg = ModelConfig.from_dict(json.loads((conv / "draftwise_config.json").read_text())["config"])
            return _from_specs(cfg, header_specs(conv / "model.safetensors"), str(conv), gguf=True)
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


def _from_gguf(path: Path) -> Shapes:
    from draftwise.models.gguf import GGUFFile

    g = GGUFFile(path)
    return _from_specs(g.config, g.tensor_specs(), str(path), gguf=True)


def _from_specs(cfg: ModelConfig, specs, source: str, gguf: bool = False) -> Shapes:
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
    return Shapes(cfg, total, linear, largest, source, tuple((name, tuple(shape)) for name, shape in specs), gguf)


def resolve_plan(s: Shapes, dtype: str, weights: str, device: str = "cpu", tune=None):
    """The KernelPlan load_model would build this model with (kernels/plan.py resolve_plan, the same call): a named
    plan as given, "auto" the autotuner's cached choice for these shapes here (measured now if none is cached)."""
    from draftwise.kernels import plan

    return plan.resolve_plan(weights, dtype, s.config, device, tune=tune)


def weight_bytes(s: Shapes, plan) -> int:
    """Bytes of the weights a model loaded under `plan` (a KernelPlan) holds: each linear in its implementations'
    layouts (kernels/linear.py nbytes; a tied head built from the embedding's shape), the embedding as load_model
    keeps it (from a GGUF: q4x8 packed for 4-bit plans, nothing more when a tied head's q4x8 buffers serve it,
    else bf16 when large; from a checkpoint folder: dense in the activation dtype), every other tensor in the
    activation dtype."""
    import torch

    from draftwise.kernels.linear import LINEARS
    from draftwise.kernels.q4x8 import packed_bytes
    from draftwise.models import quant

    cfg = s.config
    specs = dict(s.specs)
    embed = f"{quant.EMBED}.weight"
    linears = {path: name for name in specs if (path := quant.linear_path(name))}
    if cfg.tie_word_embeddings:
        linears["lm_head"] = embed
    total, head = 0, []
    for path, name in linears.items():
        N, K = specs[name]
        impls = quant.plan_impls(plan, N, K)
        total += sum(LINEARS[i].nbytes(N, K, f"{path}.bias" in specs) for i in impls)
        head = impls if path == "lm_head" else head
    biases = {f"{path}.bias" for path in linears}
    for name, shape in specs.items():
        if name in biases or (quant.linear_path(name) is not None):
            continue
        numel = 1
        for dim in shape:
            numel *= dim
        if name == embed and s.gguf and quant.compact_embedding(plan, cfg.hidden_size):
            total += 0 if cfg.tie_word_embeddings and "q4x8" in head else packed_bytes(*shape)
        elif name == embed and s.gguf:
            total += numel * torch.tensor([], dtype=quant.embed_storage_dtype(*shape, plan)).element_size()
        else:
            total += numel * BYTES[plan.dtype]
    return total


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


def estimate(target: str, draft: str | None, max_model_len: int, concurrency: int, dtype: str = "auto",
             weights: str = "auto", draft_dtype: str | None = None, k: int = 8, cache_dir: str | None = None,
             device: str = "cpu", tune=None, kv_cache_memory: int | float = DEFAULT_KV_CACHE_MEMORY) -> dict:
    """Steady-state rows, and the peak over the three phases of LLM(...): load target, load draft, serve.

    Each model in the formats load_model resolves for it (`resolve_plan`; the draft as LLM loads it: its own
    the target's weights, in `draft_dtype` or the target's dtype); `tune`
    injects the autotuner's result (tests). While a model loads it costs loading_bytes."""
    t = model_shapes(target, cache_dir)
    tp = resolve_plan(t, dtype, weights, device, tune)
    rows = {"target_weights": weight_bytes(t, tp),
            "target_kv_cache": kv_bytes(t.config, tp.dtype, target_cache_capacity(max_model_len, k), concurrency,
                                        kv_cache_memory)}
    target_blocks = kv_blocks(t.config, tp.dtype, target_cache_capacity(max_model_len, k), concurrency, kv_cache_memory)
    plans = {"target": _plan_dict(tp)}
    loading = {"target": RUNTIME_BASE_BYTES + loading_bytes(t, tp)}
    if draft:
        d = model_shapes(draft, cache_dir)
        dp = resolve_plan(d, draft_dtype or dtype, weights, device, tune)
        plans["draft"] = _plan_dict(dp)
        rows["draft_weights"] = weight_bytes(d, dp)
        draft_capacity = draft_cache_capacity(max_model_len, k)
        rows["draft_kv_cache"] = kv_bytes(d.config, dp.dtype, draft_capacity, concurrency,
                                          blocks=draft_pool_blocks(target_blocks, concurrency, draft_capacity))
        if dp.row_exact:
            rows["draft_prefix_cache"] = PREFIX_CACHE_BYTES
        loading["draft"] = RUNTIME_BASE_BYTES + rows["target_weights"] + loading_bytes(d, dp)
    if tp.row_exact:  # on by default there: at most its budget
        rows["prefix_cache"] = PREFIX_CACHE_BYTES
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

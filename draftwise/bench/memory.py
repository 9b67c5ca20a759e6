"""The estimate behind `draftwise memory` (the command lives in bench/cli.py): will a target (and draft) fit? Weights + both KV caches + runtime overhead vs available.

Owns the estimate. Shapes come from checkpoint metadata only — the converted cache's draftwise_config.json and
safetensors header, or the GGUF's key-values and tensor table — never by loading weights. Terms:
  weights  = parameters × bytes per element of the weight format (int8: 1 B + a scale per output row;
             int4: 0.5 B + 2 scales per group of 32 — models/quant.py's layouts);
  KV cache = 2 (K and V) × layers × kv_heads × head_dim × bytes × tokens per slot × slots, where the engine
             preallocates every slot at full length (engine.target_cache_capacity and
             spec_decode/draft_model.draft_cache_capacity: the same functions the engine and the draft call) —
             so concurrency is the number of slots (--max-num-seqs), used or not;
  overhead = the interpreter with torch and the tokenizer (measured, RUNTIME_BASE_BYTES) plus prefill
             activations for a full-context prompt (a few hidden-size and MLP-width buffers per token);
  loading  = a model is first built in its dtype (then quantized, if asked), reading the converted float32
             cache one tensor at a time (models/safetensors.py), so while loading it costs its dtype weights
             plus its largest float32 tensor; the peak is the max of (load target), (target + load draft),
             (serving).
Available memory: MemAvailable from /proc/meminfo, or free VRAM from torch.cuda.mem_get_info on GPU.
Loads no weights; the cache sizes come from the engine's own capacity functions.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftwise.config import ConfigError, ModelConfig
from draftwise.engine import target_cache_capacity
from draftwise.models.safetensors import header_specs
from draftwise.spec_decode.draft_model import draft_cache_capacity

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


def model_shapes(name: str, cache_dir: str | None = None) -> Shapes:
    """Shapes of a catalog name, .gguf file or HF checkpoint dir, read from metadata only."""
    from draftwise.config import default_cache_dir
    from draftwise.models import catalog

    cache = Path(cache_dir or default_cache_dir())
    if name in catalog.CATALOG:
        entry = catalog.get_entry(name)
        conv = cache / "converted" / entry.sha256[:16]
        if (conv / "draftwise_config.json").is_file() and (conv / "model.safetensors").is_file():
            cfg = ModelConfig.from_dict(json.loads((conv / "draftwise_config.json").read_text())["config"])
            return _from_specs(cfg, header_specs(conv / "model.safetensors"), str(conv))
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
    return _from_specs(g.config, g.tensor_specs(), str(path))


def _from_specs(cfg: ModelConfig, specs, source: str) -> Shapes:
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
    return Shapes(cfg, total, linear, largest, source)


def weight_bytes(s: Shapes, dtype: str, weights: str | None) -> int:
    b = BYTES[dtype]
    if weights == "int8":
        return (s.num_params - s.num_linear_params) * b + s.num_linear_params * 1 + s.num_linear_params // 1000 * 4
    if weights == "int4+dense":
        return s.num_params * b + s.num_linear_params // 2 + s.num_linear_params // 32 * 2 * 2
    if weights == "int4":
        return (s.num_params - s.num_linear_params) * b + s.num_linear_params // 2 + s.num_linear_params // 32 * 2 * 2
    return s.num_params * b


def kv_bytes(cfg: ModelConfig, dtype: str, tokens_per_slot: int, slots: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * BYTES[dtype] * tokens_per_slot * slots


def activation_bytes(cfg: ModelConfig, context: int) -> int:
    """Prefill of a full-context prompt: residual, q/k/v, attention output and two MLP-width buffers (fp32)."""
    per_token = 4 * (4 * cfg.hidden_size + 2 * cfg.num_kv_heads * cfg.head_dim + 3 * cfg.intermediate_size)
    return per_token * context


def estimate(target: str, draft: str | None, max_model_len: int, concurrency: int, dtype: str = "float32",
             weights: str | None = None, draft_dtype: str | None = None, k: int = 8, cache_dir: str | None = None) -> dict:
    """Steady-state rows, and the peak over the three phases of LLM(...): load target, load draft, serve.

    Loading builds a model in its dtype from the float32 cache read one tensor at a time, so for a while a
    model costs its unquantized dtype weights plus its largest float32 tensor."""
    t = model_shapes(target, cache_dir)
    rows = {"target_weights": weight_bytes(t, dtype, weights),
            "target_kv_cache": kv_bytes(t.config, dtype, target_cache_capacity(max_model_len, k), concurrency)}
    loading = {"target": RUNTIME_BASE_BYTES + t.num_params * BYTES[dtype] + t.largest_tensor * BYTES["float32"]}
    if draft:
        d = model_shapes(draft, cache_dir)
        dd = draft_dtype or dtype
        rows["draft_weights"] = weight_bytes(d, dd, None)
        rows["draft_kv_cache"] = kv_bytes(d.config, dd, draft_cache_capacity(max_model_len, k), concurrency)
        loading["draft"] = (RUNTIME_BASE_BYTES + rows["target_weights"] + d.num_params * BYTES[dd]
                            + d.largest_tensor * BYTES["float32"])
    rows["runtime_overhead"] = RUNTIME_BASE_BYTES + activation_bytes(t.config, max_model_len)
    serving = sum(rows.values())
    total = max(serving, *loading.values())
    avail, kind = available_memory()
    return {"target": target, "draft": draft, "max_model_len": max_model_len, "concurrency": concurrency,
            "dtype": dtype, "weights": weights, "num_speculative_tokens": k, "bytes": rows,
            "serving_bytes": serving, "loading_peak_bytes": loading, "total_bytes": total,
            "available_bytes": avail, "available_kind": kind,
            "fits": avail is None or total <= HEADROOM * avail,
            "sources": {"target": t.source, **({"draft": d.source} if draft else {})}}


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
    lines = [f"{k.replace('_', ' '):18s} {gb(v)}" for k, v in e["bytes"].items()]
    lines.append(f"{'serving':18s} {gb(e['serving_bytes'])}  (steady state, full-context prefill)")
    for what, v in e["loading_peak_bytes"].items():
        lines.append(f"{'loading ' + what:18s} {gb(v)}  (dtype weights + largest float32 tensor during the load)")
    lines.append(f"{'peak':18s} {gb(e['total_bytes'])}")
    if e["available_bytes"] is not None:
        lines.append(f"{'available':18s} {gb(e['available_bytes'])}  ({e['available_kind']})")
    lines.append("fits" if e["fits"] else "WARNING: likely out of memory — lower --max-model-len or --concurrency, "
                 "use --dtype bfloat16 or --weights int8/int4")
    return "\n".join(lines)

"""HF checkpoint directories (config.json + *.safetensors) → the checkpoint contract; safetensors writing.

This module owns mapping a transformers config.json onto ModelConfig (model_type → architecture; mixture-of-experts
fields, mixtral's expert names onto the qwen MoE names the decoder uses, transformers 5's fused in-memory expert
tensors split per expert), reading
possibly-sharded safetensors weights under HF names (`iter_tensors`: read into fresh memory; `map_tensors`: views
of a private file mapping, for files whose bytes are used as they are), and writing a safetensors file tensor by
tensor (the converted-GGUF cache is written this way, so a 6 GB float32 conversion never sits in memory at once),
or, where names and shapes are known only as tensors arrive, through a spill file (Spill: a prepared file's modules).

It does not know GGUF, tokenizers or the hub; it yields tensors in their stored dtype and the decoder casts.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator

import torch

from draftwise.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig

_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
}
# Prefixes of multimodal gemma3 checkpoints: text weights are renamed, the rest is skipped.
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
_SKIP_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _rope(cfg: dict, layer_type: str | None = None) -> tuple[float | None, dict | None]:
    """(rope_theta, rope_scaling) from transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)."""
    params = cfg.get("rope_parameters") or {}
    if layer_type and layer_type in params:
        params = params[layer_type]
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        scaling.setdefault("rope_type", scaling.pop("type", "linear"))
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling


def _eos_ids(cfg: dict, generation: dict) -> tuple[int, ...]:
    ids = []
    for source in (cfg.get("eos_token_id"), generation.get("eos_token_id")):
        ids.extend(source if isinstance(source, list) else [] if source is None else [source])
    return tuple(dict.fromkeys(int(i) for i in ids))


def config_from_hf(cfg: dict, generation: dict | None = None) -> ModelConfig:
    """ModelConfig from a transformers config.json dict (and optional generation_config.json)."""
    model_type = cfg.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r} in config.json; supported: {', '.join(_MODEL_TYPES)}"
            f" (architectures {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    top = cfg
    if model_type == "gemma3" and "text_config" in cfg:
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    arch = _MODEL_TYPES[model_type]
    hidden, num_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    theta, scaling = _rope(cfg, "full_attention" if arch == "gemma3" else None)
    out = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or hidden // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta or 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        # Qwen2's attention always has q/k/v bias; its config.json has no key for it (Qwen2-MoE's: qkv_bias).
        attention_bias=True if arch == "qwen2" else bool(cfg.get("qkv_bias", True)) if arch == "qwen2_moe"
        else bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe"),
        qk_norm_full=arch == "olmoe",
        hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
        tie_word_embeddings=bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", arch == "gemma3"))),
        bos_token_id=cfg.get("bos_token_id", top.get("bos_token_id")),
        eos_token_ids=_eos_ids({**top, **cfg}, generation or {}),
    )
    use_window = cfg.get("use_sliding_window", arch in ("mistral", "gemma3", "mixtral"))
    if use_window and cfg.get("sliding_window"):
        out["sliding_window"] = cfg["sliding_window"]
    if arch == "gemma3":
        out.update(_gemma3_fields(cfg, hidden, out["num_layers"]))
    if arch in ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe"):
        out.update(_moe_fields(cfg, arch))
    if cfg.get("clip_qkv") is not None:
        raise ConfigError(f"clip_qkv {cfg['clip_qkv']} is not supported (q/k/v clamped after projection)")
    return ModelConfig(**out)


def _moe_fields(cfg: dict, arch: str) -> dict:
    """ModelConfig's expert fields from a qwen2_moe / qwen3_moe / mixtral config.json (transformers' keys; mixtral
    names its experts' width intermediate_size and always renormalises the top-k weights)."""
    mixtral, olmoe = arch == "mixtral", arch == "olmoe"
    return dict(
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts"),
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["intermediate_size"] if mixtral or olmoe else cfg["moe_intermediate_size"],
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0 if arch == "qwen2_moe" else 0,
        norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=1 if mixtral or olmoe else cfg.get("decoder_sparse_step") or 1,
        mlp_only_layers=() if mixtral or olmoe else tuple(cfg.get("mlp_only_layers") or ()),
    )


def _gemma3_fields(cfg: dict, hidden: int, num_layers: int) -> dict:
    pattern = cfg.get("sliding_window_pattern", 6)
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
    ]
    local_theta, _ = _rope(cfg, "sliding_attention")
    return dict(
        sandwich_norm=True,
        norm_weight_offset=1.0,
        embed_scale=math.sqrt(hidden),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        rope_local_theta=float(cfg.get("rope_local_base_freq") or local_theta or 10000.0),
        layer_types=tuple(layer_types),
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def load_config(checkpoint_dir: str | os.PathLike) -> ModelConfig:
    d = Path(checkpoint_dir)
    if not (d / "config.json").is_file():
        raise ConfigError(f"{d} has no config.json; not a Hugging Face checkpoint directory")
    generation = _read_json(d / "generation_config.json") if (d / "generation_config.json").is_file() else {}
    return config_from_hf(_read_json(d / "config.json"), generation)


def weight_files(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint, in index order when sharded; an index may only name files inside
    the checkpoint folder (no absolute paths, no `..`)."""
    d = Path(checkpoint_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index}: no \"weight_map\" object naming the weight files")
        shards = dict.fromkeys(weight_map.values())
        for shard in shards:
            if not _inside_folder(shard):
                raise ConfigError(f"{index}: weight file {shard!r} is not a relative path inside the checkpoint folder")
        return [d / s for s in shards]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{d} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def _inside_folder(name) -> bool:
    """A relative path with no `..` (symlinks inside the folder, e.g. a hub snapshot's, stay allowed)."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return False
    p = Path(name)
    return not p.is_absolute() and not p.drive and ".." not in p.parts


def hf_name(name: str) -> str | None:
    """Internal name for a stored tensor name; None for tensors a text decoder does not use."""
    if name.startswith(_SKIP_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    if ".block_sparse_moe." in name:  # mixtral's checkpoint names -> the qwen MoE names the decoder uses
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in _MIXTRAL_EXPERT_LINEARS:
            if name.endswith(old):
                return name[: -len(old)] + new
    return name


_MIXTRAL_EXPERT_LINEARS = ((".w1.weight", ".gate_proj.weight"), (".w3.weight", ".up_proj.weight"),
                           (".w2.weight", ".down_proj.weight"))


def split_fused_experts(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers 5's in-memory expert layout (a model's state_dict: `mlp.experts.gate_up_proj` [E, 2 I, H],
    `mlp.experts.down_proj` [E, H, I]) -> the checkpoint names, one [out, in] weight per expert and linear
    (`mlp.experts.{e}.gate_proj.weight`, views); every other tensor passes through."""
    for name, t in tensors:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf in ("gate_up_proj", "down_proj") and t.dim() == 3:
            for e in range(t.shape[0]):
                if leaf == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
        else:
            yield name, t


def iter_tensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from safetensors files, one tensor at a time, read into fresh memory.

    Plain reads, not a memory map: a mapped file's touched pages count in the process's RSS until the whole
    file is closed, so a float32 cache cast to bfloat16 would briefly cost both copies. Read this way, the
    peak is the loaded model plus the largest single tensor."""
    for path in files:
        with open(path, "rb") as f:
            entries, base = _read_header(f)
            _check_size(path, entries, base, os.fstat(f.fileno()).st_size)
            for key, entry in entries:
                name = hf_name(key)
                if name is None:
                    continue
                start, end = entry["data_offsets"]
                buf = torch.empty(end - start, dtype=torch.uint8)
                f.seek(base + start)
                got = f.readinto(memoryview(buf.numpy()))
                if got != end - start:  # the file shrank under us: never hand out uninitialised memory
                    raise ConfigError(f"{path}: tensor {key!r} is truncated: expected {end - start} bytes at offset "
                                      f"{base + start}, read {got or 0}")
                yield name, buf.view(_TORCH_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def map_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) of one safetensors file as views of a private mapping of the whole file (MAP_PRIVATE:
    pages come from the page cache, so processes mapping one file share them, and a page is read from disk only
    when something touches it; a write would copy that page for this process and never reach the file).

    For files whose bytes are the loaded tensors as they are (the prepared kernel caches): unlike iter_tensors,
    nothing is copied, and the pages count in RSS only once touched (as file-backed, shareable, reclaimable
    memory). A tensor whose offset is not a multiple of its element size (the format packs tensors without
    padding) cannot be a view and is copied instead; so is every tensor of an empty file region."""
    with open(path, "rb") as f:
        entries, base = _read_header(f)
        size = os.fstat(f.fileno()).st_size
        _check_size(path, entries, base, size)
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    whole = torch.frombuffer(mapping, dtype=torch.uint8) if mapping is not None else None  # holds the mapping
    for key, entry in entries:
        name = hf_name(key)
        if name is None:
            continue
        start, end = entry["data_offsets"]
        dtype = _TORCH_DTYPES[entry["dtype"]]
        raw = whole[base + start:base + end] if end > start else torch.empty(0, dtype=torch.uint8)
        if (base + start) % dtype.itemsize or end == start:
            raw = raw.clone()
        yield name, raw.view(dtype).reshape(entry["shape"])


def mapped_file(t: torch.Tensor) -> str | None:
    """The file a tensor's memory is mapped from (/proc/self/maps), or None (anonymous memory, or not Linux)."""
    ptr = t.untyped_storage().data_ptr()
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi and len(fields) == 6 and fields[5].startswith("/"):
            return fields[5]
    return None


def is_complete(path: str | os.PathLike) -> bool:
    """Whether a safetensors file holds every byte its header promises (a cheap check: the header and a stat)."""
    try:
        with open(path, "rb") as f:
            entries, base = _read_header(f)
            return os.fstat(f.fileno()).st_size >= _data_end(entries, base)
    except (OSError, ConfigError):
        return False


def _data_end(entries: list[tuple[str, dict]], base: int) -> int:
    return base + max((entry["data_offsets"][1] for _, entry in entries), default=0)


def _check_size(path, entries: list[tuple[str, dict]], base: int, size: int) -> None:
    need = _data_end(entries, base)
    if size < need:
        last = max(entries, key=lambda kv: kv[1]["data_offsets"][1])[0]
        raise ConfigError(f"{path} is truncated: {size} bytes, but its header needs {need} (tensor {last!r} ends at "
                          f"offset {need}); delete it to have it rebuilt, or re-download the checkpoint")


def header_specs(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a safetensors file in data order, from its header alone (no tensor data read)."""
    with open(path, "rb") as f:
        return [(k, tuple(v["shape"])) for k, v in _read_header(f)[0]]


def _read_header(f) -> tuple[list[tuple[str, dict]], int]:
    """The (name, entry) pairs of an open safetensors file in data order, and where the data starts.

    Format (huggingface/safetensors): u64 little-endian header length, JSON header, then raw data. A short or
    malformed header, or an entry whose offsets do not match its dtype and shape, is a ConfigError naming the file."""
    path = getattr(f, "name", "safetensors file")
    raw = f.read(8)
    if len(raw) != 8:
        raise ConfigError(f"{path}: truncated safetensors file (expected 8 header-length bytes at offset 0, read {len(raw)})")
    (n,) = struct.unpack("<Q", raw)
    blob = f.read(n) if n <= _MAX_HEADER else b""
    if len(blob) != n:
        raise ConfigError(f"{path}: truncated or invalid safetensors header (expected {n} bytes at offset 8, "
                          f"read {len(blob)})")
    try:
        header = json.loads(blob)
        header.pop("__metadata__", None)
        for key, entry in header.items():
            start, end = entry["data_offsets"]
            nbytes = math.prod(entry["shape"]) * torch.tensor([], dtype=_TORCH_DTYPES[entry["dtype"]]).element_size()
            if not 0 <= start <= end or end - start != nbytes:
                raise ValueError(f"tensor {key!r}: offsets {start}..{end} do not hold {entry['dtype']} {entry['shape']}")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ConfigError(f"{path}: invalid safetensors header ({type(e).__name__}: {e})") from None
    return sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]), 8 + n


_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit on the JSON header


_TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                 "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}


_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}  # torch dtype -> safetensors name


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """A safetensors file's __metadata__ (string to string), from its header alone."""
    with open(path, "rb") as f:
        raw = f.read(8)
        (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (0,)
        try:
            return dict(json.loads(f.read(n) if 0 < n <= _MAX_HEADER else b"{}").get("__metadata__") or {})
        except ValueError as e:
            raise ConfigError(f"{path}: invalid safetensors header ({e})") from None


def write_tensors(
    path: str | os.PathLike,
    specs: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> str:
    """Write a safetensors file tensor by tensor; returns the sha256 of the bytes written (for a cache's manifest).
    The file is flushed and fsynced before returning (callers then move it in place with catalog.replace_durably).

    `specs` (name, shape, stored dtype, in yield order) make the header up front, so `tensors` may be a generator
    (a 6 GB float32 conversion never sits in memory at once); each tensor is stored in its spec's dtype, which may
    differ from tensor to tensor. Format (huggingface/safetensors): u64 little-endian header length, JSON header,
    then raw data."""
    header: dict = {"__metadata__": metadata or {}}
    offset = 0
    for name, shape, dtype in specs:
        size = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    expected = iter(specs)
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for head in (struct.pack("<Q", len(blob)), blob):
            out.write(head)
            digest.update(head)
        for name, tensor in tensors:
            want_name, want_shape, dtype = next(expected)
            if name != want_name or tuple(tensor.shape) != tuple(want_shape):
                raise ValueError(f"tensor {name} {tuple(tensor.shape)} does not match spec {want_name} {want_shape}")
            data = tensor.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data
            out.write(data)
            digest.update(data)
        out.flush()
        os.fsync(out.fileno())
    if next(expected, None) is not None:
        raise ValueError("fewer tensors than specs were written")
    return digest.hexdigest()


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02  # linux/falloc.h
_BLOCK = 4096


@functools.cache
def _hole_puncher():  # -> the C function, or None
    """libc's fallocate, or None where there is none (not Linux / not glibc)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError, TypeError):  # TypeError: no process handle to open (Windows)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def punch_hole(fd: int, at: int, size: int) -> bool:
    """Give the whole blocks inside bytes [at, at + size) of the open file back to the filesystem (the file keeps
    its size; those bytes read as zeros). A block that the range shares with bytes outside it is kept. False where
    the platform or the filesystem cannot (nothing is changed then)."""
    lo, hi = -(-at // _BLOCK) * _BLOCK, (at + size) // _BLOCK * _BLOCK
    fn = _hole_puncher()
    if fn is None or hi <= lo:
        return fn is not None
    return fn(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, lo, hi - lo) == 0


class Spill:
    """A safetensors file written from tensors whose names and shapes are known only as they arrive (a GGUF's
    prepared modules, built one at a time): `add` appends a tensor's bytes to the spill file and keeps only its
    name, shape, dtype and place, so the caller can drop it; `write` then writes the file in any order of those
    names, reading one tensor back at a time and giving its blocks in the spill file back to the filesystem once
    read (`punch_hole`). Peak memory is one tensor, not the file; peak disk is the data about once (spill file and
    file trade blocks), where the filesystem punches holes (ext4, xfs, btrfs, tmpfs), else twice until the spill
    file is removed (on leaving the `with`, written or not)."""

    def __init__(self, spill_path: str | os.PathLike):
        self.path = Path(spill_path)
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype, int, int]] = {}  # name -> shape, dtype, at, size
        self._out = open(self.path, "wb")
        self._written = False  # `write` reads each tensor once and gives its blocks back: there is no second write

    def __enter__(self) -> "Spill":
        return self

    def __exit__(self, *exc) -> None:
        self._out.close()
        self.path.unlink(missing_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.specs:
            raise ValueError(f"tensor {name} added twice")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
        self.specs[name] = (tuple(tensor.shape), tensor.dtype, self._out.tell(), len(data))
        self._out.write(data)

    def write(self, path: str | os.PathLike, names: list[str], metadata: dict[str, str] | None = None) -> str:
        """`path` with the tensors in `names`' order (every added name once); write_tensors' sha256."""
        if sorted(names) != sorted(self.specs):
            raise ValueError("the order names other tensors than were added")
        if self._written:
            raise ValueError("a spill is written once: its blocks were given back as they were read")
        self._written = True
        self._out.flush()

        def read_back() -> Iterator[tuple[str, torch.Tensor]]:
            with open(self.path, "r+b") as f:
                punch = True
                for name in names:
                    shape, dtype, at, size = self.specs[name]
                    buf = bytearray(size)
                    f.seek(at)
                    if f.readinto(buf) != size:
                        raise ValueError(f"the spill file {self.path} is short at {name}")
                    punch = punch and punch_hole(f.fileno(), at, size)  # read: its blocks are not needed again
                    flat = torch.frombuffer(buf, dtype=dtype) if size else torch.empty(0, dtype=dtype)
                    yield name, flat.reshape(shape)

        return write_tensors(path, [(n, self.specs[n][0], self.specs[n][1]) for n in names], read_back(), metadata)

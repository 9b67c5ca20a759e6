"""Resolve a model name to a Checkpoint: packaged catalog name | .gguf file | HF checkpoint dir | hub id.

This module owns the resolution order, the clear errors when nothing matches, and the conversion cache:
a GGUF source is converted once (dequantized to float32 safetensors + tokenizer.json + tokenizer_config.json
+ draftwise_config.json) under cache_dir/converted/<sha256[:16]>/, and later loads read that cache
(memory-mapped) without opening the GGUF again. The hub is used only when online (huggingface_hub).

It does not know tensor layouts or quirks (gguf.py, safetensors.py), tokenization (tokenizer.py) or how
the decoder consumes tensors.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from draftwise.config import ConfigError, ModelConfig, default_cache_dir, hub_offline
from draftwise.models import catalog
from draftwise.models import safetensors as st
from draftwise.tokenizer import Tokenizer

CONVERSION_VERSION = 1  # bump when the converted layout changes; old caches are then rebuilt
_CONFIG_FILE = "draftwise_config.json"
_WEIGHTS_FILE = "model.safetensors"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]


@dataclass
class Checkpoint:
    """The checkpoint contract: config, tokenizer, and a fresh (HF name, tensor) iterator per call."""

    config: ModelConfig
    tokenizer: Tokenizer
    tensor_source: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    info: dict = field(default_factory=dict)  # kind, name, path, sha256, description, converted_path

    def tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors as stored; with `dtype` (bfloat16) for a converted GGUF, from a cached copy in that dtype,
        written on first use, so a bf16 load reads half the bytes and skips the cast."""
        if dtype not in (torch.bfloat16, torch.float16) or "converted_path" not in self.info:
            return self.tensor_source()
        folder = Path(self.info["converted_path"])
        path = folder / f"model.{str(dtype).removeprefix('torch.')}.safetensors"
        if not path.is_file():
            with catalog.file_lock(path.with_name(path.name + ".lock")):
                if not path.is_file():
                    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
                    st.write_streaming(tmp, st.header_specs(folder / _WEIGHTS_FILE), self.tensor_source(), dtype=dtype)
                    os.replace(tmp, path)
        return st.iter_tensors([path])


def load_checkpoint(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                    progress: bool = True) -> Checkpoint:
    """Resolve `name_or_path` (catalog name, .gguf file, HF checkpoint dir, or hub id when online)."""
    cache_dir = Path(cache_dir or default_cache_dir())
    name = str(name_or_path)
    if name in catalog.CATALOG:
        return _load_packaged(name, cache_dir, progress)
    path = Path(name).expanduser()
    if path.is_file():
        if not _is_gguf(path):
            raise ConfigError(f"{path} is not a GGUF file (a model file must be .gguf; or pass a checkpoint directory)")
        sha = catalog.cached_sha256(path, cache_dir, progress)
        info = {"kind": "gguf", "name": path.name, "path": str(path.resolve()), "sha256": sha}
        return _load_gguf(path, sha, cache_dir, info, progress)
    if path.is_dir():
        return _load_hf_dir(path, {"kind": "hf_dir", "name": path.name, "path": str(path.resolve()), "sha256": None})
    return _load_from_hub(name, cache_dir)


def _packaged_list() -> str:
    return ", ".join(catalog.CATALOG)


def _load_packaged(name: str, cache_dir: Path, progress: bool) -> Checkpoint:
    entry = catalog.get_entry(name)
    try:
        path = catalog.assemble(name, cache_dir, progress)
    except catalog.ChecksumError:
        raise
    except ConfigError as e:  # chunk packages missing: use the official checkpoint if we may go online
        if hub_offline():
            raise
        print(f"{e}; downloading {entry.hub_id} from the hub instead", file=sys.stderr)
        return _load_from_hub(entry.hub_id, cache_dir)
    info = {"kind": "packaged", "name": name, "path": str(path), "sha256": entry.sha256,
            "description": entry.description}
    return _load_gguf(path, entry.sha256, cache_dir, info, progress)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def converted_dir(sha256: str, cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / "converted" / sha256[:16]


def _load_gguf(path: Path, sha256: str, cache_dir: Path, info: dict, progress: bool) -> Checkpoint:
    target = converted_dir(sha256, cache_dir)
    if not _conversion_complete(target, sha256):
        with catalog.file_lock(target.with_name(target.name + ".lock")):
            if not _conversion_complete(target, sha256):  # another process may have finished it meanwhile
                _convert_gguf(path, sha256, target, progress)
    meta = json.loads((target / _CONFIG_FILE).read_text())
    config = ModelConfig.from_dict(meta["config"])
    tokenizer = Tokenizer.load(target)
    info = {**info, "description": info.get("description") or meta.get("description"), "converted_path": str(target),
            "architecture": config.architecture}
    weights = [target / _WEIGHTS_FILE]
    return Checkpoint(config, tokenizer, lambda: st.iter_tensors(weights), info)


def _conversion_complete(target: Path, sha256: str) -> bool:
    try:
        meta = json.loads((target / _CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (meta.get("sha256") == sha256 and meta.get("version") == CONVERSION_VERSION
            and (target / _WEIGHTS_FILE).is_file() and (target / "tokenizer.json").is_file())


def _convert_gguf(path: Path, sha256: str, target: Path, progress: bool) -> None:
    """Dequantize once into a temporary folder, then rename it into place (atomic for readers)."""
    from tqdm import tqdm

    from draftwise.models.gguf import GGUFFile

    print(f"converting {path.name} once into {target} ...", file=sys.stderr)
    gguf_file = GGUFFile(path)
    config = gguf_file.config
    tokenizer = Tokenizer.from_gguf(path)
    tokenizer.eos_token_ids = config.eos_token_ids  # one stop list for engine and tokenizer
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer.save(tmp)
        specs = gguf_file.tensor_specs()
        bar = tqdm(gguf_file.tensors(), total=len(specs), desc=f"dequantize {path.name}", unit="tensor",
                   file=sys.stderr, disable=not progress)
        st.write_streaming(tmp / _WEIGHTS_FILE, specs, bar, metadata={"format": "pt", "source_sha256": sha256})
        meta = {"version": CONVERSION_VERSION, "sha256": sha256, "source": str(path),
                "description": gguf_file.field("general.name"), "config": config.to_dict()}
        (tmp / _CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_hf_dir(path: Path, info: dict) -> Checkpoint:
    config = st.load_config(path)
    tokenizer = Tokenizer.load(path)
    # One stop list: the checkpoint's eos ids plus the chat template's end-of-turn tokens.
    eos_ids = tuple(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    config = dataclasses.replace(config, eos_token_ids=eos_ids,
                                 bos_token_id=config.bos_token_id if config.bos_token_id is not None
                                 else tokenizer.bos_token_id)
    tokenizer.eos_token_ids = eos_ids
    files = st.weight_files(path)
    info = {**info, "architecture": config.architecture, "description": info.get("description") or path.name}
    return Checkpoint(config, tokenizer, lambda: st.iter_tensors(files), info)


def _load_from_hub(repo_id: str, cache_dir: Path) -> Checkpoint:
    looks_like_hub_id = repo_id.count("/") == 1 and not repo_id.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ConfigError(f"{repo_id!r} is not a packaged model, file or directory; packaged models: {_packaged_list()}")
    if hub_offline():
        raise ConfigError(f"{repo_id!r} is not a packaged model, file or directory, and the hub is offline "
                          f"(HF_HUB_OFFLINE=1); packaged models: {_packaged_list()}")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, cache_dir=str(cache_dir / "hub"))
    except Exception as e:  # network errors, missing repos, gated repos: all end the same way for the user
        raise ConfigError(f"{repo_id!r} is not a packaged model, file or directory, and the hub is unreachable "
                          f"or has no such model ({type(e).__name__}: {e}); packaged models: {_packaged_list()}") from None
    return _load_hf_dir(Path(local), {"kind": "hub", "name": repo_id, "path": local, "sha256": None})

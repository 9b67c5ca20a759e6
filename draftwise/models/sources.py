"""Resolve a model name to a Checkpoint: packaged catalog name | .gguf file | HF checkpoint dir | hub id.

This module owns the resolution order, the clear errors when nothing matches, and the conversion cache:
a GGUF source's tokenizer and config are converted once (tokenizer.json + tokenizer_config.json +
draftwise_config.json) under cache_dir/converted/<sha256[:16]>/; its tensors are cached there only in the form a
load asks for: prepared kernel weights (prepared-<key>.safetensors, e.g. q4x8's packed blocks and, for 4-bit
plans, the embedding table packed too — every plan `auto` can pick, so the defaults never write a dense copy), or
a dense float32 (model.safetensors, then in the manifest) or bfloat16 copy, only when dense or legacy formats are
asked for. Later loads read those caches; a prepared file records what it is keyed by, and writing a new one removes
the folder's prepared files no load of this code can ask for (an older format, a type moved to another kernel).
draftwise_config.json, written last, holds the manifest: each file's size,
sha256 and mtime. Every load checks the sizes; a file whose mtime changed is hashed again; a mismatch means
the cache is corrupt and is converted again. Every cache write is fsynced before its rename. The hub is used
only when online (huggingface_hub).

It does not know tensor layouts or quirks (gguf.py, safetensors.py), tokenization (tokenizer.py) or how
the decoder consumes tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from draftwise.config import ConfigError, ModelConfig, hub_offline
from draftwise.paths import default_cache_dir
from draftwise.models import catalog
from draftwise.models import safetensors as st
from draftwise.tokenizer import Tokenizer

CONVERSION_VERSION = 7  # bump when the converted layout changes; old caches are then rebuilt (2: the manifest;
# 3: tensors split from the conversion: only tokenizer + config at first, dense or prepared weights when asked;
# 4: end-of-turn ids only from control tokens; 5: with quant.PREPARED_FORMAT_VERSION 2, the embedding packed in
# prepared caches — the folder is rebuilt so older prepared files, keyed by the old version, do not linger on disk;
# 6: with PREPARED_FORMAT_VERSION 3, split plans store only their q4x8 half; 7: with 4, the registry's names)
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
    progress: bool = True  # progress bars while caches are written

    def tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors as stored; for a GGUF, from a dense cached copy written on first use from the GGUF: float32
        (model.safetensors, in the manifest) by default, or `dtype` (bfloat16) so a bf16 load reads half the
        bytes, skips the cast and never writes a float32 copy."""
        if "converted_path" not in self.info:
            return self.tensor_source()
        folder = Path(self.info["converted_path"])
        if dtype not in (torch.bfloat16, torch.float16):
            _ensure_fp32_cache(folder, Path(self.info["path"]), self.progress)
            return self.tensor_source()
        path = folder / f"model.{str(dtype).removeprefix('torch.')}.safetensors"
        if not st.is_complete(path):  # absent, or cut short by a crash: (re)write it
            with catalog.file_lock(path.with_name(path.name + ".lock")):
                if not st.is_complete(path):
                    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
                    gguf_file = self.gguf()
                    specs = [(name, shape, dtype) for name, shape in gguf_file.tensor_specs()]
                    st.write_tensors(tmp, specs, gguf_file.tensors())
                    catalog.replace_durably(tmp, path)
        return st.iter_tensors([path])

    def tensor_types(self) -> dict[str, str] | None:
        """{HF tensor name: ggml type} of a GGUF checkpoint (None otherwise): read once from the file's tensor table
        and kept beside the converted copy (tensor_types.json, with the GGUF's sha256), so a load need not open the
        GGUF to know which kernels keep it faithful (kernels/plan.py)."""
        if "converted_path" not in self.info:
            return None
        path = Path(self.info["converted_path"]) / "tensor_types.json"
        try:
            saved = json.loads(path.read_text())
            if saved.get("sha256") == self.info["sha256"]:
                return saved["types"]
        except (OSError, ValueError, KeyError):
            pass
        types = {name: item.type for name, item in self.gguf().items().items()}
        catalog.write_text_durably(path, json.dumps({"sha256": self.info["sha256"], "types": types}))
        return types

    def gguf(self):
        """The source GGUFFile (GGUF checkpoints only)."""
        from draftwise.models.gguf import GGUFFile

        return GGUFFile(self.info["path"])

    def prepared(self, plan, embed_dtype: torch.dtype,
                 progress: bool | None = None) -> Iterator[tuple[str, torch.Tensor | torch.nn.Module]]:
        """For Decoder.from_tensors: a GGUF's linears built straight from its blocks in the plan's kernels
        (models/quant.py, prepared_weights; for 4-bit plans the embedding table too, as a Q4x8Embedding, once
        when its head is tied), cached as their packed tensors under the converted folder
        (prepared-<key>.safetensors, keyed by the GGUF's sha256, the plan, PREPARED_FORMAT_VERSION and, for torch
        int4, torch's version), so a later load reads the packed form and neither dequantizes nor quantizes.
        `embed_dtype`: a dense table's storage dtype (plans that keep one)."""
        return _prepared(self, plan, embed_dtype, self.progress if progress is None else progress)


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
    if _cache_problem(target, sha256):
        with catalog.file_lock(target.with_name(target.name + ".lock")):
            problem = _cache_problem(target, sha256)  # another process may have finished it meanwhile
            if problem:
                if (target / _CONFIG_FILE).exists():
                    print(f"the converted cache {target} is unusable ({problem}); converting again", file=sys.stderr)
                _convert_gguf(path, sha256, target, progress)
    meta = json.loads((target / _CONFIG_FILE).read_text())
    config = ModelConfig.from_dict(meta["config"])
    tokenizer = Tokenizer.load(target)
    info = {**info, "description": info.get("description") or meta.get("description"), "converted_path": str(target),
            "architecture": config.architecture}
    weights = [target / _WEIGHTS_FILE]
    return Checkpoint(config, tokenizer, lambda: st.iter_tensors(weights), info, progress)


def _ensure_fp32_cache(folder: Path, gguf_path: Path, progress: bool) -> None:
    """Write the float32 dequantized copy (model.safetensors) once, durably, and add it to the manifest."""
    path = folder / _WEIGHTS_FILE
    meta_path = folder / _CONFIG_FILE
    if _WEIGHTS_FILE in json.loads(meta_path.read_text()).get("files", {}) and path.exists():
        return  # checked against the manifest by _cache_problem at load
    from tqdm import tqdm

    from draftwise.models.gguf import GGUFFile

    with catalog.file_lock(path.with_name(path.name + ".lock")):
        meta = json.loads(meta_path.read_text())
        if _WEIGHTS_FILE in meta.get("files", {}) and path.exists():
            return
        gguf_file = GGUFFile(gguf_path)
        specs = gguf_file.tensor_specs()
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        bar = tqdm(gguf_file.tensors(), total=len(specs), desc=f"dequantize {gguf_path.name}", unit="tensor",
                   file=sys.stderr, disable=not progress)
        sha = st.write_tensors(tmp, [(name, shape, torch.float32) for name, shape in specs], bar,
                               metadata={"format": "pt", "source_sha256": meta["sha256"]})
        catalog.replace_durably(tmp, path)
        stat = path.stat()
        meta["files"][_WEIGHTS_FILE] = {"size": stat.st_size, "sha256": sha, "mtime_ns": stat.st_mtime_ns}
        catalog.write_text_durably(meta_path, json.dumps(meta, indent=1))


def prepared_key_inputs(ckpt: Checkpoint, plan, embed_dtype: torch.dtype) -> list:
    """What a converted GGUF's prepared file for a plan is keyed by: the GGUF's sha256, PREPARED_FORMAT_VERSION,
    the plan's kernels and dtypes (a faithful plan: each stored type's kernel and scale form, kernels/blocktypes.py)
    and torch's version for its own int4 packing. Recorded in the file, so a later load can tell the files it can no
    longer reach (`unreachable`)."""
    from draftwise.models import quant

    dtype = getattr(torch, plan.dtype)
    what = [ckpt.info["sha256"], quant.PREPARED_FORMAT_VERSION, plan.step, plan.prefill, str(dtype), str(embed_dtype)]
    if plan.faithful:
        what.append("faithful")
        from draftwise.kernels import blocktypes

        # the kernel and scale form each stored type is held in: a prepared file from before a type's table row
        # changed (a new kernel, a narrower scale form, a float type off fp32) is never read as the new one
        what.append({t: [blocktypes.kernel_of(t), blocktypes.scale_form(t)] for t in sorted(plan.stored_types or {})})
    if "int4" in (plan.step, plan.prefill):  # torch's int4 packing is its own, and may change between versions
        what.append(torch.__version__)
    return what


def prepared_path(ckpt: Checkpoint, plan, embed_dtype: torch.dtype) -> Path:
    """Where a converted GGUF's prepared weights for a plan live (written or not): named by a hash of
    `prepared_key_inputs`."""
    key = hashlib.sha256(json.dumps(prepared_key_inputs(ckpt, plan, embed_dtype)).encode()).hexdigest()[:16]
    return Path(ckpt.info["converted_path"]) / f"prepared-{key}.safetensors"


def unreachable(what: list | None, sha256: str) -> bool:
    """Whether a prepared file recorded with key inputs `what` (None: written before the record, format <= 8) can
    no longer be asked for by this code: another GGUF, another PREPARED_FORMAT_VERSION, a stored type whose table
    row now names another kernel or scale form, or torch int4 packed by another torch."""
    from draftwise.kernels import blocktypes
    from draftwise.models import quant

    if not isinstance(what, list) or len(what) < 6 or what[0] != sha256 or what[1] != quant.PREPARED_FORMAT_VERSION:
        return True
    rows = next((w for w in what[6:] if isinstance(w, dict)), {})
    if any(blocktypes.kernel_of(t) != form[0] or blocktypes.scale_form(t) != form[1] for t, form in rows.items()):
        return True
    return "int4" in what[2:4] and what[-1] != torch.__version__


def drop_unreachable(folder: Path, sha256: str) -> list[Path]:
    """Remove a converted folder's prepared files that `unreachable` says no load will read again, and the partial
    files of writers no longer running; returns what was removed. Called after each new prepared file is written,
    so a format bump or a new table row does not leave the old files filling the disk (a reader that has one mapped
    keeps its pages: the name goes, the inode stays until unmapped)."""
    gone = []
    for path in sorted(folder.glob("prepared-*.safetensors*")):
        if ".tmp-" in path.name:
            pid = path.name.rsplit(".tmp-", 1)[1]
            stale = not pid.isdigit() or not _running(int(pid))
        elif path.name.endswith(".safetensors"):
            try:
                raw = st.read_metadata(path).get("key_inputs")
                stale = unreachable(json.loads(raw) if raw else None, sha256)
            except (OSError, ValueError, ConfigError):
                stale = False  # unreadable now (being written, another filesystem's error): leave it
        else:
            continue  # the .lock files
        if stale:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                gone.append(path)
    return gone


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prepared(ckpt: Checkpoint, plan, embed_dtype: torch.dtype,
              progress: bool) -> Iterator[tuple[str, torch.Tensor | torch.nn.Module]]:
    what = prepared_key_inputs(ckpt, plan, embed_dtype)
    path = prepared_path(ckpt, plan, embed_dtype)
    if not st.is_complete(path):
        with catalog.file_lock(path.with_name(path.name + ".lock")):
            if not st.is_complete(path):
                print(f"preparing {ckpt.info.get('name')} for kernels {plan.label} once into {path} ...",
                      file=sys.stderr)
                _write_prepared(ckpt, plan, embed_dtype, progress, path, what)
                for old in drop_unreachable(path.parent, ckpt.info["sha256"]):
                    print(f"removed {old.name}: no longer read (older format or kernel table)", file=sys.stderr)
    kinds = json.loads(st.read_metadata(path)["linears"])
    return _prepared_from_cache(path, kinds)  # the first load too: every load maps the same file


def _write_prepared(ckpt: Checkpoint, plan, embed_dtype: torch.dtype, progress: bool, path: Path, what: list) -> None:
    """The prepared file, one module at a time: each module's tensors are spilled as it is built and the module
    dropped (a Qwen3-30B-A3B layer's 384 expert linears are 0.8-1.7 MB each; all of its ~18 GB never sit in memory
    at once), then written in storage order and moved in place."""
    from draftwise.models import quant

    dtype = getattr(torch, plan.dtype)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    kinds: dict[str, dict] = {}
    owners: dict[str, str] = {}  # tensor name -> its module's name
    tied: dict[str, torch.nn.Module] = {}  # the head a tied table may share its buffers with (module_state)
    with st.Spill(path.with_name(f"{path.name}.spill.tmp-{os.getpid()}")) as spill:
        for name, value in quant.prepared_weights(ckpt.gguf().items(), ckpt.config, plan, progress):
            if not isinstance(value, torch.nn.Module):
                spill.add(name, value.to(embed_dtype if name == f"{quant.EMBED}.weight" else dtype))
                continue
            kinds[name], state = quant.module_state(value, tied)
            for leaf, t in state.items():
                owners[f"{name}.{leaf}"] = name
                spill.add(f"{name}.{leaf}", t)
            if name == "lm_head":
                tied[name] = value
            del value, state
        spill.write(tmp, quant.storage_order(list(spill.specs), owners),
                    {"format": "draftwise-prepared", "source_sha256": ckpt.info["sha256"],
                     "linears": json.dumps(kinds), "key_inputs": json.dumps(what)})
    catalog.replace_durably(tmp, path)


def _prepared_from_cache(path: Path, kinds: dict) -> Iterator[tuple[str, torch.Tensor | torch.nn.Module]]:
    from draftwise.models import quant

    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in st.map_tensors(path):  # views of the file, used as they are (docs/models.md: Mapped weights)
        owner = next((p for p in (name.rpartition(".")[0], name.rpartition(".")[0].rpartition(".")[0]) if p in kinds),
                     None)
        if owner is None:
            yield name, t
            continue
        pending.setdefault(owner, {})[name[len(owner) + 1:]] = t
    built: dict[str, torch.nn.Module] = {}
    for owner, tensors in pending.items():
        built[owner] = quant.module_from_state(kinds[owner], tensors, built)
        yield owner, built[owner]
    for owner in kinds.keys() - pending.keys():  # stored as a reference to another module's tensors (a tied table)
        yield owner, quant.module_from_state(kinds[owner], {}, built)


def _cache_problem(target: Path, sha256: str) -> str | None:
    """Why the converted cache in `target` cannot be used (None: it can). Sizes are always checked against the
    manifest; a file whose mtime differs from the recorded one is hashed again (and the new mtime recorded)."""
    try:
        meta = json.loads((target / _CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return f"no readable {_CONFIG_FILE}"
    if not isinstance(meta, dict) or meta.get("sha256") != sha256 or meta.get("version") != CONVERSION_VERSION:
        return "converted from another source or by another version"
    files = meta.get("files")
    if not isinstance(files, dict) or "tokenizer.json" not in files:
        return "no manifest"
    touched = False
    for name, want in files.items():
        try:
            stat = (target / name).stat()
        except OSError:
            return f"{name} is missing"
        if stat.st_size != want.get("size"):
            return f"{name} is {stat.st_size} bytes, its manifest says {want.get('size')}"
        if stat.st_mtime_ns != want.get("mtime_ns"):
            if catalog.sha256_file(target / name, progress=False) != want.get("sha256"):
                return f"{name} has changed since conversion (its sha256 differs from the manifest)"
            want["mtime_ns"], touched = stat.st_mtime_ns, True
    if touched:  # verified again (e.g. a copied cache): remember, so the next load is cheap
        catalog.write_text_durably(target / _CONFIG_FILE, json.dumps(meta, indent=1))
    return None


def _manifest(folder: Path, known_sha256: dict[str, str]) -> dict:
    """Size, sha256 and mtime of every file in `folder` (hashes already computed while writing are reused)."""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_file():
            stat = p.stat()
            sha = known_sha256.get(p.name) or catalog.sha256_file(p, progress=False)
            out[p.name] = {"size": stat.st_size, "sha256": sha, "mtime_ns": stat.st_mtime_ns}
    return out


def _convert_gguf(path: Path, sha256: str, target: Path, progress: bool) -> None:
    """Tokenizer + config once into a temporary folder, then rename it into place (atomic for readers). Tensors are
    not converted here: dense copies (Checkpoint.tensors) and prepared kernels (Checkpoint.prepared) are cached
    next to them when a load asks for them."""
    from draftwise.models.gguf import GGUFFile

    print(f"converting {path.name}'s tokenizer and config once into {target} ...", file=sys.stderr)
    gguf_file = GGUFFile(path)
    config = gguf_file.config
    tokenizer = Tokenizer.from_gguf(path)
    tokenizer.eos_token_ids = config.eos_token_ids  # one stop list for engine and tokenizer
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer.save(tmp)
        meta = {"version": CONVERSION_VERSION, "sha256": sha256, "source": str(path),
                "description": gguf_file.field("general.name"), "config": config.to_dict(),
                "files": _manifest(tmp, {})}
        (tmp / _CONFIG_FILE).write_text(json.dumps(meta, indent=1))  # last: its presence marks a finished conversion
        shutil.rmtree(target, ignore_errors=True)
        catalog.replace_durably(tmp, target)  # every file and the folder fsynced, then renamed into place
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

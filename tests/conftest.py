"""Shared fixtures. Loader/tokenizer section: tiny random GGUF files, a tiny HF checkpoint directory and an
empty cache directory (builders in tests/tiny_checkpoints.py). No downloads."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny_checkpoints import write_tiny_gguf, write_tiny_hf_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# ---------------------------------------------------------------------------------------------------
# Loader / tokenizer fixtures
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory) -> Path:
    """A tiny random qwen2 GGUF (q/k/v bias, untied lm_head, ChatML template, byte-level BPE)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    write_tiny_gguf(path, "qwen2")
    return path


@pytest.fixture(scope="session")
def tiny_llama_gguf_path(tmp_path_factory) -> Path:
    """A tiny random llama GGUF with tied embeddings (no output.weight) and llama.cpp's Q/K permutation."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_gguf(path, "llama", tie=True)
    return path


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A tiny random llama HF checkpoint directory (bf16, two shards with an index, tokenizer.json)."""
    directory = tmp_path_factory.mktemp("hf") / "tiny-llama-hf"
    write_tiny_hf_dir(directory)
    return directory


@pytest.fixture
def draftwise_cache_dir(tmp_path) -> Path:
    """An empty cache directory for one test (assembled models, hashes, converted checkpoints)."""
    return tmp_path / "cache"


def require_packaged(name: str) -> None:
    """Skip the calling test when the packaged model's chunk packages are not installed."""
    from draftwise.config import ConfigError
    from draftwise.models import catalog

    try:
        catalog.chunk_paths(catalog.get_entry(name))
    except ConfigError as e:
        pytest.skip(str(e))

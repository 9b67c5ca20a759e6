"""Shared fixtures and the suite's split across workers. Loader/tokenizer section: tiny random GGUF files, a tiny HF
checkpoint directory and an empty cache directory (builders in tests/tiny_checkpoints.py). No downloads. Workers
section: with 2 pytest-xdist workers (`make test`'s default), which files run beside which."""
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


# ---------------------------------------------------------------------------------------------------
# Workers: `make test TEST_WORKERS=2` on 2 cores
# ---------------------------------------------------------------------------------------------------

# Files whose time is mostly one core or waiting on other processes: a vLLM server's start (its imports, dynamo's
# tracing), distribution tests simulating one sequence at a time on one torch thread, transformers' GGUF reader,
# CLI subprocesses. With 2 workers they run first, in this order, in one worker, while the other takes every other
# file in collection order (its model forwards and kernel sweeps keep both cores when this side leaves one free);
# once this side is done, its worker takes the remaining files too.
SIDE_FILES = (
    "test_vllm_integration.py", "test_vllm_translation.py", "test_real_models_loading.py",
    "test_spec_decode_verify.py", "test_spec_decode_draft_confidence.py", "test_spec_decode_draft_vocab.py",
    "test_prefill_speculation.py", "test_readme.py",
)


def _two_workers() -> bool:
    return os.environ.get("PYTEST_XDIST_WORKER_COUNT") == "2"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (the Makefile's) with 2 workers: SIDE_FILES are one work unit, given first (to one worker),
    every other file a unit of its own as under loadfile, handed out in collection order to whichever worker is
    free; with any other count, xdist's own loadfile (a file's tests on one worker, its module fixtures once).
    A scheduler of our own rather than xdist_group marks: xdist 3.8's `--dist loadgroup` renames node ids, which
    pytest 9 no longer reads (every test became a unit of its own)."""
    if config.getoption("dist") != "loadfile" or config.getoption("numprocesses") != 2:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SideFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "side" if path.rsplit("/", 1)[-1] in SIDE_FILES else path

    config.option.loadscopereorder = False  # units in collection order (the side's first), not by their sizes
    return SideFirst(config, log)


def pytest_collection_modifyitems(config, items):
    """On each of 2 workers: SIDE_FILES first and in their own order (the vLLM test first), then the other files in
    collection order. Elsewhere (serial) nothing."""
    if _two_workers() and os.environ.get("PYTEST_XDIST_WORKER"):
        side = {name: i for i, name in enumerate(SIDE_FILES)}
        items.sort(key=lambda item: side.get(item.path.name, len(SIDE_FILES)))

"""Where draftwise keeps its files: the cache directory, $DRAFTWISE_CACHE_DIR or ~/.cache/draftwise (converted
checkpoints and prepared weights under converted/, the C++ kernels' builds and the autotune tables under
kernels/). The one place the variable is read. Imports nothing of draftwise, so every layer may ask it (the
kernels included, which config.py's option checks import).
"""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> str:
    return os.environ.get("DRAFTWISE_CACHE_DIR") or str(Path.home() / ".cache" / "draftwise")

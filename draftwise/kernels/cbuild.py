"""Building a shared library from C or C++ sources into the per-machine cache, for every library draftwise compiles:
the kernel library (kernels/library.py) and the probe's streaming read (kernels/probe.py, stream_read.c).

Owns the steps they share: a compiler's identity for a cache key (`compiler_version`: what `--version` prints),
the key itself (`cache_key`: a hash of what the build depends on, in the caller's order), and the build
(`build_shared`: every unit compiled at once into a temporary folder beside the target, linked with -shared, the
commands and the compilers' output kept in build.log beside the target, the library moved into place atomically,
so a concurrent builder sees nothing or a whole library). Knows nothing of torch, of what the libraries hold or of
which flags they need: the callers name the sources, flags and target, and decide what a failure means (the
kernel library raises KernelBuildError; the probe goes without its streaming read).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path


class BuildError(RuntimeError):
    """A unit did not compile, or the library did not link; the message holds the command and its output's tail."""


def compiler_version(compiler: str) -> str:
    """What `compiler --version` prints ("" where it cannot be run): a build's key includes it."""
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30,
                              check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cache_key(parts: Iterable[bytes]) -> str:
    """The first 16 hex digits of the sha256 of `parts` in order: a build's folder name."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


def build_shared(compiler: str, units: list[tuple[Path, list[str], str]], link: list[str], target: Path,
                 verbose: bool = False, timeout: float | None = None) -> str:
    """Compile `units` ((source, flags, object name) each, all at once) and link them with `link` into `target`;
    returns what the compilers and the linker printed (warnings: a build that prints them still succeeds);
    raises BuildError where a unit or the link fails (or runs past `timeout` seconds)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        procs = []
        for source, flags, name in units:
            obj = os.path.join(tmp, name)
            cmd = [compiler, *flags, "-c", str(source), "-o", obj]
            if verbose:
                print(" ".join(cmd), file=sys.stderr)
            procs.append((obj, cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        log, outputs = [], []  # every command with its output; the outputs alone
        try:
            for obj, cmd, p in procs:
                out = p.communicate(timeout=timeout)[0]
                if p.returncode != 0:
                    raise BuildError(f"compiling {' '.join(cmd)} failed:\n{out[-4000:]}")
                log.append(f"$ {' '.join(cmd)}\n{out}")
                outputs.append(out.strip())
        except subprocess.TimeoutExpired as e:
            raise BuildError(f"compiling {' '.join(e.cmd)} took more than {timeout} s") from None
        finally:
            for _, _, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        so = os.path.join(tmp, target.name)
        cmd = [compiler, "-shared", "-o", so, *[o for o, _, _ in procs], *link]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BuildError(f"linking {target.name} took more than {timeout} s") from None
        if r.returncode != 0:
            raise BuildError(f"linking failed:\n{(r.stdout + r.stderr)[-4000:]}")
        log.append(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")
        outputs.append((r.stdout + r.stderr).strip())
        Path(tmp, "build.log").write_text("\n".join(log))
        os.replace(Path(tmp, "build.log"), target.parent / "build.log")
        os.replace(so, target)  # atomic: a concurrent builder either sees nothing or a whole library
    return "\n".join(t for t in outputs if t)

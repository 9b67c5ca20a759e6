"""Building a shared library from C or C++ sources into the per-machine cache, for every library draftwise compiles:
the kernel library (kernels/library.py) and the probe's streaming read (kernels/probe.py, stream_read.c).

Owns the steps they share: a compiler's identity for a cache key (`compiler_version`: what `--version` prints),
the key itself (`cache_key`: a hash of what the build depends on, in the caller's order), and the build
(`build_shared`: the units compiled `build_jobs()` at a time into a temporary folder beside the target, linked with
-shared, the commands and the compilers' output kept in build.log beside the target, the library moved into place
atomically, so a concurrent reader sees nothing or a whole library; one builder at a time per target, under a lock
file beside it, so processes started together (four `draftwise serve`) build it once, not once each). Knows nothing
of torch, of what the libraries hold or of which flags they need: the callers name the sources, flags and target,
and decide what a failure means (the kernel library raises KernelBuildError; the probe goes without its streaming
read).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path


UNIT_MEMORY = 1 << 30  # bytes one compiler process may take: a unit including torch's headers peaks near 0.5 GiB


def build_jobs(units: int) -> int:
    """How many units compile at once: $DRAFTWISE_BUILD_JOBS where set, else one per core plus one, no more than
    the memory available (/proc/meminfo's MemAvailable) holds at UNIT_MEMORY each, at least one. All ~30 units at
    once took ~15 GiB, more than a small machine has (or a busy one: builders side by side were killed for memory)."""
    want = os.environ.get("DRAFTWISE_BUILD_JOBS", "").strip()
    if want:
        if not want.isdigit() or int(want) < 1:
            raise BuildError(f"DRAFTWISE_BUILD_JOBS={want!r}: expected a whole number >= 1")
        return max(1, min(units, int(want)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    jobs = cores + 1
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        jobs = min(jobs, avail // UNIT_MEMORY)
    except (OSError, StopIteration, ValueError, IndexError):
        pass  # no /proc here: cores alone
    return max(1, min(units, jobs))


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


@contextlib.contextmanager
def _one_builder(target: Path):
    """Held while this process builds `target`: an exclusive lock on `<target>.lock` beside it (released by the
    kernel if the process dies), so a second process wanting the same library waits, then finds it built."""
    with open(target.with_name(target.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_shared(compiler: str, units: list[tuple[Path, list[str], str]], link: list[str], target: Path,
                 verbose: bool = False, timeout: float | None = None) -> str:
    """Compile `units` ((source, flags, object name) each, `build_jobs` at a time) and link them with `link` into
    `target`; returns what the compilers and the linker printed (warnings: a build that prints them still succeeds;
    "" where another process built `target` while this one waited for it); raises BuildError where a unit or the
    link fails (or a unit runs past `timeout` seconds)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _one_builder(target):
        if target.exists():
            return ""
        return _build(compiler, units, link, target, verbose, timeout)


def _build(compiler: str, units: list[tuple[Path, list[str], str]], link: list[str], target: Path, verbose: bool,
           timeout: float | None) -> str:
    jobs = build_jobs(len(units))
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs, running = [], []  # every unit's object, in the units' order; (command, process, start) now running
        log, outputs = [], []  # every command with its output; the outputs alone

        def reap(until: int) -> None:  # finish compilers as they end, until at most `until` still run
            while len(running) > until:
                for unit in [u for u in running if u[1].poll() is not None]:
                    running.remove(unit)
                    cmd, p, _ = unit
                    out = p.communicate()[0]
                    if p.returncode != 0:
                        raise BuildError(f"compiling {' '.join(cmd)} failed:\n{out[-4000:]}")
                    log.append(f"$ {' '.join(cmd)}\n{out}")
                    outputs.append(out.strip())
                late = [cmd for cmd, _, start in running if timeout is not None and time.monotonic() - start > timeout]
                if late:
                    raise BuildError(f"compiling {' '.join(late[0])} took more than {timeout} s")
                if len(running) > until:
                    time.sleep(0.02)

        try:
            for source, flags, name in units:
                reap(jobs - 1)
                obj = os.path.join(tmp, name)
                cmd = [compiler, *flags, "-c", str(source), "-o", obj]
                if verbose:
                    print(" ".join(cmd), file=sys.stderr)
                objs.append(obj)
                running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True), time.monotonic()))
            reap(0)
        finally:
            for _, p, _ in running:
                if p.poll() is None:
                    p.kill()
                p.wait()
        so = os.path.join(tmp, target.name)
        cmd = [compiler, "-shared", "-o", so, *objs, *link]
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

"""README.md's commands run as printed, and the user docs' links resolve.

What is checked, and how:
- README.md stays a user's page: at most 12,000 bytes, with the two set-up commands (`make demo`, `make test`).
- Every `draftwise` command in a fenced block of README.md, the reference pages (docs/engine.md, server.md,
  bench.md, models.md, operations.md) and scripts/README.md parses with the real
  CLI parser (`draftwise.cli.build_parser`): a renamed or removed flag, or a bad choice, fails here.
- The quick README commands (those that load no model: `models`, `env`) run as printed, from the repository root.
- The README commands that load the packaged models run as printed under the `integration` mark: `generate`, the
  Python example, and `serve` with the `curl` line beside it (on another port when 8000 is taken, the only change).
  `bench` and `tune` (30 measured requests per condition), `quality` (a dense float32 reference over 1,024 tokens)
  and `verify` (400 seeded samples) are checked by parsing only: their work is tested in test_bench_*.py,
  test_quality_kl.py and test_cli.py. `make demo` and `make test` are what CI runs (`.ci/run`).
- scripts/README.md names every file under scripts/ (the removed ones only under its "Removed" heading).
- Every relative link in README.md, docs/*.md and scripts/README.md points at a file that exists and, with a
  `#fragment`, at a heading of that file (GitHub's anchor rule).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftwise.cli import build_parser
from tests.conftest import require_packaged

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
USER_DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts" / "README.md"]
# the pages that print commands for users (ARCHITECTURE.md and PERFORMANCE.md quote outputs and past commands)
COMMAND_DOCS = [README, *(ROOT / "docs" / f"{n}.md" for n in ("engine", "server", "bench", "models", "operations")),
                ROOT / "scripts" / "README.md"]
QUICK = {"models", "env"}  # sub-commands that load no model: run as printed in every test run


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, body) of each ``` block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.M | re.S)


def shell_commands(path: Path) -> list[str]:
    """The shell lines of a file's fenced blocks (not python / json), continuation lines joined."""
    out = []
    for lang, body in fenced_blocks(path):
        if lang not in ("", "sh", "bash", "shell"):
            continue
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            if line.strip():
                out.append(line.strip())
    return out


def draftwise_argv(line: str) -> list[str] | None:
    """The argv after `draftwise` of a command line (comments dropped), None for other commands."""
    if not re.match(r"(\S*/)?draftwise(\s|$)", line):
        return None
    return shlex.split(line, comments=True)[1:]


def readme_commands() -> list[str]:
    return shell_commands(README)


def run_as_printed(line: str, timeout: float, **kw) -> subprocess.CompletedProcess:
    """`line` through bash from the repository root. `.venv/bin/` is this interpreter's bin directory when the
    checkout's own .venv is not where the tests run from (the printed path otherwise)."""
    if not (ROOT / ".venv" / "bin" / "draftwise").exists():
        line = line.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          **kw)


# ---- the page --------------------------------------------------------------------------------------


def test_readme_is_a_users_page():
    text = README.read_text()
    assert len(text.encode()) <= 12_000, f"README.md is {len(text.encode())} bytes (at most 12,000)"
    commands = readme_commands()
    assert any(c.startswith("make demo") for c in commands)
    assert any(c.startswith("make test") for c in commands)
    # the five tasks a user comes for, each with a command
    subcommands = {argv[0] for argv in map(draftwise_argv, commands) if argv}
    assert {"generate", "serve", "bench", "tune", "quality"} <= subcommands, subcommands


@pytest.mark.parametrize("doc", COMMAND_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_printed_command_parses(doc):
    parser = build_parser()  # a fresh one: parse_args sets defaults on it
    argvs = [a for a in map(draftwise_argv, shell_commands(doc)) if a]
    if doc == README:
        assert len(argvs) >= 6
    for argv in argvs:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # argparse's error already went to stderr
            pytest.fail(f"{doc.name}: `draftwise {shlex.join(argv)}` does not parse (exit {e.code})")
        assert callable(args.func)


@pytest.mark.parametrize("line", [c for c in readme_commands() if (draftwise_argv(c) or [""])[0] in QUICK])
def test_quick_readme_command_runs_as_printed(line):
    r = run_as_printed(line, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()


def test_quick_set_is_not_empty():
    """The README prints at least one command of the quick set (or the test above checks nothing)."""
    assert any((draftwise_argv(c) or [""])[0] in QUICK for c in readme_commands())


# ---- the commands that load the packaged models -----------------------------------------------------


@pytest.mark.integration
def test_readme_generate_runs_as_printed():
    require_packaged("qwen2.5-coder-1.5b-instruct")
    require_packaged("qwen2.5-coder-0.5b-instruct")
    (line,) = [c for c in readme_commands() if (draftwise_argv(c) or [""])[0] == "generate"]
    r = run_as_printed(line, timeout=1800)  # a hang guard: a fresh cache prepares both models first
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"].strip()
    assert out["spec"]["num_drafts"] > 0  # the draft model speculated


@pytest.mark.integration
def test_readme_python_example_runs_as_printed():
    require_packaged("qwen2.5-coder-1.5b-instruct")
    (code,) = [body for lang, body in fenced_blocks(README) if lang == "python"]
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.integration
def test_readme_serve_and_curl_run_as_printed():
    require_packaged("qwen2.5-coder-1.5b-instruct")
    commands = readme_commands()
    (serve,) = [c for c in commands if (draftwise_argv(c) or [""])[0] == "serve"]
    (curl,) = [c for c in commands if c.startswith("curl ")]
    port = 8000
    if not _port_free(port):  # another server on this machine: the same lines on a free port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve += f" --port {port}"
        curl = curl.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    line = shlex.join(shlex.split(serve, comments=True))
    if not (ROOT / ".venv" / "bin" / "draftwise").exists():
        line = line.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    proc = subprocess.Popen(["bash", "-c", "exec " + line], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 1800
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "serve did not answer /health within 1800 s"
            probe = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{port}/health"], capture_output=True)
            if probe.returncode == 0:
                break
            time.sleep(1)
        r = run_as_printed(curl, timeout=300)
        assert r.returncode == 0, r.stderr
        body = json.loads(r.stdout)
        assert body["choices"][0]["message"]["content"].strip(), body
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_every_script_is_in_the_index():
    """scripts/README.md names every file under scripts/ (and no script that is gone)."""
    index = (ROOT / "scripts" / "README.md").read_text()
    files = {p.name for p in (ROOT / "scripts").iterdir() if p.is_file() and p.name != "README.md"}
    named = set(re.findall(r"`([\w.-]+\.(?:py|sh|cpp))`", index.split("## Removed")[0]))
    assert files - named == set(), f"scripts/README.md does not name {sorted(files - named)}"
    assert named - files == set(), f"scripts/README.md names scripts that are gone: {sorted(named - files)}"


# ---- links ---------------------------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_github_anchor_rule():
    assert github_anchor("On vLLM (`--engine vllm`)") == "on-vllm---engine-vllm"
    assert github_anchor("Quality (KL against the file)") == "quality-kl-against-the-file"
    assert github_anchor("Plain decoding against llama.cpp") == "plain-decoding-against-llamacpp"


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc):
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)

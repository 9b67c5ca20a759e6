"""Two servers of the packaged 0.5B started at the same moment against an empty autotune cache, one plain and one
with n-gram speculation (what anyone comparing "with and without speculation" does): `auto` on a quantized GGUF
is the faithful plan, read off the file with nothing timed, so both run the same plan, write no autotune entry,
and return the same greedy JSON for the same response_format requests. (Two processes tuning one plan under the
file lock: tests/test_kernels_autotune.py.) Integration: two real `draftwise serve` processes, ~2-4 min on 2 CPU
cores."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from draftwise.paths import default_cache_dir

pytestmark = pytest.mark.integration

MODEL = "qwen2.5-coder-0.5b-instruct"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "language": {"type": "string"},
                                           "year": {"type": "integer"}},
          "required": ["name", "language", "year"], "additionalProperties": False}
QUESTIONS = ["Describe the Python programming language as JSON.", "Give a JSON record for the C language.",
             "Return JSON about Rust: name, language, year."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cache_without_plans(root: Path) -> Path:
    """The real cache's models, conversions and built kernels, with an empty autotune directory."""
    real = Path(default_cache_dir())
    (root / "kernels" / "autotune").mkdir(parents=True)
    for name in ("models", "converted"):
        if (real / name).exists():
            (root / name).symlink_to(real / name)
    for entry in (real / "kernels").iterdir() if (real / "kernels").exists() else ():
        if entry.name != "autotune":
            (root / "kernels" / entry.name).symlink_to(entry)
    return root


def _get(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_ready(proc: subprocess.Popen, port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stdout.read()[-3000:]}")
        try:
            _get(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError("server did not start in time")


def test_plain_and_ngram_servers_started_together_agree_on_plan_and_json(tmp_path):
    from tests.conftest import require_packaged

    require_packaged(MODEL)
    cache = _cache_without_plans(tmp_path / "cache")
    env = {**os.environ, "DRAFTWISE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    specs = [None, json.dumps({"method": "ngram", "num_speculative_tokens": 4})]
    ports, procs = [], []
    try:
        for spec in specs:
            port = _free_port()
            cmd = [sys.executable, "-m", "draftwise.cli", "serve", "--model", MODEL, "--port", str(port),
                   "--max-num-seqs", "2", "--max-model-len", "1024", "--log-level", "warning"]
            cmd += ["--speculative-config", spec] if spec else []
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            ports.append(port)
        deadline = time.monotonic() + 900
        for proc, port in zip(procs, ports):
            _wait_ready(proc, port, deadline)
        plans = [_get(f"http://127.0.0.1:{p}/v1/models")["data"][0]["draftwise"]["plan"] for p in ports]
        assert plans[0]["summary"] == plans[1]["summary"] and plans[0]["weights"] == "faithful"
        assert all(p["faithful"] and not p["lossy"] and p["row_exact"] for p in plans)
        assert not list((cache / "kernels" / "autotune").glob("*.json"))  # nothing was timed for a faithful plan
        fmt = {"type": "json_schema", "json_schema": {"name": "language", "schema": SCHEMA}}
        for q in QUESTIONS:
            body = {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 48,
                    "temperature": 0, "response_format": fmt}
            texts = [_get(f"http://127.0.0.1:{p}/v1/chat/completions", body)["choices"][0]["message"]["content"]
                     for p in ports]
            assert texts[0] == texts[1], q
            json.loads(texts[0])  # a whole object within max_tokens
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

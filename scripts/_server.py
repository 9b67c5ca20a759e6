"""The one `draftwise serve` driver of the measurement scripts: start the server of this checkout on a free loopback
port, wait until /health answers, read /metrics (raw text, and the speculation counters and RSS parsed the way the
bench lab parses them), stop it with SIGTERM (SIGKILL after a grace period).

Used by bench_server.py, bench_concurrency.py, bench_served_methods.py, flood_server.py and heal_server.py; soak_server.py keeps its own for now (see
scripts/README.md). A script module, not part of the package: nothing under draftwise/ imports it. Its parsing comes
from draftwise/bench/clients.py, so a script and `draftwise bench --endpoint` read the same counters.

    from _server import DraftwiseServer
    with DraftwiseServer(["--model", "gemma-3-270m", "--max-num-seqs", "2"]) as server:
        httpx.post(server.url + "/v1/completions", json={...})
        counters = server.spec_counters()
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from draftwise.bench.clients import parse_rss, parse_spec_metrics  # noqa: E402


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DraftwiseServer:
    """`python -m draftwise.cli serve ARGS --port P` from this checkout, HF_HUB_OFFLINE=1, on a free loopback port.

    `serve_args` are the serve flags (model, limits, speculative config; not --port). The constructor starts the
    process and, unless `wait=False`, blocks until /health answers 200: SystemExit when the process exits first or
    `load_timeout_s` passes (the process is then stopped). `log` (a path) takes the server's stdout and stderr, else
    they go to this process's."""

    def __init__(self, serve_args: list[str], *, load_timeout_s: float = 900.0, log: str | Path | None = None,
                 env: dict[str, str] | None = None, wait: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "draftwise.cli", "serve", *serve_args, "--port", str(self.port)]
        out = open(log, "w") if log else None
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                                     stdout=out, stderr=subprocess.STDOUT if out else None)
        if out:
            out.close()
        self.load_s: float | None = None
        if wait:
            self.wait_healthy(load_timeout_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_healthy(self, timeout_s: float) -> float:
        """Block until GET /health is 200; returns the seconds since start. SystemExit if the server exits first or
        the timeout passes (then it is stopped)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode} while loading: {' '.join(self.cmd)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.load_s = time.monotonic() - t0
                    return self.load_s
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"the server did not answer /health within {timeout_s:g} s: {' '.join(self.cmd)}")

    def model(self) -> str:
        """The served model's name (GET /v1/models)."""
        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def metrics(self) -> str:
        """/metrics as Prometheus text."""
        return httpx.get(self.url + "/metrics", timeout=30).text

    def spec_counters(self) -> dict:
        """num_drafts, num_draft_tokens, num_accepted_tokens (and accepted_per_position) from /metrics; zeros before
        the first speculative step."""
        return parse_spec_metrics(self.metrics()) or {"num_drafts": 0.0, "num_draft_tokens": 0.0,
                                                      "num_accepted_tokens": 0.0, "accepted_per_position": []}

    def rss_bytes(self) -> float | None:
        """The server's resident memory as its /metrics reports it (process_resident_memory_bytes)."""
        return parse_rss(self.metrics())

    def stop(self, grace_s: float = 60.0) -> int | None:
        """SIGTERM (the server finishes requests in flight, up to its --shutdown-timeout), SIGKILL after `grace_s`;
        returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "DraftwiseServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

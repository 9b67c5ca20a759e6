"""The server listens before its engine is ready (server/boot.py): /health is 503 "starting" with Retry-After from
the first moment, other routes 503 engine_unavailable; then "ready" and served; a load that fails is 503 "failed"
naming the cause, and the server is told to exit. The engine is the tiny model of tests/harness.py built in a child
process whose factory sleeps first (a slow load)."""
from __future__ import annotations

import functools
import time

import httpx

from draftwise.server.app import create_app
from draftwise.server.boot import BootApp
from draftwise.server.engine_host import EngineProcess
from tests.harness import MODEL, Server, tiny_llm

TIMEOUT_S = 600  # catches a hang only (a child's interpreter start on a busy machine)


def _slow_tiny(delay_s: float):
    time.sleep(delay_s)
    return tiny_llm()


def _fails():
    raise RuntimeError("no such checkpoint: /nowhere")


def test_health_says_starting_until_the_engine_is_ready():
    engine = EngineProcess(functools.partial(_slow_tiny, 2.0))
    ready = []
    boot = BootApp(lambda: engine.front, lambda: create_app(engine, MODEL), on_ready=ready.append,
                   abandon=engine.kill)
    with Server(boot) as s:
        boot.server = s.server
        h = httpx.get(s.url + "/health", timeout=30)
        assert h.status_code == 503 and h.json()["state"] == "starting", h.text
        assert int(h.headers["retry-after"]) >= 1
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "w1", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert "retry-after" in r.headers
        deadline = time.monotonic() + TIMEOUT_S
        while httpx.get(s.url + "/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.05)
        assert httpx.get(s.url + "/health", timeout=30).json()["state"] == "ready" and len(ready) == 1
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "w1", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        assert not s.server.should_exit


def test_a_load_that_fails_is_failed_and_the_server_exits():
    engine = EngineProcess(_fails)
    boot = BootApp(lambda: engine.front, lambda: create_app(engine, MODEL), abandon=engine.kill)
    with Server(boot) as s:
        boot.server = s.server
        deadline = time.monotonic() + TIMEOUT_S
        while boot.failed is None:
            assert time.monotonic() < deadline, "the failed load was never noticed"
            time.sleep(0.05)
        assert "no such checkpoint" in str(boot.failed) and s.server.should_exit

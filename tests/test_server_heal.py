"""A server that heals (runner.py supervision, engine_host replay): the engine child SIGKILLed mid-generation is
restarted, and every request in flight — greedy and seeded sampled, streamed and whole — ends 200 with the text
an undisturbed run gives; /health says "restarting" (503, Retry-After) then "ready"; /metrics counts the death by
cause and the replays. Planted faults the same checks must catch: a replay from the prompt alone (the client's
text duplicated), a supervisor that does not restart, and (tests/test_sampling_replay.py) a sampler whose replay
draws new numbers. Past the restart limit the server answers 503 naming the cause. Tiny models built in the
child from tests/harness.py; each engine process costs a fresh interpreter (~3-5 s on a quiet machine; the
timeouts are generous because a busy one takes far longer: they only catch a hang). The reference run is the
same server with the engine on a thread (no child to spawn)."""
from __future__ import annotations

import functools
import os
import signal
import threading
import time

import httpx
import pytest

from draftwise.bench.clients import stream_sse
from draftwise.server import runner as runner_mod
from draftwise.server.app import create_app
from draftwise.server.engine_host import EngineProcess
from draftwise.server.runner import RestartPolicy
from tests.harness import MODEL, Server, metric, tiny_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
MAX_TOKENS = 400  # long enough that the kill lands mid-generation
TIMEOUT_S = 900  # catches a hang only (a respawn that must build the CPU kernels on a busy machine takes minutes)
BODIES = [  # 2 greedy, 2 seeded sampled (one with penalties: they count the replayed output)
    {"prompt": "w1 w2 w3 w1 w2 w3 w1 w2", "temperature": 0},
    {"prompt": "w9 w8 w7", "temperature": 0, "stream": False},
    {"prompt": "w5 w5 w5 w5 w6 w5 w5 w5 w5", "temperature": 0.8, "seed": 7},
    {"prompt": "w10 w20 w30 w40 w10 w20", "temperature": 1.0, "seed": 11, "frequency_penalty": 0.5, "top_p": 0.9},
]


def _factory():
    return functools.partial(tiny_llm, NGRAM, max_model_len=1024)


def _body(b: dict) -> dict:
    return {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, **b}


def _one(url: str, body: dict, started: threading.Event, out: dict, i: int) -> None:
    """One request; out[i] = (status, text, error event or None, finish_reason)."""
    try:
        if not body.get("stream"):
            started.set()
            r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
            js = r.json()
            if r.status_code != 200:
                out[i] = (r.status_code, "", js.get("error"), None)
                return
            out[i] = (200, js["choices"][0]["text"], None, js["choices"][0]["finish_reason"])
            return
        with httpx.Client(timeout=TIMEOUT_S) as http:  # the bench's SSE reader (an error event is an error)
            res, status, _ = stream_sse(http, url + "/v1/completions", body, on_text=lambda _t: started.set())
        if status != 200:
            out[i] = (status, "", res.error, None)
            return
        out[i] = (200, res.text, res.error, res.finish_reason)
    except Exception as e:  # noqa: BLE001 — reported as the outcome
        out[i] = (None, "", repr(e), None)


def _run(server: Server, kill: bool) -> dict:
    """BODIES concurrently; with `kill`, the engine child is SIGKILLed once every stream has text. Returns
    {"results": [...], "health": [...], "after": status of a new request, "restart_s": ...}."""
    out: dict = {}
    started = [threading.Event() for _ in BODIES]
    threads = [threading.Thread(target=_one, args=(server.url, _body(b), started[i], out, i)) for i, b in
               enumerate(BODIES)]
    for t in threads:
        t.start()
    health, t_kill = [], None
    if kill:
        for ev in started:
            assert ev.wait(TIMEOUT_S), "a request never started"
        runner = server.app.state.runner
        t_kill, restarts = time.monotonic(), runner.restarts
        os.kill(runner.host.pid, signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT_S
        while runner.state == "ready" and time.monotonic() < deadline:  # until the server has seen the death
            time.sleep(0.01)
        while time.monotonic() < deadline:  # what /health says until the engine is back
            h = httpx.get(server.url + "/health", timeout=60)
            health.append((h.status_code, h.json().get("state"), h.headers.get("retry-after")))
            if (h.status_code == 200 and runner.restarts > restarts) or health[-1][1] == "failed":
                break
            time.sleep(0.05)
    for t in threads:
        t.join(TIMEOUT_S)
    after = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "w1 w2", "max_tokens": 4},
                       timeout=TIMEOUT_S)
    return {"results": [out.get(i) for i in range(len(BODIES))], "health": health, "after": after.status_code,
            "after_s": None if t_kill is None else time.monotonic() - t_kill}


def _problems(reference: dict, disturbed: dict) -> list[str]:
    """What the disturbed run got wrong against the undisturbed one (empty: healed)."""
    bad = []
    for i, (want, got) in enumerate(zip(reference["results"], disturbed["results"])):
        if got is None or got[0] != 200 or got[2] is not None:
            bad.append(f"request {i}: {got}")
        elif got[1] != want[1]:
            bad.append(f"request {i}: text differs ({len(got[1])} chars vs {len(want[1])})")
        elif got[3] != want[3]:
            bad.append(f"request {i}: finish {got[3]} vs {want[3]}")
    if disturbed["after"] != 200:
        bad.append(f"a request after the kill got {disturbed['after']}")
    if not disturbed["health"] or disturbed["health"][-1][0] != 200:
        bad.append(f"/health never ready again: {disturbed['health'][-3:]}")
    return bad


@pytest.fixture(scope="module")
def reference():
    with Server(create_app(_factory()(), MODEL)) as s:  # the engine on a thread: the same tokens, no child
        ref = _run(s, kill=False)
    assert all(r[0] == 200 and r[2] is None for r in ref["results"]), ref
    assert all(len(r[1].split()) == MAX_TOKENS for r in ref["results"])  # word-level tokenizer: a word per token
    return ref


def test_a_killed_engine_is_restarted_and_every_request_finishes_exactly(reference):
    """With a standby child (what `draftwise serve` runs): the restart hands it the factory."""
    engine = EngineProcess(_factory())
    with Server(create_app(engine, MODEL, restart_policy=RestartPolicy(standby=True))) as s:
        first_pid = engine.pid
        deadline = time.monotonic() + TIMEOUT_S
        while engine.standby is None and time.monotonic() < deadline:  # prepared once the engine is ready
            time.sleep(0.05)
        standby_pid = engine.standby.pid
        assert httpx.get(s.url + "/health").json()["engine_pid"] == first_pid
        got = _run(s, kill=True)
        assert _problems(reference, got) == []
        runner = s.app.state.runner
        assert runner.host.pid == standby_pid and runner.restarts == 1
        assert httpx.get(s.url + "/health").json()["engine_pid"] == standby_pid
        states = {h[1] for h in got["health"]}
        assert "restarting" in states and got["health"][-1][:2] == (200, "ready")
        assert all(h[2] is not None and int(h[2]) >= 1 for h in got["health"] if h[0] == 503)  # Retry-After
        m = s.metrics()
        assert metric(m, "draftwise:engine_deaths_total", cause="SIGKILL") == 1
        assert metric(m, "draftwise:engine_restarts_total", cause="SIGKILL") == 1
        assert metric(m, "draftwise:requests_replayed_total") >= 1
        assert metric(m, "draftwise:engine_restart_seconds_count") == 1
        assert metric(m, "draftwise:engine_state", state="ready") == 1
        assert metric(m, "draftwise:request_success_total", finished_reason="length") == len(BODIES) + 1
        # past the restart limit: 503 naming the cause, for good (one more death than the limit allows)
        runner.restart_policy.max_restarts = 1
        os.kill(runner.host.pid, signal.SIGKILL)
        deadline = time.monotonic() + TIMEOUT_S
        while runner.state != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        h = httpx.get(s.url + "/health", timeout=60)
        assert h.status_code == 503 and h.json()["state"] == "failed"
        msg = h.json()["error"]["message"]
        assert "SIGKILL" in msg and "not restarting" in msg, msg
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "w1", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and "SIGKILL" in r.json()["error"]["message"]
        m = s.metrics()
        assert metric(m, "draftwise:engine_deaths_total", cause="SIGKILL") == 2
        assert metric(m, "draftwise:engine_restarts_total", cause="SIGKILL") == 1
        assert metric(m, "draftwise:engine_state", state="failed") == 1
    engine.join(10)


def _prompt_alone(req, more=0):
    """Planted fault: replay from the prompt alone (the output the client already has is generated again)."""
    return runner_mod.AddCommand(req.request_id, req.prompt_ids, req.params, req.speculate, req.cache_scope,
                                 req.arrival_time, more=more)


@pytest.mark.parametrize("fault", ["replay_from_prompt_alone", "no_restart"])
def test_planted_faults_are_caught(reference, fault, monkeypatch):
    policy = None
    if fault == "replay_from_prompt_alone":
        monkeypatch.setattr(runner_mod, "_add_command", _prompt_alone)
    else:
        policy = RestartPolicy(max_restarts=0)  # a supervisor that does not restart
    engine = EngineProcess(_factory())
    with Server(create_app(engine, MODEL, restart_policy=policy)) as s:
        got = _run(s, kill=True)
        problems = _problems(reference, got)
        assert problems, "the planted fault went unnoticed"
        if fault == "replay_from_prompt_alone":  # every request ends 200, but its text repeats what it had sent
            assert all(r[0] == 200 for r in got["results"])
            assert any("text differs" in p for p in problems)
        else:
            assert got["after"] == 503 and got["health"][-1][:2] == (503, "failed")
    engine.join(10)


def test_backoff_grows_while_children_die_young():
    p = RestartPolicy(backoff_s=1.0, max_backoff_s=8.0)
    assert [p.backoff(n) for n in range(1, 7)] == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0]

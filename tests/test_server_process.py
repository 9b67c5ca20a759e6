"""The engine in its own process (server/engine_host.EngineProcess, what `draftwise serve` runs): the same tokens
as the library through it (greedy, whole and streamed, n > 1, logprobs, stop strings, structured outputs), engine
counters forwarded to /metrics, a clean stop, the child dying with its parent (SIGKILL), and a child that dies
or cannot load reported clearly (with restarts off). Tiny models built in the child from tests/harness.py (no downloads); each
EngineProcess costs a fresh interpreter (~3-5 s)."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from draftwise.config import ConfigError
from draftwise.sampling import SamplingParams
from draftwise.server.app import create_app
from draftwise.server.engine_host import EngineProcess
from draftwise.server.runner import RestartPolicy
from tests.harness import MODEL, PROMPTS, Server, json_llm, metric, tiny_llm

ROOT = Path(__file__).resolve().parent.parent
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def proc_server():
    engine = EngineProcess(functools.partial(tiny_llm, NGRAM, max_model_len=1024))
    app = create_app(engine, MODEL)
    with Server(app) as s:
        yield s
    engine.join(10)
    assert engine.process.exitcode == 0  # told to stop at the lifespan's end, it stopped by itself


def _texts(server, prompts, stream: bool, **extra) -> list[str]:
    out = []
    for p in prompts:
        body = {"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}
        if not stream:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
            continue
        parts = []
        with httpx.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    parts += [c.get("text") or "" for c in json.loads(line[6:])["choices"]]
        out.append("".join(parts))
    return out


def test_greedy_through_the_process_equals_the_library(proc_server):
    lib = tiny_llm(NGRAM, max_model_len=1024)  # the same seeded weights, built here
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in lib.generate(PROMPTS, params)]
    assert _texts(proc_server, PROMPTS, stream=False) == want
    assert _texts(proc_server, PROMPTS, stream=True) == want
    # a stop string: the engine (child) stops at it, the server cuts the text the same way
    stop = want[0].split()[3]
    cut = lib.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stop": [stop]}
    js = httpx.post(proc_server.url + "/v1/completions", json=body, timeout=60).json()
    assert js["choices"][0]["text"] == cut.outputs[0].text and js["choices"][0]["finish_reason"] == "stop"
    assert js["usage"]["completion_tokens"] == len(cut.outputs[0].token_ids)


def test_n_logprobs_and_metrics_through_the_process(proc_server):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.8, "seed": 3, "n": 2,
            "logprobs": 2}
    js = httpx.post(proc_server.url + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in js["choices"]] == [0, 1]
    for c in js["choices"]:
        assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["token_logprobs"]) > 0
    assert js["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in js["choices"])
    m = proc_server.metrics()
    assert metric(m, "draftwise:spec_decode_num_drafts_total") > 0  # engine counters cross the pipe
    assert metric(m, "draftwise:engine_step_seconds_count") > 0
    card = httpx.get(proc_server.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 1024
    info = httpx.get(proc_server.url + "/draftwise/info").json()
    assert info["speculative_config"]["method"] == "ngram" and info["max_num_seqs"] == 4


def test_structured_output_grammar_lives_in_the_child():
    item = {"type": "object", "properties": {"qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["qty"], "additionalProperties": False}
    engine = EngineProcess(functools.partial(json_llm, {"method": "grammar", "num_speculative_tokens": 6},
                                             max_model_len=512))
    with Server(create_app(engine, MODEL)) as s:
        fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": item, "strict": True}}
        for seed in range(2):
            out = s.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "qty?"}], response_format=fmt, max_tokens=120,
                temperature=1.0, seed=seed)
            assert out.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.choices[0].message.content), item)
    engine.join(10)


def test_child_killed_mid_request_is_a_clear_error_and_the_server_stays_up():
    """With supervision off (--max-restarts 0; tests/test_server_heal.py has the restart)."""
    engine = EngineProcess(functools.partial(tiny_llm, max_model_len=4096))
    with Server(create_app(engine, MODEL, restart_policy=RestartPolicy(max_restarts=0))) as s:
        body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            os.kill(engine.pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["code"] == "engine_unavailable" and "signal 9" in err["message"], err
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "signal 9" in health.text
        again = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "w1", "max_tokens": 2})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_unavailable"


def _fails_to_load():
    raise RuntimeError("no such checkpoint: /nowhere")


def test_a_load_failure_in_the_child_names_its_cause():
    with pytest.raises(ConfigError, match="could not load the model: RuntimeError: no such checkpoint"):
        EngineProcess(_fails_to_load).front  # the constructor returns at once; the front waits for the load


PARENT = """
import functools, sys, time
sys.path.insert(0, {root!r})
from draftwise.server.engine_host import EngineProcess
from tests.harness import tiny_llm
if __name__ == "__main__":
    engine = EngineProcess(functools.partial(tiny_llm))
    print(engine.pid, flush=True)
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state and "\nState:\tX" not in state  # a zombie is dead, only not reaped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_child_dies_with_its_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(root=str(ROOT)))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()  # SIGKILL: no atexit, no cleanup in the parent
        parent.wait(10)
        deadline = time.time() + 10
        while _alive(child):
            assert time.time() < deadline, f"engine process {child} outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.integration
def test_packaged_model_through_the_process_equals_the_library():
    """The packaged 0.5B with n-gram speculation: `draftwise serve`'s engine process gives the library's tokens."""
    from draftwise.api import LLM

    model, spec = "qwen2.5-coder-0.5b-instruct", {"method": "ngram", "num_speculative_tokens": 3}
    kw = dict(speculative_config=spec, max_num_seqs=4, max_model_len=2048)
    engine = EngineProcess(functools.partial(LLM, model, **kw))
    prompts = ["def fib(n):\n", "# a stack class in Python\nclass Stack:\n"]
    want = [o.outputs[0].text for o in LLM(model, **kw).generate(
        prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))]
    with Server(create_app(engine, model)) as s:
        for stream in (False, True):
            got = []
            for p in prompts:
                body = {"model": model, "prompt": p, "max_tokens": 32, "temperature": 0,
                        "extra_body": {"ignore_eos": True}}
                if stream:
                    chunks = s.client().completions.create(**body, stream=True)
                    got.append("".join(c.choices[0].text for c in chunks if c.choices))
                else:
                    got.append(s.client().completions.create(**body).choices[0].text)
            assert got == want
    engine.join(10)


NICE = """
import functools, os, sys, threading
sys.path.insert(0, {root!r})
from draftwise.server.cli import lower_priority
from draftwise.server.engine_host import EngineProcess
from tests.harness import tiny_llm
if __name__ == "__main__":
    base = os.getpriority(os.PRIO_PROCESS, 0)
    engine = EngineProcess(functools.partial(tiny_llm))  # what cmd_serve does: the child first, then lower_priority
    lower_priority(4)
    seen = {{}}
    t = threading.Thread(target=lambda: seen.update(thread=os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    t.start(); t.join()
    engine.front  # loaded: the child's own threads exist now too
    child = max(os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{{engine.pid}}/task"))
    print(base, os.getpriority(os.PRIO_PROCESS, 0), seen["thread"], child, flush=True)
    engine.kill()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values, /proc")
def test_server_nice_lowers_the_server_not_the_engine(tmp_path):
    """--server-nice: the HTTP process and every thread it starts later yield to the engine process, whose
    threads keep the priority the server had."""
    script = tmp_path / "nice.py"
    script.write_text(NICE.format(root=str(ROOT)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr
    base, main, thread, child = map(int, out.stdout.split())
    assert (main, thread, child) == (min(base + 4, 19), min(base + 4, 19), base)


def test_server_nice_never_raises_a_priority():
    from draftwise.server.cli import lower_priority

    with pytest.raises(ConfigError, match="--server-nice must be >= 0"):
        lower_priority(-1)


class _StepOnceLLM:
    """The LLM that serve_engine drives, as far as its admission goes: added requests pile up; the first step reports
    how many (`on_step(n)`) and raises `stop` (a BaseException: serve_engine catches Exception only)."""

    def __init__(self, on_step, stop):
        self.pending, self.on_step, self.stop = [], on_step, stop

    def has_unfinished(self):
        return bool(self.pending)

    def new_request(self, prompt, params):
        from types import SimpleNamespace

        return SimpleNamespace(), None  # a request the engine host sets its fields on

    def add_request(self, req):
        self.pending.append(req)

    def step(self):
        self.on_step(len(self.pending))
        raise self.stop


def test_an_idle_engine_admits_requests_sent_together_in_one_step(monkeypatch):
    """serve_engine, idle, takes the requests that arrive a few ms apart (as the server tokenizes concurrent
    clients one after another) before its first step, so they are prefilled together; planted: without the
    admission window the first step runs the first request alone (the fourth session's
    server waves, PERFORMANCE.md)."""
    from draftwise.server import engine_host

    class Done(BaseException):  # ends the loop from inside step (serve_engine catches Exception only)
        pass

    class Conn:  # commands become readable at their offsets (s) from the first recv
        def __init__(self, offsets):
            self.cmds = [(o, ("add", engine_host.AddCommand(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1))))
                         for i, o in enumerate(offsets)]
            self.t0 = None

        def _ready(self):
            return self.cmds and time.perf_counter() - self.t0 >= self.cmds[0][0]

        def poll(self, timeout=0.0):
            end = time.perf_counter() + timeout
            while not self._ready() and time.perf_counter() < end:
                time.sleep(0.0002)
            return bool(self._ready())

        def recv(self):
            if self.t0 is None:
                self.t0 = time.perf_counter()
            while not self._ready():
                time.sleep(0.0002)
            return self.cmds.pop(0)[1]

        def send(self, msg):
            pass

    def first_step(window):
        monkeypatch.setattr(engine_host, "ADMIT_WINDOW_S", window)
        batches = []
        with pytest.raises(Done):
            engine_host.serve_engine(_StepOnceLLM(batches.append, Done), Conn([0.0, 0.003, 0.006, 0.009]))
        return batches[0]

    assert first_step(engine_host.ADMIT_WINDOW_S) == 4
    assert first_step(0.0) < 4  # planted: no window (the first step starts before the last request is in)


def test_an_idle_engine_waits_for_the_requests_an_add_announces(monkeypatch):
    """An add says how many requests the server was still reading or tokenizing when it sent it
    (AddCommand.more): an idle engine waits for them before its first step, even when they come further apart
    than the admission window (4.5-12 ms between adds on a loaded machine: 1 + 3 waves), and no longer than
    ADMIT_ANNOUNCED_MAX_S when one never comes. On a virtual clock (the loop reads time.perf_counter and
    conn.poll's timeouts): what is asserted is the order of events, not a duration. Planted: adds that announce
    nothing (the old protocol) start the first step with the first request alone."""
    from types import SimpleNamespace

    from draftwise.server import engine_host

    class Done(BaseException):  # ends the loop from inside step (serve_engine catches Exception only)
        pass

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(engine_host, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    class Conn:  # commands arrive at their virtual times (s); waiting advances the clock
        def __init__(self, arrivals):
            self.cmds = [(t, ("add", engine_host.AddCommand(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1),
                                                           more=more)))
                         for i, (t, more) in enumerate(arrivals)]

        def poll(self, timeout=0.0):
            if self.cmds and self.cmds[0][0] <= clock.now + timeout:
                clock.now = max(clock.now, self.cmds[0][0])
                return True
            clock.now += timeout
            return False

        def recv(self):
            t, cmd = self.cmds.pop(0)
            clock.now = max(clock.now, t)
            return cmd

        def send(self, msg):
            pass

    def first_step(arrivals):
        clock.now = 0.0
        steps = []
        with pytest.raises(Done):
            engine_host.serve_engine(_StepOnceLLM(lambda n: steps.append((n, clock.now)), Done), Conn(arrivals))
        return steps[0]

    apart = [0.0, 0.012, 0.030, 0.042]  # each gap beyond ADMIT_WINDOW_S, the last beyond ADMIT_WINDOW_MAX_S
    assert apart[-1] > engine_host.ADMIT_WINDOW_MAX_S and apart[-1] < engine_host.ADMIT_ANNOUNCED_MAX_S
    admitted, at = first_step(list(zip(apart, [3, 2, 1, 0])))
    assert admitted == 4
    assert at <= apart[-1] + engine_host.ADMIT_WINDOW_S  # the last announced one in: no waiting past the window
    assert first_step(list(zip(apart, [0, 0, 0, 0])))[0] == 1  # planted: nothing announced -> a 1 + 3 wave
    admitted, at = first_step([(0.0, 1)])  # announced, never sent (it failed validation): the bound
    assert admitted == 1 and at == pytest.approx(engine_host.ADMIT_ANNOUNCED_MAX_S)


def test_an_add_announces_the_requests_still_being_prepared():
    """EngineRunner: an add sent while other requests are inside `preparing()` (the route reading and tokenizing
    them) says how many (AddCommand.more), at most the engine's slots left after it; one sent with none left
    announces none. Planted: counting the request itself, or ignoring the slots, is caught by the exact values."""
    import asyncio
    from types import SimpleNamespace

    from draftwise.server.metrics import ServerMetrics
    from draftwise.server.runner import EngineRunner

    front = SimpleNamespace(max_num_seqs=3)
    runner = EngineRunner(SimpleNamespace(front=front, conn=None), ServerMetrics("m", 3))
    runner._ready = runner._reading = True  # as start() leaves them (no engine pipe is read here)
    sent = []
    runner._send = sent.append

    def shadow(i):
        return SimpleNamespace(request_id=f"r{i}", prompt_ids=[1, 2], params=SamplingParams(max_tokens=1),
                               speculate=True, cache_scope="", arrival_time=0.0, output_ids=[])

    async def main():
        with runner.preparing():  # r0's own preparation is over before it is queued
            pass
        with runner.preparing(), runner.preparing(), runner.preparing():  # three more still being read
            runner.enqueue((shadow(0), None, None))
            with runner.preparing():  # a fourth: one more than the slots left after r1
                runner.enqueue((shadow(1), None, None))
        runner.enqueue((shadow(2), None, None))

    asyncio.run(main())
    assert [(cmd.request_id, cmd.more) for _, cmd in sent] == [("r0", 2), ("r1", 1), ("r2", 0)]

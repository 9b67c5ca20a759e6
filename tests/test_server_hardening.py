"""Server hardening: hostile input, overload, engine failures and shutdown, over real HTTP.

One test (or parametrized group) per item of the issue's server half: bounded stop strings (1), tokenizing off
the event loop and the checks before it (3), number / seed / Unicode / nesting validation (4), chat roles and
content parts (5), the field policy (6), host / origin / content type / API key / 500 bodies (7), admission
control and engine failures (8), graceful shutdown (9) and the per-position acceptance series (14). Plus a
schemathesis fuzz run over the server's own OpenAPI schema (marked slow). Engine trouble is simulated by wrapping
`engine.step` (slow, blocked, raising): no timing asserts, only timeouts that catch a hang.
No downloads: the tiny LLM and the server fixture come from tests/harness.py.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import uvicorn

from draftwise.output import TextStream
from draftwise.sampling import SamplingParams, process_logits
from draftwise.server import protocol
from draftwise.server.app import create_app
from draftwise.server.limits import RequestLimits
from draftwise.server.shutdown import GracefulServer
from tests.harness import MODEL, Server, metric, tiny_llm, tiny_tokenizer

GOOD = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 4}
LONG = dict(GOOD, max_tokens=3000, ignore_eos=True)  # far longer than any test waits for


@pytest.fixture(scope="module")
def server():
    with Server(create_app(tiny_llm(max_model_len=4096), MODEL)) as s:
        yield s


def post(server, path, body, timeout=30, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout, **kw)


def error_of(resp, status, param="unset"):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if param != "unset":
        assert body["error"]["param"] == param, body
    return body["error"]


def sse_events(resp) -> list:
    """The data payloads of an SSE response: dicts, and the string "[DONE]"."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


class StepGate:
    """Wraps engine.step: optionally slow (each step sleeps), blocked until released, or raising."""

    def __init__(self, engine, delay: float = 0.0, blocked: bool = False):
        self.engine, self.real, self.delay = engine, engine.step, delay
        self.open = threading.Event()
        if not blocked:
            self.open.set()
        self.raise_next: list[BaseException] = []
        engine.step = self

    def __call__(self):
        self.open.wait(60)
        if self.delay:
            time.sleep(self.delay)
        if self.raise_next:
            raise self.raise_next.pop(0)
        return self.real()

    def restore(self):
        self.open.set()
        self.engine.step = self.real


def wait_until(cond, timeout=30.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.01)


# ---- 1: bounded stop strings ---------------------------------------------------------------------------
STOP_LIMITS = [
    ("too many stop strings", dict(GOOD, stop=[f"w{i}" for i in range(17)]), "stop"),
    ("stop string too long", dict(GOOD, stop=["x" * 257]), "stop"),
    ("too many stop ids", dict(GOOD, stop_token_ids=list(range(65))), "stop_token_ids"),
]


@pytest.mark.parametrize("name,body,param", STOP_LIMITS, ids=[s[0] for s in STOP_LIMITS])
def test_stop_limits_are_400s(server, name, body, param):
    err = error_of(post(server, "/v1/completions", body), 400, param)
    assert param in err["message"]


def test_long_stop_string_holds_back_only_a_real_prefix():
    """A stream holds back exactly the longest text suffix that could still become a stop string."""
    s = TextStream(tiny_tokenizer(), stop=["w9 " + "x" * 200, "w2 w3"])
    tok = tiny_tokenizer()
    shown = ""
    for word in ("w1", "w4", "w5"):
        s.add(tok.token_to_id(word))
        shown += s.delta()
        assert shown == s.text  # nothing held back: no suffix starts a stop string
    s.add(tok.token_to_id("w2"))
    shown += s.delta()
    assert s.text.endswith("w2") and shown == s.text[: -len("w2")]  # "w2" may become "w2 w3"
    s.add(tok.token_to_id("w6"))
    shown += s.delta()
    assert shown == s.text  # it did not: released
    s.add(tok.token_to_id("w2"))
    assert s.add(tok.token_to_id("w3")) and s.stopped
    shown += s.delta()
    assert shown == s.text and not s.text.endswith("w2")


# ---- 3: tokenize off the event loop; limits before tokenizing and queueing --------------------------------
def test_tokenizing_runs_off_the_event_loop(monkeypatch):
    llm = tiny_llm(max_model_len=256)
    entered, release = threading.Event(), threading.Event()
    real = llm.tokenizer.encode

    def slow_encode(text, **kw):
        entered.set()
        release.wait(30)
        return real(text, **kw)

    monkeypatch.setattr(llm.tokenizer, "encode", slow_encode)
    with Server(create_app(llm, MODEL)) as s, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, s, "/v1/completions", GOOD)
        assert entered.wait(30)
        try:  # the event loop is free while a prompt is being tokenized
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
        finally:
            release.set()
        assert pending.result().status_code == 200


def test_prompt_chars_limit_applies_before_tokenizing(monkeypatch):
    llm = tiny_llm(max_model_len=256)
    calls = []
    real_encode, real_chat = llm.tokenizer.encode, llm.tokenizer.encode_chat
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(a) or real_encode(*a, **k))
    monkeypatch.setattr(llm.tokenizer, "encode_chat", lambda *a, **k: calls.append(a) or real_chat(*a, **k))
    with Server(create_app(llm, MODEL, limits=RequestLimits(max_prompt_chars=30))) as s:
        error_of(post(s, "/v1/completions", dict(GOOD, prompt="w1 " * 11)), 400, "prompt")
        msgs = [{"role": "system", "content": "w1 " * 6}, {"role": "user", "content": [{"type": "text",
                                                                                       "text": "w2 " * 6}]}]
        error_of(post(s, "/v1/chat/completions", dict(CHAT, messages=msgs)), 400, "messages")
        assert calls == []
        assert post(s, "/v1/completions", dict(GOOD, prompt="w1 " * 10)).status_code == 200


def test_context_is_checked_before_queueing(monkeypatch):
    llm = tiny_llm(max_model_len=256)
    added = []
    real = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda req: added.append(req) or real(req))
    with Server(create_app(llm, MODEL)) as s:
        err = error_of(post(s, "/v1/completions", dict(GOOD, max_tokens=300)), 400, "max_tokens")
        assert err["code"] == "context_length_exceeded" and "256" in err["message"]
        chat = dict(CHAT, messages=[{"role": "user", "content": "w1 " * 300}], max_tokens=None)
        error_of(post(s, "/v1/chat/completions", chat), 400, "messages")
        assert added == []


# ---- 4: numbers, seeds, Unicode, nesting: 400s, never 500s ----------------------------------------------
def raw(fields: str, chat: bool = False) -> bytes:
    head = ('{"model": "tiny", "messages": [{"role": "user", "content": "w1"}]' if chat else
            '{"model": "tiny", "prompt": "w1", "max_tokens": 2')
    return (head + (", " + fields if fields else "") + "}").encode()


BAD_VALUES = [
    ("NaN temperature", raw('"temperature": NaN'), None),
    ("Infinity temperature", raw('"temperature": Infinity'), None),
    ("-Infinity top_p", raw('"top_p": -Infinity', chat=True), None),
    ("1e999 temperature", raw('"temperature": 1e999'), "temperature"),
    ("temperature above max", raw('"temperature": 100.5'), "temperature"),
    ("1e999 top_p", raw('"top_p": 1e999'), "top_p"),
    ("top_k below -1", raw('"top_k": -2'), "top_k"),
    ("seed 2^64", raw(f'"seed": {2**64}'), "seed"),
    ("seed below -2^63", raw(f'"seed": {-2**63 - 1}'), "seed"),
    ("lone surrogate prompt", b'{"model": "tiny", "prompt": "w1 \\ud83d", "max_tokens": 2}', "prompt"),
    ("lone surrogate in chat", raw('"user": "x", "stop": ["\\udc00"]', chat=True), "stop"),
    ("lone surrogate key", raw('"\\ud83d": 1'), None),
    ("nesting past the limit", raw('"metadata": ' + "[" * 40 + "]" * 40), "metadata"),
    ("nesting past the parser", raw('"metadata": ' + "[" * 100_000 + "]" * 100_000), None),
]


@pytest.mark.parametrize("name,body,param", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_are_400s(server, name, body, param):
    path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
    error_of(post(server, path, body), 400, param)


def test_boundary_values_are_accepted(server):
    for fields in ({"seed": 2**64 - 1}, {"seed": -2**63}, {"temperature": 100}, {"top_k": -1}, {"top_p": 1e-9}):
        assert post(server, "/v1/completions", dict(GOOD, **fields)).status_code == 200, fields


def test_tiny_temperature_is_greedy(server):
    """1e-40 overflowed logits / T to inf (NaN probabilities, one clamped id repeated); below 1e-5 is greedy."""
    assert not torch.isnan(process_logits(torch.randn(3, 64) * 30, 1e-40)).any()
    assert SamplingParams(temperature=1e-40).greedy
    body = dict(GOOD, prompt="w5 w6 w7", max_tokens=12, ignore_eos=True)
    greedy = post(server, "/v1/completions", dict(body, temperature=0)).json()["choices"][0]["text"]
    for seed in (1, 2):
        tiny = post(server, "/v1/completions", dict(body, temperature=1e-40, seed=seed)).json()
        assert tiny["choices"][0]["text"] == greedy


# ---- 5: chat roles and content parts ------------------------------------------------------------------
@pytest.fixture
def rendered(server, monkeypatch):
    """The messages the chat template is given, per request."""
    seen = []
    tok = server.app.state.llm.tokenizer
    real = tok.encode_chat
    monkeypatch.setattr(tok, "encode_chat", lambda messages, **kw: seen.append(messages) or real(messages, **kw))
    return seen


def test_developer_is_system_and_parts_join_with_newline(server, rendered):
    msgs = [{"role": "developer", "content": "w1"},
            {"role": "user", "content": [{"type": "text", "text": "w3"}, {"type": "text", "text": "w4"}]}]
    out = post(server, "/v1/chat/completions", dict(CHAT, messages=msgs)).json()
    assert rendered[-1] == [{"role": "system", "content": "w1"}, {"role": "user", "content": "w3\nw4"}]
    assert out["usage"]["prompt_tokens"] == 6  # "system w1 user w3 w4 assistant"


CHAT_REFUSALS = [
    ("unknown role", [{"role": "wizard", "content": "w1"}], "wizard"),
    ("image part", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_url"),
    ("tool calls on a user message", [{"role": "user", "content": "w1", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "tool_calls"),
    ("tool call without a function", [{"role": "user", "content": "w1"}, {"role": "assistant", "content": None,
                                                                           "tool_calls": [{"id": "a"}]}], "tool_calls"),
]


@pytest.mark.parametrize("name,messages,named", CHAT_REFUSALS, ids=[c[0] for c in CHAT_REFUSALS])
def test_chat_messages_refused_not_dropped(server, name, messages, named):
    err = error_of(post(server, "/v1/chat/completions", dict(CHAT, messages=messages)), 400)
    assert named in err["message"] and err["param"].startswith("messages")


# ---- 6: every field implemented or refused by name; neutral values accepted -----------------------------
NEUTRAL_CHAT = {"logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}, "n": 1,
                "stream_options": None, "user": "u", "presence_penalty": 0, "frequency_penalty": 0.0,
                "logit_bias": {}, "parallel_tool_calls": True, "tools": [], "tool_choice": "none", "seed": 3,
                "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "repetition_penalty": 1,
                "min_p": 0, "min_tokens": 0, "best_of": 1, "echo": False, "skip_special_tokens": True,
                "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
                "max_completion_tokens": 3, "modalities": ["text"], "draftwise": {"provenance": False}}
NEUTRAL_COMPLETION = {"logprobs": None, "suffix": "", "echo": False, "best_of": 1, "n": 1, "user": "u",
                      "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "top_logprobs": 0,
                      "response_format": {"type": "text"}, "add_special_tokens": True, "stream_options": None}


def test_neutral_values_are_accepted(server):
    out = post(server, "/v1/chat/completions", dict(CHAT, **NEUTRAL_CHAT))
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] <= 3  # max_completion_tokens is honoured
    out = post(server, "/v1/completions", dict(GOOD, **NEUTRAL_COMPLETION))
    assert out.status_code == 200, out.text


# implemented fields at values they refuse, and fields still refused (by name) at any non-neutral value
REFUSED = [("min_p", 1.1), ("repetition_penalty", 0), ("min_tokens", -1), ("logit_bias", {"w5": 10}),
           ("logit_bias", {"5": 101}), ("logit_bias", {"64": 1}), ("top_logprobs", 2), ("top_logprobs", 21),
           ("best_of", 2), ("echo", True), ("presence_penalty", 2.5),
           ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}), ("tools", [{"type": "function"}]),
           ("tool_choice", "required"), ("structural_tag", {"type": "x"}), ("n", 17), ("n", 0),
           ("use_beam_search", True), ("allowed_token_ids", [1]), ("chat_template", "{{ x }}"),
           ("add_special_tokens", True), ("frequency_penalty", False), ("no_such_field", 1)]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{r[0]}={r[1]}" for r in REFUSED])
def test_unsupported_values_are_refused_by_name(server, field, value):
    err = error_of(post(server, "/v1/chat/completions", dict(CHAT, **{field: value})), 400, field)
    assert field in err["message"]


def test_completion_only_refusals(server):
    error_of(post(server, "/v1/completions", dict(GOOD, suffix="w9")), 400, "suffix")
    error_of(post(server, "/v1/completions", dict(GOOD, top_logprobs=2)), 400, "top_logprobs")
    error_of(post(server, "/v1/completions", dict(GOOD, logprobs=21)), 400, "logprobs")


def test_draftwise_extension_passes_validation():
    req = protocol.parse(protocol.ChatRequest, dict(CHAT, draftwise={"provenance": True}))
    assert req.draftwise.provenance is True


def test_implemented_fields(server):
    base = dict(GOOD, prompt="w9 w8 w7", max_tokens=10, temperature=0, ignore_eos=True)
    text = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    stop = text.split()[2]
    cut = post(server, "/v1/completions", dict(base, stop=[stop])).json()["choices"][0]
    kept = post(server, "/v1/completions", dict(base, stop=[stop], include_stop_str_in_output=True)).json()
    assert cut["text"] == text[: text.index(stop)]
    assert kept["choices"][0]["text"] == text[: text.index(stop) + len(stop)]
    with_prompt = post(server, "/v1/chat/completions", CHAT).json()["usage"]["prompt_tokens"]
    without = post(server, "/v1/chat/completions", dict(CHAT, add_generation_prompt=False)).json()
    assert without["usage"]["prompt_tokens"] == with_prompt - 1  # the template's trailing "assistant"


def test_continue_final_message_and_skip_special_tokens():
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
    msgs = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2 w3"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|im_end|> ")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True).endswith("w2 w3")
    tok.backend.add_special_tokens(["<|im_end|>"])
    eos = tok.token_to_id("<|im_end|>")
    for skip, expect in ((True, "w1"), (False, "w1<|im_end|>")):
        s = TextStream(tok, skip_special_tokens=skip)
        s.add(tok.token_to_id("w1"))
        s.add(eos)
        s.finish()
        assert s.text.replace(" ", "") == expect
    req = protocol.parse(protocol.CompletionRequest, dict(GOOD, skip_special_tokens=False))
    assert protocol.sampling_params(req, 4).skip_special_tokens is False


# ---- 7: host, origin, content type, API key, 500 bodies ---------------------------------------------------
def test_host_origin_and_content_type(server):
    error_of(httpx.get(server.url + "/v1/models", headers={"host": "evil.example"}), 400)
    error_of(post(server, "/v1/completions", GOOD, headers={"host": "evil.example:80"}), 400)
    error_of(post(server, "/v1/completions", GOOD, headers={"origin": "http://evil.example"}), 403)
    assert post(server, "/v1/completions", GOOD, headers={"origin": server.url}).status_code == 200
    assert post(server, "/v1/completions", GOOD, headers={"host": "localhost"}).status_code == 200
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        error_of(post(server, "/v1/completions", GOOD, headers={"content-type": ctype}), 415)
    preflight = {"origin": "http://evil.example", "access-control-request-method": "POST"}
    resp = httpx.options(server.url + "/v1/completions", headers=preflight)
    assert resp.status_code == 403 and "access-control-allow-origin" not in resp.headers


def test_cors_allow_list():
    app = create_app(tiny_llm(max_model_len=256), MODEL, allowed_origins=["http://app.example"])
    with Server(app) as s:
        pre = httpx.options(s.url + "/v1/completions", headers={
            "origin": "http://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
        resp = post(s, "/v1/completions", GOOD, headers={"origin": "http://app.example"})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "http://app.example"
        error_of(post(s, "/v1/completions", GOOD, headers={"origin": "http://other.example"}), 403)


def test_api_key_on_every_route_but_the_public_ones():
    with Server(create_app(tiny_llm(max_model_len=256), MODEL, api_key="sekret")) as s:
        key = {"Authorization": "Bearer sekret"}
        for path in ("/docs", "/redoc", "/openapi.json", "/metrics", "/v1/models", "/draftwise/info", "/nothing"):
            error_of(httpx.get(s.url + path), 401)
            assert httpx.get(s.url + path, headers=key).status_code in (200, 404), path
        for path in ("/health", "/", "/static/app.js"):
            assert httpx.get(s.url + path).status_code == 200, path


def test_unhandled_error_returns_request_id_not_text(server, monkeypatch, caplog):
    def broken(*a, **k):
        raise ValueError("secret detail")

    monkeypatch.setattr(protocol, "completion_prompt", broken)
    with caplog.at_level("ERROR", logger="draftwise.server"):
        resp = post(server, "/v1/completions", GOOD)
    err = error_of(resp, 500)
    assert "secret" not in err["message"] and resp.headers["x-request-id"] in err["message"]
    assert any(resp.headers["x-request-id"] in r.getMessage() and r.exc_info for r in caplog.records)


# ---- 8: admission control and engine failures ------------------------------------------------------------
def test_full_queue_gets_429_with_retry_after():
    llm = tiny_llm(max_num_seqs=1, max_model_len=256)
    with Server(create_app(llm, MODEL, max_waiting=1)) as s, ThreadPoolExecutor(2) as pool:
        gate = StepGate(llm.engine, blocked=True)
        try:
            runner = s.app.state.runner
            pending = [pool.submit(post, s, "/v1/completions", GOOD) for _ in range(2)]
            wait_until(lambda: runner.in_flight == 2)
            resp = post(s, "/v1/completions", GOOD)
            err = error_of(resp, 429)
            assert err["type"] == "rate_limit_error" and int(resp.headers["retry-after"]) >= 1
        finally:
            gate.restore()
        assert [p.result().status_code for p in pending] == [200, 200]
        assert post(s, "/v1/completions", GOOD).status_code == 200


def test_request_timeout_aborts_and_frees_the_slot():
    llm = tiny_llm(max_model_len=4096)
    with Server(create_app(llm, MODEL, request_timeout=0.5)) as s:
        gate = StepGate(llm.engine, delay=0.02)
        try:
            err = error_of(post(s, "/v1/completions", LONG), 504)
            assert "timeout" in err["message"]
            with httpx.stream("POST", s.url + "/v1/completions", json=dict(LONG, stream=True), timeout=30) as r:
                events = sse_events(r)
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
            wait_until(lambda: s.app.state.runner.in_flight == 0 and llm.engine.num_free_slots == 4)
        finally:
            gate.restore()


class _ThreadDeath(BaseException):
    """Not an Exception: nothing in the runner catches it, so the engine thread ends."""


def test_dead_engine_thread_fails_fast_with_503():
    llm = tiny_llm(max_model_len=4096)
    with Server(create_app(llm, MODEL)) as s, ThreadPoolExecutor(1) as pool:
        gate = StepGate(llm.engine, blocked=True)
        pending = pool.submit(post, s, "/v1/completions", LONG)
        wait_until(lambda: s.app.state.runner.in_flight == 1)
        gate.raise_next.append(_ThreadDeath())
        gate.open.set()
        error_of(pending.result(), 503)  # the request in flight is told, not left hanging
        error_of(post(s, "/v1/completions", GOOD, timeout=10), 503)
        assert httpx.get(s.url + "/health").status_code == 503


def test_a_failing_step_is_retried_once(server):
    llm = server.app.state.llm
    body = dict(GOOD, prompt="w3 w4", max_tokens=8, temperature=0, ignore_eos=True)
    expect = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    gate = StepGate(llm.engine)
    try:
        gate.raise_next.append(RuntimeError("transient"))
        out = post(server, "/v1/completions", body)
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == expect
        gate.raise_next += [RuntimeError("again"), RuntimeError("and again")]
        err = error_of(post(server, "/v1/completions", body), 500)
        assert "again" not in err["message"] and "request id" in err["message"]
    finally:
        gate.restore()
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == expect


def test_engine_error_finish_fails_only_that_request(server):
    """The engine may finish one request with finish_reason "error" (Request.error); only that one fails."""
    engine = server.app.state.llm.engine
    real = engine.step
    poison = 63

    def step():
        outs = real()
        for o in outs:
            if o.request.prompt_ids[0] == poison and not o.request.finished:
                engine.abort(o.request.request_id)
                o.request.finish_reason, o.request.error, o.finished = "error", "RuntimeError: bad row", True
        return outs

    engine.step = step
    try:
        with ThreadPoolExecutor(2) as pool:
            bad = pool.submit(post, server, "/v1/completions", dict(LONG, prompt=[poison, 5], max_tokens=50))
            good = pool.submit(post, server, "/v1/completions", dict(GOOD, max_tokens=20, ignore_eos=True))
            err = error_of(bad.result(), 500)
            assert "bad row" not in err["message"]
            assert good.result().json()["usage"]["completion_tokens"] == 20
    finally:
        engine.step = real


# ---- 9: graceful shutdown -----------------------------------------------------------------------------------
class GracefulTestServer(Server):
    def __init__(self, app, shutdown_timeout: float):
        super().__init__(app)
        self.server = GracefulServer(uvicorn.Config(app, log_level="warning"), app, shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)


@pytest.mark.parametrize("shutdown_timeout,max_tokens,finishes", [(30.0, 40, True), (2.0, 3000, False)],
                         ids=["in-flight-finishes", "in-flight-ended"])
def test_sigterm_drains(shutdown_timeout, max_tokens, finishes):
    llm = tiny_llm(max_model_len=4096)
    app = create_app(llm, MODEL)
    with GracefulTestServer(app, shutdown_timeout) as s:
        gate = StepGate(llm.engine, delay=0.05)
        try:
            body = dict(GOOD, max_tokens=max_tokens, ignore_eos=True, stream=True)
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                # hold the engine while the 503s are checked: a request that finished before them would let the
                # drain end and uvicorn stop, and the checks would meet a closed port (flaky on a busy machine)
                gate.open.clear()
                s.server.handle_exit(signal.SIGTERM, None)
                wait_until(lambda: app.state.runner.draining)
                err = error_of(post(s, "/v1/completions", GOOD, timeout=10), 503)
                assert err["code"] == "shutting_down"
                assert httpx.get(s.url + "/health").status_code == 503
                gate.open.set()
                rest = [first] + [line for line in lines if line.startswith("data: ")]
            events = [x[6:] if x == "data: [DONE]" else json.loads(x[6:]) for x in rest]
            assert events[-1] == "[DONE]"
            if finishes:
                assert events[-2]["choices"][0]["finish_reason"] == "length"
            else:
                assert events[-2]["error"]["code"] == "shutting_down"
            s.thread.join(30)
            assert not s.thread.is_alive()  # uvicorn exited once the drain was done
        finally:
            gate.restore()


# ---- 14: per-position acceptance series exist from the start ------------------------------------------------
def test_per_position_series_start_at_zero():
    with Server(create_app(tiny_llm({"method": "ngram", "num_speculative_tokens": 3}), MODEL)) as s:
        m = s.metrics()
    name = "draftwise:spec_decode_num_accepted_tokens_per_pos_total"
    positions = sorted(dict(labels)["position"] for n, labels in m if n == name)
    assert positions == ["0", "1", "2"]
    assert all(metric(m, name, position=p) == 0 for p in positions)


# ---- fuzz: the server's own OpenAPI schema, positive and negative bodies --------------------------------------
FUZZ_EXAMPLES = 60  # per operation and generation mode; keeps the run well under a minute


@pytest.mark.slow
def test_fuzz_openapi_schema_no_500s_no_hangs():
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    with Server(create_app(tiny_llm(max_model_len=256), MODEL, request_timeout=20)) as s:
        raw = httpx.get(s.url + "/openapi.json").json()
        schemas = raw["components"]["schemas"]
        assert {"CompletionRequest", "ChatRequest"} <= set(schemas)  # the generation routes describe their bodies
        for name in ("CompletionRequest", "ChatRequest"):  # past the model check, into validation and generation
            schemas[name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
            schemas[name]["additionalProperties"] = False  # unknown fields are 400s anyway: fuzz the known ones
        schema = schemathesis.openapi.from_dict(raw)
        statuses: dict[int, int] = {}
        for result in schema.get_all_operations():
            op = result.ok()
            negative = [schemathesis.GenerationMode.NEGATIVE] if op.method.upper() == "POST" else []  # GETs: no input
            for mode in [schemathesis.GenerationMode.POSITIVE] + negative:
                @given(case=op.as_strategy(generation_mode=mode))
                @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))
                def call(case):
                    resp = case.call(base_url=s.url, timeout=30)  # a hung request raises ReadTimeout
                    statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
                    assert resp.status_code < 500, (case.as_curl_command(), resp.text[:500])

                call()
        assert s.app.state.runner.alive
    total = sum(statuses.values())
    print(f"\nschemathesis: {total} cases, statuses {dict(sorted(statuses.items()))}")
    assert total >= FUZZ_EXAMPLES and statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0


def test_structured_outputs_on_a_tokenizer_the_grammar_engine_cannot_read_is_a_400(server):
    """The tiny model's tokenizer.json has no decoder llguidance understands: found by the schemathesis fuzz as a
    500 (ValueError from llguidance); it is the request's constraint that cannot be served, so a 400."""
    resp = post(server, "/v1/completions", dict(GOOD, response_format={"type": "json_object"}))
    assert resp.status_code == 400, resp.text
    assert "structured outputs are not available" in resp.json()["error"]["message"]

"""The OpenAI-compatible server around a tiny random model, over real HTTP (uvicorn on a free local port).

Driven with the official `openai` client (completions and chat, streaming and not) and raw httpx for every bad
input (status code and OpenAI error shape). Invariants: greedy outputs at concurrency 4 with speculation on
equal plain greedy outputs at concurrency 1; a client that disconnects frees its KV slot at once (/metrics).
No downloads: the tiny LLM and server fixture come from tests/harness.py.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from draftwise.server.app import create_app
from tests.harness import MODEL, PROMPTS, Server, metric, tiny_llm


@pytest.fixture(scope="module")
def server():
    with Server(create_app(tiny_llm(max_model_len=4096), MODEL, max_body_bytes=64 * 1024)) as s:
        yield s


# ---- the openai client -----------------------------------------------------------------------------
def test_models_and_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_stream_matches_non_stream(server):
    c = server.client()
    full = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == 8 and full.usage.total_tokens == 20
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == choice.text and text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_stream_matches_non_stream(server):
    c = server.client()
    msgs = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": [{"type": "text", "text": "w3 w4"}]}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == 7  # "system w1 w2 user w3 w4 assistant"
    stream = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in stream)
    assert text == full.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(ch.object == "chat.completion.chunk" for ch in stream)


def test_stop_string_cuts_text(server):
    c = server.client()
    base = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    words = base.split()
    stop = words[3]
    expect = base[: base.index(stop)]
    out = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop" and out.text == expect
    streamed = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0, stop=stop,
                                    stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed) == expect


def test_seeded_sampling_reproduces(server):
    c = server.client()

    def run(seed):
        return c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, top_p=0.9,
                                    seed=seed, extra_body={"top_k": 20, "ignore_eos": True}).choices[0].text

    assert run(7) == run(7)
    assert len({run(s) for s in range(4)}) > 1


# ---- bad input: status and OpenAI error shape -----------------------------------------------------------
GOOD = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 4}
BAD_INPUTS = [
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("not an object", "/v1/completions", [1, 2], 400, None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("missing model", "/v1/completions", {"prompt": "w1"}, 400, "model"),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("message without role", "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "w1"}]}, 400,
     "messages"),
    ("mistyped temperature", "/v1/completions", dict(GOOD, temperature="hot"), 400, "temperature"),
    ("numeric string max_tokens", "/v1/completions", dict(GOOD, max_tokens="4"), 400, "max_tokens"),
    ("bool max_tokens", "/v1/completions", dict(GOOD, max_tokens=True), 400, "max_tokens"),
    ("mistyped stream", "/v1/completions", dict(GOOD, stream="yes"), 400, "stream"),
    ("mistyped prompt", "/v1/completions", dict(GOOD, prompt=5), 400, "prompt"),
    ("negative temperature", "/v1/completions", dict(GOOD, temperature=-0.5), 400, "temperature"),
    ("top_p zero", "/v1/completions", dict(GOOD, top_p=0), 400, "top_p"),
    ("top_p above one", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "top_p": 1.5}, 400, "top_p"),
    ("max_tokens zero", "/v1/completions", dict(GOOD, max_tokens=0), 400, "max_tokens"),
    ("n too many", "/v1/completions", dict(GOOD, n=17), 400, "n"),
    ("two prompts", "/v1/completions", dict(GOOD, prompt=["w1", "w2"]), 400, "prompt"),
    ("empty prompt", "/v1/completions", dict(GOOD, prompt=""), 400, "prompt"),
    ("token id out of vocab", "/v1/completions", dict(GOOD, prompt=[1, 2, 999]), 400, "prompt"),
    ("too many logprobs", "/v1/completions", dict(GOOD, logprobs=21), 400, "logprobs"),
    ("unknown model", "/v1/completions", dict(GOOD, model="gpt-9"), 404, "model"),
    ("unknown model chat", "/v1/chat/completions",
     {"model": "gpt-9", "messages": [{"role": "user", "content": "w1"}]}, 404, "model"),
]


def assert_error_shape(resp, status, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


@pytest.mark.parametrize("name,path,body,status,param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(server, name, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert_error_shape(resp, status, param)


def test_context_overflow_names_both_sizes(server):
    err = assert_error_shape(httpx.post(server.url + "/v1/completions", json=dict(GOOD, max_tokens=5000)), 400,
                             "max_tokens")
    assert "2 tokens" in err["message"] and "5000" in err["message"] and "4096" in err["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w1 " * 5000}]}
    err = assert_error_shape(httpx.post(server.url + "/v1/chat/completions", json=chat), 400)
    assert "4096" in err["message"]


def test_oversized_body_and_unknown_route(server):
    big = dict(GOOD, prompt="w1 " * 40_000)
    assert_error_shape(httpx.post(server.url + "/v1/completions", json=big), 413)
    assert_error_shape(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error_shape(httpx.get(server.url + "/v1/completions"), 405)


def test_still_serving_after_bad_input(server):
    assert httpx.get(server.url + "/health").status_code == 200
    out = server.client().completions.create(model=MODEL, prompt="w1", max_tokens=3)
    assert out.usage.completion_tokens >= 1


def test_internal_error_fails_one_request_not_the_server(server, monkeypatch, caplog):
    """A 500 names a request id and never the exception text; the traceback goes to the server log."""
    llm = server.app.state.front  # to_output runs on the server side of the pipe

    def broken(req, text):
        raise RuntimeError("boom")

    monkeypatch.setattr(llm, "to_output", broken)
    with caplog.at_level("ERROR", logger="draftwise.server"):
        err = assert_error_shape(httpx.post(server.url + "/v1/completions", json=GOOD), 500)
    assert "boom" not in err["message"] and err["type"] == "server_error"
    rid = err["message"].split("request id ", 1)[1].split(";", 1)[0]
    logged = [r for r in caplog.records if rid in r.getMessage()]
    assert logged and "boom" in str(logged[0].exc_info[1])
    monkeypatch.undo()
    wait_for_idle(server)
    assert server.client().completions.create(model=MODEL, prompt="w1", max_tokens=3).choices[0].text is not None


def test_api_key():
    llm = tiny_llm(max_model_len=256)
    with Server(create_app(llm, MODEL, api_key="sekret")) as s:
        assert httpx.get(s.url + "/health").status_code == 200  # /health is open
        for path in ("/v1/models", "/metrics"):
            assert_error_shape(httpx.get(s.url + path), 401)
            assert_error_shape(httpx.get(s.url + path, headers={"Authorization": "Bearer wrong"}), 401)
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert_error_shape(httpx.post(s.url + "/v1/completions", json=GOOD), 401)
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model=MODEL, prompt="w1", max_tokens=2)
        assert s.client("sekret").completions.create(model=MODEL, prompt="w1", max_tokens=2).choices


def test_serve_cli_defaults_and_api_key_env():
    from draftwise.cli import build_parser
    from draftwise.server.cli import API_KEY_ENV, resolve_api_key

    args = build_parser().parse_args(["serve", "--model", "m"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {API_KEY_ENV: "k"}) == "k"
    assert resolve_api_key("flag", {API_KEY_ENV: "k"}) == "flag"
    assert resolve_api_key(None, {API_KEY_ENV: ""}) is None


# ---- concurrency: greedy at 4 in flight with speculation == plain greedy one at a time ----------------------
def greedy_texts(server, concurrency: int) -> list[tuple[str, int]]:
    c = server.client()

    def one(prompt):
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.completion_tokens

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, PROMPTS * 2))


@pytest.fixture(scope="module")
def plain_reference():
    with Server(create_app(tiny_llm(), MODEL)) as s:
        return greedy_texts(s, 1)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
DRAFT = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 4}


@pytest.mark.parametrize("spec_config,max_num_seqs", [(NGRAM, 4), (DRAFT, 4), (DRAFT, 2)],
                         ids=["ngram", "draft_model", "draft_model-queued"])
def test_greedy_concurrency_4_equals_concurrency_1(plain_reference, spec_config, max_num_seqs):
    """max_num_seqs=2 with 4 clients: half the requests wait for a slot and join mid-flight."""
    with Server(create_app(tiny_llm(spec_config, max_num_seqs=max_num_seqs), MODEL)) as s:
        seq, conc = greedy_texts(s, 1), greedy_texts(s, 4)
        m = s.metrics()
    assert seq == plain_reference
    assert conc == plain_reference
    drafts = metric(m, "draftwise:spec_decode_num_drafts_total")
    accepted = metric(m, "draftwise:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= metric(m, "draftwise:spec_decode_num_draft_tokens_total")
    assert metric(m, "draftwise:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert metric(m, "draftwise:request_success_total", finished_reason="length") == 2 * len(plain_reference)


# ---- disconnects free the slot ---------------------------------------------------------------------------
def wait_for_idle(server, timeout=5.0) -> dict:
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if metric(m, "draftwise:num_requests_running") == 0 and metric(m, "draftwise:kv_slots_free") == 4:
            return m
        assert time.time() < deadline, "slot not freed"
        time.sleep(0.05)


def test_stream_disconnect_frees_slot(server):
    before = metric(server.metrics(), "draftwise:request_success_total", finished_reason="abort")
    body = dict(GOOD, max_tokens=4000, stream=True, ignore_eos=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert metric(server.metrics(), "draftwise:num_requests_running") == 1
        assert metric(server.metrics(), "draftwise:kv_slots_free") == 3
    # leaving the block closes the connection mid-stream
    m = wait_for_idle(server)
    assert metric(m, "draftwise:request_success_total", finished_reason="abort") == before + 1
    assert metric(m, "draftwise:num_requests_waiting") == 0


def test_non_stream_disconnect_frees_slot(server):
    before = metric(server.metrics(), "draftwise:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=dict(GOOD, max_tokens=4000, ignore_eos=True), timeout=0.5)
    m = wait_for_idle(server)
    assert metric(m, "draftwise:request_success_total", finished_reason="abort") == before + 1


def test_metrics_names(server):
    server.client().completions.create(model=MODEL, prompt="w1 w2", max_tokens=3)
    m = server.metrics()
    names = {name for name, _ in m}
    for name in ("draftwise:num_requests_running", "draftwise:num_requests_waiting", "draftwise:kv_slots_free",
                 "draftwise:prompt_tokens_total", "draftwise:generation_tokens_total",
                 "draftwise:time_to_first_token_seconds_bucket", "draftwise:e2e_request_latency_seconds_count",
                 "draftwise:spec_decode_num_drafts_total", "draftwise:spec_decode_num_draft_tokens_total",
                 "draftwise:spec_decode_num_accepted_tokens_total", "process_resident_memory_bytes"):
        assert name in names, name
    assert metric(m, "draftwise:prompt_tokens_total") >= 2
    assert metric(m, "draftwise:e2e_request_latency_seconds_count") >= 1


@pytest.mark.parametrize("mode", ["key", "global"])
def test_suffix_cache_scope_follows_the_api_key_unless_global(mode):
    """method suffix: each bearer token's outputs land in (and guess from) its own scope, named by a hash of the
    token, never the token; --suffix-cache-scope global puts every request in one."""
    llm = tiny_llm({"method": "suffix", "num_speculative_tokens": 4})
    with Server(create_app(llm, MODEL, suffix_cache_scope=mode)) as s:
        for key in ("alice-key", "bob-key", "alice-key"):
            s.client(api_key=key).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                                     extra_body={"ignore_eos": True})
    cache = llm.proposer.cache
    assert len(cache.entries) == 3
    if mode == "global":
        assert list(cache.tries) == ["global"]
    else:
        scopes = [scope for scope, _ in cache.entries]
        assert scopes[0] == scopes[2] != scopes[1] and all(s.startswith("key:") and "key-" not in s for s in scopes)


def test_an_unknown_suffix_cache_scope_is_refused():
    with pytest.raises(ValueError, match="suffix cache scope"):
        create_app(tiny_llm(), MODEL, suffix_cache_scope="tenant")

"""Structured outputs over HTTP with the official `openai` client: response_format json_schema (streaming and
not, chat and completions), vLLM's structured_outputs / guided_* extras, 400s that name the problem, and the
forced-token counters in /metrics. Every constrained output must parse and validate. The tiny model speaks a
byte-level BPE vocabulary (tests/harness.json_llm), so JSON is spellable; the server speculates with the grammar
proposer and n-gram lookup."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from draftwise.server.app import create_app
from tests.harness import MODEL, Server, json_llm, metric

ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]-[0-9]{1,3}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 20},
        "unit": {"enum": ["box", "kg", "each"]},
        "gift": {"type": "boolean"},
    },
    "required": ["sku", "qty", "unit", "gift"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}
MESSAGES = [{"role": "user", "content": 'Order: 2 boxes of A-1. Reply as JSON {"sku": ...}'}]


@pytest.fixture(scope="module")
def server():
    llm = json_llm({"method": "grammar", "num_speculative_tokens": 6, "then": {"method": "ngram"}},
                   max_model_len=512)
    with Server(create_app(llm, MODEL)) as s:
        yield s


def _valid(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, ITEM)
    return obj


def test_chat_json_schema_non_streaming_and_streaming(server):
    # sampled: a random model's greedy choice may be whitespace forever (JSON allows it); see the compact cases
    c = server.client()
    temperature = 1.0
    for seed in range(3):
        full = c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                         max_tokens=200, temperature=temperature, seed=seed)
        assert full.choices[0].finish_reason == "stop"
        _valid(full.choices[0].message.content)
        chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                                max_tokens=200, temperature=temperature, seed=seed, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == full.choices[0].message.content  # same seed, same tokens
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
        _valid(text)


def test_completions_json_schema_and_json_object(server):
    c = server.client()
    out = c.completions.create(model=MODEL, prompt='{"sku": "B-22", "qty": 10} ->', max_tokens=200, temperature=1,
                               seed=1, extra_body={"response_format": RESPONSE_FORMAT})
    _valid(out.choices[0].text)
    stream = c.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, temperature=1, seed=2, stream=True,
                                  extra_body={"response_format": RESPONSE_FORMAT})
    _valid("".join(ch.choices[0].text for ch in stream))
    obj = c.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, temperature=0,
                               extra_body={"response_format": {"type": "json_object"}}).choices[0]
    if obj.finish_reason == "stop":  # free-form JSON may not close within 60 tokens: then it says "length"
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == "length" and obj.text.startswith("{")


def test_text_response_format_is_unconstrained(server):
    out = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                  response_format={"type": "text"})
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"guided_regex": r"[A-Z]-\d{2,3}"}, lambda t: re.fullmatch(r"[A-Z]-\d{2,3}", t)),
    ({"guided_json": ITEM}, lambda t: _valid(t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"json": ITEM, "disable_any_whitespace": True}}, lambda t: _valid(t) and ": " in t),
    ({"guided_grammar": 'start: "ok" | "not ok"', "guided_decoding_backend": "xgrammar"},
     lambda t: t in ("ok", "not ok")),
], ids=["guided_choice", "guided_regex", "guided_json", "structured_outputs_choice", "structured_outputs_json",
        "guided_grammar"])
def test_vllm_extras_on_both_routes(server, extra, check):
    c = server.client()
    chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1, seed=3,
                                     extra_body=extra)
    assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)
    comp = c.completions.create(model=MODEL, prompt="answer:", max_tokens=200, temperature=1, seed=4,
                                extra_body=extra)
    assert comp.choices[0].finish_reason == "stop" and check(comp.choices[0].text)


def test_length_when_the_grammar_cannot_finish(server):
    out = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                                  max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}},
     "response_format", "uniqueItems"),  # an unsupported keyword is named, never silently ignored
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_choice": ["a"], "response_format": RESPONSE_FORMAT}, "response_format", "conflicting"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural"),
])
def test_bad_constraints_are_400s_naming_the_problem(server, body, param, words):
    resp = httpx.post(server.url + "/v1/chat/completions",
                      json=dict({"model": MODEL, "messages": MESSAGES, "max_tokens": 5}, **body))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                extra_body=body)


def test_forced_tokens_in_metrics_and_response(server):
    before = server.metrics()
    out = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0,
        "structured_outputs": {"json": ITEM, "disable_any_whitespace": True}}).json()
    _valid(out["choices"][0]["message"]["content"])
    spec_stats = out["draftwise"]["spec"]
    assert spec_stats["num_forced_tokens"] > 0 and 0 <= spec_stats["num_accepted_forced_tokens"] <= spec_stats["num_forced_tokens"]
    after = server.metrics()
    for name in ("draftwise:spec_decode_num_forced_tokens_total", "draftwise:spec_decode_num_accepted_forced_tokens_total"):
        assert metric(after, name) - metric(before, name) >= (1 if "accepted" not in name else 0)
    assert (metric(after, "draftwise:spec_decode_num_forced_tokens_total")
            - metric(before, "draftwise:spec_decode_num_forced_tokens_total")) == spec_stats["num_forced_tokens"]

"""The OpenAI fields agents and eval harnesses send, over HTTP with the official `openai` client: n > 1 (seeded
reproducibility, streamed choices by index, usage summed, the prompt's K/V shared), logprobs (shape, and equal with
and without speculation on row-exact kernels), sampling controls accepted, and tool calling: `tool_choice`
required / named always yields calls that validate against the function's schema (grammar-constrained), streamed
as `delta.tool_calls`, and the parsing of `auto` output (a malformed call stays content)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from draftwise.api import LLM
from draftwise.sampling import SamplingParams
from draftwise.server.app import create_app
from draftwise.server.tools import ToolCallStream, parse_calls, read_tool_choice
from tests.harness import MODEL, Server, json_llm, tiny_llm, tiny_tokenizer
from tests.tiny_models import tiny_decoder

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
             "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with Server(create_app(tiny_llm({"method": "ngram", "num_speculative_tokens": 3}), MODEL)) as s:
        yield s


@pytest.fixture(scope="module")
def json_server():
    llm = json_llm({"method": "grammar", "num_speculative_tokens": 6, "then": {"method": "ngram"}}, max_model_len=512)
    with Server(create_app(llm, MODEL)) as s:
        yield s


# ---- n ------------------------------------------------------------------------------------------------------
def test_n_with_a_seed_is_reproducible_and_streams_by_index(server):
    c = server.client()
    kw = dict(model=MODEL, prompt="w1 w2 w3", max_tokens=8, temperature=1.0, n=4, seed=7,
              extra_body={"ignore_eos": True})  # every sample runs to max_tokens: the usage sum below is exact
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    texts = [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in a.choices] == [0, 1, 2, 3]
    assert texts == [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) > 1  # seed + index: the samples differ
    assert a.usage.prompt_tokens == 3 and a.usage.completion_tokens == 32  # the prompt once, outputs summed
    streamed = {i: "" for i in range(4)}
    for chunk in c.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert [streamed[i] for i in range(4)] == texts
    one = c.completions.create(**dict(kw, n=1, seed=9)).choices[0].text  # sample i is seed + i alone
    assert one == texts[2]


def test_n_samples_share_the_prompt_through_the_prefix_cache():
    llm = LLM.from_parts(tiny_decoder("qwen2", 0, 64), tiny_tokenizer(), name=MODEL, enable_prefix_caching=True)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    pairs = [llm.new_request(prompt, p) for p in SamplingParams(n=4, seed=1, max_tokens=4).samples()]
    llm.run([r for r, _ in pairs])
    assert [r.num_cached_tokens for r, _ in pairs] == [0] + [len(prompt) - 1] * 3
    out = llm.generate(prompt, SamplingParams(n=3, seed=1, max_tokens=4))[0]
    assert [o.token_ids for o in out.outputs] == [r.output_ids for r, _ in pairs[:3]]


# ---- logprobs -----------------------------------------------------------------------------------------------
def test_chat_and_completion_logprobs_have_openai_shapes(server):
    c = server.client()
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1 w2"}], max_tokens=5,
                                    temperature=0, logprobs=True, top_logprobs=3, seed=1)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy: the top token is emitted
    assert "".join(t.token + " " for t in content).split() == out.choices[0].message.content.split()
    streamed = []  # the same entries, spread over the chunks
    for chunk in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w1 w2"}], max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=3, seed=1, stream=True):
        for ch in chunk.choices:
            streamed += ch.logprobs.content if ch.logprobs else []
    assert streamed == content
    comp = c.completions.create(model=MODEL, prompt="w1 w2", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(len(t) >= 2 for t in lp.top_logprobs)


def test_logprobs_equal_with_and_without_speculation_on_row_exact_kernels():
    llm = json_llm({"method": "ngram", "num_speculative_tokens": 4}, q4x8=True)  # skips where q4x8 cannot build
    with Server(create_app(llm, MODEL)) as s:
        c = s.client()

        def run(speculation):
            return c.completions.create(model=MODEL, prompt='{"name": "Ada", "tags": ["math", "math", "',
                                        max_tokens=24, temperature=0, logprobs=5,
                                        extra_body={"draftwise": {"speculation": speculation}})

        plain, spec = run(False), run(True)
        assert plain.choices[0].text == spec.choices[0].text
        assert plain.choices[0].logprobs == spec.choices[0].logprobs  # bitwise the same rows
        assert spec.draftwise["spec"]["num_accepted_tokens"] > 0  # guesses really were verified


def test_sampling_controls_are_accepted_and_move_greedy_output(server):
    c = server.client()
    kw = dict(model=MODEL, prompt="w1 w2 w3", max_tokens=12, temperature=0)
    base = c.completions.create(**kw).choices[0].text
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0},
                  {"logit_bias": {str(int(base.split()[0][1:]) + 4): -100}}):
        assert c.completions.create(**kw, extra_body=extra).choices[0].text != base, extra
    out = c.completions.create(**kw, extra_body={"min_p": 0.5, "min_tokens": 3})
    assert out.choices[0].text == base  # neither moves greedy output here (ignore_eos-free: max_tokens ends it)


# ---- tool calling -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("seed", range(4))
def test_constrained_choice_always_yields_valid_calls(json_server, tool_choice, seed):
    c = json_server.client()
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              max_tokens=120, temperature=1.0, seed=seed)
    out = c.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # streamed: the same call, its arguments in pieces, finish_reason tool_calls
    pieces, finish, header = [], None, None
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                assert tc.index == 0
                if tc.id:
                    header = tc
                pieces.append(tc.function.arguments or "")
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and header.function.name == call.function.name
    assert "".join(pieces) == call.function.arguments


def test_tool_fields_accepted_before_keep_their_meaning(server):
    c = server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "w1 w2"}], max_tokens=6, temperature=0)
    base = c.chat.completions.create(**kw).choices[0].message.content
    for extra in ({"tools": [], "tool_choice": "auto"}, {"tool_choice": "none"}, {"tool_choice": "auto"},
                  {"parallel_tool_calls": False}, {"tools": TOOLS, "tool_choice": "none"}):
        out = c.chat.completions.create(**kw, extra_body=extra).choices[0]
        assert out.message.content == base and out.message.tool_calls is None, extra


def test_tool_results_and_earlier_calls_are_accepted(json_server):
    c = json_server.client()
    msgs = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
    out = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


CHOICE = read_tool_choice(TOOLS, "auto", None)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'


def test_auto_output_is_parsed_into_calls_or_left_as_content():
    content, calls = parse_calls("Let me check.\n" + CALL + "\n" + CALL.replace("Rome", "Oslo"), CHOICE)
    assert content == "Let me check." and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Rome",
                                                                                                                "Oslo"]
    assert calls[0]["function"]["arguments"] == '{"city": "Rome", "days": 2}'
    for bad in (CALL.replace('"get_weather"', '"nope"'), CALL.replace("}}", "}"), CALL[:-3], CALL + " and more",
                CALL.replace('{"city"', '["city"'), CALL.replace('"get_weather"', '["get_weather"]'),
                CALL.replace('{"city": "Rome", "days": 2}', "[" * 5000 + "]" * 5000)):
        assert parse_calls(bad, CHOICE) == (bad, [])
    assert parse_calls("plain text", CHOICE) == ("plain text", [])
    cut = CALL + "\n<tool_call>\n{\"name\": \"get_w"  # max_tokens cut the second call short
    assert parse_calls(cut, CHOICE) == (cut, [])  # auto: text
    assert len(parse_calls(cut, read_tool_choice(TOOLS, "required", None))[1]) == 1  # constrained: the whole call


@pytest.mark.parametrize("trusted", [False, True])
def test_streamed_calls_equal_parsed_calls_whatever_the_cuts(trusted):
    text = "Sure." + "\n" + CALL + "\n" + CALL.replace("Rome", "Paris")
    _, whole = parse_calls(text, CHOICE)
    for step in (1, 3, 7, len(text)):
        stream, pieces = ToolCallStream(CHOICE, trusted), []
        for i in range(0, len(text), step):
            pieces += stream.feed(text[i: i + step])
        pieces += stream.finish()
        content = "".join(p.get("content", "") for p in pieces)
        args: dict[int, str] = {}
        names = {}
        for p in pieces:
            for tc in p.get("tool_calls", ()):
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
                if "name" in tc["function"]:
                    names[tc["index"]] = tc["function"]["name"]
        assert content.strip() == "Sure."
        assert [args[i] for i in sorted(args)] == [c["function"]["arguments"] for c in whole]
        assert [names[i] for i in sorted(names)] == ["get_weather", "get_weather"]


def test_a_malformed_streamed_call_comes_back_as_content():
    bad = "x " + CALL.replace('"get_weather"', '"nope"')
    stream = ToolCallStream(CHOICE, trusted=False)
    pieces = stream.feed(bad[:10]) + stream.feed(bad[10:]) + stream.finish()
    assert "".join(p.get("content", "") for p in pieces) == bad and not stream.calls


@pytest.mark.parametrize("field,body", [
    ("tools", {"tools": [{"type": "function", "function": {"name": "a b"}}]}),
    ("tools", {"tools": TOOLS + TOOLS}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}),
])
def test_bad_tool_fields_are_400s_naming_the_field(server, field, body):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", json=dict(model=MODEL, messages=MESSAGES, **body))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text

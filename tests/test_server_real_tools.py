"""Tool calling on the packaged qwen2.5-coder-1.5b-instruct (integration: loads the real target, minutes on 2 CPU
cores) with the official `openai` client: its own chat template renders the tools, the call comes back as
`message.tool_calls` (and streamed as `delta.tool_calls`), the tool's result goes back as a `tool` message after the
assistant's call, and the model answers from it; `tool_choice: required` yields a call valid under the schema.
This coder model, left to `auto`, tends to write a ```json block rather than the template's `<tool_call>` form
(which then stays content): the first step names the function, as agents that need a call do."""
import json

import jsonschema
import pytest

from tests.harness import real_model_server

pytestmark = pytest.mark.integration

MODEL = "qwen2.5-coder-1.5b-instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
# without a system message this model answers the tool's result by imitating the template's call format
ASK = [{"role": "system", "content": "You are a helpful assistant. Use tool results to answer in one sentence."},
       {"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server():
    with real_model_server(MODEL, {"method": "ngram", "num_speculative_tokens": 3}, max_num_seqs=2,
                           max_model_len=1024) as s:
        yield s


def test_two_step_tool_loop(server):
    c = server.client()
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=64,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    first = c.chat.completions.create(**kw)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and "paris" in args["city"].lower()
    jsonschema.validate(args, WEATHER)
    # the same call streamed: a header with id and name, then the arguments
    streamed = c.chat.completions.create(**kw, stream=True)
    names, arguments, finish = [], "", None
    for chunk in streamed:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                names += [tc.function.name] if tc.function.name else []
                arguments += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert names == ["get_weather"] and arguments == call.function.arguments and finish == "tool_calls"
    # step 2: the tool's result goes back, the model answers from it
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 23, "sky": "sunny"})}]
    final = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=48)
    answer = final.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "23" in answer.message.content


def test_required_yields_a_valid_call(server):
    c = server.client()
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
                                    tool_choice="required", temperature=0.7, seed=3, max_tokens=64)
    # parallel calls allowed: the model may go on calling until max_tokens cuts one short ("length"); every
    # whole call is returned and valid
    assert out.choices[0].finish_reason in ("tool_calls", "length") and out.choices[0].message.tool_calls
    for call in out.choices[0].message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)

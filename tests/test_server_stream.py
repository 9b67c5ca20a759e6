"""The streamed chunk of the usual step (text only) built from a template equals the chunk built as a dict, for
chat and completions, with and without usage, whatever the text (quotes, escapes, non-ASCII, the marker itself)
and whatever the served model's name (one that contains the template's marker falls back to the dict)."""
from __future__ import annotations

import json

import pytest

from draftwise.server import protocol

TEXTS = ["x", " def f(x):\n\treturn x", 'say "hi" \\ there', "é漢字🙂", "\u0001draftwise-text\u0001", "</s>\x00\x7f",
         "\u2028\u2029"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", ["bench", 'a "quoted" \\ name', "\u0001draftwise-text\u0001"])
def test_text_line_equals_the_dict_chunk(chat, model):
    fmt = protocol.ResponseFormat(chat, model)
    for include_usage in (False, True):
        for index in (0, 3):
            for text in TEXTS:
                want = protocol.sse_line(fmt.chunk(text, None, include_usage, index=index))
                got = fmt.text_line(text, include_usage, index)
                assert got == want
                obj = json.loads(got[len("data: "):])
                assert (obj["choices"][0]["delta"]["content"] if chat else obj["choices"][0]["text"]) == text
                assert obj["choices"][0]["index"] == index and ("usage" in obj) == include_usage


def test_an_empty_text_keeps_its_own_shape():
    """A chat delta with no text is {} (no "content" key): the template is not used for it."""
    fmt = protocol.ResponseFormat(True, "bench")
    assert json.loads(fmt.text_line("", False)[len("data: "):])["choices"][0]["delta"] == {}

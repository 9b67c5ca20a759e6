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


def test_the_step_message_round_trips_and_sends_spec_stats_only_when_they_move():
    """engine_host's wire form: StepItem and EngineSnapshot as plain tuples; spec_stats left out (None) while the
    counters /metrics reads stand still, and the receiver's last ones filled in."""
    import pickle

    from draftwise.server.engine_host import EngineSnapshot, PrefixCounters, StepItem, _Snapshots
    from draftwise.spec_decode.stats import SpecStats

    item = StepItem("r1", [5, 6], [(2, 3, 1)], None, 1.5, True, "length", None, 2.5, SpecStats(), 7)
    packed = pickle.loads(pickle.dumps(item.pack()))
    assert type(packed) is tuple and StepItem(*packed) == item

    class FakeLLM:
        stats = SpecStats()

        def status(self):
            return EngineSnapshot(1, 0, 3, self.stats, PrefixCounters(10, 4), 90, 100, 16)

    llm = FakeLLM()
    snaps = _Snapshots(llm)
    first, same = snaps.next(), snaps.next()
    assert first[3] is llm.stats and same[3] is None  # sent once, then left out while nothing moved
    llm.stats.record(3, 2)
    moved = snaps.next()
    assert moved[3] is llm.stats
    got = EngineSnapshot.unpack(pickle.loads(pickle.dumps(same)), last_spec_stats=first[3])
    assert got == EngineSnapshot(1, 0, 3, first[3], PrefixCounters(10, 4), 90, 100, 16)

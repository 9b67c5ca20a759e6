"""The server around the packaged qwen2.5-coder-0.5b-instruct (integration: loads a real model, ~1-2 min on
2 CPU cores): the openai client gets the same text streaming and not, and greedy outputs with n-gram
speculation at concurrency 4 equal those at concurrency 1."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness import real_model_server

pytestmark = pytest.mark.integration

MODEL = "qwen2.5-coder-0.5b-instruct"
PROMPTS = ["def is_even(n):", "Add type hints: def area(w, h): return w * h",
           "Explain a hash map in one sentence.", "SELECT name FROM users WHERE"]


@pytest.fixture(scope="module")
def server():
    with real_model_server(MODEL, {"method": "ngram", "num_speculative_tokens": 3}, max_num_seqs=4,
                           max_model_len=512) as s:
        yield s


def test_stream_equals_non_stream(server):
    c = server.client()
    msgs = [{"role": "user", "content": "Write hello world in Python."}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    chunks = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full.choices[0].message.content


def test_greedy_concurrency_4_equals_1(server):
    c = server.client()

    def one(p):
        return c.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text

    seq = [one(p) for p in PROMPTS]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, PROMPTS)) == seq
    assert server.metrics()[("draftwise:spec_decode_num_drafts_total", frozenset())] > 0

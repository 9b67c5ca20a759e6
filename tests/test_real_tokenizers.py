"""Integration: the packaged real models' tokenizers (converted from GGUF, cached, reloaded) give the same
prompt ids, decodes and chat renderings as transformers' own GGUF tokenizer loading."""
from __future__ import annotations

from pathlib import Path

import pytest

from draftwise.models.sources import load_checkpoint
from draftwise.tokenizer import IncrementalDetokenizer
from tests.conftest import require_packaged

pytestmark = pytest.mark.integration

PROMPTS = [
    "def quicksort(xs):\n    \"\"\"Sort a list.\"\"\"\n    if len(xs) <= 1:\n        return xs\n",
    "Write a palindrome check in Python",
    "  leading  and   multiple spaces\t\ttabs\n\n\nnewlines",
    "Unicode: héllo wörld — 你好，世界！ 😀👍🏽 🇫🇷 ∑∫√ Привет مرحبا",
    "numbers 1234567890 3.14159 1e-6 0xFF",
    "special text <|im_start|>user\nhi<|im_end|> <end_of_turn> <bos>",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are a careful coding assistant."},
    {"role": "user", "content": "Write a function that reverses a string 🙃"},
    {"role": "assistant", "content": "def rev(s):\n    return s[::-1]"},
    {"role": "user", "content": "Now in C."},
]


def _packaged(name):
    require_packaged(name)
    ck = load_checkpoint(name, progress=False)
    from transformers import AutoTokenizer

    gguf_path = Path(ck.info["path"])
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return ck.tokenizer, ref


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
def tokenizers(request):
    return request.param, *_packaged(request.param)


def test_prompt_ids_match_transformers(tokenizers):
    name, mine, ref = tokenizers
    for prompt in PROMPTS:
        assert mine.encode(prompt) == ref(prompt)["input_ids"], (name, prompt)
        assert mine.encode(prompt, add_special_tokens=False) == ref(prompt, add_special_tokens=False)["input_ids"]


def test_decode_matches_transformers(tokenizers):
    name, mine, ref = tokenizers
    for prompt in PROMPTS:
        ids = ref(prompt)["input_ids"]
        assert mine.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_streaming_deltas_equal_full_decode(tokenizers):
    name, mine, _ = tokenizers
    for prompt in PROMPTS:
        ids = mine.encode(prompt, add_special_tokens=False)
        detok = IncrementalDetokenizer(mine, skip_special_tokens=False)
        deltas = [detok.add(i) for i in ids] + [detok.finish()]
        assert "".join(deltas) == mine.decode(ids, skip_special_tokens=False)
        assert not any("\ufffd" in d for d in deltas)


def test_special_ids(tokenizers):
    name, mine, ref = tokenizers
    assert mine.bos_token_id == ref.bos_token_id
    assert ref.eos_token_id in mine.eos_token_ids
    if name.startswith("qwen"):
        assert set(mine.eos_token_ids) == {ref.convert_tokens_to_ids("<|im_end|>"), ref.convert_tokens_to_ids("<|endoftext|>")}
    else:
        assert set(mine.eos_token_ids) == {1, ref.convert_tokens_to_ids("<end_of_turn>")}


def test_qwen_chat_template_matches_transformers():
    mine, ref = _packaged("qwen2.5-coder-0.5b-instruct")
    for messages in (MESSAGES, MESSAGES[1:2]):
        for gen in (True, False):
            text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert mine.apply_chat_template(messages, add_generation_prompt=gen) == text
            assert mine.encode_chat(messages, add_generation_prompt=gen) == ref(text, add_special_tokens=False)["input_ids"]

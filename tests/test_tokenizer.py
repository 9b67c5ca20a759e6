"""Tokenizer invariants: encode/decode round trips (multi-byte characters included), streaming deltas that
concatenate to the full decode and never end inside a UTF-8 character, and chat templates rendered as
transformers renders them."""
from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as Backend
from tokenizers.processors import TemplateProcessing

from tests.tiny_checkpoints import TINY_CHAT_TEMPLATE, tiny_byte_level_backend
from draftwise.config import ConfigError
from draftwise.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "def f(x):\n    return x * 2\n",
    "héllo wörld, naïve café",
    "你好，世界！ Chinese text",
    "emoji 😀👍🏽 and flags 🇫🇷 mixed",
    "  leading spaces and trailing  ",
]


@pytest.fixture(scope="module")
def gguf_tokenizer(tiny_gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_gguf_path)


def byte_fallback_tokenizer() -> Tokenizer:
    """A sentencepiece-style BPE (like gemma's): '▁' for spaces, <0xNN> byte pieces for anything unknown."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "c", "f", "é", "he", "ll", "hell", "hello", "▁w", "▁wo"]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "w"), ("▁w", "o")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<eos>", "<bos>")])
    backend.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return Tokenizer(backend, template, bos_token="<bos>", eos_token="<eos>", add_bos_token=True)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_byte_level(gguf_tokenizer, text):
    ids = gguf_tokenizer.encode(text)
    assert gguf_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_byte_fallback(text):
    tok = byte_fallback_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text


def _stream(tok: Tokenizer, ids: list[int], step: int = 1, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return deltas + [detok.finish()]


@pytest.mark.parametrize("make", ["gguf", "byte_fallback"])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_deltas_equal_full_decode_and_never_split_characters(gguf_tokenizer, make, text):
    tok = gguf_tokenizer if make == "gguf" else byte_fallback_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    for step in (1, 2, 3):
        deltas = _stream(tok, ids, step)
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
    multibyte = [c for c in text if len(c.encode()) > 1]
    if multibyte:  # the case this class exists for: at least one character spans several tokens
        pieces = [tok.decode([i]) for i in ids]
        assert any("\ufffd" in p for p in pieces) or make == "gguf"


def test_incremental_random_ids_with_specials(gguf_tokenizer):
    rng = random.Random(0)
    vocab = gguf_tokenizer.vocab_size
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            deltas = _stream(gguf_tokenizer, ids, skip_special_tokens=skip)
            assert "".join(deltas) == gguf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_incremental_with_prompt_context(gguf_tokenizer):
    prompt = gguf_tokenizer.encode("def f(x):")
    out = gguf_tokenizer.encode("\n    return '😀'")
    deltas = _stream(gguf_tokenizer, out, prefix_ids=prompt)
    full = gguf_tokenizer.decode(prompt + out)
    assert "".join(deltas) == full[len(gguf_tokenizer.decode(prompt)):]


def test_chat_template_renders_like_transformers(gguf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    text = gguf_tokenizer.apply_chat_template(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    assert gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = gguf_tokenizer.encode_chat(messages)
    assert ids == gguf_tokenizer.encode(text) and ids[0] == gguf_tokenizer.token_to_id("<|im_start|>")
    assert gguf_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_features():
    backend = tiny_byte_level_backend()
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] | trim }}{% endfor %}"
    )
    tok = Tokenizer(backend, template, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    out = tok.apply_chat_template([{"role": "user", "content": " <b>é</b> "}, {"role": "user", "content": "x"}])
    # tojson as in transformers: no HTML escaping, non-ASCII kept
    assert out == ('<|endoftext|>[{"role": "user", "content": " <b>é</b> "}, {"role": "user", "content": "x"}]'
                   "<|im_end|><b>é</b>")
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="first message must be from the user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_sandbox_blocks_attribute_escape():
    from jinja2.exceptions import SecurityError

    tok = Tokenizer(tiny_byte_level_backend(), "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        tok.apply_chat_template([])


def test_encode_chat_does_not_double_bos():
    tok = byte_fallback_tokenizer()
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_no_chat_template_is_a_clear_error():
    tok = Tokenizer(tiny_byte_level_backend())
    with pytest.raises(ConfigError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_ids_include_end_of_turn_tokens(gguf_tokenizer):
    assert gguf_tokenizer.eos_token == "<|im_end|>"
    assert set(gguf_tokenizer.eos_token_ids) == {gguf_tokenizer.token_to_id("<|im_end|>"),
                                                 gguf_tokenizer.token_to_id("<|endoftext|>")}
    assert gguf_tokenizer.bos_token_id == gguf_tokenizer.token_to_id("<|endoftext|>")


def test_save_load_round_trip(tmp_path):
    tok = byte_fallback_tokenizer()
    tok.save(tmp_path)
    back = Tokenizer.load(tmp_path)
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)
    assert (back.chat_template, back.bos_token, back.eos_token, back.eos_token_ids, back.add_bos_token) == (
        tok.chat_template, tok.bos_token, tok.eos_token, tok.eos_token_ids, tok.add_bos_token)
    assert back.get_vocab() == tok.get_vocab() and back.id_to_token(2) == "<bos>"


def test_load_hf_style_files(tmp_path):
    tiny_byte_level_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": {"content": "<|endoftext|>"}, "eos_token": "<|im_end|>"}')
    (tmp_path / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
    tok = Tokenizer.load(tmp_path)
    assert tok.bos_token == "<|endoftext|>" and tok.chat_template == TINY_CHAT_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]).startswith("<|im_start|>user\na")

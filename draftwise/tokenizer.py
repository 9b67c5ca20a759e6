"""Text <-> token ids: a HF `tokenizers` tokenizer, the model's chat template (jinja2), streaming detokenization.

This module owns encoding/decoding, rendering chat templates the way transformers does (sandboxed jinja2,
`raise_exception`, `tojson`, `bos_token`/`eos_token`), the end-of-generation token ids, building a
tokenizer from GGUF metadata (via transformers' GGUF converter, imported lazily because it is slow), and
saving/loading as tokenizer.json + tokenizer_config.json (the files an HF checkpoint carries).

It does not know models, tensors, sampling or HTTP. BOS handling lives in one place: the backend's
post-processor (HF tokenizer.json files carry one; for GGUF we install one when add_bos_token is set).
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as BackendTokenizer

from draftwise.config import ConfigError

# End-of-turn tokens of common chat templates; each one present in a vocabulary stops generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end_of_text|>", "</s>")


def _token_text(value) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the chat template and special tokens of one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        add_bos_token: bool = False,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        if eos_token_ids is None:
            candidates = (eos_token,) + END_OF_TURN_TOKENS
            eos_token_ids = [backend.token_to_id(t) for t in candidates if t is not None]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos_token_ids if i is not None))
        self._template = None  # compiled lazily

    # -- vocabulary -------------------------------------------------------------------------------
    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # -- encode / decode --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs) -> str:
        """Render `messages` with the model's template, as transformers' apply_chat_template(tokenize=False).
        continue_final_message: end the text right after the last message's content (no end-of-turn marker), so
        the model continues that message (transformers' and vLLM's option of that name)."""
        if not self.chat_template:
            raise ConfigError("this model has no chat template (a base model?); send a plain prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ConfigError("continue_final_message and add_generation_prompt cannot both be true")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if continue_final_message:
            final = (messages[-1].get("content") or "").strip() if messages else ""
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ConfigError("continue_final_message: the final message's content is not in the rendered chat")
            text = text[: at + len(final)]
        return text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **kwargs) -> list[int]:
        """Token ids of the rendered chat; templates that write the BOS themselves do not get a second one."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, **kwargs)
        writes_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.encode(text, add_special_tokens=not writes_bos)

    # -- persistence ------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
            "eos_token_ids": list(self.eos_token_ids),  # draftwise's own key; transformers ignores it
        }
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Tokenizer":
        """From tokenizer.json + tokenizer_config.json (+ chat_template.jinja/.json) as HF checkpoints ship them."""
        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise ConfigError(f"{d} has no tokenizer.json (only fast tokenizers are supported)")
        backend = BackendTokenizer.from_file(str(d / "tokenizer.json"))
        config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        return cls(
            backend,
            chat_template=_read_chat_template(d, config),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            eos_token_ids=config.get("eos_token_ids"),
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a GGUF file's tokenizer.* metadata with transformers' converter (seconds; cache it)."""
        backend, config = _convert_gguf_tokenizer(str(path))
        add_bos = bool(config.get("add_bos_token", False))
        bos, eos = config.get("bos_token"), config.get("eos_token")
        if add_bos and bos is not None:
            from tokenizers.processors import TemplateProcessing

            bos_id = backend.token_to_id(bos)
            backend.post_processor = TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        return cls(backend, config.get("chat_template"), bos, eos, add_bos_token=add_bos)


def _read_chat_template(d: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    if template is None and (d / "chat_template.json").is_file():
        template = json.loads((d / "chat_template.json").read_text()).get("chat_template")
    return template


def _convert_gguf_tokenizer(path: str) -> tuple[BackendTokenizer, dict]:
    """(backend tokenizer, tokenizer_config with chat_template/add_bos_token/bos_token/eos_token)."""
    try:  # transformers >= 5
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

        architecture, tokenizer_dict, config = get_gguf_tokenizer(path)
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
        return backend, {**config, **extra}
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        parsed = load_gguf_checkpoint(path, return_tensors=False)
        tokenizer_dict, config = parsed["tokenizer"], dict(parsed["tokenizer_config"])
        converter = GGUF_TO_FAST_CONVERTERS[tokenizer_dict["tokenizer_type"]](tokenizer_dict)
        tokens = tokenizer_dict["tokens"]
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
            if tokenizer_dict.get(key) is not None:
                config.setdefault(name, tokens[tokenizer_dict[key]])
        return converter.converted(), {**config, **converter.additional_kwargs}


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: unlike jinja2's built-in it does not HTML-escape, so templates see plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str):
    """Compile a chat template in a sandbox with the globals and filters HF templates expect."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"the model's chat template does not compile: {e}") from None


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas that never split a UTF-8 character.

    Decodes a short window [prefix_offset:] and emits what extends beyond the already-shown
    [prefix_offset:read_offset] (the scheme vLLM uses), holding text back while it ends in U+FFFD, i.e.
    an incomplete multi-byte character (byte-fallback pieces or byte-level BPE). The concatenated
    deltas plus `finish()` equal tokenizer.decode(prefix_ids + ids) minus decode(prefix_ids)."""

    def __init__(self, tokenizer: Tokenizer, prefix_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prefix_ids)[-6:]  # a little context for leading-space rules
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Append token id(s); return the newly completed text (possibly empty)."""
        self.ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        shown = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) <= len(shown) or window.endswith("\ufffd") or not window.startswith(shown):
            return ""
        delta = window[len(shown):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flush text held back (e.g. a byte sequence that never completed)."""
        shown = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        delta = window[len(shown):] if window.startswith(shown) else ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

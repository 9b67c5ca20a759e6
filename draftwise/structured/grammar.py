"""Compiling a `StructuredOutputsSpec` against a tokenizer's vocabulary with llguidance, and caching it.

Owns the one grammar engine (llguidance; chosen in issue 12 on the numbers in docs/PERFORMANCE.md:
millisecond compiles, masks in tens of microseconds on the 152k Qwen vocabulary, native rollback and
fast-forward tokens, and it names the JSON-schema keywords it does not implement instead of ignoring
them), the translation of a spec into an llguidance grammar, the per-tokenizer engine tokenizer (about
1.5 s to build for 152k tokens, so built once per tokenizer and EOS set), the ids that are never allowed
(GGUF vocabularies padded with `[PAD<id>]` placeholders up to the embedding size), the layout ids (tokens of
only whitespace and JSON punctuation, which the grammar proposer may learn across requests), and an LRU of
compiled grammars per tokenizer keyed by the spec (schemas repeat across requests).

It does not know models, sampling or the engine; per-sequence state lives in `matcher.py`.
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable

import torch

from draftwise.config import ConfigError
from draftwise.structured.matcher import GrammarMatcher
# StructuredOutputsSpec (spec.py) appears in annotations only: spec.py imports this module to validate, and
# importing it back would be a cycle (tests/test_package_layers.py)
from draftwise.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept per tokenizer

_PAD_PLACEHOLDER = re.compile(r"\[PAD(\d+)\]")
LAYOUT_BYTES = frozenset(b' \n\t\r{}[]:,"')  # whitespace and JSON punctuation: a token of only these is layout


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a pinned dependency
        raise ConfigError("structured outputs need the llguidance package (pip install llguidance==1.9.1)") from None
    return llguidance


def _json_options(spec: StructuredOutputsSpec) -> dict:
    if spec.compact_json:
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    if spec.whitespace_pattern is not None:
        return {"whitespace_pattern": spec.whitespace_pattern}
    return {}


def to_llguidance(spec: StructuredOutputsSpec) -> str:
    """The llguidance grammar text of a spec (not yet checked)."""
    ll = _llguidance()
    try:
        if spec.kind == "json":
            return ll.LLMatcher.grammar_from_json_schema(spec.value, overrides=_json_options(spec) or None)
        if spec.kind == "regex":
            return ll.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return ll.grammar_from("choice", spec.value)
        return ll.grammar_from("grammar", spec.value)  # Lark, or GBNF/EBNF converted to Lark
    except ValueError as e:
        raise ConfigError(f"invalid {_what(spec)}: {e}") from None


def _what(spec: StructuredOutputsSpec) -> str:
    return {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}[spec.kind]


def _check(grammar: str, spec: StructuredOutputsSpec, ll_tokenizer=None) -> None:
    ll = _llguidance()
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    if is_error:
        message = messages[0].strip() if messages else "rejected by the grammar engine"
        raise ConfigError(f"invalid {_what(spec)}: {message}")


def validate_spec(spec: StructuredOutputsSpec) -> None:
    """Raise ConfigError if the grammar engine rejects the spec (bad schema/regex/grammar, unsupported
    JSON-schema keyword: the message names it). Needs no tokenizer; milliseconds."""
    _check(to_llguidance(spec), spec)


class CompiledGrammar:
    """A spec compiled for one tokenizer: a pristine llguidance matcher that `matcher()` copies (~µs)."""

    def __init__(self, spec: StructuredOutputsSpec, template, compiler: GrammarCompiler):
        self.spec = spec
        self._template = template
        self._compiler = compiler

    def matcher(self) -> GrammarMatcher:
        """A fresh per-sequence matcher at the start of the output."""
        c = self._compiler
        return GrammarMatcher(self._template.deep_copy(), c.vocab_size, c.eos_token_ids, c.never_allowed,
                              c.layout_ids)


class GrammarCompiler:
    """llguidance's tokenizer for one `Tokenizer` and EOS set, plus the LRU of grammars compiled for it."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int] | None = None, cache_size: int = CACHE_SIZE):
        ll = _llguidance()
        backend = tokenizer.backend
        self.vocab_size = tokenizer.vocab_size  # token ids the tokenizer knows (embedding rows may be more)
        eos = tuple(dict.fromkeys(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids))
        if not eos:
            raise ConfigError("structured outputs need an end-of-sequence token id (the tokenizer has none)")
        self.eos_token_ids: tuple[int, ...] = eos
        self.never_allowed = _placeholder_ids(tokenizer)  # [P] int64
        try:
            self.ll_tokenizer = ll.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=list(eos))
        except ValueError as e:  # e.g. a tokenizer.json without a decoder llguidance can read: the request's fault
            raise ConfigError(f"structured outputs are not available for this model's tokenizer ({e})") from e
        # ids whose bytes are only whitespace and JSON punctuation (`{\n`, `",\n`, `  `, `":`): layout, no content
        self.layout_ids = frozenset(i for i in range(self.vocab_size)
                                    if (b := self.ll_tokenizer.decode_bytes([i])) and set(b) <= LAYOUT_BYTES)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsSpec) -> CompiledGrammar:
        """Compile (or fetch from the LRU) `spec`; ConfigError names what is wrong with it."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit if hit.spec == spec else CompiledGrammar(spec, hit._template, self)
        grammar = to_llguidance(spec)
        _check(grammar, spec, self.ll_tokenizer)
        ll = _llguidance()
        template = ll.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ConfigError(f"invalid {_what(spec)}: {template.get_error().strip()}")
        compiled = CompiledGrammar(spec, template, self)
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def cache_info(self) -> dict:
        return {"size": len(self._cache), "max": self.cache_size}


def _placeholder_ids(tokenizer: Tokenizer) -> torch.Tensor:  # [P] int64
    """Ids whose token is llama.cpp's `[PAD<id>]` filler (GGUF vocabularies padded to the embedding size):
    not text a model writes, and a grammar would otherwise accept them as literal characters in strings."""
    vocab = tokenizer.get_vocab()
    ids = [i for t, i in vocab.items() if (m := _PAD_PLACEHOLDER.fullmatch(t)) and int(m.group(1)) == i]
    return torch.tensor(sorted(ids), dtype=torch.int64)


_compilers: weakref.WeakKeyDictionary[Tokenizer, dict[tuple, GrammarCompiler]] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer, eos_token_ids: Iterable[int] | None = None) -> GrammarCompiler:
    """The cached GrammarCompiler of `tokenizer` (one per EOS set; lives as long as the tokenizer)."""
    key = tuple(eos_token_ids) if eos_token_ids is not None else None
    with _compilers_lock:
        per_tok = _compilers.setdefault(tokenizer, {})
        compiler = per_tok.get(key)
    if compiler is None:
        compiler = GrammarCompiler(tokenizer, eos_token_ids)
        with _compilers_lock:
            compiler = per_tok.setdefault(key, compiler)
    return compiler


def compile_constraint(
    spec: StructuredOutputsSpec, tokenizer: Tokenizer, eos_token_ids: Iterable[int] | None = None
) -> CompiledGrammar:
    """Compile `spec` for `tokenizer`, cached per (tokenizer, EOS ids, spec). `eos_token_ids` defaults to the
    tokenizer's end-of-generation ids; they are allowed exactly when the output so far is complete."""
    return compiler_for(tokenizer, eos_token_ids).compile(spec)


def describe(spec: StructuredOutputsSpec) -> str:
    """A short human description for logs and errors."""
    text = spec.value if len(spec.value) <= 60 else spec.value[:57] + "..."
    return f"{spec.kind}: {json.dumps(text)[1:-1]}"

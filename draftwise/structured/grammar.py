"""Compiling a `Constraint` against a tokenizer's vocabulary with llguidance, and caching it.

Owns the one grammar engine (llguidance; chosen on the numbers in docs/PERFORMANCE.md, structured outputs:
millisecond compiles, masks in tens of microseconds on the 152k Qwen vocabulary, native rollback and
fast-forward tokens, and it names the JSON-schema keywords it does not implement instead of ignoring
them), the translation of a constraint into an llguidance grammar, the per-tokenizer engine tokenizer (seconds
to build for a 152k vocabulary, so built once per tokenizer and EOS set), the ids that are never allowed
(GGUF vocabularies padded with `[PAD<id>]` placeholders up to the embedding size), the layout ids (tokens of
only whitespace and JSON punctuation, which the grammar proposer may learn across requests), and an LRU of
compiled grammars per tokenizer keyed by the constraint (schemas repeat across requests).

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
# Constraint (constraint.py) appears in annotations only: constraint.py imports this module to validate, and
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


def _json_options(constraint: Constraint) -> dict:
    if constraint.compact_json:
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    if constraint.whitespace_pattern is not None:
        return {"whitespace_pattern": constraint.whitespace_pattern}
    return {}


def to_llguidance(constraint: Constraint) -> str:
    """The llguidance grammar text of a constraint (not yet checked)."""
    ll = _llguidance()
    try:
        if constraint.kind == "json":
            return ll.LLMatcher.grammar_from_json_schema(constraint.value, overrides=_json_options(constraint) or None)
        if constraint.kind == "regex":
            return ll.LLMatcher.grammar_from_regex(constraint.value)
        if constraint.kind == "choice":
            return ll.grammar_from("choice", constraint.value)
        return ll.grammar_from("grammar", constraint.value)  # Lark, or GBNF/EBNF converted to Lark
    except ValueError as e:
        raise ConfigError(f"invalid {_what(constraint)}: {e}") from None


def _what(constraint: Constraint) -> str:
    return {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}[constraint.kind]


def _check(grammar: str, constraint: Constraint, ll_tokenizer=None) -> None:
    ll = _llguidance()
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
    if is_error:
        message = messages[0].strip() if messages else "rejected by the grammar engine"
        raise ConfigError(f"invalid {_what(constraint)}: {message}")


def validate_constraint(constraint: Constraint) -> None:
    """Raise ConfigError if the grammar engine rejects the constraint (bad schema/regex/grammar, unsupported
    JSON-schema keyword: the message names it). Needs no tokenizer; milliseconds."""
    _check(to_llguidance(constraint), constraint)


class CompiledGrammar:
    """A constraint compiled for one tokenizer: a pristine llguidance matcher that `matcher()` copies (~µs)."""

    def __init__(self, constraint: Constraint, template, compiler: GrammarCompiler):
        self.constraint = constraint
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

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile (or fetch from the LRU) `constraint`; ConfigError names what is wrong with it."""
        with self._lock:
            hit = self._cache.get(constraint.key)
            if hit is not None:
                self._cache.move_to_end(constraint.key)
                return hit if hit.constraint == constraint else CompiledGrammar(constraint, hit._template, self)
        grammar = to_llguidance(constraint)
        _check(grammar, constraint, self.ll_tokenizer)
        ll = _llguidance()
        template = ll.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ConfigError(f"invalid {_what(constraint)}: {template.get_error().strip()}")
        compiled = CompiledGrammar(constraint, template, self)
        with self._lock:
            self._cache[constraint.key] = compiled
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
    constraint: Constraint, tokenizer: Tokenizer, eos_token_ids: Iterable[int] | None = None
) -> CompiledGrammar:
    """Compile `constraint` for `tokenizer`, cached per (tokenizer, EOS ids, constraint). `eos_token_ids` defaults to the
    tokenizer's end-of-generation ids; they are allowed exactly when the output so far is complete."""
    return compiler_for(tokenizer, eos_token_ids).compile(constraint)


def describe(constraint: Constraint) -> str:
    """A short human description for logs and errors."""
    text = constraint.value if len(constraint.value) <= 60 else constraint.value[:57] + "..."
    return f"{constraint.kind}: {json.dumps(text)[1:-1]}"

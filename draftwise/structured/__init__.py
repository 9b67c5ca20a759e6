"""Structured outputs: JSON schema, regex, choice and grammar constraints on what a sequence may emit.

A lower layer (imports torch, draftwise.config, draftwise.tokenizer; never the engine, API, server,
bench, CLI or speculation code). `constraint.py` turns OpenAI/vLLM request fields into a
`Constraint`; `grammar.py` compiles it for a tokenizer with llguidance (cached per tokenizer
and constraint); `matcher.py` holds one sequence's grammar state: masks, advance/rollback, forced tokens and
the masks along a draft for verification. How masks enter sampling and verification is the engine's
business, not this package's.
"""
from draftwise.structured.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    compile_constraint,
    compiler_for,
    validate_constraint,
)
from draftwise.structured.matcher import GrammarError, GrammarMatcher, mask_logits
from draftwise.structured.constraint import (
    Constraint,
    from_request,
    parse_guided,
    parse_response_format,
    parse_structured_outputs,
)

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "Constraint",
    "compile_constraint",
    "compiler_for",
    "from_request",
    "mask_logits",
    "parse_guided",
    "parse_response_format",
    "parse_structured_outputs",
    "validate_constraint",
]

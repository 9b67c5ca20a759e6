"""Structured-output requests -> one `Constraint`: what the output must match, nothing about how.

Owns reading the request shapes people send: OpenAI's `response_format` (`text`, `json_object`,
`json_schema` with `{"json_schema": {"name", "schema", "strict"}}`), vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`, `disable_any_whitespace`, `whitespace_pattern`) and
vLLM's older per-field extras (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
`guided_whitespace_pattern`). Malformed requests raise `ConfigError` naming the field; by default the
constraint is also checked by the grammar engine (no tokenizer needed), so an invalid schema, regex or
grammar, or an unsupported JSON-schema keyword, fails here with the engine's message naming the problem.

It does not know tokenizers, tensors, models or HTTP; compiling against a vocabulary is `grammar.py`'s job.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from draftwise.config import ConfigError

KINDS = ("json", "regex", "choice", "grammar")

# vLLM's StructuredOutputsParams fields we accept (the others are named in the error)
_SO_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_fallback")
_SO_REFUSED = {
    "structural_tag": "structural tags are not supported",
    "disable_additional_properties": "set additionalProperties in the schema instead",
}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint, in a canonical, hashable form.

    kind: "json" (value = the JSON schema, serialized compactly in its own key order, which is the order
          properties are generated in; `json_object` is the schema
          {"type": "object"}), "regex" (value = the pattern, matched against the whole output),
          "choice" (value = a JSON list of the allowed strings, output is exactly one of them) or
          "grammar" (value = a Lark grammar or a GBNF/EBNF one, as vLLM's `guided_grammar`).
    compact_json: for "json": no free whitespace; items and keys are separated as json.dumps does
          (", " and ": "). Set by vLLM's `disable_any_whitespace`. It makes keys and separators forced
          (cheap for the grammar proposer); the default lets the model choose whitespace.
    whitespace_pattern: for "json": a regex for the whitespace allowed between tokens (vLLM's option).
    name / strict: OpenAI's json_schema `name` and `strict`, kept for reporting; the schema is enforced
          exactly either way.
    """

    kind: str
    value: str
    compact_json: bool = False
    whitespace_pattern: str | None = None
    name: str | None = None
    strict: bool | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"unknown structured output kind {self.kind!r} (expected one of {', '.join(KINDS)})")

    @property
    def key(self) -> tuple:
        """What determines the compiled grammar (name/strict do not)."""
        return (self.kind, self.value, self.compact_json, self.whitespace_pattern)

    @property
    def schema(self) -> Any:
        """The JSON schema (kind "json" only)."""
        if self.kind != "json":
            raise AttributeError(f"a {self.kind!r} constraint has no schema")
        return json.loads(self.value)

    @property
    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise AttributeError(f"a {self.kind!r} constraint has no choices")
        return json.loads(self.value)


# ------------------------------------------------------------------------------------------------
# Builders for each kind
# ------------------------------------------------------------------------------------------------

def _schema_value(schema: Any, where: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: the schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ConfigError(f"{where}: a JSON schema must be an object (or a boolean), got {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)  # key order kept: it is the properties' order
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: the schema is not JSON-serializable: {e}") from None


def _choice_value(choice: Any, where: str) -> str:
    if not isinstance(choice, (list, tuple)) or not choice:
        raise ConfigError(f"{where}: expected a non-empty list of strings")
    bad = [c for c in choice if not isinstance(c, str)]
    if bad:
        raise ConfigError(f"{where}: every choice must be a string, got {bad[0]!r}")
    return json.dumps(list(choice), ensure_ascii=False)


def _text_value(text: Any, where: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: expected a non-empty string")
    return text


def _make(kind: str, raw: Any, where: str, **options) -> Constraint:
    if kind == "json":
        value = _schema_value(raw, where)
    elif kind == "choice":
        value = _choice_value(raw, where)
    else:
        value = _text_value(raw, where)
    return Constraint(kind, value, **options)


def _finish(constraint: Constraint | None, validate: bool) -> Constraint | None:
    if constraint is not None and validate:
        from draftwise.structured.grammar import (
            validate_constraint,  # the engine; imported lazily
        )

        validate_constraint(constraint)
    return constraint


# ------------------------------------------------------------------------------------------------
# Request shapes
# ------------------------------------------------------------------------------------------------

def parse_response_format(response_format: Mapping | None, validate: bool = True) -> Constraint | None:
    """OpenAI's `response_format`: {"type": "text"} or None -> None (no constraint); `json_object`;
    `json_schema` with {"json_schema": {"name": ..., "schema": {...}, "strict": bool}}."""
    if response_format is None:
        return None
    if hasattr(response_format, "model_dump"):  # a pydantic model from the openai client
        response_format = response_format.model_dump(exclude_none=True)
    if not isinstance(response_format, Mapping):
        raise ConfigError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _finish(Constraint("json", _schema_value({"type": "object"}, "response_format")), validate)
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, Mapping):
            raise ConfigError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        unknown = set(js) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ConfigError(f"response_format.json_schema: unknown field(s) {', '.join(sorted(unknown))}")
        if "schema" not in js:
            raise ConfigError("response_format.json_schema.schema is required")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise ConfigError("response_format.json_schema.name must be a string")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ConfigError("response_format.json_schema.strict must be a boolean")
        constraint = _make("json", js["schema"], "response_format.json_schema.schema", name=name, strict=strict)
        return _finish(constraint, validate)
    raise ConfigError(f"response_format.type must be one of text, json_object, json_schema; got {kind!r}")


def parse_structured_outputs(structured_outputs: Mapping | None, validate: bool = True) -> Constraint | None:
    """vLLM's `structured_outputs` (StructuredOutputsParams): exactly one of json / regex / choice / grammar /
    json_object, plus `disable_any_whitespace` and `whitespace_pattern` for JSON. None or {} -> None."""
    if structured_outputs is None:
        return None
    if isinstance(structured_outputs, Constraint):
        return _finish(structured_outputs, validate)
    if not isinstance(structured_outputs, Mapping):
        raise ConfigError(f"structured_outputs must be an object, got {type(structured_outputs).__name__}")
    so = {k: v for k, v in structured_outputs.items() if v is not None and v is not False}
    for key, why in _SO_REFUSED.items():
        if key in so:
            raise ConfigError(f"structured_outputs.{key} is not supported: {why}")
    unknown = set(so) - set(_SO_CONSTRAINTS) - set(_SO_OPTIONS)
    if unknown:
        raise ConfigError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
    given = [k for k in _SO_CONSTRAINTS if k in so]
    if not given:
        if set(so) & {"disable_any_whitespace", "whitespace_pattern"}:
            raise ConfigError("structured_outputs has options but no constraint (json, regex, choice, grammar)")
        return None
    if len(given) > 1:
        raise ConfigError(f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object; got {', '.join(given)}")
    kind = given[0]
    options = {}
    if so.get("disable_any_whitespace"):
        options["compact_json"] = True
    if "whitespace_pattern" in so:
        options["whitespace_pattern"] = _text_value(so["whitespace_pattern"], "structured_outputs.whitespace_pattern")
    if options and kind not in ("json", "json_object"):
        raise ConfigError("structured_outputs: disable_any_whitespace / whitespace_pattern apply to json only")
    if options.get("compact_json") and options.get("whitespace_pattern"):
        raise ConfigError("structured_outputs: disable_any_whitespace and whitespace_pattern exclude each other")
    if kind == "json_object":
        constraint = Constraint("json", _schema_value({"type": "object"}, "structured_outputs"), **options)
    else:
        constraint = _make(kind, so[kind], f"structured_outputs.{kind}", **options)
    return _finish(constraint, validate)


def parse_guided(fields: Mapping, validate: bool = True) -> Constraint | None:
    """vLLM's older request extras: guided_json / guided_regex / guided_choice / guided_grammar
    (+ guided_whitespace_pattern). Other keys of `fields` are ignored."""
    given = [k for k in _GUIDED if fields.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"give only one of {', '.join(_GUIDED)}; got {', '.join(given)}")
    kind = _GUIDED[given[0]]
    options = {}
    if fields.get("guided_whitespace_pattern") is not None:
        if kind != "json":
            raise ConfigError("guided_whitespace_pattern applies to guided_json only")
        options["whitespace_pattern"] = _text_value(fields["guided_whitespace_pattern"], "guided_whitespace_pattern")
    return _finish(_make(kind, fields[given[0]], given[0], **options), validate)


def from_request(body: Mapping, validate: bool = True) -> Constraint | None:
    """The constraint of an OpenAI/vLLM request body (completions or chat): `response_format`,
    `structured_outputs` or the `guided_*` extras. More than one source with a constraint is an error;
    `{"type": "text"}` is no constraint."""
    found = []
    rf = parse_response_format(body.get("response_format"), validate=False)
    if rf is not None:
        found.append(("response_format", rf))
    so = parse_structured_outputs(body.get("structured_outputs"), validate=False)
    if so is not None:
        found.append(("structured_outputs", so))
    guided = parse_guided(body, validate=False)
    if guided is not None:
        found.append(("guided_*", guided))
    if len(found) > 1:
        raise ConfigError(f"conflicting output constraints: {', '.join(name for name, _ in found)}; give one")
    return _finish(found[0][1] if found else None, validate)


# ------------------------------------------------------------------------------------------------
# Tool calls
# ------------------------------------------------------------------------------------------------

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # the Hermes / Qwen2.5 tool-call markup


def tool_call_constraint(functions: list[Mapping], parallel: bool = True, markup_ids: tuple[int, int] | None = None,
                         validate: bool = True) -> Constraint:
    """The output must be tool calls of `functions` (OpenAI function objects: name, parameters): each
    `<tool_call>\\n{"name": <one of the names>, "arguments": <that function's parameters schema>}\\n</tool_call>`
    (an anyOf over the functions), one call, or with `parallel` one or more separated by newlines. The JSON is
    laid out as json.dumps does (", " and ": ", no free whitespace), the form the Qwen2.5 template shows.
    `markup_ids`: the ids of `<tool_call>` / `</tool_call>` where the vocabulary has them as single (special)
    tokens, which is how such a model writes them (the grammar engine does not spell a special token's text)."""
    if not functions:
        raise ConfigError("a tool-call constraint needs at least one function")
    options = []
    for f in functions:
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = dict(schema, **{"x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                            "key_separator": ": "}})
    body = _schema_value(schema, "tools")
    if markup_ids is None:
        call = f"{json.dumps(TOOL_CALL_OPEN)} body {json.dumps(TOOL_CALL_CLOSE)}"
    else:
        call = f'<[{int(markup_ids[0])}]> "\\n" body "\\n" <[{int(markup_ids[1])}]>'

    more = ' ("\\n" call)*' if parallel else ""
    grammar = f"start: call{more}\ncall: {call}\nbody: %json {body}\n"
    return _finish(Constraint("grammar", grammar, name="tool_calls"), validate)

"""draftwise.structured: request parsing into a constraint, compiling with the grammar engine, and the per-sequence
matcher contract the engine relies on (allowed / advance / rollback / forced_tokens / masks_along).

Fast tests use a tiny byte-level BPE tokenizer trained here on a few JSON lines (no downloads); the one test
that needs the packaged Qwen tokenizer is marked integration and skips when the model is absent."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from draftwise.config import ConfigError
from draftwise.structured import (
    GrammarMatcher,
    Constraint,
    compile_constraint,
    compiler_for,
    from_request,
    mask_logits,
    parse_guided,
    parse_response_format,
    parse_structured_outputs,
)
from draftwise.tokenizer import Tokenizer

EOS = "<|endoftext|>"

CORPUS = [
    '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "active": true}',
    '{"name": "Alan", "age": 41, "tags": [], "active": false, "city": null}',
    '{"tool": "get_weather", "arguments": {"location": "Paris", "unit": "celsius", "days": 3}}',
    '{"id": 12, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 10}], "total": 99.5}',
    "positive negative neutral mixed 2024-05-01 (1+2)*3-4/5",
] * 4

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["math", "poetry", "art"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}
TOOL_CALL = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "tool": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string", "maxLength": 5},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["location", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["tool", "arguments"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"tool": {"const": "noop"}, "arguments": {"type": "null"}},
            "required": ["tool", "arguments"],
            "additionalProperties": False,
        },
    ]
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """Byte-level BPE (~350 ids) trained on CORPUS, with a `[PAD<id>]` placeholder appended like GGUF's."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer_json = json.loads(backend.to_str())
    pad_id = max(tokenizer_json["model"]["vocab"].values()) + 1
    tokenizer_json["model"]["vocab"][f"[PAD{pad_id}]"] = pad_id
    backend = BackendTokenizer.from_str(json.dumps(tokenizer_json))
    return Tokenizer(backend, eos_token=EOS)


def _matcher(tok, **so) -> GrammarMatcher:
    return compile_constraint(parse_structured_outputs(so), tok).matcher()


def _step_masks(m: GrammarMatcher, ids, rows):
    masks = []
    for t in ids:
        masks.append(m.allowed(rows))
        assert m.advance(t)
    masks.append(m.allowed(rows))
    return masks


# ------------------------------------------------------------------------------------------------
# Spec parsing and errors
# ------------------------------------------------------------------------------------------------

def test_text_response_format_is_no_constraint():
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format(None) is None
    assert parse_structured_outputs(None) is None
    assert parse_structured_outputs({}) is None
    assert from_request({"model": "x", "response_format": {"type": "text"}}) is None


def test_response_format_json_object_and_json_schema():
    constraint = parse_response_format({"type": "json_object"})
    assert constraint.kind == "json" and constraint.schema == {"type": "object"}
    constraint = parse_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    )
    assert (constraint.kind, constraint.name, constraint.strict) == ("json", "person", True)
    assert constraint.schema == PERSON
    assert list(constraint.schema["properties"]) == ["name", "age", "tags", "active"]  # order kept: it is the output's


def test_vllm_shapes_give_the_same_constraint():
    a = parse_structured_outputs({"json": PERSON})
    b = parse_guided({"guided_json": json.dumps(PERSON)})
    c = from_request({"structured_outputs": {"json": PERSON}})
    d = from_request({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert a == b == c and a.key == d.key
    assert parse_structured_outputs({"regex": r"\d+"}) == parse_guided({"guided_regex": r"\d+"})
    assert parse_structured_outputs({"choice": ["a", "b"]}).choices == ["a", "b"]
    assert parse_guided({"guided_grammar": 'start: "x"'}).kind == "grammar"
    compact = parse_structured_outputs({"json_object": True, "disable_any_whitespace": True})
    assert compact.compact_json and compact.schema == {"type": "object"}


@pytest.mark.parametrize(
    "request_fields, words",
    [
        ({"structured_outputs": {"json": {"type": "strin"}}}, ["JSON schema", "strin"]),
        ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, ["uniqueItems"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}}, ["not"]),
        ({"guided_json": "{not json"}, ["not valid JSON"]),
        ({"guided_json": [1, 2]}, ["must be an object"]),
        ({"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}}, ["missing"]),
        ({"structured_outputs": {"regex": "a(b"}}, ["regex", "unclosed group"]),
        ({"guided_grammar": "start: undefined_rule"}, ["grammar", "undefined_rule"]),
        ({"guided_choice": "yes"}, ["guided_choice", "list"]),
        ({"guided_choice": ["yes", 3]}, ["string"]),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, ["exactly one"]),
        ({"structured_outputs": {"json": {}, "colour": 1}}, ["colour"]),
        ({"structured_outputs": {"structural_tag": "{}"}}, ["structural_tag"]),
        ({"response_format": {"type": "yaml"}}, ["yaml"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, ["schema", "required"]),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, ["conflicting", "response_format", "guided_"]),
    ],
)
def test_invalid_requests_raise_config_error_naming_the_problem(request_fields, words):
    with pytest.raises(ConfigError) as e:
        from_request(request_fields)
    for w in words:
        assert w in str(e.value)


def test_unsatisfiable_schema_is_refused():
    with pytest.raises(ConfigError, match="minimum"):
        parse_structured_outputs({"json": {"type": "integer", "minimum": 5, "maximum": 2}})


def test_constraint_rejects_unknown_kind():
    with pytest.raises(ConfigError):
        Constraint("yaml", "x")


# ------------------------------------------------------------------------------------------------
# Compiling and the matcher contract
# ------------------------------------------------------------------------------------------------

def test_compiled_grammars_are_cached_per_tokenizer_and_constraint(tok):
    constraint = parse_structured_outputs({"json": PERSON})
    a = compile_constraint(constraint, tok)
    size = compiler_for(tok).cache_info()["size"]
    b = compile_constraint(parse_guided({"guided_json": PERSON}), tok)
    assert compiler_for(tok).cache_info()["size"] == size
    assert a._template is b._template  # the same compiled grammar, fresh matchers from it
    m1, m2 = a.matcher(), b.matcher()
    ids = tok.encode('{"name": "Ada"', add_special_tokens=False)
    assert m1.advance_many(ids) == len(ids)
    assert m2.num_tokens == 0 and torch.equal(m2.allowed(tok.vocab_size), b.matcher().allowed(tok.vocab_size))


def test_allowed_shape_padding_rows_placeholders_and_eos(tok):
    m = _matcher(tok, json=PERSON)
    v = tok.vocab_size
    pad_id = tok.token_to_id(f"[PAD{v - 1}]")
    assert pad_id == v - 1
    eos = tok.token_to_id(EOS)
    rows = v + 13  # the model's embedding may have more rows than the tokenizer has ids
    assert m.advance_many(tok.encode('{"name": "', add_special_tokens=False)) > 0
    mask = m.allowed(rows)
    assert mask.shape == (rows,) and mask.dtype == torch.bool
    assert not mask[v:].any() and not mask[pad_id] and not mask[eos]
    assert mask.sum() > 100  # inside a string almost any byte-level token fits
    assert not m.advance(pad_id) and not m.advance(v + 3) and not m.advance(-1) and not m.advance(eos)
    # fewer rows than the tokenizer: truncated, never an error
    assert m.allowed(50).shape == (50,)


def test_advance_rollback_round_trip(tok):
    m = _matcher(tok, json=PERSON)
    ids = tok.encode('{"name": "Ada", "age": 36, "tags": ["math"], "active": true}', add_special_tokens=False)
    rows = tok.vocab_size
    masks = _step_masks(m, ids, rows)
    assert m.is_accepting() and m.is_finished()
    eos = tok.token_to_id(EOS)
    assert masks[-1].nonzero().flatten().tolist() == [eos]  # closed object: only EOS
    assert m.advance(eos) and m.num_tokens == len(ids) + 1
    assert m.is_finished() and not m.is_accepting() and not m.allowed(rows).any()
    assert not m.advance(eos)
    m.rollback(1)  # undo EOS
    assert torch.equal(m.allowed(rows), masks[-1])
    for back in (3, 5, 1):
        m.rollback(back)
        pos = m.num_tokens
        assert torch.equal(m.allowed(rows), masks[pos])
        assert m.advance_many(ids[pos:pos + back]) == back
        assert torch.equal(m.allowed(rows), masks[pos + back])
    m.rollback(m.num_tokens)
    assert torch.equal(m.allowed(rows), masks[0])
    with pytest.raises(ValueError):
        m.rollback(1)
    # a forbidden token leaves the state as it was
    bad = tok.encode("x", add_special_tokens=False)[0]
    assert not masks[0][bad] and not m.advance(bad)
    assert m.num_tokens == 0 and torch.equal(m.allowed(rows), masks[0])


def test_copy_is_independent(tok):
    m = _matcher(tok, regex=r"[0-9]{3}-[a-z]+")
    ids = tok.encode("123-ab", add_special_tokens=False)
    m.advance(ids[0])
    c = m.copy()
    assert c.advance_many(ids[1:]) == len(ids) - 1 and c.is_accepting()
    assert m.num_tokens == 1 and not m.is_accepting()
    assert torch.equal(m.allowed(tok.vocab_size), _after(tok, ids[:1]))


def _after(tok, prefix):
    m = _matcher(tok, regex=r"[0-9]{3}-[a-z]+")
    m.advance_many(prefix)
    return m.allowed(tok.vocab_size)


@pytest.mark.parametrize("start", [0, 3, 9])
def test_masks_along_equals_step_by_step(tok, start):
    text = '{"tool": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}'
    ids = tok.encode(text, add_special_tokens=False)
    eos = tok.token_to_id(EOS)
    rows = tok.vocab_size + 5
    m = _matcher(tok, json=TOOL_CALL)
    m.advance_many(ids[:start])
    reference = _step_masks(m.copy(), ids[start:], rows)
    for k in (1, 4, 8):
        draft = ids[start:start + k]
        masks, valid = m.masks_along(draft, rows)
        assert masks.shape == (len(draft) + 1, rows) and valid == len(draft)
        for i in range(valid + 1):
            assert torch.equal(masks[i], reference[i]), (k, i)
        assert m.num_tokens == start  # rolled back to where it started
    # a forbidden token in the middle of the draft stops it; later rows are all False
    bad = tok.encode("x", add_special_tokens=False)[0]
    draft = torch.tensor(ids[start:start + 2] + [bad] + ids[start + 2:start + 4])
    masks, valid = m.masks_along(draft, rows)
    assert valid == 2 and not masks[3:].any() and not masks[2][bad]
    assert torch.equal(masks[2], reference[2]) and m.num_tokens == start
    # EOS inside a draft: valid only where the output is complete
    full = _matcher(tok, json=TOOL_CALL)
    masks, valid = full.masks_along(ids + [eos, ids[0]], rows)
    assert valid == len(ids) + 1 and masks[len(ids)][eos] and not masks[len(ids) + 1].any()
    masks, valid = full.masks_along(ids[:4] + [eos], rows)
    assert valid == 4 and full.num_tokens == 0


def test_forced_tokens_on_fixed_keys(tok):
    m = _matcher(tok, json=TOOL_CALL, disable_any_whitespace=True)
    forced = m.forced_tokens(20)
    assert forced and tok.decode(forced).startswith('{"tool')
    assert m.num_tokens == 0  # state unchanged
    assert m.advance_many(forced) == len(forced)
    m.rollback(len(forced))
    assert m.forced_tokens(1) == forced[:1]
    assert m.forced_tokens(0) == []
    # after choosing the tool, "arguments" and its keys are fixed by the schema
    prefix = tok.encode('{"tool": "get_weather", ', add_special_tokens=False)
    assert m.advance_many(prefix) == len(prefix)
    text = tok.decode(m.forced_tokens(20))
    assert text.startswith('"arguments": {"location')
    # a complete output forces nothing (EOS is never proposed)
    done = _matcher(tok, choice=["positive", "negative"])
    done.advance_many(tok.encode("negative", add_special_tokens=False))
    assert done.is_accepting() and done.forced_tokens(5) == []


def _random_walk(m: GrammarMatcher, rng: random.Random, rows: int, eos: int, max_steps: int = 400) -> list[int]:
    """Sample uniformly among allowed ids (EOS with prob. 1/2 when allowed) until EOS."""
    ids = []
    for _ in range(max_steps):
        allowed = m.allowed(rows)
        if allowed[eos] and rng.random() < 0.5:
            assert m.advance(eos)
            return ids
        choices = [i for i in allowed.nonzero().flatten().tolist() if i != eos]
        if not choices:
            assert allowed[eos]
            assert m.advance(eos)
            return ids
        t = rng.choice(choices)
        assert m.advance(t)
        ids.append(t)
    raise AssertionError("walk did not finish")


@pytest.mark.parametrize("schema", [PERSON, TOOL_CALL], ids=["person", "tool_call"])
@pytest.mark.parametrize("compact", [False, True], ids=["any_ws", "compact"])
def test_random_walks_parse_and_validate(tok, schema, compact):
    compiled = compile_constraint(parse_structured_outputs({"json": schema, "disable_any_whitespace": compact}), tok)
    rng = random.Random(1234)
    eos = tok.token_to_id(EOS)
    for _ in range(25):
        ids = _random_walk(compiled.matcher(), rng, tok.vocab_size + 3, eos)
        text = tok.decode(ids)
        value = json.loads(text)
        jsonschema.validate(value, schema)
        if compact:
            assert text == json.dumps(value, ensure_ascii=False)


@pytest.mark.parametrize(
    "fields, check",
    [
        ({"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, lambda s: len(s) == 10 and s[4] == "-" and s.replace("-", "").isdigit()),
        ({"choice": ["positive", "negative", "neutral"]}, lambda s: s in ("positive", "negative", "neutral")),
        ({"grammar": 'start: expr\nexpr: NUM (("+"|"*") NUM){0,3}\nNUM: /[1-9]/'}, lambda s: _arith(s)),
        ({"grammar": 'root ::= num (("+" | "*") num)?\nnum ::= [1-9]'}, lambda s: _arith(s)),
    ],
    ids=["regex", "choice", "lark", "gbnf"],
)
def test_random_walks_regex_choice_grammar(tok, fields, check):
    compiled = compile_constraint(parse_structured_outputs(fields), tok)
    rng = random.Random(7)
    eos = tok.token_to_id(EOS)
    for _ in range(20):
        text = tok.decode(_random_walk(compiled.matcher(), rng, tok.vocab_size, eos))
        assert check(text), text


def _arith(s: str) -> bool:
    import re

    return re.fullmatch(r"[1-9]([+*][1-9]){0,3}", s) is not None


def test_mask_logits():
    logits = torch.randn(3, 10)
    allowed = torch.zeros(3, 10, dtype=torch.bool)
    allowed[:, [2, 5]] = True
    out = mask_logits(logits, allowed)
    assert torch.isinf(out[~allowed]).all() and torch.equal(out[allowed], logits[allowed])
    probs = out.softmax(-1)
    assert torch.allclose(probs.sum(-1), torch.ones(3)) and (probs[~allowed] == 0).all()


# ------------------------------------------------------------------------------------------------
# The packaged Qwen vocabulary
# ------------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_qwen_vocabulary_masks():
    from tests.conftest import require_packaged

    require_packaged("qwen2.5-coder-0.5b-instruct")
    from draftwise.models.sources import load_checkpoint

    ckpt = load_checkpoint("qwen2.5-coder-0.5b-instruct", progress=False)
    qtok, rows = ckpt.tokenizer, ckpt.config.vocab_size
    m = compile_constraint(parse_structured_outputs({"json": TOOL_CALL}), qtok).matcher()
    im_end = qtok.token_to_id("<|im_end|>")
    text = '{"tool": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}'
    ids = qtok.encode(text, add_special_tokens=False)
    masks, valid = m.masks_along(ids + [im_end], rows)
    assert valid == len(ids) + 1 and masks.shape == (len(ids) + 2, rows)
    assert masks[len(ids)][im_end] and not masks[:len(ids), im_end].any()
    placeholders = [i for i in range(qtok.vocab_size) if qtok.id_to_token(i) == f"[PAD{i}]"]
    if placeholders:  # GGUF-converted vocabularies pad to the embedding size with these
        assert not masks[:, placeholders].any()
    assert not masks[:, qtok.vocab_size:].any()
    assert not masks[:, qtok.token_to_id("<|im_start|>")].any()
    string_pos = next(i for i in range(len(ids)) if "Paris" in qtok.decode(ids[: i + 1]))  # emits free text
    assert masks[string_pos].sum() > 50_000  # free text inside a string (maxLength 5 still admits most tokens)
    assert m.advance_many(ids) == len(ids) and m.is_accepting()


EMAIL_TOOL = {"type": "object", "properties": {
    "name": {"const": "send_email"},
    "arguments": {"type": "object", "properties": {
        "to": {"type": "string", "maxLength": 40}, "subject": {"type": "string", "maxLength": 60},
        "body": {"type": "string", "maxLength": 200},
        "cc": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5}},
        "required": ["to", "subject", "body", "cc"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
# the 1.5B's greedy output for the structured bench's email-tool item, up to `"cc": ["alice@example`
EMAIL_PREFIX = [515, 220, 330, 606, 788, 330, 6681, 9172, 756, 220, 330, 16370, 788, 341, 262, 330, 983, 788, 330,
                47086, 35487, 905, 756, 262, 330, 11501, 788, 330, 10361, 39793, 291, 756, 262, 330, 2599, 788, 330,
                785, 1895, 374, 22706, 311, 6602, 10346, 262, 330, 638, 788, 4383, 63195, 35487]


@pytest.mark.integration
def test_rollback_restores_exactly_the_state_before():
    """A draft walked and rolled back must leave no trace: llguidance 1.9.1's own rollback did here (after the
    detour `.com", <newline>   ` the state allowed a new key without a comma and forbade `}`), and greedy
    speculation then differed from plain decoding on the structured bench."""
    from tests.conftest import require_packaged

    require_packaged("qwen2.5-coder-0.5b-instruct")
    from draftwise.models.sources import load_checkpoint

    ckpt = load_checkpoint("qwen2.5-coder-0.5b-instruct", progress=False)
    qtok, rows = ckpt.tokenizer, ckpt.config.vocab_size
    grammar = compile_constraint(parse_structured_outputs({"json": EMAIL_TOOL}), qtok)
    detour, emitted = [905, 756, 262], [905, 7026]
    assert qtok.decode(detour) == '.com",\n   ' and qtok.decode(emitted) == '.com"]\n'
    straight = grammar.matcher()
    assert straight.advance_many(EMAIL_PREFIX + emitted) == len(EMAIL_PREFIX) + 2
    m = grammar.matcher()
    assert m.advance_many(EMAIL_PREFIX) == len(EMAIL_PREFIX)
    _, valid = m.masks_along(detour, rows)  # advances the detour, then rolls it back
    assert valid == 3 and m.advance_many(emitted) == 2
    assert torch.equal(m.allowed(rows), straight.allowed(rows))
    assert m.allowed(rows)[qtok.encode("}", add_special_tokens=False)[0]]
    # deeper than the kept snapshots: rebuilt from the start, the same state
    m.rollback(m.num_tokens - 3)
    assert m.advance_many(EMAIL_PREFIX[3:] + emitted) == len(EMAIL_PREFIX) - 3 + 2
    assert torch.equal(m.allowed(rows), straight.allowed(rows))

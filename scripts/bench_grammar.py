"""Grammar-engine evaluation for structured outputs (issue 12): llguidance vs xgrammar vs outlines-core.

Measures, on this CPU with the packaged Qwen tokenizer (the vocabulary of the default target/draft pair):
  * tokenizer set-up time per engine (once per tokenizer; cached by the caller),
  * compile time per constraint (JSON schemas of the extraction / tool-call kind, a regex, a choice list, a
    Lark/EBNF grammar) and the time of the first mask after compiling,
  * mask cost per token (median and p95) while walking a realistic JSON output token by token,
  * rollback: advance along k draft tokens, roll back, and check the mask is the one from before,
  * JSON-schema coverage: per keyword, whether a valid instance is accepted and an invalid one rejected
    ("enforced"), the compile is refused ("refused"), or the keyword is silently ignored ("ignored"),
  * install size of each package and of what it pulls.
Also times draftwise.structured (the layer built on the chosen engine) when it is importable.

Not a test: timings are noisy on a shared machine, so every engine runs side by side in one process and
medians are reported. Run: .venv/bin/python scripts/bench_grammar.py [--model qwen2.5-coder-0.5b-instruct]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# ------------------------------------------------------------------------------------------------
# Workload: constraints and realistic outputs
# ------------------------------------------------------------------------------------------------

EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "country": {"type": "string", "enum": ["US", "UK", "DE", "FR", "JP"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "address", "skills", "employed"],
    "additionalProperties": False,
}
EXTRACTION_OUTPUT = {
    "name": "Maria Gonzalez",
    "age": 34,
    "email": "maria.gonzalez@example.com",
    "address": {"street": "221 Baker Street", "city": "London", "country": "UK"},
    "skills": ["Python", "SQL", "distributed systems", "technical writing"],
    "employed": True,
}

INVOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,6}$"},
        "date": {"type": "string", "format": "date"},
        "vendor": {"type": "string", "minLength": 1, "maxLength": 80},
        "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
        "line_items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number", "minimum": 0},
                },
                "required": ["description", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["invoice_number", "date", "vendor", "currency", "line_items", "total", "notes"],
    "additionalProperties": False,
}
INVOICE_OUTPUT = {
    "invoice_number": "INV-20417",
    "date": "2024-03-18",
    "vendor": "Northwind Traders",
    "currency": "EUR",
    "line_items": [
        {"description": "Espresso machine", "quantity": 2, "unit_price": 349.5},
        {"description": "Coffee beans 1kg", "quantity": 12, "unit_price": 18.25},
    ],
    "total": 918.0,
    "notes": None,
}

TOOL_CALL_SCHEMA = {
    "$defs": {
        "weather": {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    },
                    "required": ["location", "unit", "days"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        "search": {
            "type": "object",
            "properties": {
                "name": {"const": "search_web"},
                "arguments": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
                    "required": ["query", "max_results"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {"tool_calls": {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/weather"}, {"$ref": "#/$defs/search"}]}}},
    "required": ["tool_calls"],
    "additionalProperties": False,
}
TOOL_CALL_OUTPUT = {
    "tool_calls": [
        {"name": "get_weather", "arguments": {"location": "San Francisco, CA", "unit": "celsius", "days": 3}},
        {"name": "search_web", "arguments": {"query": "best hiking trails near San Francisco", "max_results": 5}},
    ]
}

REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z \| (INFO|WARN|ERROR) \| [a-z_]+: [A-Za-z ,.]{1,60}"
REGEX_OUTPUT = "2024-05-01T12:30:05Z | WARN | disk_monitor: Disk usage above ninety percent, cleaning caches."
CHOICES = ["positive", "negative", "neutral", "mixed"]
CHOICE_OUTPUT = "negative"
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+(\.[0-9]+)?/
"""
GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+ ("." [0-9]+)?
"""
GRAMMAR_OUTPUT = "(12+3.5)*4-(7/2)*(8+1)"

DUMPS = {"separators": (", ", ": "), "ensure_ascii": False}

# (name, kind, payload, output text); kind in json | regex | choice | grammar
CONSTRAINTS = [
    ("json:extraction", "json", EXTRACTION_SCHEMA, json.dumps(EXTRACTION_OUTPUT, **DUMPS)),
    ("json:invoice", "json", INVOICE_SCHEMA, json.dumps(INVOICE_OUTPUT, **DUMPS)),
    ("json:tool_call", "json", TOOL_CALL_SCHEMA, json.dumps(TOOL_CALL_OUTPUT, **DUMPS)),
    ("json_object", "json", {"type": "object"}, json.dumps(EXTRACTION_OUTPUT, **DUMPS)),
    ("regex:log_line", "regex", REGEX, REGEX_OUTPUT),
    ("choice:4", "choice", CHOICES, CHOICE_OUTPUT),
    ("grammar:arith", "grammar", (LARK, GBNF), GRAMMAR_OUTPUT),
]

# keyword -> (schema, valid instance, invalid instance)
COVERAGE = {
    "enum": ({"type": "string", "enum": ["a", "b"]}, "a", "c"),
    "const": ({"const": "x1"}, "x1", "x2"),
    "required+additionalProperties:false": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
        {"a": 1}, {"a": 1, "b": 2}),
    "additionalProperties:schema": (
        {"type": "object", "additionalProperties": {"type": "integer"}}, {"x": 1}, {"x": "s"}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "s"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, 3, "s"),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
              {"a": 1, "b": 2}, {"a": 1}),
    "$ref/$defs": ({"$defs": {"n": {"type": "integer"}}, "type": "object",
                    "properties": {"v": {"$ref": "#/$defs/n"}}, "required": ["v"]}, {"v": 1}, {"v": "s"}),
    "recursive $ref": ({"$defs": {"node": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                                           "required": ["c"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
                       {"c": [{"c": []}]}, {"c": [{}]}),
    "pattern": ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ABC-12", "AB-123"),
    "format:date": ({"type": "string", "format": "date"}, "2024-02-29", "29/02/2024"),
    "format:date-time": ({"type": "string", "format": "date-time"}, "2024-02-29T10:00:00Z", "yesterday"),
    "format:email": ({"type": "string", "format": "email"}, "a@b.co", "not an email"),
    "format:uuid": ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "1234"),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    "minimum/maximum": ({"type": "integer", "minimum": 10, "maximum": 20}, 15, 25),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, 7),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, [1, 2], [1, 2, 3]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}, [1, "a"], ["a", 1]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, [1, 7], [1, 2]),
    "minProperties/maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                                    {"a": 1}, {"a": 1, "b": 2}),
    "patternProperties": ({"type": "object", "patternProperties": {"^n_": {"type": "integer"}}, "additionalProperties": False},
                          {"n_a": 1}, {"x": 1}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"}},
                      {"ab": 1}, {"AB": 1}),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
    "if/then/else": ({"type": "object", "properties": {"t": {"type": "string"}, "n": {"type": "integer"}},
                      "if": {"properties": {"t": {"const": "num"}}}, "then": {"required": ["n"]}}, {"t": "num", "n": 1}, {"t": "num"}),
    "not": ({"not": {"type": "string"}}, 1, "s"),
    "type:[list]": ({"type": ["integer", "null"]}, None, "s"),
}


# ------------------------------------------------------------------------------------------------
# Tokenizer helpers
# ------------------------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-unicode table used by byte-level BPE vocabularies (Qwen's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def token_bytes(backend) -> list[bytes | None]:
    """The byte string of every token id of a byte-level BPE `tokenizers` tokenizer (added tokens: utf-8)."""
    inv = {c: b for b, c in _bytes_to_unicode().items()}
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    out: list[bytes | None] = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        if i in added:
            out.append(added[i].encode())
            continue
        tok = backend.id_to_token(i)
        if tok is None:
            out.append(None)
            continue
        try:
            out.append(bytes(inv[c] for c in tok))
        except KeyError:
            out.append(tok.encode())
    return out


def dir_size(paths) -> int:
    total = 0
    for p in paths:
        p = Path(p)
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


# ------------------------------------------------------------------------------------------------
# Engine adapters: compile(kind, payload) -> factory; matcher with mask_into / advance / rollback / accepting
# ------------------------------------------------------------------------------------------------

class Unsupported(Exception):
    pass


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, backend, vocab_size, eos_ids):
        import llguidance

        self.lib = llguidance
        self.vocab_size = vocab_size
        t = time.perf_counter()
        self.tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
        self.setup_s = time.perf_counter() - t
        self.mask_words = (vocab_size + 31) // 32

    def compile(self, kind, payload):
        lib = self.lib
        if kind == "json":
            grammar = lib.LLMatcher.grammar_from_json_schema(json.dumps(payload))
        elif kind == "regex":
            grammar = lib.LLMatcher.grammar_from_regex(payload)
        elif kind == "choice":
            grammar = lib.grammar_from("choice", json.dumps(payload))
        else:
            grammar = lib.LLMatcher.grammar_from_lark(payload[0])
        m = lib.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def new_bitmask(self):
        return torch.zeros(self.mask_words, dtype=torch.int32)

    def fill(self, m, bitmask):
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def advance(self, m, tok):
        return m.consume_token(tok)

    def rollback(self, m, n):
        m.rollback(n)

    def accepting(self, m):
        return m.is_accepting()

    def forced(self, m):
        return m.compute_ff_tokens()


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, backend, vocab_size, eos_ids):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.lib = xgrammar
        self.vocab_size = vocab_size
        t = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_object=backend)
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
        self.setup_s = time.perf_counter() - t
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)

    def compile(self, kind, payload):
        c = self.compiler
        if kind == "json":
            cg = c.compile_json_schema(json.dumps(payload), any_whitespace=True, strict_mode=True)
        elif kind == "regex":
            cg = c.compile_regex(payload)
        elif kind == "choice":
            cg = c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in payload))
        else:
            cg = c.compile_grammar(payload[1])
        return self.lib.GrammarMatcher(cg, max_rollback_tokens=64)

    def new_bitmask(self):
        return self.lib.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask)

    def advance(self, m, tok):
        return m.accept_token(tok)

    def rollback(self, m, n):
        m.rollback(n)

    def accepting(self, m):
        return m.is_completed() if hasattr(m, "is_completed") else m.is_terminated()

    def forced(self, m):
        return m.find_jump_forward_string()


class OutlinesCoreEngine:
    name = "outlines-core"

    def __init__(self, backend, vocab_size, eos_ids):
        import outlines_core

        self.lib = outlines_core
        self.vocab_size = vocab_size
        t = time.perf_counter()
        eos = next(iter(eos_ids))
        mapping: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes(backend)):
            if b is None or i in eos_ids:
                continue
            mapping.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, mapping)
        self.eos = eos
        self.setup_s = time.perf_counter() - t
        self.mask_words = (vocab_size + 31) // 32

    def compile(self, kind, payload):
        oc = self.lib
        if kind == "json":
            regex = oc.json_schema.build_regex_from_schema(json.dumps(payload))
        elif kind == "regex":
            regex = payload
        elif kind == "choice":
            import re

            regex = "(" + "|".join(re.escape(x) for x in payload) + ")"
        else:
            raise Unsupported("no context-free grammars (regular languages only)")
        return oc.Guide(oc.Index(regex, self.vocab), max_rollback=64)

    def new_bitmask(self):
        return torch.zeros(self.mask_words, dtype=torch.int32)

    def fill(self, m, bitmask):
        m.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def advance(self, m, tok):
        try:
            m.advance(tok, return_tokens=False)
            return True
        except ValueError:  # outlines-core: "No next state found for the current state ... with token ID ..."
            return False

    def rollback(self, m, n):
        m.rollback_state(n)

    def accepting(self, m):
        return m.is_finished()

    def forced(self, m):
        return None


ENGINES = [LLGuidanceEngine, XGrammarEngine, OutlinesCoreEngine]


# ------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------

def time_compile(engine, kind, payload, reps):
    compile_s, first_mask_s = [], []
    m = None
    for _ in range(reps):
        gc.collect()
        t = time.perf_counter()
        m = engine.compile(kind, payload)
        t1 = time.perf_counter()
        bm = engine.new_bitmask()
        engine.fill(m, bm)
        t2 = time.perf_counter()
        compile_s.append(t1 - t)
        first_mask_s.append(t2 - t1)
    return statistics.median(compile_s), statistics.median(first_mask_s)


def walk(engine, kind, payload, ids, reps):
    """Mask + advance at each position of `ids` (a realistic output + EOS); per-token mask times in µs."""
    mask_us, advance_us = [], []
    ok = True
    for _ in range(reps):
        m = engine.compile(kind, payload)
        bm = engine.new_bitmask()
        for tok in ids:
            t = time.perf_counter_ns()
            engine.fill(m, bm)
            t1 = time.perf_counter_ns()
            if tok is None:  # the position after the output, where EOS must be allowed
                mask_us.append((t1 - t) / 1e3)
                break
            good = engine.advance(m, tok)
            t2 = time.perf_counter_ns()
            mask_us.append((t1 - t) / 1e3)
            advance_us.append((t2 - t1) / 1e3)
            if not good:
                ok = False
                break
        ok = ok and engine.accepting(m)
    return mask_us, advance_us, ok


def rollback_check(engine, kind, payload, ids, k=5):
    """Advance k tokens, roll back k, and compare the mask with the one before; also partial rollback."""
    m = engine.compile(kind, payload)
    k = min(k, len(ids))
    start = max(0, min(3, len(ids) - k))
    for tok in ids[:start]:
        engine.advance(m, tok)
    before = engine.new_bitmask()
    engine.fill(m, before)
    for tok in ids[start:start + k]:
        engine.advance(m, tok)
    mid = engine.new_bitmask()
    engine.rollback(m, k)
    after = engine.new_bitmask()
    engine.fill(m, after)
    same = torch.equal(before, after)
    # partial: advance k, roll back k-2, re-advance the two -> same as straight through
    for tok in ids[start:start + k]:
        engine.advance(m, tok)
    engine.fill(m, mid)
    back = min(2, k)
    engine.rollback(m, back)
    for tok in ids[start + k - back:start + k]:
        engine.advance(m, tok)
    mid2 = engine.new_bitmask()
    engine.fill(m, mid2)
    return same and torch.equal(mid, mid2)


def coverage(engine, backend, eos_id):
    out = {}
    for kw, (schema, valid, invalid) in COVERAGE.items():
        try:
            engine.compile("json", schema)
        except Unsupported as e:
            out[kw] = f"n/a ({e})"
            continue
        except BaseException as e:  # noqa: BLE001 - libraries raise their own types (and pyo3 panics)
            out[kw] = "refused: " + str(e).splitlines()[0][:90] if str(e) else "refused"
            continue

        def accepts(instance, schema=schema):
            m = engine.compile("json", schema)
            ids = backend.encode(json.dumps(instance, **DUMPS), add_special_tokens=False).ids
            for tok in ids:
                if not engine.advance(m, tok):
                    return False
            return engine.accepting(m)

        try:
            va, ia = accepts(valid), accepts(invalid)
        except BaseException as e:  # noqa: BLE001
            out[kw] = "error: " + str(e)[:80]
            continue
        if not va:
            out[kw] = "BROKEN (valid rejected)"
        elif ia:
            out[kw] = "ignored (invalid accepted)"
        else:
            out[kw] = "enforced"
    return out


def bitmask_to_bool_us(vocab_size, reps=200):
    """Cost of expanding an int32 bitmask [ceil(V/32)] to a BoolTensor [V] (what allowed() returns)."""
    words = torch.randint(-(2**31), 2**31 - 1, ((vocab_size + 31) // 32,), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    times = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten()[:vocab_size]
        times.append((time.perf_counter_ns() - t) / 1e3)
    return statistics.median(times)


def packages_size():
    import importlib.util

    res = {}
    for name, pkgs in {
        "llguidance": ["llguidance"],
        "xgrammar": ["xgrammar", "tvm_ffi"],
        "outlines-core": ["outlines_core"],
    }.items():
        paths = []
        for p in pkgs:
            spec = importlib.util.find_spec(p)
            if spec and spec.origin:
                paths.append(Path(spec.origin).parent)
        res[name] = dir_size(paths) / 2**20
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--skip-coverage", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from draftwise.models.sources import load_checkpoint

    ckpt = load_checkpoint(args.model, progress=False)
    tok = ckpt.tokenizer
    vocab_size = ckpt.config.vocab_size  # embedding rows
    backend = tok.backend
    eos_ids = [i for i in tok.eos_token_ids if tok.backend.id_to_token(i) and tok.backend.id_to_token(i).startswith("<|")]
    print(f"# model {args.model}: embedding rows {vocab_size}, tokenizer ids {tok.vocab_size} "
          f"(added {len(backend.get_added_tokens_decoder())}), eos {eos_ids}; torch {torch.__version__}, "
          f"{os.cpu_count()} cpus, torch threads 1")
    import importlib.metadata as md

    for p in ("llguidance", "xgrammar", "outlines-core", "apache-tvm-ffi"):
        try:
            print(f"#   {p}=={md.version(p)}")
        except md.PackageNotFoundError:
            print(f"#   {p}: not installed")

    wanted = set(args.engines.split(","))
    engines = []
    for cls in ENGINES:
        if cls.name in wanted:
            try:
                engines.append(cls(backend, vocab_size, eos_ids))
            except ImportError as e:
                print(f"# {cls.name}: not installed ({e}); skipped")
                continue
            print(f"# {cls.name}: tokenizer set-up {engines[-1].setup_s:.2f} s")

    print(f"\n## compile (median of {args.reps}) and mask per token over a realistic output")
    print(f"{'constraint':18} {'engine':14} {'tokens':>6} {'compile ms':>10} {'1st mask ms':>11} "
          f"{'mask med µs':>11} {'mask p95 µs':>11} {'mask max µs':>11} {'adv med µs':>10} {'walk ok':>7} {'rollback':>8}")
    summary: dict[str, dict[str, list]] = {e.name: {"mask": [], "compile": []} for e in engines}
    for cname, kind, payload, text in CONSTRAINTS:
        ids = backend.encode(text, add_special_tokens=False).ids + [None]
        for e in engines:
            try:
                c_s, f_s = time_compile(e, kind, payload, args.reps)
                mask_us, adv_us, ok = walk(e, kind, payload, ids, args.reps)
                rb = rollback_check(e, kind, payload, [i for i in ids if i is not None])
            except Unsupported as ex:
                print(f"{cname:18} {e.name:14} {'':>6} n/a: {ex}")
                continue
            except BaseException as ex:  # noqa: BLE001
                print(f"{cname:18} {e.name:14} {'':>6} ERROR: {str(ex).splitlines()[0][:100]}")
                continue
            summary[e.name]["mask"] += mask_us
            summary[e.name]["compile"].append(c_s)
            print(f"{cname:18} {e.name:14} {len(ids) - 1:>6} {c_s * 1e3:>10.1f} {f_s * 1e3:>11.2f} "
                  f"{statistics.median(mask_us):>11.0f} {pct(mask_us, 95):>11.0f} {max(mask_us):>11.0f} "
                  f"{statistics.median(adv_us):>10.0f} {ok!s:>7} {rb!s:>8}")

    print("\n## all constraints pooled")
    for name, s in summary.items():
        if s["mask"]:
            print(f"{name:14} mask/token median {statistics.median(s['mask']):.0f} µs, p95 {pct(s['mask'], 95):.0f} µs, "
                  f"max {max(s['mask']):.0f} µs; compile median {statistics.median(s['compile']) * 1e3:.1f} ms, "
                  f"max {max(s['compile']) * 1e3:.1f} ms")
    print(f"bitmask [V/32] int32 -> BoolTensor [V]: {bitmask_to_bool_us(vocab_size):.0f} µs (torch, 1 thread)")

    if not args.skip_coverage:
        print("\n## JSON-schema coverage (valid instance accepted + invalid rejected = enforced)")
        covs = {e.name: coverage(e, backend, eos_ids[0]) for e in engines}
        print(f"{'keyword':36} " + " ".join(f"{e.name:32}" for e in engines))
        for kw in COVERAGE:
            print(f"{kw:36} " + " ".join(f"{covs[e.name][kw][:32]:32}" for e in engines))

    sizes = packages_size()
    print("\n## installed size (package + its non-torch native deps), MiB")
    for k, v in sizes.items():
        print(f"{k:14} {v:.1f}")

    try:
        from draftwise.structured import compile_constraint, parse_structured_outputs
    except ImportError:
        return
    print("\n## draftwise.structured on top (allowed() = engine mask + BoolTensor [V]; masks_along over k=5 drafts)")
    for cname, kind, payload, text in CONSTRAINTS:
        spec = {"json": lambda p: {"json": p}, "regex": lambda p: {"regex": p}, "choice": lambda p: {"choice": p},
                "grammar": lambda p: {"grammar": p[0]}}[kind](payload)
        cs = parse_structured_outputs(spec)
        compiled = compile_constraint(cs, tok)
        ids = backend.encode(text, add_special_tokens=False).ids
        allowed_us, along_us = [], []
        for _ in range(args.reps):
            m = compiled.matcher()
            for i, t in enumerate(ids):
                t0 = time.perf_counter_ns()
                m.allowed(vocab_size)
                allowed_us.append((time.perf_counter_ns() - t0) / 1e3)
                if i % 5 == 0:
                    t0 = time.perf_counter_ns()
                    m.masks_along(ids[i:i + 5], vocab_size)
                    along_us.append((time.perf_counter_ns() - t0) / 1e3)
                m.advance(t)
        print(f"{cname:18} allowed() median {statistics.median(allowed_us):.0f} µs p95 {pct(allowed_us, 95):.0f} µs; "
              f"masks_along(k=5) median {statistics.median(along_us):.0f} µs p95 {pct(along_us, 95):.0f} µs")


if __name__ == "__main__":
    main()

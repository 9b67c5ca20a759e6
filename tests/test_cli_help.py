"""`draftwise --help`, each sub-command's help, and the defaults the docs state agree.

The docs (README.md and the reference pages docs/engine.md, server.md, bench.md, models.md, operations.md) state a
flag's default in two forms, both read here:
  - "`--flag` (default `VALUE`)", "`--flag VALUE` (default: why)", "`--flag a|b|c` (default a: what a means)" or
    "`--flag` (default: a phrase)";
  - a limits-table row "| `--flag` NUMBER ...".
Each stated default must be the parser's default of that flag in every sub-command that has the flag, or, where the
parser's default is None (the value is resolved later), the flag's help must say the same thing. Where the docs
explain what `auto` picks and the help does too, both must name the same dtype first. Every sub-command must be
documented (`draftwise NAME` appears in the docs), and `draftwise --help` must list every sub-command.
"""
from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftwise.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *(ROOT / "docs" / f"{n}.md" for n in ("engine", "server", "bench", "models", "operations"))]
DTYPES = ("bfloat16", "float32", "float16")


@functools.lru_cache(maxsize=1)
def parser() -> argparse.ArgumentParser:
    return build_parser()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def flag_actions(flag: str) -> list[tuple[str, argparse.Action]]:
    """(sub-command, action) for every sub-command that takes `flag`."""
    out = []
    for name, sub in subparsers(parser()).items():
        for a in sub._actions:
            if flag in a.option_strings:
                out.append((name, a))
    return out


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", "")).strip().lower()


def stated_defaults() -> list[tuple[str, str, str, str, str]]:
    """(doc, flag, value, explanation, the whole statement) for every default the docs state."""
    out = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for m in re.finditer(r"`(--(?:\[no-\])?[a-z][\w-]*)(?: ([^`]*))?`\s*\(default(:?)\s*((?:`[^`]*`)?[^)]*)", text):
            flag, rest, colon, said = m.group(1).replace("[no-]", ""), (m.group(2) or "").strip(), m.group(3), m.group(4)
            code = re.match(r"`([^`]*)`", said)
            if code:
                value, why = code.group(1), ""
            elif rest and "|" not in rest and " " not in rest and not rest.isupper() and colon:  # `--dtype auto` (default: why)
                value, why = rest, said
            elif rest and "|" in rest and said.split(" ", 1)[0].rstrip(":") in rest.split("|"):  # a|b (default a: why)
                value, _, why = said.partition(" ")
                value, why = value.rstrip(":"), why
            else:  # a phrase: up to the first dash, semicolon or parenthesis
                value, why = re.split(r"\s+[—;(]|;|\(", said)[0].strip(), ""
            out.append((doc.name, flag, value, why, said))
        for line in text.splitlines():  # limits tables: | `--flag` NUMBER ...
            if line.startswith("|"):
                for m in re.finditer(r"`(--[a-z][\w-]*)` (\d+(?:\.\d+)?)\b", line):
                    out.append((doc.name, m.group(1), m.group(2), "", m.group(2)))
    return out


STATED = stated_defaults()


def test_the_docs_state_defaults():
    """The extraction finds what the pages state (else the test below would check nothing)."""
    flags = {flag for _, flag, _, _, _ in STATED}
    assert {"--kv-cache-memory", "--kv-cache-dtype", "--dtype", "--max-body-bytes", "--request-timeout",
            "--shutdown-timeout", "--max-waiting", "--out", "--threads", "--enable-prefix-caching"} <= flags, flags


@pytest.mark.parametrize("doc,flag,value,why,said", STATED, ids=[f"{d}:{f}={v}"[:80] for d, f, v, _, _ in STATED])
def test_stated_default_is_the_parsers(doc, flag, value, why, said):
    """A sub-command whose default differs (`demo --out`) passes where the same statement names its value."""
    actions = flag_actions(flag)
    assert actions, f"{doc} states a default for {flag}, which no sub-command takes"
    for sub, action in actions:
        default = action.default
        if default is None:  # resolved later: the help, where it states a default, states this one
            if "default" not in (action.help or ""):
                continue
            assert flat(value) in flat(action.help), (
                f"{doc}: {flag} (default {value}); `draftwise {sub} --help` says: {action.help!r}")
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            assert float(value) == float(default), f"{doc}: {flag} default {value}; `draftwise {sub}`: {default}"
        else:
            assert str(default) == value or f"`{default}`" in said, (
                f"{doc}: {flag} default {value}; `draftwise {sub}`: {default}")
        if why and action.help:  # what the default means: the first dtype each names
            said = re.search(rf"\b{re.escape(value)}: ([^;]*)", action.help)
            doc_dtype = next((d for d in re.findall(r"bfloat16|float32|float16", why)), None)
            help_dtype = next((d for d in re.findall(r"bfloat16|float32|float16", said.group(1))), None) if said else None
            if doc_dtype and help_dtype:
                assert doc_dtype == help_dtype, (
                    f"{doc}: {flag} {value} means {why.strip()!r}; `draftwise {sub} --help`: {said.group(0)!r}")


def test_every_subcommand_is_documented_and_listed():
    names = set(subparsers(parser()))
    text = "\n".join(p.read_text() for p in DOCS)
    undocumented = sorted(n for n in names if not re.search(rf"draftwise {n}\b", text))
    assert not undocumented, f"sub-commands no page shows: {undocumented}"
    r = subprocess.run([sys.executable, "-m", "draftwise.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert all(n in r.stdout for n in names), r.stdout


@pytest.mark.parametrize("name", sorted(subparsers(parser())))
def test_subcommand_help_prints(name):
    text = subparsers(parser())[name].format_help()
    assert text.startswith(f"usage: draftwise {name}")

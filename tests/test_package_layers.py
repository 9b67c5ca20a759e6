"""The package's import graph (every import, module-level or inside a function): no cycles, and no import the
layer rules forbid. The rules are RULES below, one table: each layer, the layers it may import, its modules.
The entry points (server, bench, the CLI, `draftwise verify`'s checks) reach the engine only through api.LLM;
what they share with the engine (ContextLengthError, the KV-cache sizes) sits in the base layer.
docs/ARCHITECTURE.md's "Layers" section shows the same table; test_the_docs_draw_these_rules holds them equal."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import draftwise

ROOT = Path(draftwise.__file__).parent
DOC = ROOT.parent / "docs" / "ARCHITECTURE.md"

RULES = """\
layer        may import                      modules
entry        entry, api, base                server/ bench/ cli.py cli_args.py equivalence.py
api          api, engine, spec_decode, base  api.py
engine       engine, spec_decode, base       engine.py scheduler.py
spec_decode  spec_decode, base               spec_decode/
base         base                            config.py paths.py kv_cache.py prefix_cache.py sampling.py
                                             tokenizer.py output.py models/ kernels/ structured/
"""
HEADER = ["layer", "may import", "modules"]
FACADE = "facade"  # draftwise/__init__.py re-exports the API lazily: it may import api, and nothing imports it


def parse_rules(text: str) -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """layer -> (layers it may import, its top-level names: `server/`, `cli.py` -> server, cli). Columns are
    two or more spaces apart; a line that starts with a space continues the row above's modules."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert re.split(r"\s{2,}", lines[0].strip()) == HEADER, f"the table's header must be {HEADER}: {lines[0]!r}"
    rows: dict[str, tuple[list[str], list[str]]] = {}
    for line in lines[1:]:
        if line[0].isspace():
            rows[next(reversed(rows))][1].extend(line.split())
            continue
        layer, may, modules = re.split(r"\s{2,}", line.strip())
        rows[layer] = ([m.strip() for m in may.split(",")], modules.split())
    return {layer: (frozenset(may), frozenset(m.removesuffix("/").removesuffix(".py") for m in modules))
            for layer, (may, modules) in rows.items()}


LAYERS = parse_rules(RULES)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every draftwise module this file imports (a `from pkg import name` counts as pkg.name when that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("draftwise"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftwise"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if _exists(sub) else node.module)
    return out


def _exists(mod: str) -> bool:
    p = ROOT.parent / Path(*mod.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in ROOT.rglob("*.py")}


def layer_of(mod: str) -> str | None:
    if mod == "draftwise":
        return FACADE
    top = mod.split(".")[1]
    return next((layer for layer, (_, names) in LAYERS.items() if top in names), None)


def may_import(layer: str) -> frozenset[str]:
    return frozenset({"api"}) if layer == FACADE else LAYERS[layer][0]


def test_every_module_has_a_layer():
    for mod in graph():
        assert layer_of(mod) is not None, mod


def test_the_rules_name_each_module_once_and_only_known_layers():
    names = [n for _, modules in LAYERS.values() for n in modules]
    assert len(names) == len(set(names)), names
    for layer, (may, _) in LAYERS.items():
        assert layer in may and may <= set(LAYERS), layer


def test_the_rules_are_layered():
    """Apart from a layer importing itself, the rules form no cycle: they are layers, not a web."""
    between = {layer: {d for d in may if d != layer} for layer, (may, _) in LAYERS.items()}
    assert find_cycle(between) is None


def forbidden_imports(g: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({layer_of(m)}) imports {d} ({layer_of(d)})"
            for m, deps in g.items() for d in deps if layer_of(d) not in may_import(layer_of(m))]


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(g.get(m, ())):
            if d == m or d not in g:
                continue
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_the_rules_forbid():
    bad = forbidden_imports(graph())
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_catch_a_planted_cycle_and_an_upward_import():
    g = {"draftwise.sampling": {"draftwise.engine"}, "draftwise.engine": {"draftwise.sampling"}}
    assert forbidden_imports(g) == ["draftwise.sampling (base) imports draftwise.engine (engine)"]
    assert find_cycle(g) == ["draftwise.engine", "draftwise.sampling", "draftwise.engine"]


def test_the_checks_keep_entry_points_on_the_api():
    g = {"draftwise.bench.memory": {"draftwise.engine", "draftwise.spec_decode.draft_model", "draftwise.api",
                                    "draftwise.kv_cache", "draftwise.bench.stats"},
         "draftwise.api": {"draftwise.engine"}, "draftwise.kernels.q4x8": {"draftwise.config"},
         "draftwise.config": {"draftwise"}}
    assert sorted(forbidden_imports(g)) == [
        "draftwise.bench.memory (entry) imports draftwise.engine (engine)",
        "draftwise.bench.memory (entry) imports draftwise.spec_decode.draft_model (spec_decode)",
        "draftwise.config (base) imports draftwise (facade)"]


def test_the_docs_draw_these_rules():
    """docs/ARCHITECTURE.md's "Layers" section holds a fenced block that parses to RULES (spacing may differ)."""
    text = DOC.read_text()
    section = text[text.index("\n## Layers\n"):]
    section = section[:section.find("\n## ", 1)]
    blocks = re.findall(r"\n```[^\n]*\n(.*?)\n```", section, re.S)
    drawn = [b for b in blocks if b.lstrip().startswith(HEADER[0] + " ")]
    assert len(drawn) == 1, f"the Layers section of {DOC.name} should hold one fenced block of the rules:\n{RULES}"
    assert parse_rules(drawn[0]) == LAYERS, f"{DOC.name}'s rule block differs from this module's RULES:\n{RULES}"

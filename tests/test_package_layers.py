"""The package's import graph (every import, module-level or inside a function): no cycles, and no import from a
lower layer to a higher one. Layers, low to high: models / kv_cache / sampling / tokenizer / config / output /
kernels / structured ← spec_decode ← engine ← api ← server / bench / cli / cli_args / equivalence."""
from __future__ import annotations

import ast
from pathlib import Path

import draftwise

ROOT = Path(draftwise.__file__).parent
LAYERS = [
    ("config", "kv_cache", "prefix_cache", "sampling", "tokenizer", "output", "models", "kernels", "structured"),
    ("spec_decode",),
    ("engine",),
    ("api",),
    ("server", "bench", "cli", "cli_args", "equivalence"),
]


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


def layer_of(mod: str) -> int | None:
    if mod == "draftwise":  # the package facade re-exports the API lazily; nothing imports it from inside
        return len(LAYERS)
    top = mod.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_every_module_has_a_layer():
    for mod in graph():
        assert layer_of(mod) is not None, mod


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    return [f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
            for m, deps in g.items() for d in deps if layer_of(d) > layer_of(m)]


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


def test_no_import_from_a_lower_layer_to_a_higher_one():
    bad = upward_imports(graph())
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_catch_a_planted_cycle_and_an_upward_import():
    g = {"draftwise.sampling": {"draftwise.engine"}, "draftwise.engine": {"draftwise.sampling"}}
    assert upward_imports(g) == ["draftwise.sampling (layer 0) imports draftwise.engine (layer 2)"]
    assert find_cycle(g) == ["draftwise.engine", "draftwise.sampling", "draftwise.engine"]

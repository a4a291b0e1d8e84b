"""The package layers import one way (DESIGN.md "Where code lives"), no file imports another in a
circle, and no file grows past ~400 lines. Read from the source with `ast`, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "mmserve"
# top to bottom; a package may import its own modules and any package of a lower rank
RANK = {"api": 7, "runtime": 6, "actors": 5, "engine": 4.5, "inputs": 4, "generation": 3.5, "models": 3,
        "cache": 2, "config": 1, "errors": 1, "logs": 1}
UNLAYERED = {"cli", "bench", "trace", "__init__"}  # entry points: they may import anything
MAX_LINES = 420


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every mmserve module `path` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    found = set()
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}  # annotations only: no import at run time
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mmserve")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("mmserve"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


FILES = sorted(ROOT.rglob("*.py"))
MODULES = {_module(p) for p in FILES}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_layers_import_downwards_only(path):
    here = _layer(_module(path))
    if here in UNLAYERED:
        return
    assert here in RANK, f"{path}: package {here!r} has no place in the layer order; add it to RANK"
    for target in _imports(path):
        there = _layer(target)
        if target not in MODULES and target.rsplit(".", 1)[0] not in MODULES:
            continue
        assert there not in ("cli", "bench"), f"{path} imports the entry point {target}"
        assert there == here or RANK.get(there, 99) < RANK[here], \
            f"{path} ({here}) imports {target} ({there}): layers import downwards only"


def test_no_file_imports_another_in_a_circle():
    graph = {m: {t for t in _imports(p) if t in MODULES and t != m} for p in FILES for m in [_module(p)]}
    # a package's __init__ re-exporting its modules is not a cycle with them
    graph = {m: {t for t in ts if not (m == t.rsplit(".", 1)[0] or t == m.rsplit(".", 1)[0])} for m, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_small(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path}: split it (one job per file)"


def test_every_package_says_what_it_may_import():
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc, f"{init}: its docstring should say what lives there and what it may import"

"""The package layers import one way (DESIGN.md "Where code lives"), no file imports another in a
circle (imports for annotations only, under TYPE_CHECKING, count too), no class mixes in others'
methods, and no class grows past ~400 lines. Read from the source with `ast`, lazy imports included."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "mmserve"
# top to bottom; a package may import its own modules and any package of a lower rank
RANK = {"api": 7, "runtime": 6, "actors": 5, "engine": 4.5, "inputs": 4, "generation": 3.5, "models": 3,
        "cache": 2, "config": 1, "errors": 1, "logs": 1}
UNLAYERED = {"cli", "bench", "trace", "__init__"}  # entry points: they may import anything
MAX_CLASS_LINES = 400  # a class past this does more than one job: split it by jobs, into objects it holds
MAX_LINES = 600  # a backstop only: classes and their jobs set the size of a module
# bases that say what a class is, not whose methods it borrows: none counts towards "one base"
NEUTRAL_BASES = {"ABC", "Protocol", "Generic", "NamedTuple", "TypedDict", "object",
                 "Enum", "IntEnum", "StrEnum", "Flag", "IntFlag"}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, typing_only: bool = False) -> set[str]:
    """Every mmserve module `path` imports, wherever the import statement is; `typing_only`: those
    under `if TYPE_CHECKING:` (annotations only, no import at run time) too."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    found = set()
    skipped = set() if typing_only else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skipped:
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
    """Annotation-only imports count: a cycle hidden under TYPE_CHECKING is still two modules that
    each need the other (a Protocol, or plain values, breaks it for real)."""
    graph = {m: {t for t in _imports(p, typing_only=True) if t in MODULES and t != m} for p in FILES for m in [_module(p)]}
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


def _classes(path: Path) -> list[ast.ClassDef]:
    return [n for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.ClassDef)]


def _base_name(base: ast.expr) -> str:
    """`Generic[T]` → Generic, `enum.Enum` → Enum."""
    if isinstance(base, ast.Subscript):
        base = base.value
    return ast.unparse(base).rsplit(".", 1)[-1]


def _is_builtin_exception(name: str) -> bool:
    return isinstance(getattr(builtins, name, None), type) and issubclass(getattr(builtins, name), BaseException)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_class_mixes_in_another(path):
    """Composition, not mixins: a class has at most one base that gives it behaviour (`Actor`, an
    adapter's parent, an error's parent class, `torch.nn.Module`, ...). Bases that only say what it
    is do not count: ABC, Protocol, Generic, NamedTuple, TypedDict, enum types, and built-in
    exception types beside an error's own parent (`CheckpointError(ServiceUnavailable, ValueError)`).
    A part of an actor's job with state of its own is an object the actor holds."""
    for cls in _classes(path):
        doing = [ast.unparse(b) for b in cls.bases
                 if _base_name(b) not in NEUTRAL_BASES and not _is_builtin_exception(_base_name(b))]
        assert len(doing) <= 1, \
            f"{path}: class {cls.name} mixes in {', '.join(doing)}: hold the parts as objects (composition)"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_classes_stay_small(path):
    for cls in _classes(path):
        lines = cls.end_lineno - cls.lineno + 1
        assert lines <= MAX_CLASS_LINES, f"{path}: class {cls.name} is {lines} lines: split it by jobs"


def test_every_package_says_what_it_may_import():
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc, f"{init}: its docstring should say what lives there and what it may import"

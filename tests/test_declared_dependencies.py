"""Every import the package makes is a declared dependency.

A module imported but not declared works wherever something else happens to install it (the dev
extra, a transitive dependency of the day) and fails on a fresh `pip install .`: `httpcore` did,
after the packages that used to bring it moved to another HTTP client. This walks every module
under `mmserve/` with `ast` (a lazy import inside a function counts as much as one at the top) and
checks each third-party import against `[project] dependencies` in pyproject.toml. `mmserve/bench/`
may also rely on the `bench` extra: `mmserve bench` checks for it before importing the benchmark.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mmserve"
EXTRA_FOR = {"bench": "bench"}
"""Subpackage of mmserve -> the extra its imports may also be satisfied by."""
EXTRA_FOR_FILE = {"mmserve/engine/attention/triton_paged.py": "dev",
                  "mmserve/engine/attention/triton_deterministic.py": "dev"}
"""Module -> the extra its imports may also be satisfied by: the Triton kernels' `triton` comes with
torch's CUDA wheels (where they run compiled) and, for the interpreter tests on the CPU, with the dev
extra; `attention.select` imports the module only when the triton backend is chosen."""


def normalise(name: str) -> str:
    """A distribution name as PEP 503 compares them (`Quart_Trio` == `quart-trio`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules(source: str) -> set[str]:
    """The top-level names of the absolute imports in `source` (relative imports are the package's own)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def third_party_imports() -> dict[Path, set[str]]:
    """Each module of the package -> the imports it makes that neither the standard library nor
    mmserve itself provides."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = {n for n in imported_modules(path.read_text(encoding="utf-8"))
                 if n not in sys.stdlib_module_names and n != "mmserve"}
        if names:
            out[path.relative_to(ROOT)] = names
    return out


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """The normalised names of `[project] dependencies`, and of each optional extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = lambda reqs: {normalise(Requirement(r).name) for r in reqs}  # noqa: E731
    extras = {extra: names(reqs) for extra, reqs in project.get("optional-dependencies", {}).items()}
    return names(project["dependencies"]), extras


def extra_of(module: Path) -> str | None:
    if module.as_posix() in EXTRA_FOR_FILE:
        return EXTRA_FOR_FILE[module.as_posix()]
    parts = module.parts  # ("mmserve", "bench", ...)
    return EXTRA_FOR.get(parts[1]) if len(parts) > 2 else None


def test_every_import_is_a_declared_dependency():
    dependencies, extras = declared()
    providers = importlib.metadata.packages_distributions()  # import name -> the distributions that provide it
    undeclared, unknown = [], []
    for module, names in third_party_imports().items():
        allowed = dependencies | extras.get(extra_of(module), set())
        for name in sorted(names):
            distributions = {normalise(d) for d in providers.get(name, ())}
            if not distributions:
                unknown.append(f"{module}: imports {name}, which no installed distribution provides")
            elif not distributions & allowed:
                where = "[project] dependencies" + (f" or the {extra_of(module)!r} extra" if extra_of(module) else "")
                undeclared.append(f"{module}: imports {name} (distribution {', '.join(sorted(distributions))}), "
                                  f"which is not in {where}")
    assert not unknown, "\n".join(unknown)
    assert not undeclared, "declare these in pyproject.toml:\n" + "\n".join(undeclared)


def test_the_walk_sees_lazy_and_nested_imports():
    """The check is only as good as the walk: imports inside functions and `from a.b import c` count."""
    source = "import os\nfrom a.b import c\n\ndef f():\n    import httpcore\n    from .local import x\n"
    assert imported_modules(source) == {"os", "a", "httpcore"}
    found = third_party_imports()
    assert "httpcore" in found[Path("mmserve/inputs/remote_images.py")]
    assert "certifi" in found[Path("mmserve/inputs/remote_images.py")]  # imported inside a function


def test_names_are_compared_normalised():
    assert normalise("Quart_Trio") == normalise("quart-trio") == normalise("quart.trio")
    dependencies, extras = declared()
    assert "quart-trio" in dependencies and "redis" in dependencies  # `redis[hiredis]>=5`: the name only
    assert "matplotlib" in extras["bench"]

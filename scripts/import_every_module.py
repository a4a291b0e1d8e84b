"""Imports every module of the installed mmserve package; exits non-zero naming each one that fails.

Run by scripts/check-fresh-install.sh in a virtual environment that has the project without
extras, so an import that only an extra (or the dev tools) provides shows up here, not on a
user's machine. Modules under `mmserve.bench` may fail only for want of the `bench` extra's own
modules: `mmserve bench` checks for the extra and says so in one line before importing them. The
Triton kernels' modules may fail only for want of triton: torch's CUDA wheels bring it, and
`mmserve.engine.attention.selection` imports the module only when that backend is chosen, saying what
is missing if it is not installed.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback

import mmserve
from mmserve.bench.extra import REQUIRED as BENCH_EXTRA

BENCH = "mmserve.bench"
TRITON_KERNELS = ("mmserve.engine.attention.triton_paged", "mmserve.engine.attention.triton_deterministic")


def needs_only_the_bench_extra(name: str, err: BaseException) -> bool:
    missing = err.name.split(".")[0] if isinstance(err, ModuleNotFoundError) and err.name else None
    if name in TRITON_KERNELS:
        return missing == "triton"
    return (name == BENCH or name.startswith(BENCH + ".")) and missing in BENCH_EXTRA


def main() -> int:
    failures: dict[str, str] = {}  # module -> its error (a package that fails is met twice: walking, importing)
    skipped: set[str] = set()
    imported = 0

    def failed(name: str) -> None:
        err = sys.exc_info()[1]
        if needs_only_the_bench_extra(name, err):
            skipped.add(name)
        else:
            failures[name] = "".join(traceback.format_exception_only(err)).strip()

    names = [m.name for m in pkgutil.walk_packages(mmserve.__path__, "mmserve.", onerror=failed)]
    for name in ["mmserve", *names]:
        try:
            importlib.import_module(name)
            imported += 1
        except Exception:  # every failure is reported, not only the first
            failed(name)
    print(f"imported {imported} modules of mmserve from {mmserve.__path__[0]}"
          + (f"; {len(skipped)} need an optional package (the bench extra: {', '.join(BENCH_EXTRA)}; "
             "the Triton kernels: triton)" if skipped else ""))
    for name, error in failures.items():
        print(f"cannot import {name}: {error}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

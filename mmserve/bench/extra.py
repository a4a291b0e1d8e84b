"""The `bench` extra: what `mmserve bench` needs beyond mmserve's own dependencies. Checked before
anything of the benchmark is imported, so that a missing extra is one line, not a traceback.
(The peer of scenario 6, `transformers[serving]`, is in the extra too, but optional: without it
that scenario is skipped; see peer.py.)"""

from __future__ import annotations

import importlib.util

REQUIRED = ("matplotlib", "tqdm", "httpx")  # httpx: the client of every HTTP scenario
INSTALL = "pip install -e '.[bench]'"


def missing() -> list[str]:
    """The required modules that cannot be imported here (found without importing them)."""
    out = []
    for name in REQUIRED:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a blocked or half-initialised module
            found = False
        if not found:
            out.append(name)
    return out


def missing_message() -> str | None:
    """None when the extra is installed; otherwise what to do about it, in one line."""
    absent = missing()
    if not absent:
        return None
    return f"needs the bench extra ({', '.join(REQUIRED)}; missing: {', '.join(absent)}): {INSTALL}"

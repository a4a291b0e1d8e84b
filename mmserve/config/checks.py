"""Checks of config values: each raises ValueError("config [SECTION] KEY: must be WHAT, got VALUE"),
so one line of a section's __post_init__ checks one key; and the names config values draw from."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
HASH_ALGORITHMS = ("xxh3_128", "sha256")
DTYPES = ("float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")  # mmserve.engine.attention.NAMES (a test keeps them equal)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # PIL's names (Image.format), upper case
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
SHARED_CACHE_TRUST = ("secret", "network")  # [shared_cache] trust
MIN_SHARED_SECRET_BYTES = 16  # cache.shared_values.MIN_SECRET_BYTES (a test keeps them equal)
TOOL_PARSERS = ("hermes",)  # [models.x] tool_parser: mmserve.generation.tool_calls has one parser each
DEVICE = re.compile(r"(cpu|mps|cuda(:[0-9]+)?)")

# the committed demo checkpoints (`builtin:NAME`); models/demo builds and reads them here
DEMO_CHECKPOINTS = Path(__file__).resolve().parent.parent / "models" / "demo" / "checkpoints"




def fail(where: str, key: str, want: str, value: Any) -> None:
    raise ValueError(f"config {where} {key}: must be {want}, got {value!r}")


def _range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"from {lo} to {hi}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"<= {hi}" if hi is not None else ""


def check_int(where: str, key: str, value: Any, lo: int | None = None, hi: int | None = None, bound: str = "") -> None:
    """An int (not a bool) in [lo, hi]; `bound` words the range when a bound is another key."""
    if (not isinstance(value, int) or isinstance(value, bool)
            or (lo is not None and value < lo) or (hi is not None and value > hi)):
        fail(where, key, f"an integer {bound or _range(lo, hi)}".rstrip(), value)


def check_number(where: str, key: str, value: Any, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, bound: str = "") -> None:
    """A finite int or float (not a bool) in [lo, hi], or (lo, hi] with lo_open; `bound` as in _int."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        fail(where, key, f"a number {bound or _range(lo, hi, lo_open)}".rstrip(), value)


def check_bool(where: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        fail(where, key, "true or false", value)


def check_str(where: str, key: str, value: Any, empty: bool = False) -> None:
    """A string; a non-empty one (not just spaces) unless `empty`."""
    if not isinstance(value, str) or (not empty and not value.strip()):
        fail(where, key, "a string" if empty else "a non-empty string", value)


def check_choice(where: str, key: str, value: Any, choices: tuple) -> None:
    if isinstance(value, bool) or value not in choices:
        fail(where, key, "one of " + ", ".join(repr(c) for c in choices), value)


def check_strings(obj: Any, where: str, key: str, choices: tuple[str, ...] | None = None, nonempty: bool = False) -> None:
    """A list of non-empty strings (of `choices`, if given; at least one if `nonempty`); stored as a tuple."""
    value = getattr(obj, key)
    want = ("a non-empty list" if nonempty else "a list") + (
        " with entries among " + ", ".join(repr(c) for c in choices) if choices
        else " of non-empty strings without surrounding spaces")
    if not isinstance(value, (list, tuple)) or (nonempty and not value):
        fail(where, key, want, value)
    for item in value:
        if not isinstance(item, str) or (item not in choices if choices else (not item or item != item.strip())):
            fail(where, key, want, value)
    object.__setattr__(obj, key, tuple(value))


def known_builtins() -> tuple[str, ...]:
    """The demo checkpoints `builtin:NAME` can name."""
    if not DEMO_CHECKPOINTS.is_dir():
        return ()
    return tuple(sorted(p.name for p in DEMO_CHECKPOINTS.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))))


def check_model_path(name: str, path: str) -> None:
    """That model `name`'s checkpoint `path` exists: a directory, or a known `builtin:NAME` (config
    files only; a ModelConfig built in code may name a missing directory, which the registry reports
    at load). Plain values, not the ModelConfig: the sections import these checks, never the reverse."""
    where = f"[[models]] {name!r}"
    if path.startswith(BUILTIN_PREFIX):
        known = known_builtins()
        if path[len(BUILTIN_PREFIX):] not in known:
            builtins = ", ".join(repr(BUILTIN_PREFIX + k) for k in known)
            fail(where, "path", f"a checkpoint directory or one of {builtins}", path)
    elif not Path(path).expanduser().is_dir():
        fail(where, "path", "an existing checkpoint directory", path)


def check_buckets(where: str, key: str, value: Any) -> tuple[int, ...]:
    """A list of positive integers (bucket sizes), returned sorted without repeats."""
    if not isinstance(value, (list, tuple)) or any(
            not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in value):
        fail(where, key, "a list of positive integers (empty: the default buckets)", value)
    return tuple(sorted(set(value)))

"""Keeps Python's cyclic garbage collector off a loaded model's heap.

A process serving a model holds a few hundred thousand long-lived objects (transformers' modules,
the tokenizer, torch's and triton's imports: ~400,000 with one tiny model loaded). Every full
collection walks them all — about 200 ms on this project's 2-core VM — and it runs on whichever
thread allocates next, usually the event loop's: every stream and `/health` stall for that long,
once every few seconds of load (measured in `mmserve bench`'s /health polls as a ~200 ms maximum).

After a model loads, `settle()` collects once and then freezes what survives (`gc.freeze`): those
objects move to the permanent generation, which collections skip. Objects made later (requests,
steps) are collected as before. Unloading a model calls `settle()` again, after `gc.unfreeze()`, so
that the unloaded model's cycles are found; closing a Runtime unfreezes. The freeze is a property of
the interpreter, not of one Runtime: several Runtimes in one process share it, and a host program's
objects that exist at a load are frozen with the model's (kept until a Runtime closes or unloads).
`[runtime] gc_freeze = false` turns this off."""

from __future__ import annotations

import gc
import time


def settle() -> dict:
    """Collects everything (frozen objects included), then freezes the survivors. Returns what the
    log line reports: the seconds it took and the objects now frozen."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return {"gc_s": round(time.perf_counter() - t0, 3), "gc_frozen": gc.get_freeze_count()}


def release() -> None:
    """Hands the frozen objects back to the collector (a Runtime closes)."""
    gc.unfreeze()

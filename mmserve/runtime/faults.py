"""Fault injection for tests and drills — off unless `MMSERVE_FAULTS` is set (or `configure` is called).

    MMSERVE_FAULTS="encoder.forward=raise,generator.step=hang@3,prefix.commit=raise@1,image.decode=hang"

Points: `image.decode`, `encoder.forward`, `generator.step`, `prefix.commit`. Actions: `raise`
(an InjectedFault) or `hang` (blocks for MMSERVE_FAULT_HANG_S seconds, default 3600). `@N` fires
only on the Nth time the point is reached (counting from 1), once; without it, every time.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import trio

POINTS = ("image.decode", "encoder.forward", "generator.step", "prefix.commit")


class InjectedFault(RuntimeError):
    """Raised at a fault point configured to `raise`."""


@dataclass
class _Rule:
    action: str
    nth: int | None
    seen: int = 0

    def fires(self) -> bool:
        self.seen += 1
        return self.nth is None or self.seen == self.nth


_rules: dict[str, _Rule] = {}
_lock = threading.Lock()


def configure(spec: str | None) -> None:
    """Replaces the active faults with `spec` (the MMSERVE_FAULTS syntax); None or "" clears them."""
    rules = {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        point, _, action = item.partition("=")
        action, _, nth = action.partition("@")
        if point not in POINTS or action not in ("raise", "hang"):
            raise ValueError(f"MMSERVE_FAULTS: bad entry {item!r}; points {POINTS}, actions raise|hang[@N]")
        rules[point] = _Rule(action, int(nth) if nth else None)
    with _lock:
        _rules.clear()
        _rules.update(rules)


def _due(point: str) -> str | None:
    if not _rules:
        return None
    with _lock:
        rule = _rules.get(point)
        return rule.action if rule is not None and rule.fires() else None


def fault(point: str) -> None:
    """A fault point in synchronous code (worker threads)."""
    action = _due(point)
    if action == "raise":
        raise InjectedFault(f"injected fault at {point}")
    if action == "hang":
        # only ever reached in worker threads (decode, encode, model steps): blocking the thread
        # is the point — it reproduces a stuck model call for the supervisor's stall watchdog
        time.sleep(float(os.environ.get("MMSERVE_FAULT_HANG_S", "3600")))


async def afault(point: str) -> None:
    """A fault point on the event loop: a hang sleeps the task, never the loop."""
    action = _due(point)
    if action == "raise":
        raise InjectedFault(f"injected fault at {point}")
    if action == "hang":
        await trio.sleep(float(os.environ.get("MMSERVE_FAULT_HANG_S", "3600")))


configure(os.environ.get("MMSERVE_FAULTS"))

"""Fault injection for tests and drills — off unless `MMSERVE_FAULTS` is set (or `configure` is called).

    MMSERVE_FAULTS="generator.step=hang@3,prefix.commit=raise@1,generator.sample[tenant-7]=raise"

`point=action` fires for every request that reaches the point; `point[LABEL]=action` fires only
for requests whose client request id (the caller's label, e.g. `X-Request-Id`) is LABEL — a
fault hook per request, for tests that one request's failure stays its own. Actions: `raise`
(an InjectedFault) or `hang` (blocks for MMSERVE_FAULT_HANG_S seconds, default 3600). `@N` fires
only on the Nth time the rule matches (counting from 1), once; without it, every time.

Where each point sits decides what a fault there does: at a per-request point the request fails
alone (a 500 naming it); at an actor-wide point (`generator.step`, the batched decode forward)
the actor is restarted by the supervisor.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import trio

POINTS = {
    "image.decode": "intake: decoding the request's images (worker thread)",
    "intake.prepare": "intake: chat template, tokenizing, content keys (worker thread)",
    "encoder.forward": "encoder: a batched vision forward (a failure is retried item by item)",
    "encoder.item": "encoder: one image's pixel preprocessing",
    "prefix.lookup": "prefix cache: answering one request's lookup",
    "prefix.commit": "prefix cache: committing one request's blocks",
    "prefix.refill": "prefix cache: refilling the generator's block reservation after its step report "
                     "(actor-wide: restarts the manager)",
    "prefix.release": "prefix cache: one request's release, alone or in a step report (actor-wide: restarts the manager)",
    "prefix.resume": "prefix cache: preempted sequences' cached blocks (actor-wide: restarts the manager)",
    "prefix.fork": "prefix cache: a request's choices sharing its blocks (actor-wide: restarts the manager)",
    "generator.hash": "generator: keying one sequence's newly filled blocks",
    "generator.prefill": "generator: one sequence's prefill chunk (its embeddings for the step)",
    "generator.reencode": "generator: encoding again the images a preempted sequence lost (only after a preemption)",
    "generator.sample": "generator: sampling one sequence's next token",
    "generator.detokenize": "generator: detokenizing and stop matching one sequence's token",
    "generator.step": "generator: the step's batched forward (actor-wide: restarts the generator)",
    "generator.forward": "generator: right before the batched forward, after the step's last check that it "
                         "was not abandoned (a hang there: a step slower than stall_timeout_s that writes "
                         "after its restart; its blocks are quarantined)",
}


# points where a fault is the actor's own (it dies and is restarted), not one request's
ACTOR_WIDE = frozenset({"generator.step", "generator.forward", "prefix.refill", "prefix.release", "prefix.resume", "prefix.fork"})


class InjectedFault(RuntimeError):
    """Raised at a fault point configured to `raise`."""


@dataclass
class _Rule:
    point: str
    label: str | None
    action: str
    nth: int | None
    seen: int = 0

    def fires(self) -> bool:
        self.seen += 1
        return self.nth is None or self.seen == self.nth


_rules: list[_Rule] = []
_lock = threading.Lock()


def _parse(item: str) -> _Rule:
    target, _, action = item.partition("=")
    action, _, nth = action.partition("@")
    point, label = target, None
    if target.endswith("]") and "[" in target:
        point, _, label = target[:-1].partition("[")
    if point not in POINTS or action not in ("raise", "hang") or label == "" or (nth and not nth.isdigit()):
        raise ValueError(f"MMSERVE_FAULTS: bad entry {item!r}; expected point[LABEL]=raise|hang[@N] "
                         f"with a point among {sorted(POINTS)}")
    return _Rule(point, label, action, int(nth) if nth else None)


def configure(spec: str | None) -> None:
    """Replaces the active faults with `spec` (the MMSERVE_FAULTS syntax); None or "" clears them."""
    rules = [_parse(item) for item in filter(None, (s.strip() for s in (spec or "").split(",")))]
    with _lock:
        _rules[:] = rules


def _due(point: str, labels: Iterable[str | None]) -> str | None:
    if not _rules:
        return None
    labels = set(labels)
    with _lock:
        for rule in _rules:
            if rule.point == point and (rule.label is None or rule.label in labels) and rule.fires():
                return rule.action
    return None


def fault(point: str, *labels: str | None) -> None:
    """A fault point in synchronous code (worker threads), reached on behalf of `labels`'
    requests (their client request ids)."""
    action = _due(point, labels)
    if action == "raise":
        raise InjectedFault(f"injected fault at {point}")
    if action == "hang":
        # only ever reached in worker threads (decode, encode, model steps): blocking the thread
        # is the point — it reproduces a stuck model call for the supervisor's stall watchdog
        time.sleep(float(os.environ.get("MMSERVE_FAULT_HANG_S", "3600")))


async def afault(point: str, *labels: str | None) -> None:
    """A fault point on the event loop: a hang sleeps the task, never the loop."""
    action = _due(point, labels)
    if action == "raise":
        raise InjectedFault(f"injected fault at {point}")
    if action == "hang":
        await trio.sleep(float(os.environ.get("MMSERVE_FAULT_HANG_S", "3600")))


configure(os.environ.get("MMSERVE_FAULTS"))

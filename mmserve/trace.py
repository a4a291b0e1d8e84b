"""`mmserve trace ID`: a request's timeline across actors, rebuilt from the JSON log. ID is the
completion's id as the API returns it (`chatcmpl-…`), the internal request id it is made of, or the
client's X-Request-Id (every request sent with that label is shown)."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Iterable, Iterator, TextIO

_SKIP = {"event", "timestamp", "level", "request_ids", "actor", "model"}
COMPLETION_ID_PREFIX = "chatcmpl-"
"""A completion's id is this prefix and the internal request id the log names (`ChatStream.id`)."""
TEXT_COMPLETION_ID_PREFIX = "cmpl-"
"""The same for a `/v1/completions` answer (its first prompt's request id)."""


def _events(lines: Iterable[str]) -> Iterator[dict]:
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def request_events(lines: Iterable[str], request_id: str) -> list[dict]:
    """The events of the request(s) `request_id` names — a completion id (`chatcmpl-…`), an
    internal id, or a client's `X-Request-Id` label, which may name several requests — with the
    batched steps that list them, in time order."""
    events = list(_events(lines))
    # a label may start so too: every reading
    ids = {request_id, *(request_id.removeprefix(p) for p in (COMPLETION_ID_PREFIX, TEXT_COMPLETION_ID_PREFIX))}
    ids |= {e["request_id"] for e in events if e.get("client_request_id") == request_id and e.get("request_id")}
    out = [e for e in events if e.get("request_id") in ids or ids & set(e.get("request_ids") or ())]
    out.sort(key=lambda e: e.get("timestamp", ""))
    return out


def timeline(events: list[dict]) -> list[dict]:
    """Each event with its offset from the first and the time since the previous, in ms."""
    out, first, prev = [], None, None
    for e in events:
        t = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00"))
        first = first or t
        out.append({"offset_ms": round((t - first).total_seconds() * 1000, 3),
                    "delta_ms": round((t - (prev or t)).total_seconds() * 1000, 3),
                    "actor": e.get("actor", ""), "event": e.get("event", ""),
                    "details": {k: v for k, v in e.items() if k not in _SKIP}})
        prev = t
    return out


def render_table(rows: list[dict]) -> str:
    header = f"{'offset ms':>10} {'+ms':>9}  {'actor':<13} {'event':<32} details"
    lines = [header, "-" * len(header)]
    for r in rows:
        details = " ".join(f"{k}={_short(v)}" for k, v in r["details"].items())
        lines.append(f"{r['offset_ms']:>10.3f} {r['delta_ms']:>9.3f}  {r['actor']:<13} {r['event']:<32} {details}")
    return "\n".join(lines)


def _short(v) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= 60 else text[:57] + "..."


def main(request_id: str, log: TextIO, as_json: bool = False, out: TextIO = sys.stdout) -> int:
    rows = timeline(request_events(log, request_id))
    if not rows:
        print(f"no events for request {request_id!r} in this log", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=2) if as_json else render_table(rows), file=out)
    return 0

"""`mmserve trace ID`: a request's timeline across actors, rebuilt from the JSON log. ID is the
completion's id as the API returns it (`chatcmpl-…`), the internal request id it is made of, or the
client's X-Request-Id (every request sent with that label is shown)."""

from __future__ import annotations

import json
import sys
from datetime import datetime
import os
import re
from typing import Iterable, Iterator, TextIO

# a line of structlog's console renderer: `2026-01-01T00:00:00.000000Z [info     ] event.name  key=value`
CONSOLE_LINE = re.compile(r"\S+ \[(debug|info|warning|error|critical)\s*\] ")
JSON_HINT = ("trace reads the JSON log: serve with --log-format json (the default) and keep stderr, "
             "e.g. `mmserve serve 2> mmserve.log`, then `mmserve trace ID --log mmserve.log`")
_SKIP = {"event", "timestamp", "level", "request_ids", "actor", "model"}
COMPLETION_ID_PREFIX = "chatcmpl-"
"""A completion's id is this prefix and the internal request id the log names (`ChatStream.id`)."""
TEXT_COMPLETION_ID_PREFIX = "cmpl-"
"""The same for a `/v1/completions` answer (its first prompt's request id)."""


class _Reading:
    """What `_events` saw besides the JSON events: lines in structlog's console format."""

    def __init__(self):
        self.console_lines = 0


def _events(lines: Iterable[str], seen: _Reading | None = None) -> Iterator[dict]:
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            if seen is not None and CONSOLE_LINE.match(line):
                seen.console_lines += 1
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def request_events(lines: Iterable[str], request_id: str, seen: _Reading | None = None) -> list[dict]:
    """The events of the request(s) `request_id` names — a completion id (`chatcmpl-…`), an
    internal id, or a client's `X-Request-Id` label, which may name several requests — with the
    batched steps that list them, in time order."""
    events = list(_events(lines, seen))
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
    seen = _Reading()
    rows = timeline(request_events(log, request_id, seen))
    if not rows:
        if seen.console_lines:
            print(f"this log is in the console format ({seen.console_lines} lines), which trace cannot read; "
                  + JSON_HINT, file=sys.stderr)
            return 2
        print(f"no events for request {request_id!r} in this log", file=sys.stderr)
        return 1
    try:
        print(json.dumps(rows, indent=2) if as_json else render_table(rows), file=out)
        out.flush()
    except BrokenPipeError:  # `mmserve trace ID --json | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())  # Python's flush at exit would raise again
    return 0

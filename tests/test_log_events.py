"""Every emitted event is catalogued, and `mmserve trace` rebuilds a request's timeline."""

import io
import json
import re
from pathlib import Path

import trio

from mmserve import Runtime
from mmserve.logs import configure_logging
from mmserve.models.demo import Q_SHAPE, render_image
from mmserve.trace import main as trace
from tests.helpers import ask

CATALOGUE = Path(__file__).resolve().parent.parent / "docs" / "log-events.md"


def catalogued() -> set[str]:
    return set(re.findall(r"^\| `([a-z_]+\.[a-z_]+)`", CATALOGUE.read_text(), re.M))


def test_every_event_in_the_source_is_catalogued():
    src = Path(__file__).resolve().parent.parent / "mmserve"
    emitted = set()
    for path in src.rglob("*.py"):
        emitted |= set(re.findall(r'\blog\.(?:info|debug|warning|error)\(\s*"([a-z_]+\.[a-z_]+)"', path.read_text()))
    assert emitted and emitted <= catalogued(), sorted(emitted - catalogued())


async def test_runtime_events_are_catalogued_and_trace_shows_the_phases(tiny_config):
    buf = io.StringIO()
    configure_logging("json", "debug", stream=buf)
    try:
        img = render_image("red", "circle", seed=3)
        async with Runtime.open(tiny_config) as rt:
            first = ask(img)
            a = await rt.chat_completion(first, temperature=0, max_tokens=4, min_tokens=4)
            b = await rt.chat_completion([*first, {"role": "assistant", "content": a.text},
                                          {"role": "user", "content": Q_SHAPE}], temperature=0, max_tokens=3)
            await trio.testing.wait_all_tasks_blocked(cushion=0.02)
    finally:
        configure_logging("json", "info")
    lines = buf.getvalue().splitlines()
    events = [json.loads(line) for line in lines]
    assert {e["event"] for e in events} <= catalogued()
    assert all("actor" in e for e in events)

    out = io.StringIO()
    assert trace(b.id.removeprefix("chatcmpl-"), io.StringIO(buf.getvalue()), as_json=True, out=out) == 0
    rows = json.loads(out.getvalue())
    names = [r["event"] for r in rows]
    # the prefix cache is asked before the encoder: here the hit ends inside the image, so the
    # encoder is still asked for it (a hit that covers an image whole skips it: test_prefix_cache)
    order = ["request.received", "intake.prepared", "prefix_cache.lookup", "encoder_cache.hit",
             "generator.prefill", "generator.step", "generator.finished", "request.finished"]
    positions = [names.index(n) for n in order]
    assert positions == sorted(positions), list(zip(names, [r["offset_ms"] for r in rows]))
    # blocks are committed as steps fill them: the prompt's once prefilled, the answer's as it grows
    commits = [i for i, n in enumerate(names) if n == "prefix_cache.commit"]
    assert commits and names.index("generator.prefill") < commits[0]
    assert names.index("prefix_cache.release") > names.index("generator.finished")
    lookup = rows[names.index("prefix_cache.lookup")]["details"]
    assert lookup["hit_blocks"] > 0 and lookup["blocks"]
    assert rows[names.index("request.finished")]["details"]["cached_tokens"] == b.usage.cached_tokens > 0
    table = io.StringIO()
    trace(b.id.removeprefix("chatcmpl-"), io.StringIO(buf.getvalue()), out=table)
    assert "prefix_cache.lookup" in table.getvalue() and "offset ms" in table.getvalue()


async def test_trace_by_client_label_shows_every_request_sent_with_it(tiny_config):
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)
    try:
        async with Runtime.open(tiny_config) as rt:
            same = [await rt.chat_completion(ask(render_image(c, "circle", seed=3)), temperature=0, max_tokens=2,
                                             client_request_id="retry-7") for c in ("red", "blue")]
            other = await rt.chat_completion(ask(render_image("green", "circle", seed=3)), max_tokens=2,
                                             client_request_id="someone")
    finally:
        configure_logging("json", "info")
    out = io.StringIO()
    assert trace("retry-7", io.StringIO(buf.getvalue()), as_json=True, out=out) == 0
    rows = json.loads(out.getvalue())
    ids = {r["details"].get("request_id") for r in rows} - {None}
    assert ids == {c.id.removeprefix("chatcmpl-") for c in same}
    assert other.id.removeprefix("chatcmpl-") not in ids
    assert [r["event"] for r in rows].count("request.finished") == 2

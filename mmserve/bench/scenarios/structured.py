"""Scenario 8, structured output: what a JSON-schema `response_format` costs in decode tokens/s,
one stream and a batch, against the same requests unconstrained, interleaved in one runtime.

The schema asks for a string of at least 10,000 characters, so every run decodes exactly its
token budget inside the grammar (the random-weight bench model never closes it early): the cost
measured is the mask computed each step (overlapped with the forward) and applied to the logits.
"""

from __future__ import annotations

import trio

from mmserve.bench.common import median, ratio, row, timed_chat
from mmserve.bench.context import Bench
from mmserve.bench.scenarios.shared import at_most, brief

SCHEMA = {"type": "object", "properties": {"description": {"type": "string", "minLength": 10_000}},
          "required": ["description"], "additionalProperties": False}
JSON = {"response_format": {"type": "json_schema", "json_schema": {"name": "description", "schema": SCHEMA}}}
BATCH = 8


async def structured(b: Bench) -> dict:
    p = b.params
    tokens, msgs = p.decode_tokens * 2, b.ask(b.new_image())
    single: dict[str, list] = {"free": [], "json": []}
    batch: dict[str, list[float]] = {"free": [], "json": []}
    async with b.runtime(prefix=False, encoder=False) as rt:
        for r in range(p.decode_repeats):
            b.note(f"repeat {r + 1}/{p.decode_repeats}")
            for kind, extra in (("free", None), ("json", JSON)):
                single[kind].append(await timed_chat(rt, msgs, tokens, extra=extra))
                batch[kind].append(await _batch_tps(rt, b, tokens, extra))
    tps = {k: median(t.decode_tps for t in v) for k, v in single.items()}
    agg = {k: median(v) for k, v in batch.items()}
    slowdown = {"single": 1 - ratio(tps["json"], tps["free"]), f"batch_{BATCH}": 1 - ratio(agg["json"], agg["free"])}
    rows = [row("8 structured", "decode tok/s, JSON schema, 1 stream", tps["json"], "tok/s", tps["free"],
                ratio(tps["json"], tps["free"]), "≥ 0.90", at_most(slowdown["single"], 0.10)),
            row("8 structured", f"aggregate tok/s, JSON schema, {BATCH} streams", agg["json"], "tok/s", agg["free"],
                ratio(agg["json"], agg["free"]), "≥ 0.90", at_most(slowdown[f"batch_{BATCH}"], 0.10))]
    return {"tokens": tokens, "decode_tps": tps, "aggregate_tps": agg, "slowdown": slowdown, "schema": SCHEMA,
            "runs": {k: [brief(t) for t in v] for k, v in single.items()}, "rows": rows}


async def _batch_tps(rt, b: Bench, tokens: int, extra: dict | None) -> float:
    """Aggregate decode tokens/s of BATCH concurrent streams (all constrained, or none)."""
    timings = []
    t0 = trio.current_time()

    async def one():
        timings.append(await timed_chat(rt, b.ask(b.new_image()), tokens, extra=extra))

    async with trio.open_nursery() as nursery:
        for _ in range(BATCH):
            nursery.start_soon(one)
    return sum(t.completion_tokens for t in timings) / (trio.current_time() - t0)

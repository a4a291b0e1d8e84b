"""Scenario 9, engine_overhead: how long the GPU would wait on the host, measured on any device.

`engine_streams` (32) streams decode `engine_tokens` tokens each through an embedded runtime —
the real intake, scheduler, generator, runner, sampling and streaming — on text prompts of about
`engine_prompt_tokens` tokens (as long as an image request's prompt; no image, so no encoder time
before the window, which only decode steps are in), with a KV arena that holds them all (a
preemption would put prefill steps into the window), with the model's forward
replaced by a stand-in of fixed duration that releases the GIL (`mmserve.bench.stand_in`; 4 ms by
default, an H200's 7B decode step at 32). Over the window where every stream decodes (from the
moment the last one has its first token to the moment the first one finishes, its last step left
out), the stand-in's busy fraction — the union of its busy intervals over their span, from its own
clock, as GPU busy is from the kernels' — and the host's time per step, split as the concurrency
scenario's host share is: the generator's time on the event loop between steps
(`Generator.host_s`), and the compute thread's own work around the stand-in (input building,
sampling, the device→host copy, the hand-offs between the threads: `forward_s` less the stand-in's
time and less its thread's late wake-ups from the sleep, reported apart: an OS artefact of the
stand-in that grows with the machine's load, which a GPU's end would not have).

The overlap variant (`[runtime] overlap = true`, step n+1 prepared while step n runs) runs as soon as
`RuntimeConfig` has an `overlap` key: then both variants run in the same scenario, each a runtime
of its own. Until then its row says "not built", with no value and no verdict. On CUDA the runtime
runs with `cuda_graphs = false`: a captured graph would replay the real model, not the stand-in.

Each variant runs with the stand-in as an asynchronous device (the issue's rows: a GPU's stream,
whose launches return at once and whose samples reach the host at the end of the work queued
before them) and as a blocking one (rows marked "blocking stand-in": the compute thread sleeps out
every forward, so its own work between two forwards counts as idle time a GPU would not have);
`mmserve.bench.stand_in` says what each models. Beside each, the event loop's busy time per step
(outside its I/O wait, from a trio instrument: the generator's work and everything else the loop
runs, the in-process clients' streams included) — what must fit inside a forward for overlap to
keep the device busy.
"""

from __future__ import annotations

import dataclasses
import time
from time import perf_counter

import torch
import trio
from transformers import AutoConfig, AutoTokenizer

from mmserve.bench.common import MODEL, QUESTIONS, row, timed_chat, user
from mmserve.bench.context import Bench
from mmserve.bench.gpu_busy import union_length
from mmserve.bench.scenarios.shared import at_least
from mmserve.bench.scenarios.throughput import run_level
from mmserve.bench.stand_in import SAMPLE_TEXT, StandInForward, window_calls
from mmserve.config.sections import KVCacheConfig, RuntimeConfig

SCENARIO = "9 engine overhead"
OVERLAP_KEY = "overlap"  # [runtime] overlap: the overlap scheduler's switch (issue 38), once it exists
BUSY_TARGET = 0.92  # the target for the stand-in's busy fraction with overlap
PROMPT_MARGIN = 64  # the chat template's tokens around a prompt
BLOCKING = ", blocking stand-in"
VARIANTS = (("overlap", True, True), ("serial", False, True),  # (name, overlap, asynchronous stand-in)
            ("overlap" + BLOCKING, True, False), ("serial" + BLOCKING, False, False))


def overlap_configurable() -> bool:
    """Whether `[runtime] overlap` is a config key (the overlap scheduler is built)."""
    return OVERLAP_KEY in {f.name for f in dataclasses.fields(RuntimeConfig)}


async def engine_overhead(b: Bench) -> dict:
    p = b.params
    tokenizer = AutoTokenizer.from_pretrained(b.model_dir)
    requests = [text_request(tokenizer, i, p.engine_prompt_tokens) for i in range(p.engine_streams)]
    budget = kv_budget(b, p.engine_streams * (p.engine_prompt_tokens + p.engine_tokens + PROMPT_MARGIN))
    variants: dict[str, dict] = {}
    if overlap_configurable():
        for name, flag, asynchronous in VARIANTS:
            b.note(f"{p.engine_streams} streams, stand-in forward, {name}")
            variants[name] = await _variant(b, requests, budget, {OVERLAP_KEY: flag}, asynchronous)
    else:
        b.note(f"{p.engine_streams} streams, stand-in forward, serial")
        variants["serial"] = await _variant(b, requests, budget, {})
        variants["overlap"] = {"status": "not built",
                               "reason": f"[runtime] {OVERLAP_KEY} is not a config key: mmserve has no overlap "
                                         "scheduling yet"}
    return {"streams": p.engine_streams, "new_tokens": p.engine_tokens, "stand_in_ms": p.engine_stand_in_ms,
            "variants": variants, "rows": engine_rows(variants, p.engine_streams)}


def text_request(tokenizer, i: int, tokens: int) -> list[dict]:
    """A text-only request of about `tokens` tokens (the chat template's aside), distinct for each i."""
    ids = tokenizer(f"Request {i}. " + " ".join([SAMPLE_TEXT] * 64), add_special_tokens=False)["input_ids"]
    return [user(tokenizer.decode(ids[:tokens]) + " " + QUESTIONS[3])]


def kv_budget(b: Bench, tokens: int) -> int:
    """Bytes of a KV arena holding `tokens` tokens of the benchmark's model (with a block per
    stream to spare), or the configured budget if larger: on the CPU the arena's pages that the
    stand-in never writes cost nothing (`torch.empty`)."""
    config = AutoConfig.from_pretrained(b.model_dir)
    text = getattr(config, "text_config", None) or config
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    elem = torch.empty((), dtype=getattr(torch, b.params.dtype)).element_size()
    per_token = 2 * int(text.num_hidden_layers) * heads * head_dim * elem
    blocks = b.params.engine_streams * 2  # every stream's partly filled last block, and more
    need = (tokens + blocks * KVCacheConfig().block_size) * per_token
    return max(b.params.kv_budget_bytes() or 0, need)


class LoopClock(trio.abc.Instrument):
    """The event loop's busy time: every moment it is not waiting for I/O (or a timer)."""

    def __init__(self):
        self.busy_s = 0.0
        self._since = time.perf_counter()

    def before_io_wait(self, timeout: float) -> None:
        now = time.perf_counter()
        self.busy_s += now - self._since
        self._since = now

    def after_io_wait(self, timeout: float) -> None:
        self._since = time.perf_counter()


async def _variant(b: Bench, requests: list, budget: int, runtime_keys: dict, asynchronous: bool) -> dict:
    """One runtime (with `runtime_keys` in its [runtime] section), all `requests` at once with the
    stand-in installed (`asynchronous`: as a GPU's stream), and the window's figures."""
    p = b.params
    async with b.runtime(prefix=False, encoder=False, runtime={"cuda_graphs": False, **runtime_keys},
                         kv_cache={"budget_bytes": budget}) as rt:
        loaded = rt.registry.require(MODEL)
        gen = loaded.generator

        loop = LoopClock()

        def counters() -> tuple:  # read by the stand-in at every call, on the compute thread
            return gen.steps, gen.host_s, gen.forward_s, loop.busy_s

        firsts: set[int] = set()
        marks: dict[str, float] = {}
        finishes: list[float] = []
        prompt_tokens: list[int] = []

        async def send(rt_, _url, messages: list[dict], n: int):
            key = id(messages)

            def on_delta() -> None:
                if key not in firsts:
                    firsts.add(key)
                    if len(firsts) == len(requests):
                        marks["opened"] = perf_counter()

            timing = await timed_chat(rt_, messages, n, on_delta=on_delta)
            finishes.append(perf_counter())
            prompt_tokens.append(timing.prompt_tokens)
            return timing

        preemptions = gen.preemptions
        trio.lowlevel.add_instrument(loop)
        try:
            with StandInForward(loaded.adapter, p.engine_stand_in_ms / 1000, counters, asynchronous) as stand_in:
                level = await run_level(rt, None, requests, p.engine_tokens, None, send=send)
        finally:
            trio.lowlevel.remove_instrument(loop)
        final = counters()
        # the serial loop's time awaiting a step includes its results (the device's work) either way
        out = window_figures(stand_in.calls, marks.get("opened"), min(finishes, default=None), final,
                             asynchronous and runtime_keys.get(OVERLAP_KEY, False))
        out.update(agg_tps=level["agg_tps"], wall_s=level["wall_s"], calls=len(stand_in.calls),
                   preemptions=gen.preemptions - preemptions, config={"runtime": runtime_keys},
                   prompt_tokens=max(prompt_tokens, default=0), kv_budget_bytes=budget,
                   stand_in="asynchronous" if asynchronous else "blocking")
        if out["preemptions"] and out["status"] == "ok":  # re-prefills in the window: not a decode window
            out.update(status="preempted", reason=f"{out['preemptions']} preemption(s): the KV arena was too small")
    return out


def window_figures(calls: list, opened: float | None, closed: float | None, final: tuple,
                   launches_only: bool = False) -> dict:
    """The stand-in's busy fraction and the host's time per step over the window's calls; `final`:
    the generator's counters after the run (for the window's last step when no call follows it):
    (steps, its event-loop time, its time awaiting the compute thread, the loop's busy time).
    `launches_only`: what the generator awaited of the compute thread holds no forward (an
    asynchronous stand-in returns at once, and the overlap chain awaits the device's results
    apart), so it is all the compute thread's own work; else the forward is taken out of it."""
    if opened is None or closed is None:
        return {"status": "no window", "reason": "the streams never all decoded at once"}
    window = window_calls(calls, opened, closed)
    if len(window) < 2:
        return {"status": "no window", "reason": f"{len(window)} step(s) with every stream decoding: "
                                                 "give the streams more tokens (engine_tokens)"}
    span = window[-1].end - window[0].start
    busy = union_length((c.start, c.end) for c in window)
    steps = len(window)
    stand_in_ms = 1000 * sum(c.end - c.start for c in window) / steps
    late_ms = 1000 * sum(max(0.0, (c.woke or c.end) - c.end) for c in window) / steps
    out = {"status": "ok", "steps": steps, "busy": busy / span, "span_s": span, "stand_in_busy_s": busy,
           "stand_in_ms_per_step": stand_in_ms, "late_wake_ms_per_step": late_ms,
           "tokens_per_step": sorted({c.tokens for c in window}),
           # the stand-in's idle time per step: the host work no overlap hid
           "idle_ms_per_step": 1000 * (span - busy) / (steps - 1),
           "step_ms": 1000 * (window[-1].start - window[0].start) / (steps - 1)}
    after = calls.index(window[-1]) + 1
    first, last = window[0].counters, calls[after].counters if after < len(calls) else final
    if first and last and last[0] > first[0]:
        n = last[0] - first[0]
        forward_ms = 1000 * (last[2] - first[2]) / n
        out.update(generator_steps=n, event_loop_ms_per_step=1000 * (last[1] - first[1]) / n,
                   forward_ms_per_step=forward_ms,
                   compute_host_ms_per_step=forward_ms if launches_only else forward_ms - stand_in_ms - late_ms)
        if len(first) > 3:
            out["loop_busy_ms_per_step"] = 1000 * (last[3] - first[3]) / n
    return out


def engine_rows(variants: dict, streams: int) -> list[dict]:
    """The issue's two rows, named exactly, and the host's time per step beside each measured one."""
    rows = []
    named = [("overlap", "stand-in busy with overlap"), ("serial", "stand-in busy, serial")]
    named += [(n + BLOCKING, m + BLOCKING) for n, m in named if n + BLOCKING in variants]
    for name, metric in named:
        v = variants.get(name) or {}
        target = ("≥ 0.92", at_least(v["busy"], BUSY_TARGET)) if name == "overlap" and "busy" in v else \
            ("≥ 0.92", None) if name == "overlap" else (None, None)
        if v.get("status") == "ok":
            rows.append(row(SCENARIO, metric, v["busy"], "", None, None, *target))
            rows.append(row(SCENARIO, _host_metric(name, v, streams), v["idle_ms_per_step"], "ms"))
        else:  # not built (no value, no verdict), or no window (a failed measurement)
            status = v.get("status", "not run")
            rows.append(row(SCENARIO, metric, status, "", None, None, target[0],
                            None if status == "not built" else False))
    return rows


def _host_metric(name: str, v: dict, streams: int) -> str:
    split = ""
    if "event_loop_ms_per_step" in v and v.get("stand_in") == "asynchronous" and name.startswith("overlap"):
        split = (f": the compute thread's own work {v['compute_host_ms_per_step']:.2f} ms, the generator's on the "
                 f"event loop {v['event_loop_ms_per_step']:.2f} ms (the device's results awaited included)")
    elif "event_loop_ms_per_step" in v:
        late = (f", {v.get('late_wake_ms_per_step', 0):.2f} ms waking late from its sleep"
                if v.get("stand_in") != "asynchronous" else "")
        split = (f": {v['event_loop_ms_per_step']:.2f} ms on the event loop, {v['compute_host_ms_per_step']:.2f} ms "
                 f"on the compute thread around the stand-in{late}")
    if "loop_busy_ms_per_step" in v:
        split += f"; the event loop busy {v['loop_busy_ms_per_step']:.2f} ms a step"
    return (f"host time per step, {name}, stand-in idle while {streams} decode ({v['steps']} steps of "
            f"{v['stand_in_ms_per_step']:.2f} ms{split})")

"""Scenarios 1 and 2, throughput: single-stream decode, and the concurrency sweep (with /health
polled under load), against HF `generate` (one request after another, and at the top level all of
them in one batched call), plus the KV arena's usage in an embedded run of the top level. The
concurrency level runner is scenario 6's too."""

from __future__ import annotations

import traceback
from time import perf_counter

import trio

from mmserve.bench import retention
from mmserve.bench.arena_usage import ArenaUsage
from mmserve.bench.gpu_busy import PeakMemory, measure_busy, measure_host_share
from mmserve.bench.common import MODEL, Timing, error_text, median, percentile, ratio, row, timed_chat, timed_http
from mmserve.bench.context import Bench
from mmserve.bench.scenarios.shared import at_least, at_most, brief

TTFT_P99_CUDA_S = 1.5  # the GPU issue's TTFT p99 at the top level (32 concurrent)
GPU_BUSY_TARGET = 0.8
MIB = 1024 * 1024


# -- 1. single-stream decode -------------------------------------------------------------------

async def decode(b: Bench) -> dict:
    """Decode tokens/s of one stream: mmserve embedded and over HTTP vs HF `generate`, interleaved."""
    p = b.params
    msgs = b.ask(b.new_image())
    runs: dict[str, list[Timing]] = {"embedded": [], "http": [], "hf": []}
    async with b.runtime(prefix=False, encoder=False) as rt, b.server(prefix=False, encoder=False) as (client, url):
        for r in range(p.decode_repeats):
            b.note(f"repeat {r + 1}/{p.decode_repeats}")
            runs["embedded"].append(await timed_chat(rt, msgs, p.decode_tokens))
            runs["http"].append(await timed_http(client, url, msgs, p.decode_tokens))
            runs["hf"].append(await b.hf_generate(msgs, p.decode_tokens))
    tps = {k: median(t.decode_tps for t in v) for k, v in runs.items()}
    ttft = {k: median(t.ttft for t in v) for k, v in runs.items()}
    rows = [row("1 decode", f"decode tok/s, {k}", tps[k], "tok/s", tps["hf"], ratio(tps[k], tps["hf"]),
                "≥ 1.0", at_least(ratio(tps[k], tps["hf"]), 1.0)) for k in ("embedded", "http")]
    rows += [row("1 decode", f"TTFT, {k}", ttft[k], "s", ttft["hf"], ratio(ttft[k], ttft["hf"]))
             for k in ("embedded", "http")]
    return {"new_tokens": p.decode_tokens, "decode_tps": tps, "ttft_s": ttft,
            "ratio_vs_hf": {k: ratio(tps[k], tps["hf"]) for k in ("embedded", "http")},
            "runs": {k: [brief(t) for t in v] for k, v in runs.items()}, "rows": rows}


# -- 2. concurrency sweep ------------------------------------------------------------------------

async def _poll_health(client, url: str, interval: float, out: list) -> None:
    while True:
        t0 = perf_counter()
        r = await client.get(url + "/health")
        out.append((perf_counter() - t0, r.status_code))
        await trio.sleep(interval)


def _health_stats(polls: list[tuple[float, int]]) -> dict:
    lat = [p[0] * 1000 for p in polls]
    return {"polls": len(lat), "non_200": sum(p[1] != 200 for p in polls), "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "max_ms": max(lat, default=None)}


async def _idle_health(client, url: str, interval: float, seconds: float = 1.0) -> dict:
    """/health latency with nothing else running: what the busy numbers compare with."""
    polls: list[tuple[float, int]] = []
    with trio.move_on_after(seconds):
        await _poll_health(client, url, interval, polls)
    return _health_stats(polls)


async def run_level(client, url: str | None, requests: list, tokens: int, poll: float | None, send=timed_http) -> dict:
    """All `requests` at once, each by `send(client, url, messages, tokens)` (default: over HTTP);
    with `poll`, /health is polled every `poll` s meanwhile."""
    results: list[Timing | None] = [None] * len(requests)
    health: list[tuple[float, int]] = []

    async def one(i: int) -> None:
        results[i] = await send(client, url, requests[i], tokens)

    start = perf_counter()
    async with trio.open_nursery() as outer:
        if poll:
            outer.start_soon(_poll_health, client, url, poll, health)
        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(one, i)
        wall = perf_counter() - start
        outer.cancel_scope.cancel()
    ttfts = [t.ttft for t in results]
    out = {"concurrency": len(requests), "wall_s": wall, "agg_tps": sum(t.completion_tokens for t in results) / wall,
           "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}
    if poll:
        out["health"] = _health_stats(health)
    return out


def _hf_sequential(runs: list[Timing]) -> dict:
    """HF `generate` of the same requests one after another: aggregate tokens/s, and the TTFTs the
    requests would see if they all arrived at once and were served in order."""
    busy, ttfts = 0.0, []
    for t in runs:
        ttfts.append(busy + t.ttft)
        busy += t.total
    return {"agg_tps": sum(t.completion_tokens for t in runs) / busy,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def _hf_batched(t: Timing, n: int) -> dict:
    """HF `generate` of the same n requests in one batched call: every row gets its tokens together."""
    return {"batch": n, "wall_s": t.total, "ttft_s": t.ttft, "new_tokens": t.completion_tokens,
            "agg_tps": n * t.completion_tokens / t.total}


async def _embedded_level(b: Bench, requests: list, tokens: int) -> dict:
    """The top level through an embedded Runtime (caches off), sampling its KV arena all along:
    at every delta any request receives (one per step) and every `kv_sample_interval_s`. On CUDA
    also the GPU's busy time once all requests decode, and the run's peak GPU memory."""
    decoding, started = trio.Event(), set()
    with PeakMemory(b.params.device) as memory:
        async with b.runtime(prefix=False, encoder=False) as rt:
            usage = ArenaUsage(rt, MODEL)
            loaded = rt.registry.require(MODEL)
            busy: dict = {}
            host: dict = {}

            async def send(rt_, _url, messages: list[dict], n: int) -> Timing:
                key = id(messages)

                def on_delta() -> None:
                    usage.sample()
                    started.add(key)
                    if len(started) == len(requests):
                        decoding.set()

                return await timed_chat(rt_, messages, n, on_delta=on_delta)

            async def gpu_busy() -> None:  # the host's share first: the profiler's own overhead is not in it
                host.update(await measure_host_share(loaded.generator, decoding, steps=b.params.host_share_steps))
                busy.update(await measure_busy(loaded.generator, decoding))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(usage.poll, b.params.kv_sample_interval_s)
                nursery.start_soon(gpu_busy)
                out = await run_level(rt, None, requests, tokens, None, send=send)
                nursery.cancel_scope.cancel()
            weights = sum(t.numel() * t.element_size() for t in loaded.adapter.model.parameters())
            kv_bytes = loaded.generator.arena.nbytes
    out["kv"] = usage.summary(len(requests))
    out["gpu_busy"] = busy
    out["host_share"] = host
    out["gpu_memory"] = {"peak_bytes": memory.peak, "weights_bytes": weights, "kv_bytes": kv_bytes}
    return out


async def concurrency(b: Bench) -> dict:
    """N concurrent streaming HTTP requests (distinct images; caches off) vs sequential HF generate;
    at the top level also vs one batched HF generate of the same requests, and the same requests
    through an embedded runtime whose KV arena usage is sampled."""
    p, top = b.params, max(b.params.levels)
    requests = [b.ask(b.new_image()) for _ in range(top)]
    batched_at = set(p.batched_levels) | {top}
    b.note(f"HF generate x{top}")
    hf_runs = [await b.hf_generate(m, p.sweep_tokens) for m in requests]
    levels = []
    async with b.server(prefix=False, encoder=False) as (client, url):
        idle = await _idle_health(client, url, p.health_interval_s)
        for n in p.levels:
            b.note(f"{n} concurrent")
            lv = await run_level(client, url, requests[:n], p.sweep_tokens, p.health_interval_s if n == top else None)
            lv["hf"] = _hf_sequential(hf_runs[:n])
            lv["ratio_agg_tps"] = ratio(lv["agg_tps"], lv["hf"]["agg_tps"])
            if n in batched_at:  # right after mmserve's level, the server idle meanwhile
                b.note(f"HF generate, one batch of {n}")
                lv["hf_batched"] = _hf_batched(await b.hf_generate_batch(requests[:n], p.sweep_tokens), n)
                lv["ratio_agg_tps_batched"] = ratio(lv["agg_tps"], lv["hf_batched"]["agg_tps"])
            levels.append(lv)
    b.note(f"{top} concurrent, embedded (KV arena usage)")
    embedded = await _embedded_level(b, requests, p.sweep_tokens)
    batched = next(lv for lv in levels if lv["concurrency"] == top)["hf_batched"]
    embedded["hf_batched_agg_tps"] = batched["agg_tps"]
    embedded["ratio_agg_tps_batched"] = ratio(embedded["agg_tps"], batched["agg_tps"])
    b.note(f"RSS over {p.retention_requests} requests once the caches are full")
    try:
        kept = await retention.measure(b)
    except Exception as e:  # the sweep's figures above stand without it (the H200 run of 2026-11-28 lost them)
        traceback.print_exc()
        kept = {"error": error_text(e)}
    return {"new_tokens": p.sweep_tokens, "levels": levels, "health_idle": idle, "health_during": top,
            "embedded": embedded, "retention": kept,
            "rows": _concurrency_rows(levels, idle, top, p.device) + _embedded_rows(embedded, top)
            + [_retention_row(kept)]}


def _retention_row(r: dict) -> dict:
    """Resident memory growth per 1,000 requests once both caches are full: what requests leave
    behind (issue 46's leak kept ~7.7 MiB per 1,000 small requests, ~5.4 GiB with 4 MB images). A
    figure without a target: runs are not yet long enough to tell a small slope from the
    allocator's noise, but a request kept alive shows."""
    if "error" in r:
        return row("2 concurrency", "RSS growth per 1,000 requests, caches full: error", r["error"], ok=False)
    full = "" if r["caches_full"] else f"; caches NOT full after {r['fill_requests']} requests"
    return row("2 concurrency", f"RSS growth per 1,000 requests, caches full ({r['requests']} requests "
               f"@{r['concurrency']} after {r['fill_requests']} to fill, embedded; slope of "
               f"{len(r['samples'])} readings, R² {r['r2']:.2f}{full})", r["growth_per_1000_mib"], "MiB")


def _concurrency_rows(levels: list[dict], idle: dict, top: int, device: str) -> list[dict]:
    """The sweep's rows; the issue's targets sit on the top level (16 on the CPU, 32 on a GPU)."""
    rows = []
    for lv in levels:
        n, hf = lv["concurrency"], lv["hf"]
        target = ("≥ 2.5", at_least(lv["ratio_agg_tps"], 2.5)) if n == 8 else (None, None)
        rows.append(row("2 concurrency", f"aggregate tok/s @{n} vs sequential HF", lv["agg_tps"], "tok/s",
                        hf["agg_tps"], lv["ratio_agg_tps"], *target))
        if "hf_batched" in lv:
            # a figure without a target (retired: ≥ 2 at the top level): on a CPU both sides are
            # bound by reading the same weights once a step, so the ratio stays near 1 however good
            # the scheduler is
            r = lv["ratio_agg_tps_batched"]
            rows.append(row("2 concurrency", f"aggregate tok/s @{n} vs batched HF (one generate call)", lv["agg_tps"],
                            "tok/s", lv["hf_batched"]["agg_tps"], r))
        rows.append(row("2 concurrency", f"TTFT p50 @{n}", lv["ttft_p50_s"], "s", hf["ttft_p50_s"],
                        ratio(lv["ttft_p50_s"], hf["ttft_p50_s"])))
        rows.append(row("2 concurrency", f"TTFT p99 @{n}", lv["ttft_p99_s"], "s", hf["ttft_p99_s"],
                        ratio(lv["ttft_p99_s"], hf["ttft_p99_s"])))
        if "hf_batched" in lv:
            r = ratio(lv["ttft_p99_s"], lv["ttft_p50_s"])
            target = ("≤ 2", at_most(r, 2)) if n == top else (None, None)
            rows.append(row("2 concurrency", f"TTFT p99 / TTFT p50 @{n}", lv["ttft_p99_s"], "s", lv["ttft_p50_s"], r,
                            *target))
        if n == top and device.startswith("cuda"):
            rows.append(row("2 concurrency", f"TTFT p99 @{n}", lv["ttft_p99_s"], "s", None, None,
                            f"≤ {TTFT_P99_CUDA_S} s", at_most(lv["ttft_p99_s"], TTFT_P99_CUDA_S)))
        if "health" in lv:
            h = lv["health"]
            rows.append(row("2 concurrency", f"/health p99 @{n} vs idle ({h['polls']} polls, max {h['max_ms']:.0f} ms, "
                            f"{h['non_200']} not 200)", h["p99_ms"], "ms", idle["p99_ms"], ratio(h["p99_ms"], idle["p99_ms"]),
                            "< 50 ms", bool(h["p99_ms"] < 50 and not h["non_200"])))
    return rows


def _embedded_rows(e: dict, top: int) -> list[dict]:
    n, kv = e["concurrency"], e["kv"]
    rows = [row("2 concurrency", f"aggregate tok/s @{n}, embedded vs batched HF", e["agg_tps"], "tok/s",
                e["hf_batched_agg_tps"], e["ratio_agg_tps_batched"])]
    rows += _gpu_rows(e, n)
    peak = kv["at_peak"]
    if peak is None:
        return rows + [row("2 concurrency", f"KV bytes in use / bytes of tokens held @{n}", "no sample taken", "",
                           ok=False)]
    target = ("≤ 1.1", at_most(peak["ratio"], 1.1)) if n == top else (None, None)
    rows.append(row("2 concurrency", f"KV bytes in use / bytes of tokens held @{n}, embedded, at peak usage "
                    f"({peak['referenced_blocks']} blocks, {peak['held_tokens']} tokens)", peak["bytes_in_use"] / MIB,
                    "MiB", peak["bytes_held"] / MIB, peak["ratio"], *target))
    worst = kv["max_ratio_all_decoding"]
    if worst is not None:
        rows.append(row("2 concurrency", f"KV in use / held @{n}, worst of {kv['samples_all_decoding']} samples "
                        f"with all {n} decoding", worst, "", None, worst))
    return rows


def _gpu_rows(e: dict, n: int) -> list[dict]:
    """The host's share of a step while all `n` decode (any device); GPU busy meanwhile and peak GPU
    memory vs weights + KV arena (CUDA runs only)."""
    rows = []
    host = e.get("host_share") or {}
    if host.get("status") == "ok":
        rows.append(row("2 concurrency", f"host share of a step while {n} decode ({host['steps']} steps: "
                        f"{host['host_ms_per_step']:.2f} ms on the event loop, {host['forward_ms_per_step']:.2f} ms "
                        "awaiting the forward)", host["host_share"], "", None, host["host_share"]))
    busy = e.get("gpu_busy") or {}
    if busy.get("status") == "ok" and busy.get("busy") is not None:
        rows.append(row("2 concurrency", f"GPU busy while {n} decode ({busy['steps']} steps, "
                        f"{busy['kernels_per_step']:.0f} kernels a step; {busy['source']})", busy["busy"], "", None,
                        None, f"≥ {GPU_BUSY_TARGET}", at_least(busy["busy"], GPU_BUSY_TARGET)))
    mem = e.get("gpu_memory") or {}
    if mem.get("peak_bytes") is not None:
        allowed = mem["weights_bytes"] + mem["kv_bytes"]
        r = ratio(mem["peak_bytes"], allowed)
        rows.append(row("2 concurrency", f"peak GPU memory @{n}, embedded / (weights + KV arena)",
                        mem["peak_bytes"] / MIB, "MiB", allowed / MIB, r, "≤ 1.1", at_most(r, 1.1)))
    return rows

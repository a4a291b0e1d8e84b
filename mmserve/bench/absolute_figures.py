"""The report's absolute figures, beside the ratios: what a reader compares with vLLM's and
SGLang's published numbers directly — tokens/s, the fraction of the memory-bandwidth limit, GPU
busy, prefill time per token count — gathered from the scenarios of one run (each figure only
where the scenarios it needs ran).

The bandwidth limit: a decode step reads every weight of the language model and the output head
once (`device_limits.decode_weight_bytes`), so at the device's copy bandwidth (measured in the
same run, scenario 10) a step takes at least weights / bandwidth; the fraction is that floor over
the measured step time — for one stream, 1 / decode tok/s; while N decode, the generator's step
(its host time plus the awaited forward, scenario 2's embedded run). Reads of the KV cache come on
top of the weights, so at N streams the fraction understates the memory traffic.
"""

from __future__ import annotations

import math

GB = 1e9


def _get(d: dict | None, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _ok(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def absolute_figures(scenarios: dict) -> list[dict]:
    """[{figure, value, unit, source}] from a run's scenarios (see the module docstring)."""
    out: list[dict] = []

    def add(figure: str, value, unit: str, source: str) -> None:
        if _ok(value):
            out.append({"figure": figure, "value": value, "unit": unit, "source": source})

    ab = scenarios.get("absolute") or {}
    bandwidth = _get(ab, "copy", "bytes_per_s")
    weights = ab.get("decode_weight_bytes")
    limited = _ok(bandwidth) and _ok(weights) and weights > 0
    add("device copy bandwidth", bandwidth / GB if _ok(bandwidth) else None, "GB/s",
        "10: device-to-device copy, 2 x bytes / time")
    add("weights a decode step reads", weights / GB if _ok(weights) else None, "GB", "10: language model + output head")
    if limited:
        add("decode limit of one stream (bandwidth / weights)", bandwidth / weights, "tok/s", "10")

    tps = _get(scenarios, "decode", "decode_tps") or {}
    for side in ("embedded", "http"):
        add(f"decode tok/s, one stream, {side}", tps.get(side), "tok/s", "1 decode")
    if limited and _ok(tps.get("embedded")):
        add("fraction of the bandwidth limit, one stream", tps["embedded"] * weights / bandwidth, "",
            "1 decode x 10: weights x tok/s / bandwidth")

    conc = scenarios.get("concurrency") or {}
    levels = conc.get("levels") or []
    if levels:
        top = levels[-1]
        add(f"aggregate tok/s @{top['concurrency']}, HTTP", top.get("agg_tps"), "tok/s", "2 concurrency")
    emb = conc.get("embedded") or {}
    n = emb.get("concurrency")
    add(f"aggregate tok/s @{n}, embedded", emb.get("agg_tps"), "tok/s", "2 concurrency")
    host = emb.get("host_share") or {}
    if host.get("status") == "ok":
        step_ms = host["host_ms_per_step"] + host["forward_ms_per_step"]
        add(f"step time while {n} decode", step_ms, "ms", "2 concurrency (embedded): event loop + forward")
        if limited and step_ms > 0:
            add(f"fraction of the bandwidth limit while {n} decode (weights only)",
                weights / bandwidth / (step_ms / 1000), "", "2 concurrency x 10")
    add(f"GPU busy while {n} decode", _get(emb, "gpu_busy", "busy"), "", "2 concurrency (CUDA kernels)")

    engine = scenarios.get("engine_overhead") or {}
    for name in ("serial", "overlap", "serial, blocking stand-in", "overlap, blocking stand-in"):
        v = _get(engine, "variants", name) or {}
        if not v and "blocking" in name:
            continue
        add(f"stand-in busy, {name} ({engine.get('stand_in_ms')} ms forward)", v.get("busy"), "", "9 engine overhead")

    for r in ab.get("prefill") or []:
        add(f"prefill of {r['tokens']} tokens", r.get("ms"), "ms", f"10: {ab.get('prefill_path', 'runner')}")
        if _ok(r.get("ms")) and r["ms"] > 0:
            add(f"prefill tok/s at {r['tokens']} tokens", 1000 * r["tokens"] / r["ms"], "tok/s", "10")
    for r in ab.get("prefill_captured") or []:
        add(f"prefill of {r['tokens']} tokens, captured graph", r.get("ms"), "ms",
            f"10: {ab.get('prefill_captured_path', 'runner')}")
    return out

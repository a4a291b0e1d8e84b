"""Scenario 10, absolute: what the device allows, for the report's absolute figures beside the
ratios (`mmserve.bench.absolute_figures`): the measured copy bandwidth, the bytes of weights a
decode step reads, and the prefill time of a prompt per token count through the runner
(`mmserve.bench.device_limits`). It runs on the benchmark's loaded model (the one under the HF
baselines), on the compute thread like every other model step of the benchmark."""

from __future__ import annotations

from functools import partial

from mmserve.actors import compute
from mmserve.bench.common import row
from mmserve.bench.context import Bench
from mmserve.bench.device_limits import PrefillTimer, copy_bandwidth, decode_weight_bytes

SCENARIO = "10 absolute"
GB = 1e9


async def absolute(b: Bench) -> dict:
    p = b.params
    b.note(f"copy bandwidth ({p.copy_mib} MiB)")
    copy = await compute.run(partial(copy_bandwidth, p.device, p.copy_mib))
    adapter = await b.model_adapter()
    weights = decode_weight_bytes(adapter)
    b.note("prefill per token count")
    timer = await compute.run(partial(PrefillTimer, adapter, max(p.prefill_tokens)))
    prefill = []
    for n in p.prefill_tokens:
        prefill.append(await compute.run(timer.time, n, p.prefill_repeats))
    path = f"runner, {timer.runner.backend.name} backend"
    captured, captured_path = [], None
    if p.device == "cuda":  # the same prefills replayed from graphs captured per token count (issue 38)
        b.note("prefill per token count, captured graphs")
        graphed = await compute.run(partial(PrefillTimer, adapter, max(p.prefill_tokens),
                                            graph_buckets=tuple(p.prefill_tokens)))
        if graphed.captured:
            for n in p.prefill_tokens:
                captured.append(await compute.run(graphed.time, n, p.prefill_repeats))
            captured_path = f"runner, {graphed.runner.backend.name} backend, captured graph"
        del graphed
    rows = [row(SCENARIO, f"copy bandwidth, device to device ({copy['bytes'] >> 20} MiB, 2 x bytes / time)",
                copy["bytes_per_s"] / GB, "GB/s"),
            row(SCENARIO, "weights a decode step reads (language model + output head)", weights / GB, "GB"),
            row(SCENARIO, "decode tok/s limit of one stream (copy bandwidth / weights per step)",
                copy["bytes_per_s"] / weights, "tok/s")]
    rows += [row(SCENARIO, f"prefill of {r['tokens']} tokens ({path}; median of {len(r['ms_all'])})", r["ms"], "ms")
             for r in prefill]
    rows += [row(SCENARIO, f"prefill of {r['tokens']} tokens ({captured_path}; median of {len(r['ms_all'])})",
                 r["ms"], "ms") for r in captured]
    return {"copy": copy, "decode_weight_bytes": weights, "prefill": prefill, "prefill_path": path,
            "prefill_captured": captured, "prefill_captured_path": captured_path, "rows": rows}

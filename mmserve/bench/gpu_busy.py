"""How busy the GPU is while mmserve decodes, and how much GPU memory its run took.

Busy: the fraction of a window's wall time in which at least one CUDA kernel ran — the union of
the kernel intervals that torch.profiler records (CUPTI, every thread of the process), over the
span from the window's first kernel to its last. The window opens once every request of the level
has its first token (all of them decoding) and closes after `steps` generator steps, so prefill
and ramp-down are not in it. Also reported: kernels per step, and (on any device, in the window of
steps before) the host's share of a step: the generator's time on the event loop between steps.

Memory: the peak of `torch.cuda.max_memory_allocated` during the run, less what the process held
before it (the HF baseline's weights), against mmserve's weights plus its KV arena.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch
import trio


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def busy_summary(kernels: list[tuple[float, float]], steps: int) -> dict:
    """{busy, kernels, kernels_per_step, span_us} of kernel intervals (µs) over `steps` steps."""
    if not kernels:
        return {"busy": None, "kernels": 0, "kernels_per_step": None, "span_us": 0.0}
    span = max(b for _, b in kernels) - min(a for a, _ in kernels)
    return {"busy": union_length(kernels) / span if span > 0 else None, "kernels": len(kernels),
            "kernels_per_step": len(kernels) / steps if steps else None, "span_us": span}


def _kernel_intervals(prof) -> list[tuple[float, float]]:
    from torch.autograd import DeviceType

    return [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]


async def measure_host_share(generator, all_decoding: trio.Event, steps: int = 32, timeout_s: float = 60.0) -> dict:
    """Over `steps` generator steps from when `all_decoding` is set: the share of the generator's busy
    time spent on the event loop between back-to-back steps (`Generator.host_s`) rather than awaiting
    the compute thread's step (`forward_s`), on any device: the part of a step no GPU can speed up."""
    with trio.move_on_after(timeout_s):
        await all_decoding.wait()
    first, host, forward = generator.steps, generator.host_s, generator.forward_s
    with trio.move_on_after(timeout_s):
        while generator.steps < first + steps:
            await trio.sleep(0.001)
    done = generator.steps - first
    host, forward = generator.host_s - host, generator.forward_s - forward
    if not done or host + forward <= 0:
        return {"status": "no steps"}
    return {"status": "ok", "steps": done, "host_share": host / (host + forward),
            "host_ms_per_step": 1000 * host / done, "forward_ms_per_step": 1000 * forward / done}


async def measure_busy(generator, all_decoding: trio.Event, steps: int = 32, timeout_s: float = 60.0) -> dict:
    """GPU busy over `steps` generator steps, from when `all_decoding` is set; on a CPU run, n/a."""
    if not torch.cuda.is_available() or generator.arena.device.type != "cuda":
        return {"status": "n/a (not a CUDA run)"}
    from torch.profiler import ProfilerActivity, profile

    with trio.move_on_after(timeout_s):
        await all_decoding.wait()
    first = generator.steps
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with trio.move_on_after(timeout_s):
            while generator.steps < first + steps:
                await trio.sleep(0.001)
        torch.cuda.synchronize()
    done = generator.steps - first
    out = busy_summary(_kernel_intervals(prof), done)
    out.update(status="ok", steps=done, wall_s=time.perf_counter() - t0, source="torch.profiler (CUPTI kernels)")
    return out


class PeakMemory:
    """`torch.cuda.max_memory_allocated` during a block, less what was allocated when it began."""

    def __init__(self, device: str):
        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.base = 0
        self.peak: int | None = None

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base

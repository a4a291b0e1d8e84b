"""Which decode-graph captures fail on this GPU, and under what condition (a device-session probe;
see scripts/gpu-run.sh probe). Both GPU runs of 2026-11-26 saw Qwen2-VL's fourth capture in one
runner invalidated (cudaErrorStreamCaptureInvalidated) whatever the bucket order, LLaVA's never.
For each family: every bucket alone in a fresh runner; all buckets in one runner ascending,
descending, and descending with a fresh memory pool per capture. Then issue 38 item 4's cause, in
one call: a dead runner's captured graphs (garbage in a cycle) collected by a garbage collection
inside another capture — "operation not permitted when stream is capturing (function reset)", the
capture invalidated — with the collector left on (the fault: expected FAIL) and paused as
`DecodeGraphs` now pauses it (expected ok); and every mixed-step token bucket of each family.
Prints one line per attempt. Last, each fixed-shape family's vision tower (tiny presets: the launch
overhead is what a graph removes) per view count: the eager body and the replayed graph (with the
static path's copies in and out), in ms."""

from __future__ import annotations

import contextlib
import gc
import sys
import tempfile
from pathlib import Path

import torch

from mmserve.engine import decode_graphs
from mmserve.engine.runner import ModelRunner
from mmserve.engine.vision_step import VisionPath
from mmserve.models.demo import build_untrained
from mmserve.models.demo.qwen import build_untrained_qwen
from mmserve.models.fixed_tower import TowerViews
from mmserve.models.loading import load_adapter

DEVICE = "cuda" if torch.cuda.is_available() else sys.exit("a CUDA device is needed")


def runner(adapter) -> ModelRunner:
    return ModelRunner(adapter, 1 << 21, 4, "triton", max_batch=8, token_buckets=(16, 64))


def collection_inside_a_capture(label: str, adapter, paused: bool) -> None:
    """A dead runner with a captured graph, then a capture in another runner whose body runs a
    collection halfway (as an allocation may trigger one) whenever the collector is on."""
    dead = runner(adapter)
    dead.buffers.clear(1)
    with torch.inference_mode():
        dead.graphs._try_capture(1)
    del dead  # a cycle (graphs.body is its bound method): freed only by a collection
    r = runner(adapter)
    body = r.graphs.body

    def collecting(bucket):
        if gc.isenabled() and torch.cuda.is_current_stream_capturing():
            gc.collect()
        return body(bucket)

    r.graphs.body = collecting
    real = decode_graphs.collector_paused
    if not paused:
        decode_graphs.collector_paused = contextlib.nullcontext
    try:
        attempt(label, r, [2])
    finally:
        decode_graphs.collector_paused = real


def mixed(label: str, r: ModelRunner) -> None:
    results = []
    for t in sorted(r.token_buckets, reverse=True):
        r.mixed.clear(t)
        with torch.inference_mode():
            ok = r.mixed_graphs._try_capture(t)
        results.append(f"{t}:{'ok' if ok else 'FAIL'}")
    first = next(iter(r.mixed_graphs.failed.values()), "")
    print(f"{label:40s} {' '.join(results)}  {first[:120]}", flush=True)


def attempt(label: str, r: ModelRunner, order, fresh_pool: bool = False) -> None:
    results = []
    for b in order:
        if fresh_pool:
            r.graphs._pool = None
        r.buffers.clear(b)
        with torch.inference_mode():
            ok = r.graphs._try_capture(b)
        results.append(f"{b}:{'ok' if ok else 'FAIL'}")
    first = next(iter(r.graphs.failed.values()), "")
    print(f"{label:40s} {' '.join(results)}  {first[:120]}", flush=True)


def vision_towers(tmp: Path) -> None:
    """Per fixed-shape family and view count: the tower's body eagerly vs its replayed graph, ms."""
    for family, preset in (("llava", "tiny"), ("gemma3", "tiny-gemma3"), ("idefics3", "tiny-idefics3")):
        # a directory of its own: the decode probes above built `tiny` (without random_weights) in tmp / "tiny"
        built = build_untrained(preset, tmp / f"vision-{preset}", seed=0, random_weights=True)
        adapter = load_adapter(f"probe-vision-{family}", built, device=DEVICE)
        path = VisionPath(adapter, (1, 2, 4, 8), cuda_graphs=True)
        captured, static = path.capture(), path.static
        c, h, w = static.tower.view_shape
        for n in static.buckets:
            pixels = torch.randn(n, c, h, w)
            mask = torch.ones(n, h, w, dtype=torch.bool) if static.tower.masked else None
            on_device = pixels.to(DEVICE, adapter.dtype), None if mask is None else mask.to(DEVICE)
            with torch.inference_mode():
                eager = timed(lambda: static.tower.body(*on_device))
                replayed = timed(lambda: static.rows(TowerViews(pixels, mask)))
            label = f"{family} vision tower, {n} views"
            print(f"{label:40s} eager {eager:.3f} ms  replayed {replayed:.3f} ms"
                  f"  (captured {captured}, failed {sorted(path.failed_captures)})", flush=True)


def timed(fn, repeat: int = 20) -> float:
    """Mean ms of `fn` on the device (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    builds = {"llava": lambda: build_untrained("tiny", tmp / "tiny", seed=0),
              "qwen2_vl": lambda: build_untrained_qwen("tiny-qwen", tmp / "tiny-qwen", seed=0)}
    for family, build in builds.items():
        adapter = load_adapter(f"probe-{family}", build(), device=DEVICE)
        buckets = runner(adapter).buckets
        for b in buckets:
            attempt(f"{family} alone {b}", runner(adapter), [b])
        attempt(f"{family} ascending", runner(adapter), buckets)
        attempt(f"{family} descending", runner(adapter), buckets[::-1])
        attempt(f"{family} descending, a pool each", runner(adapter), buckets[::-1], fresh_pool=True)
        collection_inside_a_capture(f"{family} gc in capture (expect FAIL)", adapter, paused=False)
        collection_inside_a_capture(f"{family} gc paused in capture", adapter, paused=True)
        mixed(f"{family} mixed token buckets", runner(adapter))
    vision_towers(tmp)


if __name__ == "__main__":
    main()

"""Which decode-graph captures fail on this GPU, and under what condition (a device-session probe;
see scripts/gpu-run.sh probe). Both GPU runs of 2026-11-26 saw Qwen2-VL's fourth capture in one
runner invalidated (cudaErrorStreamCaptureInvalidated) whatever the bucket order, LLaVA's never.
For each family: every bucket alone in a fresh runner; all buckets in one runner ascending,
descending, and descending with a fresh memory pool per capture. Prints one line per attempt."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from mmserve.generation.runner import ModelRunner
from mmserve.models.demo import build_untrained
from mmserve.models.demo.qwen import build_untrained_qwen
from mmserve.models.loading import load_adapter

DEVICE = "cuda" if torch.cuda.is_available() else sys.exit("a CUDA device is needed")


def runner(adapter) -> ModelRunner:
    return ModelRunner(adapter, 1 << 21, 4, "triton", max_batch=8)


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


if __name__ == "__main__":
    main()

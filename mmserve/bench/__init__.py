"""`mmserve bench`: side-by-side benchmarks of mmserve against raw transformers and against itself
with its caches off. See bench/README.md. An entry point: it may import anything; nothing but the
CLI imports it. Its heavy dependencies (matplotlib, tqdm, the peer server) come with the `bench`
extra and are imported only when the command runs: `run_bench` (and with it the runner, the report
and the scenarios) is loaded on first use, so the CLI's parser and the benchmark's server process
(`python -m mmserve.bench.servers`) import only what they need."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmserve.bench.params import PARAMS, BenchParams

if TYPE_CHECKING:
    from mmserve.bench.run import run_bench

__all__ = ["PARAMS", "BenchParams", "run_bench"]


def __getattr__(name: str):
    if name == "run_bench":  # the runner imports tqdm and, through the report, matplotlib
        from mmserve.bench.run import run_bench

        return run_bench
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""`mmserve bench`: side-by-side benchmarks of mmserve against raw transformers and against itself
with its caches off. See bench/README.md."""

from mmserve.bench.params import PARAMS, BenchParams
from mmserve.bench.run import run_bench

__all__ = ["PARAMS", "BenchParams", "run_bench"]

"""Running the benchmark: the model, the scenarios in order under a progress bar, the report."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import structlog
import torch
import transformers
import trio
from tqdm import tqdm

from mmserve.bench.absolute_figures import absolute_figures
from mmserve.bench.baselines import release_device_memory
from mmserve.bench.common import error_text
from mmserve.bench.context import Bench
from mmserve.bench.model import (built_preset, default_model_dir, ensure_model, family_name, sizes_vary,
                                 tokens_per_image)
from mmserve.bench.params import BenchParams
from mmserve.bench.report import write_reports
from mmserve.bench.scenarios import SCENARIOS
from mmserve.logs import configure_logging
from mmserve.actors import compute
from mmserve.models.random_weights import is_random_weights
from mmserve.runtime.runtime import configure_device


# Each scenario's share of a run, about its seconds in the recorded runs (a quick CPU run,
# bench/results/2026-11-26-quick-session-after, and an H200 run; the two newest scenarios
# estimated): the progress bar advances by these, so its ETA after the first scenario scales the
# rest by how fast this machine ran that one. Counting scenarios alike put the ETA off by several
# times (concurrency and replicas take ten times what same_image does).
SCENARIO_WEIGHTS = {"decode": 8, "concurrency": 34, "multiturn": 5, "same_image": 2, "three_images": 2, "peer": 2,
                    "replicas": 29, "scaleout": 40, "structured": 15, "engine_overhead": 10, "absolute": 5, "video": 6,
                    "deterministic": 60}
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]"


def scenario_weight(name: str) -> int:
    return SCENARIO_WEIGHTS.get(name, 10)


def run_bench(out: str | Path, params: BenchParams, model_dir: str | Path | None = None,
              progress: bool = True) -> dict:
    """Runs `params.scenarios` and writes report.json / report.md / report.png into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not model_dir:
        with compute.single_threaded():  # this thread runs the embedded runtimes' event loops: no OpenMP team here
            model_dir = ensure_model(default_model_dir(out, params.preset, params.random_weights), params.preset,
                                     params.random_weights)
    model_dir = Path(model_dir)
    configure_device(params.device)  # as mmserve's runtime does: the baselines in this process get it too
    with _quiet_process_settings(params.torch_threads):
        meta = _meta(params, model_dir)
        start = time.perf_counter()
        with tqdm(total=sum(scenario_weight(n) for n in params.scenarios), desc="bench", disable=not progress,
                  bar_format=BAR_FORMAT) as bar:
            bench = Bench(params, model_dir, out, note=bar.set_postfix_str)
            meta.update(_family_meta(bench))
            results, probes = _trio_run(_run_scenarios, bench, bar)
        meta.update(duration_s=time.perf_counter() - start, loadavg_end=_loadavg(), **probes)
    summary = [r for res in results.values() for r in res.pop("rows", [])]
    report = {"meta": meta, "summary": summary, "absolute": absolute_figures(results), "scenarios": results}
    report["paths"] = {k: str(v) for k, v in write_reports(report, out).items()}
    return report


def _trio_run(fn, *args):
    """`trio.run`, with a Ctrl-C raised as a plain KeyboardInterrupt: by the time it leaves
    `trio.run` every scenario has stopped what it started, and nurseries have wrapped it in groups."""
    try:
        return trio.run(fn, *args)
    except BaseExceptionGroup as group:
        if group.split(KeyboardInterrupt)[0] is not None:
            raise KeyboardInterrupt from None  # where it landed in the nurseries says nothing
        raise


@contextmanager
def _quiet_process_settings(threads: int):
    """Warnings-only logs (a readable progress bar) and `threads` torch threads while the benchmark
    runs; the caller's settings come back afterwards."""
    saved = structlog.get_config(), transformers.logging.get_verbosity(), torch.get_num_threads()
    configure_logging("json", "warning")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    compute.configure(threads)  # the baselines run on the compute thread too
    try:
        yield
    finally:
        structlog.configure(**saved[0])
        transformers.logging.set_verbosity(saved[1])
        torch.set_num_threads(saved[2])


async def _run_scenarios(bench: Bench, bar: tqdm) -> tuple[dict, dict]:
    """The scenarios in order, and the thread probes before and after them. SIGTERM cancels the
    scenarios (each stops the processes it started, in its `finally`), then ends the benchmark with
    SystemExit(143), no report written: the default action, ending the process at once, would leave
    its servers and its Redis running."""
    results, terminated = {}, []
    # on the compute thread, as every model step and baseline: run here, on the main thread, its
    # parallel matmul started a second OpenMP team, and every embedded figure after it paid a
    # futex wake-up per op (`mmserve.actors.compute`)
    probes = {"thread_probe_start": await compute.run(thread_probe, bench.params.torch_threads)}
    async with trio.open_nursery() as nursery:
        if threading.current_thread() is threading.main_thread():  # trio's signal handling needs it
            nursery.start_soon(_cancel_on_sigterm, nursery.cancel_scope, terminated)
        for name in bench.params.scenarios:
            bar.set_description(name)
            results[name] = await _run_one(name, bench)
            _write_partial(bench.workdir, results)
            bar.update(scenario_weight(name))
        nursery.cancel_scope.cancel()  # the SIGTERM watcher
    if terminated:
        raise SystemExit(128 + signal.SIGTERM)
    probes["thread_probe_end"] = await compute.run(thread_probe, bench.params.torch_threads)
    return results, probes


def _write_partial(out: Path, results: dict) -> None:
    """The scenarios finished so far, rewritten after each: a run killed by a time limit (a lent
    GPU's) keeps what it measured."""
    (out / "partial.json").write_text(json.dumps(results, indent=1, default=str))


async def _cancel_on_sigterm(scope: trio.CancelScope, terminated: list) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            terminated.append(True)
            scope.cancel()
            return


async def _run_one(name: str, bench: Bench) -> dict:
    """One scenario; a failure is recorded in the report rather than ending the run."""
    t0 = time.perf_counter()
    try:
        result = await SCENARIOS[name](bench)
        result.setdefault("status", "ok")
    except Exception as e:
        traceback.print_exc()
        error = error_text(e)
        result = {"status": "error", "error": error,
                  "rows": [{"scenario": name, "metric": "error", "value": error, "unit": "",
                            "baseline": None, "ratio": None, "target": None, "ok": False}]}
    result["duration_s"] = time.perf_counter() - t0
    # the scenario's frames held its runtimes until it returned: hand their device memory back now,
    # or the next scenario's server (its own process) finds the GPU full
    release_device_memory(bench.params.device)
    if torch.device(bench.params.device).type == "cuda":
        result["device_memory_after_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    return result


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def thread_probe(threads: int, repeats: int = 20) -> dict:
    """Median ms of a small matmul ([40, 512] x [512, 512]) with 1 and with `threads` torch threads.
    Far apart means the CPU is oversubscribed: torch's threads wait for each other at every op,
    which inflates every absolute time in the report (the ratios were measured under the same load)."""
    x, w = torch.randn(40, 512), torch.randn(512, 512)
    out = {}
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x @ w
            times.append((time.perf_counter() - t0) * 1000)
        out[f"matmul_ms_{n}_threads"] = round(sorted(times)[repeats // 2], 3)
    torch.set_num_threads(threads)
    return out


def _family_meta(bench: Bench) -> dict:
    """Which family and preset ran (the preset: None for a checkpoint the benchmark did not build)
    and, where the images vary in size (the Qwens, LLaVA-OneVision, Idefics3), the sizes used and each
    one's image tokens."""
    out = {"family": family_name(bench.family), "model_type": bench.family, "preset": built_preset(bench.model_dir)}
    sizes = bench.images.sizes
    if sizes_vary(bench.family) and sizes:
        out["image_sizes"] = [list(s) for s in sizes]
        out["tokens_per_image"] = tokens_per_image(bench.model_dir, bench.images, len(sizes))
    return out


def _meta(params: BenchParams, model_dir: Path) -> dict:
    return {"params": params.to_json(), "model_dir": str(model_dir), "torch_threads": params.torch_threads,
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            **device_meta(params.device, params.dtype), "random_weights": is_random_weights(model_dir),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": _loadavg()}


def device_meta(device: str, dtype: str) -> dict:
    """Where the run ran: the device, its name (the GPU's, or the CPU model), the dtype, and the
    CUDA version torch was built with (None for a CPU build)."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
    return {"device": device, "device_name": name, "dtype": dtype, "cuda": torch.version.cuda}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"

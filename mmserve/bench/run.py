"""Running the benchmark: the model, the scenarios in order under a progress bar, the report."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import torch
import transformers
import trio
from tqdm import tqdm

from mmserve.bench.context import Bench
from mmserve.bench.params import BenchParams
from mmserve.bench.report import write_reports
from mmserve.bench.scenarios import SCENARIOS
from mmserve.logs import configure_logging


def ensure_model(model_dir: Path, preset: str) -> Path:
    """The random-weight checkpoint of `preset` in `model_dir`, built there unless already present."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists() or not (model_dir / "model.safetensors").exists():
        from mmserve.models.demo import build_untrained

        build_untrained(preset, model_dir)
    return model_dir


def run_bench(out: str | Path, params: BenchParams, model_dir: str | Path | None = None,
              progress: bool = True) -> dict:
    """Runs `params.scenarios` and writes report.json / report.md / report.png into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    configure_logging("json", "warning")  # keep the progress bar readable
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(params.torch_threads)
    model_dir = Path(model_dir) if model_dir else ensure_model(out / f"{params.preset}-model", params.preset)
    meta = _meta(params, model_dir)
    start = time.perf_counter()
    with tqdm(total=len(params.scenarios), desc="bench", unit="scenario", disable=not progress) as bar:
        results = trio.run(_run_scenarios, params, model_dir, out, bar)
    meta.update(duration_s=time.perf_counter() - start, loadavg_end=_loadavg())
    summary = [r for res in results.values() for r in res.pop("rows", [])]
    report = {"meta": meta, "summary": summary, "scenarios": results}
    report["paths"] = {k: str(v) for k, v in write_reports(report, out).items()}
    return report


async def _run_scenarios(params: BenchParams, model_dir: Path, out: Path, bar: tqdm) -> dict:
    results = {}
    bench = Bench(params, model_dir, out, note=bar.set_postfix_str)
    for name in params.scenarios:
        bar.set_description(name)
        results[name] = await _run_one(name, bench)
        bar.update(1)
    return results


async def _run_one(name: str, bench: Bench) -> dict:
    """One scenario; a failure is recorded in the report rather than ending the run."""
    t0 = time.perf_counter()
    try:
        result = await SCENARIOS[name](bench)
        result.setdefault("status", "ok")
    except Exception as e:
        traceback.print_exc()
        result = {"status": "error", "error": f"{type(e).__name__}: {e}",
                  "rows": [{"scenario": name, "metric": "error", "value": f"{type(e).__name__}: {e}", "unit": "",
                            "baseline": None, "ratio": None, "target": None, "ok": False}]}
    result["duration_s"] = time.perf_counter() - t0
    return result


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _meta(params: BenchParams, model_dir: Path) -> dict:
    return {"params": params.to_json(), "model_dir": str(model_dir), "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": _loadavg()}

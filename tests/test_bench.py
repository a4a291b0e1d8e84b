"""`mmserve bench`: the whole machinery on the tiny preset with the `test` parameter set (seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

from mmserve.bench import PARAMS, run_bench
from mmserve.bench import peer as peer_lib
from mmserve.bench.model import MARKER, ensure_model
from mmserve.bench.params import ALL_SCENARIOS
from mmserve.bench.servers import bench_config, config_toml
from mmserve.cli import build_parser
from mmserve.config import load_config


def test_bench_writes_reports_with_expected_keys(tmp_path, monkeypatch):
    # the peer as if not installed (tests/test_bench_peer.py runs it): seconds, whatever is installed
    monkeypatch.setattr(peer_lib, "unavailable", lambda: "not installed (test)")
    params = PARAMS["test"]
    report = run_bench(tmp_path, params, progress=False)  # builds the tiny model into tmp_path/tiny-model

    assert (tmp_path / "tiny-model" / MARKER).exists()
    data = json.loads((tmp_path / "report.json").read_text())
    assert set(data) >= {"meta", "summary", "scenarios"}
    assert data["meta"]["params"]["name"] == "test" and data["meta"]["torch_threads"] == params.torch_threads
    sc = data["scenarios"]
    assert list(sc) == list(ALL_SCENARIOS)
    assert {name: r["status"] for name, r in sc.items()} == {**{n: "ok" for n in ALL_SCENARIOS}, "peer": "skipped"}

    assert set(sc["decode"]["decode_tps"]) == {"embedded", "http", "hf"}
    assert all(r["completion_tokens"] == params.decode_tokens for runs in sc["decode"]["runs"].values() for r in runs)
    levels = sc["concurrency"]["levels"]
    assert [lv["concurrency"] for lv in levels] == list(params.levels)
    assert {"agg_tps", "ttft_p50_s", "ttft_p99_s", "hf", "ratio_agg_tps"} <= set(levels[0])
    assert levels[-1]["health"]["polls"] >= 1 and levels[-1]["health"]["non_200"] == 0
    top = max(params.levels)  # batched HF and the embedded run with KV sampling: the top level only
    assert [lv["concurrency"] for lv in levels if "hf_batched" in lv] == [top]
    batched = levels[-1]["hf_batched"]
    assert batched["batch"] == top and batched["new_tokens"] == params.sweep_tokens
    assert batched["agg_tps"] > 0 and levels[-1]["ratio_agg_tps_batched"] > 0
    embedded = sc["concurrency"]["embedded"]
    assert embedded["concurrency"] == top and embedded["ratio_agg_tps_batched"] > 0
    kv = embedded["kv"]
    assert kv["samples"] >= 1 and kv["block_bytes"] > 0 and kv["block_size"] > 0
    peak = kv["at_peak"]
    assert peak["referenced_blocks"] >= 1 and 0 < peak["held_tokens"] <= peak["referenced_blocks"] * kv["block_size"]
    assert peak["bytes_in_use"] == peak["referenced_blocks"] * kv["block_bytes"] and peak["ratio"] >= 1
    kept = sc["concurrency"]["retention"]  # RSS over requests once both caches are full
    assert kept["caches_full"] and kept["requests"] == params.retention_requests
    assert len(kept["samples"]) == params.retention_samples + 1 and kept["rss_end_mib"] > 0
    turns = sc["multiturn"]["turns"]
    assert len(turns) == params.turns
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] > 0 for t in turns[1:])
    assert {"ratio_on_off", "ratio_hit_vs_suffix_prefill", "prefill_suffix_s"} <= set(turns[-1])
    assert set(sc["same_image"]["summary"]) == {"encoder_cache_on", "encoder_cache_off"}
    assert all(sc["three_images"]["outputs_equal"]) and sc["three_images"]["no_cross_image_hits"]
    assert sc["peer"]["reason"] == "not installed (test)"

    metrics = {(r["scenario"], r["metric"]) for r in data["summary"]}
    assert any(s == "3 multi-turn" and "on / off" in m for s, m in metrics)
    conc = [r["metric"] for r in data["summary"] if r["scenario"] == "2 concurrency"]
    for metric in (f"aggregate tok/s @{top} vs batched HF", f"TTFT p99 / TTFT p50 @{top}",
                   f"aggregate tok/s @{top}, embedded vs batched HF", f"KV bytes in use / bytes of tokens held @{top}",
                   "RSS growth per 1,000 requests, caches full"):
        assert any(m.startswith(metric) for m in conc), metric
    targets = {(r["scenario"], r["metric"].split(": ")[-1].split("(")[0]): r["target"] for r in data["summary"]}
    assert targets[("1 decode", "decode tok/s, embedded")] == targets[("1 decode", "decode tok/s, http")] == "≥ 1.0"
    assert targets[("3 multi-turn", "TTFT")] == "≤ 1.05"  # TTFT(hit) / prefill(suffix), turns >= 3
    assert report["paths"]["md"] == str(tmp_path / "report.md")
    md = (tmp_path / "report.md").read_text()
    assert "| scenario | metric | mmserve | baseline | ratio | target | ok |" in md
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_model_is_reused(tmp_path):
    path = ensure_model(tmp_path / "m", "tiny")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(tmp_path / "m", "tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_server_config_round_trips_through_toml(tmp_path):
    config = bench_config(tmp_path, threads=2, prefix=False, encoder=True)
    (tmp_path / "c.toml").write_text(config_toml(config))
    assert load_config(tmp_path / "c.toml") == config


def test_cli_bench_arguments():
    args = build_parser().parse_args(["bench", "--quick"])
    assert args.quick and args.out == "bench-out" and args.model_dir is None
    assert args.func.__name__ == "_bench"


ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter: what it imports is not what this test run imported before."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_serving_never_imports_the_bench_extra(tmp_path):
    """`mmserve serve`, the server and the runtime (and the CLI's parser, `bench --scenarios`
    included) import no part of the `bench` extra. tqdm itself is loaded anyway, by torch.hub and
    huggingface_hub (a dependency of transformers); what counts is that no mmserve module imports it."""
    proc = _python("""
        import builtins, json, sys
        real, importers = builtins.__import__, []

        def spy(name, globals=None, locals=None, fromlist=(), level=0):
            if level == 0 and name.split(".")[0] in ("matplotlib", "tqdm", "httpx"):
                importers.append(((globals or {}).get("__name__") or "?", name))
            return real(name, globals, locals, fromlist, level)

        builtins.__import__ = spy
        import mmserve, mmserve.cli, mmserve.api.server, mmserve.runtime
        mmserve.cli.build_parser().parse_args(["bench", "--quick", "--scenarios", "decode,peer"])
        mmserve.cli.build_parser().parse_args(["serve", "--model", "demo"])
        print(json.dumps({"matplotlib": "matplotlib" in sys.modules,
                          "mmserve_importers": sorted({f"{w} -> {n}" for w, n in importers if w.startswith("mmserve")})}))
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"matplotlib": False, "mmserve_importers": []}


def test_bench_without_its_extra_is_one_line(tmp_path):
    proc = _python("""
        import sys
        sys.modules["matplotlib"] = None  # as if not installed: find_spec() finds nothing, import fails
        import mmserve.cli  # without touching matplotlib (it would raise here)

        sys.modules["tqdm"] = None  # loaded by torch and transformers already; hidden from now on
        sys.exit(mmserve.cli.main(["bench", "--quick"]))
    """, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "mmserve bench: needs the bench extra (matplotlib, tqdm, httpx; missing: matplotlib, tqdm): "
        "pip install -e '.[bench]'"]
    assert not (tmp_path / "bench-out").exists()  # stopped before building or running anything


def test_a_failed_retention_run_keeps_the_sweeps_figures(tmp_path):
    """The H200 run of 2026-11-28: the retention run's arena held less than one request, its first
    request was refused, and the whole concurrency scenario (the sweep's figures included) was lost.
    Now that measurement fails on its own row."""
    params = replace(PARAMS["test"], scenarios=("concurrency",), levels=(1,), retention_kv_budget_bytes=4096)
    run_bench(tmp_path, params, progress=False)
    data = json.loads((tmp_path / "report.json").read_text())
    sc = data["scenarios"]["concurrency"]
    assert sc["status"] == "ok" and [lv["concurrency"] for lv in sc["levels"]] == [1]
    assert "BadRequest" in sc["retention"]["error"] and "KV arena holds" in sc["retention"]["error"]
    failed = [r for r in data["summary"] if r["ok"] is False]
    assert [r["metric"] for r in failed] == ["RSS growth per 1,000 requests, caches full: error"]

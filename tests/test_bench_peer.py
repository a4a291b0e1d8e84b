"""Scenario 6, the peer `transformers serve`: skipped cleanly when it is not installed, an error row
(never a crash, never a leftover process) when it fails, and for real (slow) when installed."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import textwrap

import pytest
import trio

from mmserve.bench import PARAMS, run_bench
from mmserve.bench import peer as peer_lib
from mmserve.bench.context import Bench
from mmserve.bench.scenarios import peer
from mmserve.cli import build_parser


def _bench(tmp_path, model_dir=None) -> Bench:
    return Bench(PARAMS["test"], model_dir or tmp_path / "no-model", tmp_path, note=lambda _: None)


async def test_peer_skips_when_not_installed(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    reason = peer_lib.unavailable()
    assert "fastapi" in reason and ".[bench]" in reason

    result = await peer(_bench(tmp_path))
    assert result["status"] == "skipped" and result["reason"] == reason
    assert [r["scenario"] for r in result["rows"]] == ["6 peer"] and "skipped" in result["rows"][0]["value"]


def _fake_peer(monkeypatch, tmp_path, script: str) -> None:
    path = tmp_path / "fake_peer.py"
    path.write_text(textwrap.dedent(script))
    monkeypatch.setattr(peer_lib, "command", lambda model_dir: [sys.executable, str(path), str(tmp_path)])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is dead (orphans wait for init)
    except FileNotFoundError:
        return True


async def test_peer_that_exits_is_an_error_with_its_output(tmp_path, monkeypatch):
    _fake_peer(monkeypatch, tmp_path, """
        import sys
        print("Traceback: OSError: no checkpoint here", file=sys.stderr)
        sys.exit(3)
    """)
    with pytest.raises(peer_lib.PeerError) as err:
        async with peer_lib.serve(tmp_path, 1, tmp_path):
            pass
    assert "exited with code 3" in str(err.value) and "no checkpoint here" in err.value.log_tail


async def test_peer_that_never_listens_is_stopped_with_its_children(tmp_path, monkeypatch):
    _fake_peer(monkeypatch, tmp_path, """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(os.path.join(sys.argv[1], "pids"), "w").write(f"{os.getpid()} {child.pid}")
        print("loading...", flush=True)
        time.sleep(60)
    """)
    monkeypatch.setattr(peer_lib, "START_TIMEOUT_S", 2)
    with pytest.raises(peer_lib.PeerError, match="not ready after 2 s") as err:
        async with peer_lib.serve(tmp_path, 1, tmp_path):
            pass
    assert "loading..." in err.value.log_tail
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    with trio.fail_after(5):
        while not all(_gone(p) for p in pids):
            await trio.sleep(0.05)


async def test_peer_failure_is_a_row_not_a_crash(tmp_path, monkeypatch, tiny_model_dir):
    _fake_peer(monkeypatch, tmp_path, """
        import sys
        print("boom: the peer cannot start", file=sys.stderr)
        sys.exit(1)
    """)
    monkeypatch.setattr(peer_lib, "unavailable", lambda: None)
    result = await peer(_bench(tmp_path, tiny_model_dir))
    assert result["status"] == "error" and "exited with code 1" in result["error"]
    assert "boom" in result["peer_log_tail"]
    failed = [r for r in result["rows"] if r["metric"] == "transformers serve failed"]
    assert len(failed) == 1 and failed[0]["ok"] is False and "boom" in failed[0]["baseline"]


def test_cli_bench_scenarios():
    args = build_parser().parse_args(["bench", "--quick", "--scenarios", "peer, decode"])
    assert args.scenarios == ("decode", "peer")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--scenarios", "decode,nope"])


@pytest.mark.slow
@pytest.mark.skipif(peer_lib.unavailable() is not None, reason=str(peer_lib.unavailable()))
def test_peer_for_real_on_the_tiny_preset(tmp_path):
    """`transformers serve` started, measured and stopped (about 10 s)."""
    params = dataclasses.replace(PARAMS["test"], scenarios=("peer",))
    report = run_bench(tmp_path, params, progress=False)
    sc = report["scenarios"]["peer"]
    assert sc["status"] == "ok", sc.get("error")
    assert sc["peer_tokens"]["fixed_length"] and sc["peer_tokens"]["requests"] == 1 + params.decode_repeats + sum(params.levels)
    assert sc["prompt_tokens"]["mmserve"] == sc["prompt_tokens"]["peer"] and sc["same_text"]
    assert [lv["concurrency"] for lv in sc["levels"]] == list(params.levels)
    assert all(lv["peer"]["agg_tps"] > 0 and lv["mmserve"]["agg_tps"] > 0 for lv in sc["levels"])
    metrics = [r["metric"] for r in report["summary"]]
    assert any(m.startswith("aggregate tok/s @2: mmserve / transformers serve") for m in metrics)
    assert "transformers serve" in (tmp_path / "report.md").read_text()
    log = (tmp_path / peer_lib.LOG).read_text()
    assert "Uvicorn running" in log
    assert _gone(int(re.search(r"Started server process \[(\d+)\]", log).group(1)))

"""One OpenMP team in a serving process (`mmserve.actors.compute`): every OS thread that runs a
parallel torch op gets a team of its own, and once the process holds more OpenMP threads than
CPUs, libgomp stops spin-waiting and every later op of every step pays a futex wake-up.
Deterministic mode packs its weights for oneDNN while the model's actors are built on the event
loop; done with the event loop's torch threads, that started a second team, and the mode's decode
on the 2-core bench took 20.8 ms a token where the default's took 15.4 (its linear layers ran at
one thread's speed). Counted in fresh processes: the OS threads not started by Python (OpenMP's
workers among them) after a load and a request are as many in deterministic mode as in the default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys, threading
from mmserve import SyncRuntime
from mmserve.config import DEMO_CHECKPOINTS, Config, ModelConfig
config = Config(models=(ModelConfig("demo", str(DEMO_CHECKPOINTS / "demo"), default=True),)).replace(
    runtime={"device": "cpu", "torch_threads": 2, "deterministic": sys.argv[1] == "deterministic"})
with SyncRuntime(config) as rt:
    rt.chat_completion([{"role": "user", "content": "hi"}], max_tokens=2)
    python = {t.native_id for t in threading.enumerate()}
    print(sum(int(tid) not in python for tid in os.listdir("/proc/self/task")))
"""


def native_threads(mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts threads in /proc; one CPU gives the event loop no team to start")
def test_deterministic_mode_starts_no_openmp_team_of_its_own():
    runs = {mode: native_threads(mode) for mode in ("default", "deterministic")}  # side by side: seconds
    counts = {}
    for mode, run in runs.items():
        out, err = run.communicate(timeout=180)
        assert run.returncode == 0, err[-2000:]
        counts[mode] = int(out.split()[-1])
    assert counts["deterministic"] == counts["default"], counts

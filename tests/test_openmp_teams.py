"""The compute thread's torch threads (`mmserve.actors.compute`): its own count, and one OpenMP
team in a serving process. Every OS thread that runs a parallel torch op gets a team of its own,
and once the process holds more OpenMP threads than CPUs, libgomp stops spin-waiting and every
later op of every step pays a futex wake-up. Deterministic mode packs its weights for oneDNN while
the model's actors are built on the event loop; done with the event loop's torch threads, that
started a second team, and the mode's decode on the 2-core bench took 20.8 ms a token where the
default's took 15.4 (its linear layers ran at one thread's speed). Counted in fresh processes: the
OS threads not started by Python (OpenMP's workers among them) after a load and a request are as
many in deterministic mode as in the default."""

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


def torch_default_env() -> dict:
    """This environment without the suite's OMP_NUM_THREADS (tests/conftest.py): torch's own default."""
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def native_threads(mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=torch_default_env())


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


THREADS_PROBE = """
import sys, threading, torch, trio
from mmserve.actors import compute
default = torch.get_num_threads()
if sys.argv[1] == "runtime":  # the shipped config: [runtime] torch_threads = 0
    from mmserve import SyncRuntime
    from mmserve.config import DEMO_CHECKPOINTS, Config, ModelConfig
    config = Config(models=(ModelConfig("demo", str(DEMO_CHECKPOINTS / "demo"), default=True),)).replace(
        runtime={"device": "cpu"})
    with SyncRuntime(config) as rt:
        rt.chat_completion([{"role": "user", "content": "hi"}], max_tokens=2)
        print(default, trio.run(compute.run, torch.get_num_threads))
else:  # another thread sets torch's process-wide count between the compute thread's start and its first op
    compute.configure(2)
    trio.run(compute.run, lambda: None)  # the thread started, its count set
    other = threading.Thread(target=torch.set_num_threads, args=(1,))
    other.start(), other.join()
    print(2, trio.run(compute.run, torch.get_num_threads))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: every count is 1")
@pytest.mark.parametrize("case", ["runtime", "set elsewhere"])
def test_the_compute_thread_keeps_its_torch_threads(case):
    """torch gives a thread its count at its first parallel op, from a process-wide value other
    threads overwrite (the loader and the encoder set 1): the default config served every step on
    one thread of two. The compute thread's count is its own: torch's default with `torch_threads =
    0`, the configured one otherwise, whatever other threads set."""
    out = subprocess.run([sys.executable, "-c", THREADS_PROBE, case], capture_output=True, text=True, timeout=180,
                         env=torch_default_env())
    assert out.returncode == 0, out.stderr[-2000:]
    want, got = out.stdout.split()[-2:]
    assert got == want and int(want) >= 2

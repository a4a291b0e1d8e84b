"""No process outlives what started it: the benchmark and the tests stop every `redis-server` and
every server process they start — after a normal run, after an exception, on cancellation, on
KeyboardInterrupt and on SIGTERM — and (Linux) a child dies with a parent that was SIGKILLed."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from mmserve.bench import PARAMS, run_bench
from mmserve.bench import peer as peer_lib
from mmserve.bench.context import Bench
from mmserve.bench.model import ensure_model
from mmserve.bench.servers import bench_config, http_server
from tests.redis_server import RedisServer

pytestmark = [
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (make redis-server)"),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="walks /proc (Linux)"),
]

ROOT = Path(__file__).resolve().parent.parent
replicas_mod = importlib.import_module("mmserve.bench.scenarios.replicas")  # the package re-exports its function
REPLICAS = replace(PARAMS["test"], scenarios=("replicas",))  # the smallest: tiny model, servers in this trio run


# -- the process table --------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, str, int, str] | None:
    """(ppid, state, start time in clock ticks after boot, comm) of a live (or zombie) process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()  # from field 3 (state) on
    return int(fields[1]), fields[0], int(fields[19]), comm


def _table() -> dict[int, tuple[int, str, int, str]]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            table[int(entry)] = st
    return table


def descendants(root: int, table: dict | None = None) -> set[int]:
    """Every process whose parent chain leads to `root` (zombies included: a child nobody waited for)."""
    table = _table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def _describe(pid: int, table: dict) -> str:
    ppid, state, _, comm = table[pid]
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return f"pid {pid} ({comm}, state {state}, parent {ppid}, cwd {_cwd(pid) or '?'}): {cmd or comm}"


class Processes:
    """A snapshot taken when a test starts; `left()` lists what that test left behind: new
    descendants of this process, and live `redis-server`s started since whose working directory
    (Redis runs in its --dir) lies under the test's directory, whoever their parent now is (pid 1
    for an orphan). Other people's redis-servers on a shared machine are not ours to count."""

    def __init__(self, under: Path):
        self.under = str(Path(under).resolve())
        self.table = _table()
        self.before = descendants(os.getpid(), self.table)
        self.since = max((st[2] for st in self.table.values()), default=0)  # ticks: no later than now

    def left(self) -> list[str]:
        table = _table()
        ours = descendants(os.getpid(), table) - self.before
        orphans = {pid for pid, (_, state, start, comm) in table.items()
                   if comm == "redis-server" and state != "Z" and start >= self.since and pid not in ours
                   and _cwd(pid).startswith(self.under)}
        return [_describe(pid, table) for pid in sorted(ours | orphans)]


def _redis_children() -> list[int]:
    table = _table()
    return [pid for pid in descendants(os.getpid(), table) if table[pid][3] == "redis-server" and table[pid][1] != "Z"]


@pytest.fixture
def processes(tmp_path):
    return Processes(tmp_path)


# -- the replicas scenario ----------------------------------------------------------------------------

def test_replicas_scenario_leaves_no_process(tmp_path, processes, monkeypatch):
    monkeypatch.setattr(peer_lib, "unavailable", lambda: "not installed (test)")
    report = run_bench(tmp_path, REPLICAS, progress=False)
    assert report["scenarios"]["replicas"]["status"] == "ok", report["scenarios"]["replicas"]
    assert report["scenarios"]["replicas"]["redis_keys"] > 0  # the tier was used
    assert processes.left() == []


def _fail_once_redis_runs(exc: BaseException):
    """A stand-in for the scenario's conversations: checks that Redis is up (a child of this
    process, answering), then raises `exc`."""

    async def conversations(b, servers, tag):
        assert len(_redis_children()) == 1, _redis_children()
        raise exc

    return conversations


def test_a_failure_mid_scenario_still_stops_redis(tmp_path, processes, monkeypatch):
    monkeypatch.setattr(replicas_mod, "_conversations", _fail_once_redis_runs(RuntimeError("injected")))
    report = run_bench(tmp_path, REPLICAS, progress=False)
    result = report["scenarios"]["replicas"]
    assert result["status"] == "error" and "injected" in result["error"], result
    assert processes.left() == []


def test_keyboard_interrupt_mid_scenario_still_stops_redis(tmp_path, processes, monkeypatch):
    monkeypatch.setattr(replicas_mod, "_conversations", _fail_once_redis_runs(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        run_bench(tmp_path, REPLICAS, progress=False)
    assert processes.left() == []


def test_cancellation_mid_scenario_still_stops_redis(tmp_path, processes, monkeypatch):
    started = trio.Event()

    async def conversations(b, servers, tag):
        assert len(_redis_children()) == 1
        started.set()
        await trio.sleep_forever()

    monkeypatch.setattr(replicas_mod, "_conversations", conversations)
    bench = Bench(REPLICAS, ensure_model(tmp_path / "model", "tiny"), tmp_path, note=lambda _: None)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(replicas_mod.replicas, bench)
            await started.wait()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert processes.left() == []


# -- the server process -------------------------------------------------------------------------------

def test_a_cancelled_server_process_is_stopped_and_reaped(tmp_path, processes):
    """`mmserve serve` in its own process (as `mmserve bench` runs it), cancelled while serving:
    stopped and waited for before the cancellation goes on."""
    model = ensure_model(tmp_path / "model", "tiny")
    config = bench_config(model, threads=1, prefix=False, encoder=False)

    async def main():
        with trio.CancelScope() as scope:
            async with http_server(config, "subprocess", tmp_path / "server"):
                assert descendants(os.getpid()) - processes.before  # it runs
                scope.cancel()
                await trio.sleep_forever()

    trio.run(main)
    assert processes.left() == []


# -- RedisServer: one owner, started once ------------------------------------------------------------

def test_redis_server_starts_once_and_restarts_after_a_kill(tmp_path, processes):
    server = RedisServer(tmp_path / "redis")
    try:
        server.start()
        with pytest.raises(RuntimeError, match="already running"):
            server.start()
        with pytest.raises(RuntimeError, match="already running"):
            server.__enter__()  # `with server:` on a started server: an error, not a second process
        assert len(_redis_children()) == 1
        server.kill()
        assert _redis_children() == []
        server.start()  # a restart on the same port (the shared-tier tests do this)
        assert server.client().ping() and len(_redis_children()) == 1
    finally:
        server.kill()
    assert processes.left() == []


def test_redis_server_is_not_fooled_by_another_server_on_its_port(tmp_path, processes):
    """The leak's cause: a second start on a taken port pinged the first server and called itself
    ready. Readiness is now the answer of *this* process (its pid in INFO), or an error."""
    with RedisServer(tmp_path / "a") as first:
        second = RedisServer(tmp_path / "b", first.port)
        with pytest.raises(RuntimeError, match="did not start"):
            second.start()
        assert second.proc is None and len(_redis_children()) == 1
    assert processes.left() == []


def test_redis_server_on_a_port_held_by_something_else_fails_cleanly(tmp_path, processes):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        server = RedisServer(tmp_path / "redis", s.getsockname()[1])
        with pytest.raises(RuntimeError, match="did not start"):
            server.start()
    assert server.proc is None and processes.left() == []


# -- a benchmark stopped from outside (fresh interpreters) ---------------------------------------------

_BENCH = """
    import sys
    from dataclasses import replace
    from pathlib import Path

    import importlib
    from mmserve.bench import PARAMS, run_bench

    replicas = importlib.import_module("mmserve.bench.scenarios.replicas")

    async def conversations(b, servers, tag):
        print("REDIS UP", flush=True)  # the parent signals this process now
        import trio
        await trio.sleep_forever()

    replicas._conversations = conversations
    run_bench(Path(sys.argv[1]), replace(PARAMS["test"], scenarios=("replicas",)), progress=False)
"""


def _bench_until_redis_is_up(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_BENCH), str(out)], cwd=out.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    if line.strip() != "REDIS UP":
        proc.kill()
        _, err = proc.communicate(timeout=30)
        raise AssertionError(f"the benchmark did not reach the replicas scenario: {line!r}\n{err[-3000:]}")
    return proc


def _redis_under(path: Path) -> list[int]:
    table = _table()
    return [pid for pid, (_, state, _, comm) in table.items()
            if comm == "redis-server" and state != "Z" and _cwd(pid).startswith(str(path.resolve()))]


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while [p for p in pids if (st := _stat(p)) is not None and st[1] != "Z"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_sigterm_stops_the_benchmark_and_its_redis(tmp_path, processes):
    out = tmp_path / "out"
    proc = _bench_until_redis_is_up(out)
    try:
        redis = _redis_under(out)
        assert len(redis) == 1, redis
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert _redis_under(out) == [] and _gone(redis, 0)  # stopped before the benchmark exited
    finally:
        proc.kill()
        proc.wait()
    assert processes.left() == []


@pytest.mark.slow  # ~10 s: a fresh interpreter runs the benchmark up to Redis
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_redis_dies_with_a_benchmark_that_was_killed(tmp_path, processes):
    out = tmp_path / "out"
    proc = _bench_until_redis_is_up(out)
    try:
        redis = _redis_under(out)
        assert len(redis) == 1, redis
        proc.kill()  # SIGKILL: no finally runs; the kernel signals the children (PR_SET_PDEATHSIG)
        proc.communicate(timeout=30)
        assert _gone(redis, 10), [_describe(p, _table()) for p in redis if p in _table()]
    finally:
        proc.kill()
        proc.wait()
    assert processes.left() == []

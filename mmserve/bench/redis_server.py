"""A real `redis-server` for the shared-tier tests and the replicas benchmark: started on a free loopback port in a temporary directory, with
no persistence; it can be killed and started again on the same port (a restart mid-run).

One `RedisServer` owns one process: `start()` while it runs is an error (never a second process
that cannot bind, while the first one answers), readiness is the answer of *this* process (its pid
in `INFO`), a failed start stops what it started, and `kill()` stops and reaps it. Use it as a
context manager — `with` (tests) or `async with` (trio: the readiness poll runs in a worker thread)
— so it is stopped on every way out; it also dies with a parent that was SIGKILLed (Linux, when
started from the main thread: see `mmserve.bench.processes.die_with_parent`)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
import trio
from redis.backoff import NoBackoff
from redis.retry import Retry

from mmserve.bench.processes import die_with_parent, stop_now

START_TIMEOUT_S = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, directory: Path, port: int | None = None, *extra: str):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (`make test` installs it: apt-get install -y redis-server)")
        self.binary, self.dir, self.port, self.extra = binary, Path(directory), port or free_port(), extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "RedisServer":
        """Starts the process and waits until it answers (blocking: from trio, `async with` or
        `await astart()`)."""
        self._spawn()
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    async def astart(self) -> "RedisServer":
        """`start()` for trio: the fork here (the event loop's thread, so `die_with_parent` holds),
        the readiness poll in a worker thread; on cancellation the process is stopped."""
        self._spawn()
        try:
            await trio.to_thread.run_sync(self._wait_ready)
        except BaseException:
            self.kill()
            raise
        return self

    def _spawn(self) -> None:
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running (pid {self.proc.pid}): "
                               "one RedisServer starts one process; kill() it before starting it again")
        if self.proc is not None:  # exited by itself (or was killed from outside): reap it
            self.proc.wait()
            self.proc = None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "no", "--protected-mode", "no", *self.extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGKILL))

    def _wait_ready(self) -> None:
        # synchronous by design: tests call it directly, the benchmark from a worker thread
        # (astart), so no event loop is ever blocked by this readiness poll
        proc, deadline = self.proc, time.monotonic() + START_TIMEOUT_S
        # one try per poll (redis-py's default retries would spend ~10 s on a port that never answers)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5,
                             retry=Retry(NoBackoff(), 0))
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}: it exited with "
                                       f"{proc.returncode} (is the port taken?)")
                try:
                    pid = int(client.info("server")["process_id"])
                except (redis.ConnectionError, redis.TimeoutError):
                    pid = None
                if pid == proc.pid:
                    return
                if pid is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}: another redis-server "
                                       f"(pid {pid}) answers there")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port} in {START_TIMEOUT_S} s")
                time.sleep(0.02)
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def kill(self) -> None:
        """Stops the process (SIGKILL: nothing is persisted) and waits for it; idempotent."""
        if self.proc is not None:
            stop_now(self.proc)
            self.proc = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()

    async def __aenter__(self) -> "RedisServer":
        return await self.astart()

    async def __aexit__(self, *exc) -> None:
        self.kill()

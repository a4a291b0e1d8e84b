"""Shared test helpers: images as data URLs, messages, and a real server on a real socket."""

from __future__ import annotations

import base64
import io
import threading
import time

import trio
import trio.testing

from mmserve.actors.messages import StepFence
from mmserve.api.server import serve
from mmserve.models.demo import Q_COLOR, render_image
from mmserve.config import Config


def data_url(img, fmt: str = "PNG", **save) -> str:
    buf = io.BytesIO()
    img.save(buf, fmt, **save)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(img, fmt: str = "PNG") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(img, fmt)}}


def run_concurrently(target, args_list, timeout: float = 120) -> int:
    """Calls target(*args) for every args of `args_list`, each in a thread of its own, at the same
    time; returns how many are still running after `timeout` seconds in all (a hang costs the
    suite that much once, not once per thread)."""
    threads = [threading.Thread(target=target, args=args, daemon=True) for args in args_list]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    return sum(t.is_alive() for t in threads)


async def assert_nothing_held(rt) -> None:
    """Once the runtime is idle, no loaded model holds anything for a request: no sequence in the
    generator, no encoder job or pin, no KV block held, no waiter or in-flight registration, and
    the KV arena's invariants hold."""
    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    for name, model in rt.registry.loaded.items():
        assert not model.generator.running and not model.generator.in_flight, name
        assert not model.encoder.in_flight and model.encoder.stats().get("pinned_entries", 0) == 0, name  # none: cache off
        model.prefix_cache.arena.check_invariants()
        # a step abandoned by a restart that still runs holds its blocks (quarantine) until it returns
        manager = model.prefix_cache
        fences = {o for o in manager.arena.owners() if isinstance(o, StepFence)}
        assert fences == {StepFence(step) for step in manager.quarantine.steps}, (name, fences, manager.quarantine.steps)
        assert not manager.arena.owners() - fences, (name, manager.arena.owners())
        inflight = model.prefix_cache.inflight
        assert len(inflight) == 0 and inflight.registered_blocks == 0, name


def ask(img, question: str = Q_COLOR) -> list[dict]:
    return [{"role": "user", "content": [image_part(img), {"type": "text", "text": question}]}]


def colour_question(color: str, shape: str = "circle", seed: int = 0) -> list[dict]:
    return ask(render_image(color, shape, seed=seed))


class ServerThread:
    """`mmserve.api.server.serve` on 127.0.0.1, port 0, in a background thread with its own trio loop."""

    def __init__(self, config: Config):
        self.config = config.replace(server={"host": "127.0.0.1", "port": 0})
        self.url: str | None = None
        self.runtime = None
        self._token = None
        self._shutdown: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:
            self._error = e
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(lambda task_status: serve(
                self.config, shutdown=self._shutdown, on_runtime=self._set_runtime, task_status=task_status))
            self.url = binds[0]
            self._ready.set()

    def _set_runtime(self, rt) -> None:
        self.runtime = rt

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait(120)
        if self.url is None:
            raise RuntimeError(f"server did not start: {self._error!r}")
        return self

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._shutdown.set, trio_token=self._token)
        self._thread.join(30)

    def run_sync(self, fn, *args):
        """Runs `fn` inside the server's trio thread (to inspect the runtime safely)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)


# -- waiting on conditions, not clocks ---------------------------------------------------------------


async def wait_until(predicate, timeout: float = 5.0, interval: float = 0.005, what: str = "") -> None:
    """Waits until `predicate()` holds. For state the code under test offers no event for: polls it
    (a short sleep per round keeps the loop free), bounded by `timeout` seconds — the bound only
    turns a hang into a failure, it orders nothing. AssertionError naming `what` when it never holds."""
    try:
        with trio.fail_after(timeout):
            while not predicate():
                await trio.sleep(interval)
    except trio.TooSlowError:
        raise AssertionError(f"still not true after {timeout} s: {what or predicate}") from None


def wait_until_sync(predicate, timeout: float = 5.0, interval: float = 0.005, what: str = "") -> None:
    """`wait_until` for a test thread outside trio (e.g. watching a `ServerThread`)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"still not true after {timeout} s: {what or predicate}"
        time.sleep(interval)


def runtime_idle(rt) -> bool:
    """No request left anywhere in `rt` (call from its trio thread): intake holds none, and in every
    loaded model the encoder and generator hold none (nor does a step of its still in flight) and
    the prefix-cache manager is parked on an empty inbox (not inside a handler). A hung worker thread keeps its request held, so this turns
    true only once every injected hang has run out. (No event marks this moment: poll it.)"""
    def holds(actor) -> bool:
        return bool(actor.in_flight) or actor.inbox.statistics().current_buffer_used > 0

    if holds(rt.intake):
        return False
    for model in rt.registry.loaded.values():
        if holds(model.encoder) or holds(model.generator) or model.generator.running:
            return False
        if model.generator.overlap.flying:  # a step launched ahead still carries an ended sequence
            return False
        if model.prefix_cache is not None:
            inbox = model.prefix_cache.inbox.statistics()
            if inbox.current_buffer_used or not inbox.tasks_waiting_receive:
                return False
    return True

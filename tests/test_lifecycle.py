"""Lifecycle an operator can trust, on the embedded runtime: graceful drain, truthful health for
hung actors (per model), loads on their own clock, unloads that never strand a request, a restart
backoff that forgets old faults. The server-process side (signals) is in test_server_process.py."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import trio
import trio.testing

from mmserve import Runtime
from mmserve.errors import MMServeError, ServiceUnavailable
from mmserve.actors import faults
from mmserve.config import ModelConfig, SupervisorConfig
from mmserve.runtime.supervisor import Supervisor
from tests.helpers import assert_nothing_held, colour_question, wait_until

LONG = dict(temperature=0, max_tokens=400, min_tokens=400)


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    faults.configure(None)


async def _collect(stream) -> str:
    async with stream:
        return "".join([d.text async for d in stream])


async def test_drain_finishes_short_requests_and_cuts_the_rest(tiny_config):
    async with Runtime.open(tiny_config) as rt:
        results = {}

        async def run(name, params):
            try:
                results[name] = await _collect(rt.chat(colour_question("red"), **params))
            except MMServeError as e:
                results[name] = e

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "short", dict(temperature=0, max_tokens=3))
            # long enough that no machine finishes it within the grace (400 tokens of the tiny model
            # took < 0.5 s on a quiet machine), short enough to stay cheap once it is cut
            nursery.start_soon(run, "long", dict(temperature=0, max_tokens=3000, min_tokens=3000))
            await trio.testing.wait_all_tasks_blocked()  # both admitted
            nursery.start_soon(rt.drain, 1.0)
            await wait_until(lambda: rt.supervisor.draining, what="the drain began")
            health = rt.health()
            assert not health.ok and "draining" in health.reason
            with pytest.raises(ServiceUnavailable) as refused:
                rt.chat(colour_question("blue"), max_tokens=2)
            assert refused.value.retry_after_s >= 1
        assert isinstance(results["short"], str)
        cut = results["long"]
        assert isinstance(cut, ServiceUnavailable) and cut.code == "shutdown"
        assert rt.drained == {"in_flight_at_drain": 2, "finished_in_grace": 1, "cut": 1}
        await assert_nothing_held(rt)


async def test_leaving_the_runtime_block_drains(tiny_config):
    config = tiny_config.replace(server={"shutdown_grace_s": 0.3})
    outcome = {}
    async with trio.open_nursery() as nursery:
        async with Runtime.open(config) as rt:
            stream = rt.chat(colour_question("red"), **LONG)
            await stream.__anext__()

            async def read_on():
                try:
                    async for _ in stream:
                        pass
                except MMServeError as e:
                    outcome["error"] = e
            nursery.start_soon(read_on)
            t0 = time.monotonic()
    # a clock: leaving within the grace (0.3 s) plus a margin is the behaviour, not waiting for
    # the 400 tokens; the margin is generous (several times what stopping takes)
    assert outcome["error"].code == "shutdown" and time.monotonic() - t0 < 0.3 + 2


def _two_models(demo_config, eager: bool = False, **supervisor):
    # eager: both loaded at start (one model's health is ok only while it serves, as GET /health?model=)
    models = tuple(dataclasses.replace(m, load="eager") if eager else m for m in demo_config.models)
    return demo_config.replace(models=models,
                               supervisor={"stall_timeout_s": 0.5, "restart_backoff_s": 0.05, **supervisor})


async def test_a_hung_model_is_unhealthy_fast_and_the_other_model_serves_on(demo_config, monkeypatch):
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", "3")
    async with Runtime.open(_two_models(demo_config, eager=True)) as rt:
        faults.configure("generator.step=hang@2")  # demo's second decode step hangs
        msgs = colour_question("red")
        outcome = {}

        async def victim():
            try:
                await rt.chat_completion(msgs, model="demo", **LONG)
            except MMServeError as e:
                outcome["victim"] = e

        async with trio.open_nursery() as nursery:
            nursery.start_soon(victim)
            t0 = trio.current_time()
            # stall_timeout 0.5 s + the watchdog's reaction; no event marks it: health is polled
            await wait_until(lambda: not rt.health("demo").ok, timeout=2.5, what="demo unhealthy")
            detected = trio.current_time() - t0
            down = rt.health("demo")
            assert "generator[demo]" in down.reason and down.models["demo"] == "down"
            # requests routed to the sick model fail at once, with a hint when to come back
            t1 = time.monotonic()
            with pytest.raises(ServiceUnavailable) as fast:
                rt.chat(msgs, model="demo", max_tokens=2)
            # a clock: "at once" is the behaviour (rt.chat is synchronous, so only blocking on the
            # hung model could slow it; it takes microseconds, 0.1 s is generous)
            assert time.monotonic() - t1 < 0.1 and fast.value.retry_after_s >= 1
            # the other model: healthy throughout, and it answers (its queued step moved to a fresh thread)
            assert rt.health("demo-wide").ok
            other = await rt.chat_completion(colour_question("green"), model="demo-wide", temperature=0, max_tokens=4)
            assert "green" in other.text
        assert isinstance(outcome["victim"], ServiceUnavailable) and "stalled" in outcome["victim"].message
        assert detected < 2.0  # a clock: detection soon after stall_timeout (0.5 s) is the behaviour
        await wait_until(lambda: rt.health().ok, what="healthy again after the restart")
        assert rt.supervisor.states["generator[demo-wide]"].restarts == 0
        await assert_nothing_held(rt)


async def test_a_crash_of_one_models_actor_never_fails_the_other_model(demo_config):
    config = _two_models(demo_config, eager=True, restart_backoff_s=1.0)
    async with Runtime.open(config) as rt:
        faults.configure("generator.step=raise@2")
        with pytest.raises(ServiceUnavailable):
            await rt.chat_completion(colour_question("red"), model="demo", **LONG)
        assert not rt.health("demo").ok and not rt.health().ok  # demo restarts (backoff 1 s)
        assert rt.health("demo-wide").ok
        ok = await rt.chat_completion(colour_question("blue"), model="demo-wide", temperature=0, max_tokens=4)
        assert "blue" in ok.text


class _Crasher:
    """A fake actor whose run() records when it started and raises after `runs[i]` seconds (of
    trio's clock: the test below runs on an autojump MockClock, so these sleeps take no time)."""

    name = key = "crasher"

    key = "crasher"

    def __init__(self, runs):
        self.runs, self.starts, self.in_flight, self.last_progress = list(runs), [], {}, 0.0

    async def run(self):
        self.starts.append(trio.current_time())
        if not self.runs:
            await trio.sleep_forever()
        await trio.sleep(self.runs.pop(0))
        raise RuntimeError("boom")

    def progressed(self):
        self.last_progress = time.monotonic()

    def has_work(self):
        return False

    def fail_in_flight(self, error):
        return 0


async def test_the_restart_backoff_resets_after_a_healthy_run(autojump_clock):
    supervisor = Supervisor(SupervisorConfig(restart_backoff_s=1.0, max_restart_backoff_s=8.0, healthy_reset_s=60.0))
    actor = _Crasher([0, 0, 0, 100, 0])  # three quick crashes, a long healthy run, a crash
    async with trio.open_nursery() as nursery:
        supervisor.attach(nursery)
        supervisor.start(actor)
        await trio.sleep(500)  # virtual time (autojump_clock): every crash and backoff plays out
        nursery.cancel_scope.cancel()
    gaps = [round(b - a) for a, b in zip(actor.starts, actor.starts[1:])]
    # backoff 1, 2, 4; then 100 s of healthy running and the backoff starts again from 1
    assert gaps == [1, 2, 4, 100 + 1, 2]


async def test_a_slow_load_is_not_a_stall_and_models_shows_loading(tiny_config, monkeypatch):
    from mmserve.runtime import registry

    real = registry.load_adapter
    loading = threading.Event()

    def slow(*args, **kwargs):
        loading.set()
        time.sleep(1.2)  # a large checkpoint (simulated): longer than the stall timeout below
        return real(*args, **kwargs)

    monkeypatch.setattr(registry, "load_adapter", slow)
    lazy = tiny_config.replace(models=(ModelConfig("tiny", tiny_config.models[0].path, default=True, load="on_demand"),),
                               supervisor={"stall_timeout_s": 0.4})
    async with Runtime.open(lazy) as rt:
        states = []
        async with trio.open_nursery() as nursery:
            async def ask_once():
                states.append(await rt.chat_completion(colour_question("red"), temperature=0, max_tokens=2))
            nursery.start_soon(ask_once)
            assert await trio.to_thread.run_sync(loading.wait, 10), "the load never started"
            assert [m["state"] for m in rt.models()] == ["loading"]  # while the checkpoint is read
        assert states and rt.models()[0]["state"] == "ok"
        assert not any(s.restarts for s in rt.supervisor.states.values())


async def test_a_load_past_its_timeout_is_a_503(tiny_config, monkeypatch):
    from mmserve.runtime import registry

    stuck, ended = threading.Event(), threading.Event()

    def never_loads(*args, **kwargs):
        stuck.wait(10)  # a checkpoint on a dead network share
        ended.set()
        raise OSError("gave up")

    monkeypatch.setattr(registry, "load_adapter", never_loads)
    lazy = tiny_config.replace(models=(ModelConfig("tiny", tiny_config.models[0].path, default=True, load="on_demand"),),
                               runtime={"load_timeout_s": 0.2})
    async with Runtime.open(lazy) as rt:
        with pytest.raises(ServiceUnavailable, match="load_timeout_s"):
            await rt.chat_completion(colour_question("red"), max_tokens=2)
        assert rt.models()[0]["state"] == "failed" and not rt.health("tiny").ok
    stuck.set()  # the abandoned loader thread ends before the test does
    assert ended.wait(5)


async def test_unload_never_strands_a_request(demo_config):
    """One model slot, two models, requests alternating as fast as they come: every request is
    answered (the model it was routed to is leased until its job is in the model's inbox)."""
    config = demo_config.replace(runtime={"max_loaded_models": 1},
                                 models=tuple(ModelConfig(m.name, m.path, m.default, "on_demand") for m in demo_config.models))
    async with Runtime.open(config) as rt:
        answers, unloads = [], []
        unload = rt.registry.unload
        rt.registry.unload = lambda name: (unloads.append(name), unload(name))[1]

        async def one(i):
            model = ("demo", "demo-wide")[i % 2]
            for attempt in range(20):  # both slots busy → 503 "retry shortly": a client retries
                try:
                    c = await rt.chat_completion(colour_question("red", seed=i), model=model, temperature=0, max_tokens=3)
                    answers.append(c.text)
                    return
                except ServiceUnavailable as e:
                    assert "busy" in e.message, e.message
                    await trio.sleep(0.05)  # the client's back-off before its retry (simulated client)

        with trio.fail_after(60):
            for wave in range(10):  # each wave asks both models at nearly the same time
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, wave + i)
                        # deliberate jitter: arrivals a few ms apart land at varied points of a
                        # load or an unload, which is the race this test runs (not an ordering)
                        await trio.sleep(0.004 * i)
        assert len(answers) == 40 and all("red" in a for a in answers)
        assert len(unloads) >= 5, unloads  # the race was run: models came and went under load
        await assert_nothing_held(rt)


def test_health_per_model_over_http(demo_config):
    from tests.helpers import ServerThread
    import httpx

    config = _two_models(demo_config, restart_backoff_s=2.0)
    with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/v1/models").json()["data"][1]["state"] == "not_loaded"
        warm = {"model": "demo-wide", "messages": colour_question("red"), "max_tokens": 3, "temperature": 0}
        assert c.post("/v1/chat/completions", json=warm).status_code == 200  # loads demo-wide
        faults.configure("generator.step=raise@2")
        crashed = c.post("/v1/chat/completions", json={"model": "demo", "messages": colour_question("red"), **LONG})
        assert crashed.status_code == 503
        whole, demo, wide = c.get("/health"), c.get("/health?model=demo"), c.get("/health?model=demo-wide")
        assert whole.status_code == demo.status_code == 503 and int(demo.headers["Retry-After"]) >= 1
        assert demo.json()["models"] == {"demo": "down", "demo-wide": "ok"} and demo.json()["model"] == "demo"
        assert wide.status_code == 200
        assert c.get("/health?model=nope").status_code == 404
        refused = c.post("/v1/chat/completions", json={"model": "demo", "messages": colour_question("red"), "max_tokens": 2})
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert c.post("/v1/chat/completions", json=warm).status_code == 200
        assert {m["id"]: m["state"] for m in c.get("/v1/models").json()["data"]} == {"demo": "down", "demo-wide": "ok"}


class _Idler:
    """A fake actor idle for a long time, then handed one job that it holds for `window` seconds
    (a batch window) before its first progress mark."""

    name = key = "idler"

    def __init__(self):
        self.in_flight, self.last_progress = {}, time.monotonic()
        self.job = trio.Event()
        self.done = False

    async def run(self):
        await self.job.wait()
        self.in_flight["r"] = object()
        await trio.sleep(0.25)
        self.last_progress = time.monotonic()
        self.in_flight.clear()
        self.done = True
        await trio.sleep_forever()

    def progressed(self):
        self.last_progress = time.monotonic()

    def has_work(self):
        return bool(self.in_flight)

    def fail_in_flight(self, error):
        return 0


async def test_time_spent_idle_never_counts_as_a_stall():
    """An actor idle for longer than the stall timeout that then takes a job is not declared hung
    on the spot: the quiet time counts from when the work arrived."""
    supervisor = Supervisor(SupervisorConfig(stall_timeout_s=0.4))
    actor = _Idler()
    async with trio.open_nursery() as nursery:
        supervisor.attach(nursery)
        supervisor.start(actor)
        await trio.sleep(0.8)  # idle, longer than the stall timeout
        actor.job.set()
        await trio.sleep(0.5)
        state = supervisor.states["idler"]
        assert actor.done and not state.stalled and state.restarts == 0
        nursery.cancel_scope.cancel()

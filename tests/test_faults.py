"""Supervision under injected faults (DESIGN.md F4): a dead or hung actor turns /health 503,
fails its in-flight requests at once with a clear error, leaves caches consistent, restarts."""

import time

import httpx
import pytest
import trio

from mmserve import Runtime
from mmserve.errors import InternalError, ServiceUnavailable
from mmserve.models.demo import render_image
from mmserve.actors import faults
from tests.helpers import (
    ServerThread, ask, assert_nothing_held, colour_question, runtime_idle, wait_until, wait_until_sync)

LONG = dict(temperature=0, max_tokens=200, min_tokens=200)


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    faults.configure(None)


def cfg(tiny_config, stall=5.0):
    return tiny_config.replace(supervisor={"stall_timeout_s": stall, "restart_backoff_s": 0.05})


async def wait_healthy(rt, timeout=5):
    await wait_until(lambda: rt.health().ok, timeout, what="healthy again")  # no event marks a restart


async def assert_consistent(rt):
    await assert_nothing_held(rt)
    c = await rt.chat_completion(colour_question("red"), temperature=0, max_tokens=3)
    assert c.usage.completion_tokens >= 1


async def test_a_dying_actor_fails_its_requests_and_restarts(tiny_config):
    """The batched decode forward is the generator's own: a fault there restarts the actor."""
    async with Runtime.open(cfg(tiny_config)) as rt:
        faults.configure("generator.step=raise@3")
        with pytest.raises(ServiceUnavailable, match="injected fault"):
            await rt.chat_completion(ask(render_image("red", "circle", seed=1)), **LONG)
        await wait_healthy(rt)
        assert rt.supervisor.states["generator[tiny]"].restarts == 1
        await assert_consistent(rt)


@pytest.mark.parametrize("spec", ["encoder.forward=raise@1", "image.decode=raise@1", "prefix.commit=raise@1",
                                  "prefix.lookup=raise@1"])
async def test_a_fault_while_handling_one_request_fails_it_alone(tiny_config, spec):
    """Per-request work that raises fails that request with a 500 naming it; no actor restarts,
    health never drops, and the prefix cache holds nothing half-written."""
    config = cfg(tiny_config).replace(kv_cache={"block_size": 8})
    async with Runtime.open(config) as rt:
        faults.configure(spec)
        img = render_image("blue", "square", seed=2)
        stream = rt.chat(ask(img), temperature=0, max_tokens=4)
        with pytest.raises(InternalError, match=stream.request_id):
            async with stream:
                async for _ in stream:
                    pass
        assert rt.health().ok and not any(s.restarts for s in rt.supervisor.states.values())
        again = await rt.chat_completion(ask(img), temperature=0, max_tokens=4)
        faults.configure(None)
        off = await rt.chat_completion(ask(img), temperature=0, max_tokens=4)
        assert again.text == off.text
        await assert_consistent(rt)


async def test_a_hung_generator_is_detected_and_restarted(tiny_config, monkeypatch):
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", "3")
    async with Runtime.open(cfg(tiny_config, stall=0.5)) as rt:
        faults.configure("generator.step=hang@2")
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="stalled"):
            await rt.chat_completion(ask(render_image("green", "circle", seed=3)), **LONG)
        # a clock: detection within stall_timeout + 1 s is the behaviour (the hang itself lasts 3 s)
        assert time.monotonic() - t0 < 0.5 + 1.0
        assert "stalled" in (rt.supervisor.states["generator[tiny]"].last_error or "")
        await wait_healthy(rt)
        await assert_consistent(rt)


def test_http_health_and_sse_error_on_a_crash(tiny_config):
    with ServerThread(cfg(tiny_config, stall=0.5)) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        faults.configure("generator.step=hang@5")
        import os
        os.environ["MMSERVE_FAULT_HANG_S"] = "3"
        try:
            saw_503, lines = False, []
            with c.stream("POST", "/v1/chat/completions", json={
                    "messages": colour_question("red"), "stream": True, **LONG}) as resp:
                for line in resp.iter_lines():
                    if line:
                        lines.append(line)
                    if not saw_503:
                        t = time.perf_counter()
                        h = c.get("/health")
                        # a clock: /health answering at once while a step hangs is the behaviour
                        # (a few ms expected; 0.1 s is generous)
                        assert time.perf_counter() - t < 0.1
                        saw_503 = h.status_code == 503
            assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2] and "stalled" in lines[-2]
            wait_until_sync(lambda: c.get("/health").status_code == 200, what="/health 200 after the restart")
            ok = c.post("/v1/chat/completions", json={"messages": colour_question("red"), "max_tokens": 2})
            assert ok.status_code == 200, ok.text
        finally:
            os.environ.pop("MMSERVE_FAULT_HANG_S", None)


async def test_a_lookup_without_answer_becomes_a_miss_in_time(tiny_config, monkeypatch):
    """The KV-cache manager is stuck in a commit: a later request's lookup gets no answer, and after
    `inflight_wait_s + lookup_timeout_s` intake sends it on as a miss; its blocks come once the
    manager is back, and its answer is the same."""
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", "2")
    config = cfg(tiny_config).replace(kv_cache={"inflight_wait_s": 0.2}, generator={"lookup_timeout_s": 0.3})
    async with Runtime.open(config) as rt:
        msgs = ask(render_image("blue", "circle", seed=4))
        faults.configure("prefix.commit=hang@1")
        # its prompt commit hangs; its answer fits the blocks it already holds
        first = await rt.chat_completion(msgs, temperature=0, max_tokens=2)
        t0 = trio.current_time()
        second = await rt.chat_completion(msgs, temperature=0, max_tokens=2)
        waited = trio.current_time() - t0
        assert second.text == first.text and second.usage.cached_tokens == 0
        # a clock: the wait is the behaviour — at least inflight_wait_s + lookup_timeout_s (0.5 s)
        assert waited >= 0.5
        await wait_until(lambda: runtime_idle(rt), timeout=5, what="the prefix-cache manager idle")
        await assert_consistent(rt)

"""Soak: mixed traffic — multi-turn, one or two images, both demo models, random disconnects,
injected crashes and hangs, tiny cache budgets. Every request ends (answer or clean error) within its
deadline, answers equal the no-cache baseline, nothing leaks. A short version runs in CI; the
long one is marked slow (`pytest -m slow tests/test_soak.py`)."""

import random
import threading

import pytest
import trio

from mmserve import Runtime
from mmserve.errors import InternalError, ServiceUnavailable
from mmserve.models.demo import (
    BACKGROUNDS, COLORS, Q_BACKGROUND, Q_COLOR, Q_FIRST, Q_SECOND, Q_SHAPE, SHAPES, render_image)
from mmserve.actors import faults
from tests.helpers import ask, assert_nothing_held, image_part, wait_until

IMAGES = [render_image(COLORS[i % 6], SHAPES[i % 3], BACKGROUNDS[(i // 3) % 3], seed=700 + i) for i in range(8)]
# one fault every FAULT_EVERY requests, cycling through these: crashes and hangs (a hung step
# blocks its thread for HANG_S; the stall watchdog must notice it within STALL_S)
FAULTS = ["generator.step=raise@7", "encoder.forward=hang@2", "prefix.commit=raise@3", "image.decode=raise@4",
          "generator.step=hang@5", "encoder.forward=raise@2"]
FAULT_EVERY, HANG_S, STALL_S = 12, 2.0, 1.0


def workload(n, seed):
    """(index, model, messages, disconnect, fault spec or None) per request."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        img = rng.randrange(len(IMAGES))
        if rng.random() < 0.2:  # two images in one message
            other = rng.randrange(len(IMAGES))
            msgs = [{"role": "user", "content": [image_part(IMAGES[img]), image_part(IMAGES[other]),
                                                 {"type": "text", "text": rng.choice([Q_FIRST, Q_SECOND])}]}]
        else:
            msgs = ask(IMAGES[img], rng.choice([Q_COLOR, Q_SHAPE, Q_BACKGROUND]))
        if rng.random() < 0.4:
            msgs = [*msgs, {"role": "assistant", "content": COLORS[img % 6]}, {"role": "user", "content": rng.choice([Q_SHAPE, Q_BACKGROUND])}]
        fault = FAULTS[(i // FAULT_EVERY) % len(FAULTS)] if i % FAULT_EVERY == FAULT_EVERY // 2 else None
        out.append((i, rng.choice(["demo", "demo-wide"]), msgs, rng.random() < 0.15, fault))
    return out


async def answer_with_retries(rt, msgs, model, attempts=6):
    """A well-behaved client: a 503 (actor restarting) is retried, backing off 0.1 s, 0.2 s, ...
    (3.1 s in all: a hang's detection and the restart fit in it)."""
    for attempt in range(attempts):
        try:
            return (await rt.chat_completion(msgs, model=model, temperature=0, max_tokens=6)).text
        except ServiceUnavailable:
            if attempt == attempts - 1:
                raise
            await trio.sleep(0.1 * 2 ** attempt)  # the client's own back-off (simulated client behaviour)


async def soak(demo_config, n, seed=0):
    requests = workload(n, seed)
    baseline = {}
    off = demo_config.replace(kv_cache={"prefix_caching": False}, encoder_cache={"enabled": False})
    async with Runtime.open(off) as rt:
        for i, model, msgs, _, _ in requests:
            baseline[i] = (await rt.chat_completion(msgs, model=model, temperature=0, max_tokens=6)).text

    on = demo_config.replace(kv_cache={"block_size": 8, "budget_bytes": 24 * 16384},
                             encoder_cache={"max_entries": 3},
                             supervisor={"restart_backoff_s": 0.02, "stall_timeout_s": STALL_S})
    results = {"ok": 0, "mismatch": [], "failed": 0, "disconnected": 0, "faults": 0}
    async with Runtime.open(on) as rt:
        limiter = trio.CapacityLimiter(6)

        async def one(i, model, msgs, disconnect, fault):
            async with limiter:
                if fault is not None:
                    faults.configure(fault)
                    results["faults"] += 1
                with trio.fail_after(30):  # the per-request deadline
                    try:
                        if disconnect:
                            async with rt.chat(msgs, model=model, temperature=0, max_tokens=6, min_tokens=6) as s:
                                await s.__anext__()
                            results["disconnected"] += 1
                            return
                        text = await answer_with_retries(rt, msgs, model)
                    except (ServiceUnavailable, InternalError):  # a restart; a fault in this request
                        results["failed"] += 1
                        return
                if text == baseline[i]:
                    results["ok"] += 1
                else:
                    results["mismatch"].append((i, model, text, baseline[i]))

        health = {"polls": 0, "down_episodes": 0}

        async def watch_health():
            was_ok = True
            while True:
                ok = rt.health().ok
                health["polls"] += 1
                health["down_episodes"] += was_ok and not ok
                was_ok = ok
                # a sampler, like a load balancer's probe: no event marks a health change, and
                # the test counts the down episodes it sees
                await trio.sleep(0.002)

        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(watch_health)
                async with trio.open_nursery() as nursery:
                    for req in requests:
                        nursery.start_soon(one, *req)
                outer.cancel_scope.cancel()
        finally:
            faults.configure(None)
        restarts = sum(state.restarts for state in rt.supervisor.states.values())
        # truthful health: down at some point whenever an actor died, and never down otherwise
        assert health["down_episodes"] <= restarts and (health["down_episodes"] > 0 or restarts == 0), (health, restarts)
        results["restarts"], results["health_down_episodes"] = restarts, health["down_episodes"]
        await wait_until(lambda: rt.health().ok, timeout=10, what="healthy after the soak")
        await assert_nothing_held(rt)
        # a hung step's abandoned thread finishes its sleep, then exits: none outlives the soak
        await wait_until(lambda: sum(t.name.startswith("mmserve-compute") for t in threading.enumerate()) <= 1,
                         timeout=HANG_S + 5, interval=0.05, what="abandoned compute threads exited")
    print("soak:", {k: (len(v) if isinstance(v, list) else v) for k, v in results.items()})
    assert not results["mismatch"], results["mismatch"][:5]
    assert results["ok"] + results["failed"] + results["disconnected"] == n  # every request ended
    assert results["ok"] >= n // 4
    return results


async def test_soak_short(demo_config, monkeypatch):
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", str(HANG_S))
    await soak(demo_config, 48)


@pytest.mark.slow
async def test_soak_long(demo_config, monkeypatch):
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", str(HANG_S))
    await soak(demo_config, 600, seed=7)

"""A step slower than `stall_timeout_s` writes nothing into blocks another request owns (issue 42).

The watchdog restarts the generator and replaces the compute thread; the abandoned step runs on,
on the old thread, and writes its K/V. The blocks it was given are quarantined — held by the
manager under `StepFence(step)`, never granted — until the step has really returned; only its
return (`StepReturned`, sent when the compute thread's call finished) releases them, and a late or
duplicate one changes nothing."""

from __future__ import annotations

import pytest
import trio

from mmserve import Runtime
from mmserve.actors import faults
from mmserve.actors.messages import Quarantine, Release, StepFence, StepReport, StepReturned
from mmserve.actors.prefix_cache import PrefixCacheManager
from mmserve.cache.block_arena import BlockArena
from mmserve.config import KVCacheConfig
from mmserve.errors import ServiceUnavailable
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import ask, assert_nothing_held, wait_until

SLOW = ask(render_image("green", "circle", background="white", seed=42), Q_SHAPE)
OTHER = ask(render_image("blue", "square", background="white", seed=41), Q_COLOR)
HANG_S = 2.5


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    faults.configure(None)


def quarantined(rt, model="demo") -> tuple[float, int]:
    """(the metric, /debug/cache's count) of quarantined blocks."""
    metric = rt.metrics.registry.get_sample_value("mmserve:kv_cache_quarantined_blocks", {"model_name": model})
    return metric, rt.debug_cache()[model]["prefix_cache"]["quarantined_blocks"]


async def test_a_step_slower_than_the_stall_timeout_writes_only_into_quarantined_blocks(demo_config, monkeypatch):
    """A's first step sleeps past the stall timeout right before its forward (after its last check
    that it was not abandoned): A fails with a 503, the generator restarts, B runs while A's step
    sleeps, then A's step wakes and writes A's K/V into the blocks it was given. B answers as it
    does alone, and a later request hitting B's cached blocks too (the cache is not poisoned); the
    quarantine is counted while A's step runs and is 0 once it returned."""
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", str(HANG_S))
    config = demo_config.replace(kv_cache={"block_size": 8, "budget_bytes": 12 * 16384},
                                 supervisor={"stall_timeout_s": 0.3, "restart_backoff_s": 0.05})
    async with Runtime.open(config) as rt:
        kw = dict(temperature=0, max_tokens=12, min_tokens=12, logprobs=True)
        alone = await rt.chat_completion(OTHER, **kw)
        await rt.reset_caches()
        assert quarantined(rt) == (0, 0)

        faults.configure("generator.forward=hang@1")
        with pytest.raises(ServiceUnavailable, match="stalled"):
            await rt.chat_completion(SLOW, temperature=0, max_tokens=4)
        await wait_until(lambda: quarantined(rt)[1] > 0, 2.0, what="A's blocks quarantined")
        metric, shown = quarantined(rt)
        assert metric == shown > 0
        manager = rt.registry.require("demo").prefix_cache
        held = set(manager.arena.table(StepFence(next(iter(manager.quarantine.steps)))))

        await wait_until(lambda: rt.health().ok, 2.0, what="the generator restarted")
        owner = await rt.chat_completion(OTHER, **kw)  # runs while A's step sleeps
        assert quarantined(rt)[1] > 0, "A's step returned before B ran: the test proves nothing"
        assert owner.text == alone.text
        assert [t.logprob for t in owner.choices[0].logprobs] == pytest.approx([t.logprob for t in alone.choices[0].logprobs], abs=1e-4)

        await wait_until(lambda: quarantined(rt) == (0, 0), HANG_S + 5, what="the quarantine ended")
        assert not set(manager.arena.owners()) & {StepFence(s) for s in range(10)}
        hit = await rt.chat_completion(OTHER, **kw)  # its blocks were cached before A's step wrote
        assert hit.usage.cached_tokens > 0
        assert hit.text == alone.text
        assert [t.logprob for t in hit.choices[0].logprobs] == pytest.approx([t.logprob for t in alone.choices[0].logprobs], abs=1e-4)
        assert held  # A's step held blocks (B could not have them meanwhile)
        await assert_nothing_held(rt)


def test_an_arena_hold_keeps_named_blocks_from_allocation_whatever_their_state():
    arena = BlockArena(6)
    arena.allocate("a", 2)  # 0, 1 referenced
    arena.commit("a", 0, b"h" * 16)
    arena.free("a")  # 0 evictable, 1 free
    arena.allocate("b", 1)
    held = arena.hold(StepFence(1), [0, 1, 2, 2])
    assert held == [0, 1, 2]
    arena.check_invariants()
    assert arena.num_free() == 6 - len(set(held) | set(arena.table("b")))
    assert set(arena.allocate("c", arena.num_free())).isdisjoint(held) and not arena.can_allocate(1)
    arena.free("b")
    arena.free("c")
    assert arena.block_of(b"h" * 16) == 0  # a held cached block stays a hit
    with pytest.raises(ValueError):
        arena.hold(StepFence(1), [3])
    arena.free(StepFence(1))
    arena.check_invariants()
    assert arena.num_free() == 6


async def test_the_manager_holds_a_quarantine_across_releases_and_restarts_until_the_step_returns():
    manager = PrefixCacheManager("m", KVCacheConfig(block_size=4), 8)
    send, replies = trio.open_memory_channel(100)
    numbers = iter(range(100))

    async def report(*entries):
        await manager._handle(StepReport(next(numbers), manager.epoch, 1, entries, 0, send))

    await report()
    manager.arena.allocate("r", 3)  # a request holding blocks 0-2
    await report(Quarantine(7, (0, 1, 2)), Release("r"))
    assert manager.stats()["quarantined_blocks"] == 3
    assert not manager.arena.can_allocate(6)
    manager.fail_in_flight(ServiceUnavailable("restart"))  # a new life: the step still writes
    manager.arena.check_invariants()
    assert manager.stats()["quarantined_blocks"] == 3 and manager.arena.table(StepFence(7)) == (0, 1, 2)
    assert not manager.arena.can_allocate(6)
    await manager._handle(StepReturned(7))
    assert manager.stats()["quarantined_blocks"] == 0 and manager.arena.can_allocate(8)
    await manager._handle(StepReturned(7))  # a duplicate: nothing
    assert manager.arena.can_allocate(8)
    # a return that comes before its quarantine: the quarantine is void
    await manager._handle(StepReturned(9))
    await report(Quarantine(9, (3,)))
    assert manager.stats()["quarantined_blocks"] == 0 and manager.arena.can_allocate(8)
    manager.arena.check_invariants()


async def test_compute_guards_an_abandoned_step_until_it_ends_or_is_dropped_unrun():
    """`compute.run(if_abandoned=...)`: a caller that gives up on a step still running or queued
    guards it, and the guard ends only when that step has returned — or, queued on a thread that
    was replaced, was dropped without running; a step that returned first needs no guard."""
    import threading
    import time

    from mmserve.actors import compute

    gate, log = threading.Event(), []

    def guard(name):
        def abandoned():
            log.append(("abandoned", name))
            return lambda: log.append(("ended", name))
        return abandoned

    assert await compute.run(time.sleep, 0, abandon_on_cancel=True, if_abandoned=guard("quick")) is None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: compute.run(gate.wait, 10, abandon_on_cancel=True, if_abandoned=guard("running")))
        await wait_until(lambda: compute.quiet_for() > 0, 5, what="the step running")
        nursery.start_soon(lambda: compute.run(time.sleep, 0, abandon_on_cancel=True, if_abandoned=guard("queued")))
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert sorted(log) == [("abandoned", "queued"), ("abandoned", "running")]
    compute.replace("test: a step hung")  # the queued step is dropped: it will never write
    await wait_until(lambda: ("ended", "queued") in log, 5, what="the dropped step's guard ended")
    assert ("ended", "running") not in log  # still running: still guarded
    gate.set()
    await wait_until(lambda: ("ended", "running") in log, 5, what="the running step's guard ended")
    assert len(log) == 4 and not any(name == "quick" for _, name in log)

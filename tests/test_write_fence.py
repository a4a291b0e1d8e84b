"""Ownership checked where KV is written (issue 42, item 1): every writer of the arena — a step,
a shared-tier restore — runs inside the runner's write fence, and a new life of the cache manager
begins on that fence. A writer that entered before the new life is quarantined with every block
it may write until it returns; one that enters after it writes nothing for tables of an earlier
life. No message timing is involved: the manager restarting while a step is in its forward is
the case that used to depend on one."""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from mmserve import Runtime
from mmserve.actors import faults
from mmserve.actors.messages import StepFence
from mmserve.errors import MMServeError, ServiceUnavailable
from mmserve.engine.write_fence import WriteFence
from tests.helpers import assert_nothing_held, wait_until
from tests.test_manager_faults import LONG

HANG_S = 1.5


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    faults.configure(None)


def test_a_writer_in_flight_at_a_new_epoch_is_listed_with_its_blocks_and_reports_its_return():
    fence = WriteFence()
    assert fence.new_epoch(1, lambda w: pytest.fail("reported")) == []  # no writer yet
    returned, inside, leave = [], threading.Event(), threading.Event()
    seen = {}

    def step():
        with fence.writing(lambda: [3, 4, 3]) as epoch:
            seen["epoch"] = epoch
            inside.set()
            leave.wait(5)

    thread = threading.Thread(target=step)
    thread.start()
    assert inside.wait(5)
    fenced = fence.new_epoch(2, returned.append)
    assert [blocks for _, blocks in fenced] == [(3, 4)] and seen["epoch"] == 1
    assert fence.epoch == 2 and returned == []  # still writing: the caller holds its blocks
    leave.set()
    thread.join(5)
    assert returned == [fenced[0][0]] and fence.writers() == 0
    with fence.writing(lambda: pytest.fail("blocks asked for without a new epoch")) as epoch:
        assert epoch == 2  # a writer after the new epoch sees it
    assert returned == [fenced[0][0]]  # and was never fenced


def test_a_writer_that_left_before_the_new_epoch_is_not_fenced():
    fence = WriteFence()
    with fence.writing(lambda: [1]) as epoch:
        assert epoch is None  # no manager tracks the arena yet
    assert fence.new_epoch(1, lambda w: pytest.fail("reported")) == []


def test_a_write_granted_in_an_earlier_life_is_refused_by_the_epoch_it_names():
    """A restore names the life its blocks were granted in; the fence compares it with its own
    under its lock, at the writer's entry: an earlier life's restore writes nothing, even one
    that reaches the fence the instant after the new life began."""
    fence = WriteFence()
    fence.new_epoch(1, lambda w: pytest.fail("reported"))
    with fence.writing_granted(1, lambda: [5]) as granted:
        assert granted and fence.writers() == 1  # registered while it writes: a new life would fence it
    fence.new_epoch(2, lambda w: pytest.fail("reported"))
    with fence.writing_granted(1, lambda: [5]) as granted:
        assert not granted
    with fence.writing_granted(2, lambda: [5]) as granted:
        assert granted
    assert fence.writers() == 0


async def test_a_manager_restart_during_a_step_quarantines_what_the_step_may_write(demo_config, monkeypatch):
    """A's step hangs inside its forward (inside the fence) when the cache manager starts a new life
    (what the supervisor's restart does: `fail_in_flight`). Every block of A's table is held in
    quarantine at once, in the same turn as the new bookkeeping: no lookup or restore of the new life
    can be given one while the step may write it. Its return ends the quarantine; a restore of the
    dead life written afterwards writes nothing."""
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", str(HANG_S))
    async with Runtime.open(demo_config.replace(supervisor={"stall_timeout_s": 30.0})) as rt:
        model = rt.registry.require("demo")
        manager, runner = model.prefix_cache, model.generator.runner
        faults.configure("generator.forward=hang@3")  # A's third step: its table holds blocks by then
        table, error = None, None

        async def answer_a():
            nonlocal error
            try:
                await rt.chat_completion(LONG, temperature=0, max_tokens=20, min_tokens=20)
            except MMServeError as e:
                error = e

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer_a)
            rule = faults._rules[0]
            await wait_until(lambda: rule.seen >= 3 and runner.fence.writers() == 1, 10,
                             what="A's step hanging in its forward")
            table = set(model.generator.seqs[0].table)
            old_epoch = manager.epoch
            manager.fail_in_flight(ServiceUnavailable("the manager restarted (test)"))
            assert manager.epoch == old_epoch + 1
            fences = {o for o in manager.arena.owners() if isinstance(o, StepFence)}
            assert len(fences) == 1 and table <= set(manager.arena.table(next(iter(fences))))
            taken = manager.arena.allocate("newcomer", manager.arena.num_free())  # all the new life can grant
            assert table.isdisjoint(taken)
            manager.arena.free("newcomer")
            assert rt.debug_cache()["demo"]["prefix_cache"]["quarantined_blocks"] >= len(table)
            await wait_until(lambda: not manager.quarantine.steps, HANG_S + 5, what="the quarantine to end")
        assert isinstance(error, ServiceUnavailable)
        # a restore allocated in the dead life and written after the new one began writes nothing
        block = sorted(table)[0]
        before = [t[block].clone() for t in (*runner.kv.keys, *runner.kv.values)]
        junk = torch.full(runner.block_shape, 7.0, dtype=runner.dtype)
        assert runner.write_blocks([block], [junk], old_epoch) is False
        assert all(torch.equal(t[block], b) for t, b in zip((*runner.kv.keys, *runner.kv.values), before))
        assert runner.write_blocks([block], [junk], manager.epoch) is True  # its own life's restore writes
        await assert_nothing_held(rt)

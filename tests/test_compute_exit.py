"""`compute.stop()`, what `mmserve serve` asks before the interpreter exits (which joins the compute
thread after the steps queued for it): a step running, or one an abandoned caller left queued,
must not hold the exit. A queued step is dropped, never started; a running one makes stop() say so
(the CLI then leaves with os._exit)."""

from __future__ import annotations

import threading

import trio

from mmserve.actors import compute
from tests.helpers import wait_until


async def test_stop_drops_a_queued_step_and_reports_the_running_one():
    release, started, ran = threading.Event(), threading.Event(), []

    def blocking():
        started.set()
        release.wait(10)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: compute.run(blocking, abandon_on_cancel=True))
        await trio.to_thread.run_sync(started.wait, 10)
        # a second step queued behind it, its caller gone (an abandoned step of a cancelled actor)
        queued = trio.Event()
        nursery.start_soon(lambda: compute.run(ran.append, 1, abandon_on_cancel=True, submitted=queued.set))
        await queued.wait()
        nursery.cancel_scope.cancel()
    assert compute.stop() is False  # one is running: the exit would wait for it
    release.set()
    await wait_until(compute.stop, timeout=1, what="the running step ended")
    assert compute.stop() is True
    assert ran == []  # the queued one never ran
    # a later caller (an embedding program) gets a fresh compute thread
    assert await compute.run(lambda: 42) == 42
    assert compute.stop() is True


async def test_a_replaced_threads_step_ending_late_leaves_the_new_threads_record_alone():
    """A hung step is abandoned and its thread replaced; when it finally ends, the step running on
    the new thread is still what the watchdog sees (its owner and start): before, the old step
    cleared the record, so a hang on the new thread was never seen as the compute thread's and the
    thread was never replaced again."""
    release_old, old_started, release_new, new_started = (threading.Event() for _ in range(4))

    def hold(started, release):
        started.set()
        release.wait(10)

    old_done, new_done = trio.Event(), trio.Event()

    async def step(owner, started, release, done):
        await compute.run(hold, started, release, owner=owner)  # returns once the step (and its record's update) ended
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(step, "old", old_started, release_old, old_done)
        await trio.to_thread.run_sync(old_started.wait, 10)
        compute.replace("test: the old step hangs")
        nursery.start_soon(step, "new", new_started, release_new, new_done)
        await trio.to_thread.run_sync(new_started.wait, 10)
        assert compute.busy_owner() == "new"
        release_old.set()  # the abandoned thread's step ends while the new one runs
        await old_done.wait()
        assert compute.busy_owner() == "new" and compute.quiet_for() > 0
        release_new.set()
        await new_done.wait()
    assert compute.busy_owner() is None

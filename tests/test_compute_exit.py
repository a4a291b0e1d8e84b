"""`compute.stop()`, what `mmserve serve` asks before the interpreter exits (which joins the compute
thread after the steps queued for it): a step running, or one an abandoned caller left queued,
must not hold the exit. A queued step is dropped, never started; a running one makes stop() say so
(the CLI then leaves with os._exit)."""

from __future__ import annotations

import threading

import trio

from mmserve.actors import compute


async def test_stop_drops_a_queued_step_and_reports_the_running_one():
    release, started, ran = threading.Event(), threading.Event(), []

    def blocking():
        started.set()
        release.wait(10)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: compute.run(blocking, abandon_on_cancel=True))
        await trio.to_thread.run_sync(started.wait, 10)
        # a second step queued behind it, its caller gone (an abandoned step of a cancelled actor)
        nursery.start_soon(lambda: compute.run(ran.append, 1, abandon_on_cancel=True))
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert compute.stop() is False  # one is running: the exit would wait for it
    release.set()
    for _ in range(100):
        if compute.stop():
            break
        await trio.sleep(0.01)
    assert compute.stop() is True
    assert ran == []  # the queued one never ran
    # a later caller (an embedding program) gets a fresh compute thread
    assert await compute.run(lambda: 42) == 42
    assert compute.stop() is True

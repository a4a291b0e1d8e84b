"""A fault of the KV cache manager fails only what it held (issue 28).

A manager exception at a message that is its own (a refill of the generator's reservation, a
release, a resume) kills it; the
supervisor restarts it with fresh bookkeeping (a new epoch). The requests whose blocks the dead
life held fail with a 503 to retry; a request that held nothing — waiting for admission, or
preempted — goes on and gets its answer alone; the generator never dies of it. A fault at one
request's lookup or commit fails that request alone (tests/test_faults.py).
"""

from __future__ import annotations

import pytest
import torch
import trio

from mmserve import Runtime
from mmserve.actors import faults
from mmserve.errors import MMServeError, ServiceUnavailable
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import ask, assert_nothing_held, wait_until
from tests.test_preemption import QUESTION, small_arena

LONG = ask(render_image("green", "circle", background="white", seed=42), Q_SHAPE)
WAITING = ask(render_image("red", "triangle", background="black", seed=43), Q_COLOR)
DOOMED = ask(render_image("yellow", "square", background="gray", seed=44), Q_COLOR)


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    faults.configure(None)


def one_at_a_time(config):
    return config.replace(generator={"max_running_requests": 1},
                          supervisor={"stall_timeout_s": 5.0, "restart_backoff_s": 0.05})


async def answer_or_error(rt, messages, **kw):
    try:
        return await rt.chat_completion(messages, temperature=0, **kw)
    except MMServeError as e:
        return e


def restarts(rt, actor: str) -> int:
    return rt.supervisor.states[f"{actor}[demo]"].restarts


@pytest.mark.parametrize("point", ["prefix.refill", "prefix.release"])
async def test_a_manager_fault_fails_the_holders_only(demo_config, point):
    """A long answer holds blocks; a request waiting for admission (max_running_requests = 1)
    holds none. The manager dies at its next refill (or at the Release of a third request that
    gave up while waiting): the long answer gets a 503, the waiting one its answer alone. (The
    reservation's refill follows every step report that drew blocks; a release is an entry of
    the step report.)"""
    async with Runtime.open(one_at_a_time(demo_config)) as rt:
        await rt.chat_completion([{"role": "user", "content": "warm up"}], max_tokens=1)
        out = {}

        async def waiting():
            out["waiting"] = await answer_or_error(rt, WAITING, max_tokens=12)

        async with trio.open_nursery() as nursery:
            long_answer = rt.chat(LONG, temperature=0, max_tokens=60, min_tokens=60)
            got_error = None
            try:
                async with long_answer:
                    async for _ in long_answer:  # it decodes: the others come after it
                        if "waiting" not in out:
                            out["waiting"] = None
                            nursery.start_soon(waiting)
                            await wait_until(lambda: len(rt.registry.require("demo").generator.seqs) >= 2, 5,
                                             what="the second request waiting in the generator")
                            if point == "prefix.refill":
                                faults.configure("prefix.refill=raise@1")
                            else:
                                faults.configure("prefix.release=raise@1")
                                async with rt.chat(DOOMED, temperature=0, max_tokens=4) as doomed:
                                    await wait_until(
                                        lambda: len(rt.registry.require("demo").generator.seqs) >= 3, 5,
                                        what="a third request waiting")
                                # it leaves while waiting: its Release is the message the manager dies at
            except MMServeError as e:
                got_error = e
        assert isinstance(got_error, ServiceUnavailable), got_error
        assert "restarted" in got_error.message
        assert restarts(rt, "prefix_cache") == 1 and restarts(rt, "generator") == 0
        await assert_nothing_held(rt)
        # it held nothing (its lookup missed, it was not admitted): it went on, and answered as alone
        alone = await rt.chat_completion(WAITING, temperature=0, max_tokens=12)
        assert alone.usage.cached_tokens > 0  # (now its prompt is cached)
        assert out["waiting"].text == alone.text


async def test_a_manager_fault_at_a_resume_fails_the_holder_and_the_preempted_one_goes_on(three_model_config):
    """A preempted request holds nothing while it asks for its cached blocks back: the manager
    dies of that Resume; the long answer (which held blocks) gets a 503, the preempted request
    recomputes its prompt and answers as alone."""
    async with Runtime.open(small_arena(three_model_config).replace(
            supervisor={"stall_timeout_s": 5.0, "restart_backoff_s": 0.05})) as rt:
        alone = await rt.chat_completion(QUESTION, temperature=0, max_tokens=30, min_tokens=30)
        faults.configure("prefix.resume=raise@1")
        out, long_error = {}, None

        async def again():
            out["again"] = await answer_or_error(rt, QUESTION, max_tokens=30, min_tokens=30)

        async with trio.open_nursery() as nursery:
            try:
                async with rt.chat(LONG, temperature=0, max_tokens=60, min_tokens=60) as long_answer:
                    async for _ in long_answer:
                        if "again" not in out:
                            out["again"] = None
                            nursery.start_soon(again)
            except MMServeError as e:
                long_error = e
        generator = rt.registry.require("demo").generator
        assert generator.preemptions >= 1
        assert isinstance(long_error, ServiceUnavailable) and "restarted" in long_error.message
        assert out["again"].text == alone.text  # preempted, it held nothing: it went on
        assert rt.supervisor.states["prefix_cache[demo]"].restarts == 1
        assert rt.supervisor.states["generator[demo]"].restarts == 0
        await assert_nothing_held(rt)


async def test_a_step_of_a_dead_manager_life_writes_nothing(demo_config):
    """After a manager restart its fresh bookkeeping may give any block to a shared-tier restore
    at once (written on the compute thread). A step that starts after the restart must not write
    the void tables of the earlier life: the write fence's epoch moved (as `_reset` moves it), so the
    sequence fails with a 503 and its blocks keep what they held."""
    async with Runtime.open(demo_config) as rt:
        model = rt.registry.require("demo")
        generator, kv = model.generator, model.generator.arena
        error, snapshot = None, None
        try:
            async with rt.chat(LONG, temperature=0, max_tokens=60, min_tokens=60) as long_answer:
                async for _ in long_answer:
                    if snapshot is None:
                        seq = generator.seqs[0]
                        blocks, steps = list(seq.table), generator.steps
                        # what the restarted manager's `_reset` does (its quarantine aside)
                        generator.runner.fence.new_epoch(seq.epoch + 1, lambda writer: None)
                        # a step that was already running when the epoch moved may still write: once
                        # it is done, no later step writes these blocks
                        await wait_until(lambda: generator.steps > steps or not generator.seqs, 5,
                                         what="the step running at the restart to end")
                        snapshot = [t[blocks].clone() for t in (*kv.keys, *kv.values)]
        except MMServeError as e:
            error = e
        assert isinstance(error, ServiceUnavailable) and "restarted" in error.message
        assert all(torch.equal(t[blocks], s) for t, s in zip((*kv.keys, *kv.values), snapshot))

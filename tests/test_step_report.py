"""One message each way per step between the generator and the KV cache manager (issue 29).

The generator draws its blocks from a reservation the manager refills; each step it sends at most
one `StepReport` (draws, commits, releases) and gets at most one `Refill` back, never waiting for
it — and a step that changed nothing sends nothing. Counted here on the real runtime, over a run
of steps with no forks or resumes (lookups are intake's, not the generator's)."""

from __future__ import annotations

import pytest
import trio

from mmserve import Runtime
from mmserve.actors.messages import Draw, Refill, StepReport
from tests.helpers import assert_nothing_held

PROMPTS = ["what colour is the sky", "name a shape", "count to three"]


@pytest.mark.parametrize("overlap", [False, True])
async def test_one_message_each_way_per_step_and_none_when_nothing_changed(demo_config, overlap):
    async with Runtime.open(demo_config.replace(runtime={"overlap": overlap})) as rt:
        generator = rt.registry.require("demo").generator
        sent, received = [], []  # (step, in a step round, message) / (step, message)
        reserve_at = {}  # report number -> the generator's reserve when it was sent
        manager, on_message, step_round = generator.grants.manager, generator._on_message, generator._step_round
        rounds = {"in": False}

        class Counting:
            def send_nowait(self, msg):
                sent.append((generator.steps, rounds["in"], msg))
                reserve_at[msg.number] = len(generator.grants.reserve)
                manager.send_nowait(msg)

        def counting_on_message(msg):
            if isinstance(msg, Refill):
                received.append((generator.steps, msg))
            on_message(msg)

        async def counting_step_round():
            rounds["in"] = True
            try:
                return await step_round()
            finally:
                rounds["in"] = False

        generator.grants.manager = Counting()  # the reports' way to the manager
        generator._on_message = counting_on_message
        generator._step_round = counting_step_round
        first = generator.steps
        async with trio.open_nursery() as nursery:
            for text in PROMPTS:
                nursery.start_soon(lambda t=text: rt.chat_completion([{"role": "user", "content": t}], temperature=0,
                                                                    max_tokens=40, min_tokens=40))
        await assert_nothing_held(rt)
        steps = generator.steps - first

    assert all(isinstance(m, StepReport) for _, _, m in sent), [type(m).__name__ for _, _, m in sent]
    in_steps = [(step, m) for step, inside, m in sent if inside]
    # one report per step, sent before its forward; one refill (at most) taken per step
    for step in {s for s, _ in in_steps}:
        assert sum(s == step for s, _ in in_steps) <= 1, step
    # at most one refill answers a report (counted by the report it answers: a report sent outside a
    # step round — the first blocks after idle — may be answered within the same step count)
    answered = [m.number for _, m in received]
    assert len(answered) == len(set(answered)), answered
    assert set(answered) <= {m.number for _, _, m in sent}
    assert len(received) <= len(sent)
    # a step's report says something: draws, commits or releases, or (the reserve short of the next
    # step's draws, which a late refill under load can leave it) an ask for blocks — never nothing
    empty = [m for _, m in in_steps if not m.entries and not m.hints]
    assert all(m.want > reserve_at[m.number] for m in empty), [(m, reserve_at[m.number]) for m in empty]
    # most steps change nothing (a decode token inside a block it holds): they send nothing. With
    # overlap a block's draw (for the step launched ahead) goes a report before the commit of the
    # block before it (once the step in flight has filled it): two reports where serial steps send one
    assert steps >= 40 and len(in_steps) <= steps // (2 if overlap else 3), (steps, len(in_steps))
    # outside steps: asking for the first blocks (the reserve is empty when idle), giving them back at the end
    assert len(sent) - len(in_steps) <= 3, [(s, m.entries, m.want) for s, inside, m in sent if not inside]
    assert any(isinstance(e, Draw) for _, m in in_steps for e in m.entries)

"""A caller that goes away at any phase — queued, decoding its image, encoding, prefill, decode,
after the last token — leaves nothing behind, and a concurrent request completes correctly."""

from functools import partial

import pytest
import trio

from mmserve import Runtime
from mmserve.models.demo import render_image
from mmserve.actors import faults
from tests.helpers import ask, assert_nothing_held, colour_question, runtime_idle, wait_until

PHASES = {
    "queued": ("image.decode=hang@1", {"limits": {"decode_concurrency": 1}}),
    "image_decode": ("image.decode=hang@1", {}),
    "encoding": ("encoder.forward=hang@1", {}),
    "prefill": ("", {"generator": {"max_batched_tokens": 2}}),
    "decode": ("", {}),
    "after_last_token": ("", {}),
}


@pytest.fixture(autouse=True)
def short_hangs(monkeypatch):
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", "0.4")
    yield
    faults.configure(None)


def leaver_in(rt, phase) -> bool:
    """Whether the leaver's request (client request id "leaver") is in `phase` right now."""
    def mine(handles) -> bool:
        return any(h.client_request_id == "leaver" for h in handles)

    model = rt.registry.require("tiny")
    if phase == "queued":  # behind the holder, whose hung decode holds the only slot
        return mine(rt.intake.in_flight.values()) and rt.intake.limiter.statistics().tasks_waiting > 0
    if phase == "image_decode":  # its own decode hangs, holding a slot
        return mine(rt.intake.in_flight.values()) and rt.intake.limiter.borrowed_tokens > 0
    if phase == "encoding":  # its vision forward hangs
        return mine(model.encoder.in_flight.values())
    assert phase == "prefill"  # two prompt tokens per chunk: many chunks, each a hop to the compute thread
    return any(s.label == "leaver" and s.state.value == "prefilling" for s in model.generator.running)


@pytest.mark.parametrize("phase", list(PHASES))
async def test_disconnect_at_every_phase(tiny_config, phase):
    spec, overrides = PHASES[phase]
    img = render_image("red", "circle", seed=11)
    async with Runtime.open(tiny_config.replace(**overrides)) as rt:
        baseline = (await rt.chat_completion(colour_question("blue"), temperature=0, max_tokens=5)).text
        faults.configure(spec)
        entered = trio.Event()  # the leaver's request is in `phase`: the bystander arrives now

        async def holder():  # for "queued": holds the only decode slot (its decode hangs a while)
            await rt.chat_completion(ask(render_image("green", "square", seed=12)), temperature=0, max_tokens=2)

        async def leaver():
            if phase == "queued":
                await wait_until(lambda: rt.intake.limiter.borrowed_tokens == 1, what="the holder has the slot")
            if phase in ("queued", "image_decode", "encoding", "prefill"):
                async with trio.open_nursery() as call:
                    call.start_soon(partial(rt.chat_completion, ask(img), temperature=0, max_tokens=50, min_tokens=50,
                                            client_request_id="leaver"))
                    # interval 0: a checkpoint per round, so no phase is too short to be seen
                    await wait_until(lambda: leaver_in(rt, phase), interval=0, what=f"the leaver in {phase}")
                    entered.set()
                    call.cancel_scope.cancel()  # the caller goes away
            elif phase == "decode":
                async with rt.chat(ask(img), temperature=0, max_tokens=50, min_tokens=50) as s:
                    await s.__anext__()
                    entered.set()
            else:
                async with rt.chat(ask(img), temperature=0, max_tokens=3, min_tokens=3) as s:
                    async for d in s:
                        entered.set()
                        if d.finish_reason:
                            break

        other = {}

        async def bystander():
            await entered.wait()
            other["text"] = (await rt.chat_completion(colour_question("blue"), temperature=0, max_tokens=5)).text

        async with trio.open_nursery() as n:
            if phase == "queued":
                n.start_soon(holder)
            n.start_soon(leaver)
            n.start_soon(bystander)
        # the abandoned work (a hung decode or forward) finishes and lets go of the request
        await wait_until(lambda: runtime_idle(rt), what="the runtime let go of every request")
        await assert_nothing_held(rt)
        assert other["text"] == baseline
        assert not [h for h in rt._live if h.active]
        assert rt.health().ok

"""A caller that goes away at any phase — queued, decoding its image, encoding, prefill, decode,
after the last token — leaves nothing behind, and a concurrent request completes correctly."""

import pytest
import trio

from mmserve import Runtime
from mmserve.models.demo import render_image
from mmserve.actors import faults
from tests.helpers import ask, assert_nothing_held, colour_question

PHASES = {
    "queued": ("image.decode=hang@1", {"limits": {"decode_concurrency": 1}}),
    "image_decode": ("image.decode=hang@1", {}),
    "encoding": ("encoder.forward=hang@1", {}),
    "prefill": ("", {"generator": {"prefill_chunk_tokens": 2}}),
    "decode": ("", {}),
    "after_last_token": ("", {}),
}


@pytest.fixture(autouse=True)
def short_hangs(monkeypatch):
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", "0.4")
    yield
    faults.configure(None)


@pytest.mark.parametrize("phase", list(PHASES))
async def test_disconnect_at_every_phase(tiny_config, phase):
    spec, overrides = PHASES[phase]
    img = render_image("red", "circle", seed=11)
    async with Runtime.open(tiny_config.replace(**overrides)) as rt:
        baseline = (await rt.chat_completion(colour_question("blue"), temperature=0, max_tokens=5)).text
        faults.configure(spec)

        async def holder():  # for "queued": holds the only decode slot (its decode hangs a while)
            await rt.chat_completion(ask(render_image("green", "square", seed=12)), temperature=0, max_tokens=2)

        async def leaver():
            if phase == "queued":
                await trio.sleep(0.02)  # behind the holder
            if phase in ("queued", "image_decode", "encoding", "prefill"):
                with trio.move_on_after(0.05):
                    await rt.chat_completion(ask(img), temperature=0, max_tokens=50, min_tokens=50)
            elif phase == "decode":
                async with rt.chat(ask(img), temperature=0, max_tokens=50, min_tokens=50) as s:
                    await s.__anext__()
            else:
                async with rt.chat(ask(img), temperature=0, max_tokens=3, min_tokens=3) as s:
                    async for d in s:
                        if d.finish_reason:
                            break

        other = {}

        async def bystander():
            await trio.sleep(0.01)
            other["text"] = (await rt.chat_completion(colour_question("blue"), temperature=0, max_tokens=5)).text

        async with trio.open_nursery() as n:
            if phase == "queued":
                n.start_soon(holder)
            n.start_soon(leaver)
            n.start_soon(bystander)
        await trio.sleep(0.5)  # let any hang run out
        await assert_nothing_held(rt)
        assert other["text"] == baseline
        assert not [h for h in rt._live if h.active]
        assert rt.health().ok

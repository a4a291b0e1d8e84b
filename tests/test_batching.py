"""Continuous batching: every sequence's greedy output equals its unbatched output, whatever the
mix of lengths, arrival times, chunked prefill and early departures."""

import trio

from mmserve import Runtime
from mmserve.models.demo import Q_BACKGROUND, Q_COLOR, Q_FIRST, Q_SHAPE, render_image
from tests.helpers import ask, image_part

IMGS = [render_image(c, s, seed=i) for i, (c, s) in enumerate([("red", "circle"), ("blue", "square"), ("green", "triangle")])]
PROMPTS = [
    ask(IMGS[0], Q_COLOR),
    [{"role": "system", "content": "You are a friendly and precise assistant. " * 3}, *ask(IMGS[1], Q_SHAPE)],
    [{"role": "user", "content": [image_part(IMGS[1]), image_part(IMGS[2]), {"type": "text", "text": Q_FIRST}]}],
    ask(IMGS[2], Q_BACKGROUND),
    [{"role": "user", "content": "hello " * 20}],
]
LENGTHS = [9, 17, 5, 12, 20]


def cfg(tiny_config, **gen):
    return tiny_config.replace(kv_cache={"prefix_caching": False}, generator=gen)


async def sequential(config):
    async with Runtime.open(config) as rt:
        return [(await rt.chat_completion(p, temperature=0, max_tokens=n, min_tokens=n)).text
                for p, n in zip(PROMPTS, LENGTHS)]


async def concurrent(config, staggered=False, abort_index=None):
    """All requests at once; or `staggered`: each arrives once the one before it has its first
    token (so it joins a batch already decoding). `abort_index` leaves after its first token."""
    out = [None] * len(PROMPTS)
    decoding = [trio.Event() for _ in PROMPTS]
    async with Runtime.open(config) as rt:
        async def one(i):
            if staggered and i:
                await decoding[i - 1].wait()
            if i == abort_index:
                async with rt.chat(PROMPTS[i], temperature=0, max_tokens=50, min_tokens=50) as s:
                    await s.__anext__()
                    decoding[i].set()
                return
            if not staggered:
                c = await rt.chat_completion(PROMPTS[i], temperature=0, max_tokens=LENGTHS[i], min_tokens=LENGTHS[i])
                out[i] = c.text
                return
            async with rt.chat(PROMPTS[i], temperature=0, max_tokens=LENGTHS[i], min_tokens=LENGTHS[i]) as s:
                text = []
                async for delta in s:
                    decoding[i].set()
                    text.append(delta.text)
            out[i] = "".join(text)

        async with trio.open_nursery() as n:
            for i in range(len(PROMPTS)):
                n.start_soon(one, i)
        batched_steps = rt.registry.require("tiny").generator.steps
    return out, batched_steps


async def test_batched_outputs_equal_unbatched(tiny_config):
    expected = await sequential(cfg(tiny_config))
    together, steps = await concurrent(cfg(tiny_config))
    assert together == expected
    assert steps < sum(LENGTHS) - len(LENGTHS)  # decoding really was shared


async def test_staggered_arrivals_chunked_prefill_and_an_early_departure(tiny_config):
    expected = await sequential(cfg(tiny_config))
    got, _ = await concurrent(cfg(tiny_config, max_batched_tokens=7), staggered=True, abort_index=2)
    assert [g for i, g in enumerate(got) if i != 2] == [e for i, e in enumerate(expected) if i != 2]

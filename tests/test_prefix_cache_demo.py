"""Prefix-cache regressions on the trained demo model, where a cache bug shows as a wrong colour:
DESIGN.md F2 (image placeholders must not collide) and F3 (slots, aborts and stale entries)."""

import trio
import trio.testing

from mmserve import Runtime
from mmserve.models.demo import Q_BACKGROUND, render_image
from tests.helpers import ask


async def complete(rt, msgs, **kw):
    c = await rt.chat_completion(msgs, temperature=0, max_tokens=8, **kw)
    return c.text.strip(), c.usage.cached_tokens


def follow_up(first_msgs, answer, question):
    return [*first_msgs, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


async def test_f2_different_images_same_text_never_collide(demo_config):
    images = {c: render_image(c, "circle", background="white", seed=40 + i)
              for i, c in enumerate(("red", "green", "blue"))}
    async with Runtime.open(demo_config) as rt:
        for color, img in images.items():
            answer, cached = await complete(rt, ask(img))
            assert answer == color
            assert cached == 0  # the first block already holds this image's placeholders
        red = ask(images["red"])
        answer, cached = await complete(rt, follow_up(red, "red", Q_BACKGROUND))
        assert answer == "white" and cached > 0


async def test_f3_abort_and_block_reuse_never_corrupt(demo_config):
    """A four-block arena: A's cached block is evicted for C, B leaves before its
    prefill ends; every answer stays right, and what survives of A is still a usable prefix."""
    async with Runtime.open(demo_config) as rt:
        block_bytes = rt.registry.require("demo").generator.arena.block_bytes
    config = demo_config.replace(kv_cache={"budget_bytes": 4 * block_bytes}, encoder_cache={"enabled": False})
    img_a = render_image("purple", "square", background="black", seed=50)
    img_b = render_image("yellow", "triangle", background="white", seed=51)
    img_c = [render_image("green", "circle", background="gray", seed=52 + i) for i in range(2)]
    a = ask(img_a)
    async with Runtime.open(config) as rt:
        pc = rt.registry.require("demo").prefix_cache
        assert pc.num_blocks == 4
        assert await complete(rt, a) == ("purple", 0)                      # A cached
        async with rt.chat(ask(img_b), temperature=0, max_tokens=8):         # B: gone before prefill ends
            pass
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)
        c = [{"role": "user", "content": [*ask(img_c[0])[0]["content"], *ask(img_c[1], "What color is the first shape?")[0]["content"]]}]
        assert (await complete(rt, c))[0] == "green"                       # C reuses A's blocks
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)
        assert pc.arena.stats().evictions >= 1
        short = ask(img_a, Q_BACKGROUND)                                     # what is left of A's prefix
        assert (await complete(rt, short))[0] == "black"
        await complete(rt, a)                                               # re-cache A
        longer = follow_up(a, "purple", Q_BACKGROUND)
        answer, cached = await complete(rt, longer)
        assert answer == "black" and cached > 0
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)
        pc.arena.check_invariants()
        assert not pc.arena.owners()

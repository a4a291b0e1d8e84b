"""A Qwen2-VL model (tiny, random weights) in the runtime: images of different sizes make
different token counts, and both caches stay exact — prefix hits across turns and inside an
image, encoder hits, concurrent batching — against the cache-off answers."""

from __future__ import annotations

import trio
import trio.testing

from mmserve import Runtime
from mmserve.config import Config, ModelConfig
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import ask

KW = dict(temperature=0, max_tokens=10, min_tokens=10)


def config(tiny_qwen_dir, **kv) -> Config:
    base = Config(models=(ModelConfig("tiny-qwen", str(tiny_qwen_dir), default=True),))
    return base.replace(kv_cache={"prefix_caching" if k == "enabled" else k: v for k, v in kv.items()})


def image(colour: str, size: tuple[int, int], seed: int):
    return render_image(colour, "circle", seed=seed).resize(size)


async def answers(cfg: Config, conversations, concurrent: bool = False):
    """(text, cached_tokens, prompt_tokens) per conversation, and the encoder's stats."""
    out: list = [None] * len(conversations)
    async with Runtime.open(cfg) as rt:
        async def one(i):
            c = await rt.chat_completion(conversations[i], **KW)
            out[i] = (c.text, c.usage.cached_tokens, c.usage.prompt_tokens)

        if concurrent:
            async with trio.open_nursery() as n:
                for i in range(len(conversations)):
                    n.start_soon(one, i)
        else:
            for i in range(len(conversations)):
                await one(i)
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)
        model = rt.registry.require("tiny-qwen")
        pc = model.prefix_cache
        if pc:
            pc.arena.check_invariants()
            assert not pc.arena.owners(), "blocks held after every request ended"
        stats = model.encoder.stats()
    return out, stats


def turns(img, answer: str = "red"):
    first = ask(img, Q_COLOR)
    return [first, [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": Q_SHAPE}]]


async def test_second_turn_hits_and_equals_the_uncached_answer(tiny_qwen_dir):
    convo = turns(image("red", (112, 40), 1))
    on, _ = await answers(config(tiny_qwen_dir), convo)
    off, _ = await answers(config(tiny_qwen_dir, enabled=False), convo)
    assert [t for t, _, _ in on] == [t for t, _, _ in off]
    assert on[1][1] >= 16 and off[1][1] == 0


async def test_token_counts_vary_with_image_size(tiny_qwen_dir):
    sizes = [(32, 32), (128, 32), (96, 96)]
    out, _ = await answers(config(tiny_qwen_dir), [ask(image("blue", s, 2)) for s in sizes])
    prompt_tokens = [p for _, _, p in out]
    assert len(set(prompt_tokens)) == 3


async def test_hit_ending_inside_an_image_gets_the_remaining_rows(tiny_qwen_dir):
    img = image("green", (96, 64), 3)
    convo = [ask(img, Q_COLOR), ask(img, Q_SHAPE)]  # share the image and differ after it
    for block in (4, 8, 16):
        on, _ = await answers(config(tiny_qwen_dir, block_size=block), convo)
        off, _ = await answers(config(tiny_qwen_dir, enabled=False), convo)
        assert on[1][1] > 0 and [t for t, _, _ in on] == [t for t, _, _ in off], block


async def test_same_token_count_other_grid_never_shares_what_follows(tiny_qwen_dir):
    """128x32 and 64x64 make 16 tokens each, with other positions after them: only the blocks
    before the image are shared, and answers equal the cache-off ones."""
    convo = [ask(image("red", (128, 32), 4)), ask(image("red", (64, 64), 4))]
    on, _ = await answers(config(tiny_qwen_dir, block_size=4), convo)
    off, _ = await answers(config(tiny_qwen_dir, enabled=False), convo)
    assert [t for t, _, _ in on] == [t for t, _, _ in off]
    assert on[0][2] == on[1][2] and on[1][1] < 12  # the system and user lead-in only


async def test_same_image_in_another_conversation_skips_the_encoder(tiny_qwen_dir):
    img = image("blue", (80, 48), 5)
    convo = [ask(img, Q_COLOR), [{"role": "system", "content": "Be brief."}, *ask(img, Q_SHAPE)]]
    on, stats = await answers(config(tiny_qwen_dir), convo)
    off, _ = await answers(config(tiny_qwen_dir, enabled=False), convo)
    assert stats["items_encoded"] == 1
    assert [t for t, _, _ in on] == [t for t, _, _ in off]


async def test_concurrent_batches_equal_one_at_a_time(tiny_qwen_dir):
    sizes = [(32, 32), (128, 32), (40, 100), (96, 96), (64, 48), (120, 120)]
    convos = [ask(image(c, s, 10 + i)) for i, (c, s) in enumerate(zip(["red", "blue", "green"] * 2, sizes))]
    convos += [turns(image("red", (72, 40), 20))[1]]
    batched, _ = await answers(config(tiny_qwen_dir), convos, concurrent=True)
    alone, _ = await answers(config(tiny_qwen_dir, enabled=False), convos)
    assert [t for t, _, _ in batched] == [t for t, _, _ in alone]

"""n choices in the runtime over a tiny KV arena: the choices share their prompt's blocks (one
prefill, a copied partial block each), survive preemption and eviction, equal the single greedy
answer when greedy, reproduce with a seed, and leave no block, pin or copy source held."""

from __future__ import annotations

import trio

from mmserve import Runtime
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import ask, assert_nothing_held


def tiny_arena(config):
    # 20 blocks of 8 tokens: a few concurrent 3-choice requests preempt each other
    return config.replace(kv_cache={"block_size": 8, "budget_bytes": 20 * 16384})


def question(i: int):
    colours, shapes = ["red", "blue", "green", "yellow"], ["circle", "square", "triangle"]
    img = render_image(colours[i % 4], shapes[i % 3], background="white", seed=100 + i)
    return ask(img, Q_COLOR if i % 2 else Q_SHAPE)


async def run_all(config, requests):
    out = [None] * len(requests)
    async with Runtime.open(config) as rt:
        async def one(i):
            messages, kw = requests[i]
            c = await rt.chat_completion(messages, **kw)
            out[i] = ([ch.text for ch in c.choices], [ch.finish_reason for ch in c.choices], c.usage)

        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(one, i)
        await assert_nothing_held(rt)
        preemptions = rt.registry.require("demo").generator.preemptions
    return out, preemptions


async def test_greedy_choices_equal_the_single_answer_under_preemption(demo_config):
    single = [(question(i), dict(temperature=0, max_tokens=12, min_tokens=12)) for i in range(6)]
    plain, _ = await run_all(demo_config.replace(kv_cache={"prefix_caching": False}), single)
    many, preempted = await run_all(tiny_arena(demo_config), [(m, dict(kw, n=3)) for m, kw in single])
    for (texts, reasons, usage), (one, _, one_usage) in zip(many, plain):
        assert texts == one * 3 and reasons == ["length"] * 3
        assert usage.completion_tokens == 3 * one_usage.completion_tokens
        assert usage.prompt_tokens == one_usage.prompt_tokens
    assert preempted > 0  # the arena was too small for all of them at once


async def test_seeded_choices_reproduce_alone_or_together(demo_config):
    kw = dict(temperature=1.5, max_tokens=10, min_tokens=10, seed=77, n=4, presence_penalty=0.5)
    alone, _ = await run_all(demo_config, [(question(1), kw)])
    together, _ = await run_all(tiny_arena(demo_config), [(question(1), kw)] + [(question(i), dict(kw, seed=i))
                                                                             for i in range(2, 6)])
    assert together[0][0] == alone[0][0]
    assert len(set(alone[0][0])) > 1  # the choices are not copies of one another


async def test_a_prompt_on_a_block_boundary_shares_every_block_and_copies_none(demo_config):
    async with Runtime.open(tiny_arena(demo_config)) as rt:
        for words in range(1, 12):  # find a prompt whose length is a whole number of blocks
            messages = [{"role": "user", "content": " ".join(["red"] * words)}]
            one = await rt.chat_completion(messages, temperature=0, max_tokens=5, min_tokens=5)
            if one.usage.prompt_tokens % 8 == 0:
                break
        assert one.usage.prompt_tokens % 8 == 0
        c = await rt.chat_completion(messages, temperature=0, max_tokens=5, min_tokens=5, n=2)
        assert [ch.text for ch in c.choices] == [one.text] * 2
        await assert_nothing_held(rt)


async def test_choices_that_end_at_their_fork_leave_no_copy_source_pinned(demo_config):
    """With one token each, the choices end where they are forked — before the step that would
    copy the parent's partial block into theirs: the pinned copy sources are released at once,
    not at some later step (an idle server holds no block)."""
    out, _ = await run_all(tiny_arena(demo_config), [(question(0), dict(temperature=0, max_tokens=1, n=3))])
    texts, reasons, _ = out[0]
    assert len(texts) == 3 and len(set(texts)) == 1 and reasons == ["length"] * 3

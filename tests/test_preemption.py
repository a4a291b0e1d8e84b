"""Preemption gives every block of the newest sequence back: it is prefilled again later from
what is still cached, and images whose KV came from the cache (it never had their encoder output)
are encoded again once that KV is gone. So whatever the arena holds, the oldest sequence always
runs, no request is refused for want of blocks, and every answer equals its answer alone."""

from __future__ import annotations

import pytest
import trio

from mmserve import Runtime
from mmserve.actors import faults
from mmserve.errors import InternalError, MMServeError
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import ask, assert_nothing_held

BLOCKS = 12  # of 8 tokens: 96 tokens of KV; a prompt with one 64x64 image is 29 (LLaVA) or 31 tokens
BLOCK_BYTES = {"demo": 16384, "demo-qwen": 8192}


def small_arena(config, model: str = "demo"):
    return config.replace(kv_cache={"block_size": 8, "budget_bytes": BLOCKS * BLOCK_BYTES[model]})


IMAGE = render_image("blue", "square", background="white", seed=41)
QUESTION = ask(IMAGE, Q_COLOR)
LONG = ask(render_image("green", "circle", background="white", seed=42), Q_SHAPE)


async def ask_again_beside_a_long_answer(rt, model: str, **kw) -> dict:
    """QUESTION, asked once its prompt's blocks are cached (so its prefix hit covers the image
    whole and it gets no encoder output) while a long answer decodes: both cannot fit, it is the
    newest, so it is preempted, and the long answer evicts its cached blocks before it resumes.
    Returns {"again": its completion or error, "long": the long answer's text}."""
    out = {}

    async def again():
        try:
            out["again"] = await rt.chat_completion(QUESTION, model=model, temperature=0, max_tokens=30,
                                                    min_tokens=30, **kw)
        except MMServeError as e:
            out["again"] = e

    async with trio.open_nursery() as nursery:
        long_answer = rt.chat(LONG, model=model, temperature=0, max_tokens=60, min_tokens=60)
        texts = []
        async for delta in long_answer:  # the long answer is decoding: the question comes after it
            texts.append(delta.text)
            nursery.start_soon(again)
            break
        texts += [delta.text async for delta in long_answer]
    out["long"] = "".join(texts)
    return out


@pytest.mark.parametrize("model", ["demo", "demo-qwen"])
async def test_a_preempted_request_whose_image_kv_was_evicted_encodes_it_again(three_model_config, model):
    async with Runtime.open(small_arena(three_model_config, model)) as rt:
        alone = await rt.chat_completion(QUESTION, model=model, temperature=0, max_tokens=30, min_tokens=30)
        generator = rt.registry.require(model).generator
        got = await ask_again_beside_a_long_answer(rt, model)
        assert got["again"].text == alone.text
        assert got["again"].usage.cached_tokens >= 24
        assert generator.preemptions >= 1 and generator.builder.reencoded_images >= 1
        assert rt.metrics.registry.get_sample_value("mmserve:reencoded_images_total", {"model_name": model}) \
            == generator.builder.reencoded_images
        await assert_nothing_held(rt)


async def test_a_failed_re_encoding_fails_that_request_alone(demo_config):
    async with Runtime.open(demo_config) as plain:
        long_alone = (await plain.chat_completion(LONG, temperature=0, max_tokens=60, min_tokens=60)).text
    async with Runtime.open(small_arena(demo_config)) as rt:
        await rt.chat_completion(QUESTION, temperature=0, max_tokens=30, min_tokens=30)
        faults.configure("generator.reencode[again]=raise")
        try:
            got = await ask_again_beside_a_long_answer(rt, "demo", client_request_id="again")
        finally:
            faults.configure(None)
        assert isinstance(got["again"], InternalError) and got["again"].status == 500
        assert got["long"] == long_alone
        assert rt.health().ok and not any(s.restarts for s in rt.supervisor.states.values())
        await assert_nothing_held(rt)


async def test_an_answer_longer_than_the_arena_ends_at_its_capacity(demo_config):
    """Alone it could never be prefilled again after a preemption: it ends with "length" where
    the arena is full, instead of waiting for blocks that cannot exist."""
    async with Runtime.open(small_arena(demo_config)) as rt:
        got = await rt.chat_completion(ask(render_image("red", "circle", seed=43)), temperature=0,
                                       max_tokens=200, min_tokens=200)
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens + got.usage.completion_tokens == BLOCKS * 8
        await assert_nothing_held(rt)


SCORED = ("red green blue square circle triangle " * 9).strip()  # ~55 tokens: 7 blocks of 8


async def test_a_scoring_request_preempted_mid_prompt_still_scores_every_position(demo_config):
    """A request that scores its prompt (echo + logprobs) is preempted in the middle of its prefill
    by an older answer that grows, and holds the same prompt's blocks: its resume must not take
    back cached blocks whose positions it has not scored (a cached block has KV, no logits) —
    every position gets its logprob, the same as alone."""
    async with Runtime.open(small_arena(demo_config).replace(generator={"max_batched_tokens": 9})) as rt:
        generator = rt.registry.require("demo").generator
        alone = await rt.text_completion(SCORED, max_tokens=0, echo=True, logprobs=1)
        want = [s.logprob for s in alone.choices[0].prompt_logprobs]
        assert want[0] is None and None not in want[1:] and len(want) > 48
        await rt.reset_caches()
        out = {}
        async with trio.open_nursery() as nursery:
            older = rt.chat(request=rt.parse_completions(dict(prompt=SCORED, max_tokens=30, min_tokens=30,
                                                               temperature=0))[0])
            async for _ in older:  # the older answer decodes (its prompt's blocks committed): then the scoring one
                async def score():
                    out["scored"] = await rt.text_completion(SCORED, max_tokens=0, echo=True, logprobs=1)
                nursery.start_soon(score)
                break
            async for _ in older:
                pass
        got = [s.logprob for s in out["scored"].choices[0].prompt_logprobs]
        assert generator.preemptions >= 1
        assert got[0] is None and None not in got[1:], [j for j, lp in enumerate(got) if lp is None]
        assert got[1:] == pytest.approx(want[1:], abs=1e-4)
        await assert_nothing_held(rt)

"""The prefix cache inside the runtime (tiny random model): hits across turns, an exact hit
boundary inside an image, salts, and nothing pinned once requests end."""

import trio
import trio.testing

from mmserve import Runtime
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import ask


def cfg(tiny_config, **kv):
    return tiny_config.replace(kv_cache={"prefix_caching" if k == "enabled" else k: v for k, v in kv.items()})


async def run(config, conversations, **kw):
    """Greedy answers (text, cached_tokens) for each conversation, in order, in one runtime."""
    out = []
    async with Runtime.open(config) as rt:
        for msgs in conversations:
            c = await rt.chat_completion(msgs, temperature=0, max_tokens=12, min_tokens=12, **kw)
            out.append((c.text, c.usage.cached_tokens))
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)  # let the manager drain its inbox
        pc = rt.registry.require("tiny").prefix_cache
        stats = pc.stats() if pc else None
        if pc:
            pc.arena.check_invariants()
            assert not pc.arena.owners(), "blocks held after every request ended"
    return out, stats


def two_turns(img):
    first = ask(img, Q_COLOR)
    return first, [*first, {"role": "assistant", "content": "red"}, {"role": "user", "content": Q_SHAPE}]


async def test_second_turn_hits_and_equals_the_uncached_answer(tiny_config):
    img = render_image("red", "circle", seed=1)
    t1, t2 = two_turns(img)
    on, stats = await run(cfg(tiny_config), [t1, t2])
    off, _ = await run(cfg(tiny_config, enabled=False), [t1, t2])
    assert [text for text, _ in on] == [text for text, _ in off]
    assert on[0][1] == 0 and on[1][1] >= 16 and on[1][1] % 16 == 0
    assert all(cached == 0 for _, cached in off)
    assert stats["hit_blocks"] * 16 == on[1][1]


async def test_hit_ending_inside_an_image_gets_the_remaining_rows(tiny_config):
    img = render_image("blue", "square", seed=2)
    a, b = ask(img, Q_COLOR), ask(img, Q_SHAPE)  # share "<s>user: <image>" and differ after it
    on, _ = await run(cfg(tiny_config, block_size=8), [a, b])
    off, _ = await run(cfg(tiny_config, enabled=False), [a, b])
    assert on[1][1] > 0
    assert [t for t, _ in on] == [t for t, _ in off]


async def test_hit_boundary_sweep_over_block_sizes(tiny_config):
    img = render_image("green", "triangle", seed=3)
    convo = [ask(img, Q_COLOR), ask(img, Q_COLOR)]  # the identical prompt: the hit is capped
    off, _ = await run(cfg(tiny_config, enabled=False), convo)
    for block in (3, 5, 7, 16):
        on, _ = await run(cfg(tiny_config, block_size=block), convo)
        assert [t for t, _ in on] == [t for t, _ in off], block
        assert on[1][1] > 0 and on[1][1] % block == 0


async def test_different_salts_never_share(tiny_config):
    img = render_image("red", "circle", seed=4)
    async with Runtime.open(cfg(tiny_config)) as rt:
        kw = dict(temperature=0, max_tokens=4)
        await rt.chat_completion(ask(img), cache_salt="alice", **kw)
        bob = await rt.chat_completion(ask(img), cache_salt="bob", **kw)
        alice = await rt.chat_completion(ask(img), cache_salt="alice", **kw)
    assert bob.usage.cached_tokens == 0 and alice.usage.cached_tokens > 0


async def test_aborted_requests_leave_no_pins(tiny_config):
    img = render_image("red", "circle", seed=5)
    async with Runtime.open(cfg(tiny_config)) as rt:
        await rt.chat_completion(ask(img), temperature=0, max_tokens=4)
        for _ in range(3):
            async with rt.chat(ask(img), temperature=0, max_tokens=500, min_tokens=500) as s:
                await s.__anext__()
        with trio.fail_after(5):
            while rt.registry.require("tiny").generator.running:
                await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)
        store = rt.registry.require("tiny").prefix_cache.arena
        store.check_invariants()
        assert not store.owners()


async def test_an_image_the_hit_covers_is_never_encoded(demo_config):
    """The lookup comes before the encoder: a later turn whose cached prefix holds every placeholder
    of its image asks the encoder for nothing (no encoder-cache lookup either), and answers the same
    as with the caches off."""
    img = render_image("purple", "triangle", seed=8)
    first = ask(img, Q_COLOR)
    answers = {}
    for on in (True, False):
        config = demo_config.replace(kv_cache={"block_size": 8, "prefix_caching": on}, encoder_cache={"enabled": on})
        async with Runtime.open(config) as rt:
            a = await rt.chat_completion(first, temperature=0, max_tokens=4)
            follow = [*first, {"role": "assistant", "content": a.text}, {"role": "user", "content": Q_SHAPE}]
            enc = rt.registry.require("demo").encoder
            before = enc.stats()
            b = await rt.chat_completion(follow, temperature=0, max_tokens=4)
            after = enc.stats()
            answers[on] = (a.text, b.text)
            if on:
                assert b.usage.cached_tokens > 0
                assert after["items_encoded"] == before["items_encoded"]
                assert after["hits"] + after["misses"] == before["hits"] + before["misses"], "encoder was asked"
    assert answers[True] == answers[False]

"""The Encoder actor with its cache: hits, misses, batching, in-flight dedup, identity rules."""

import json
import shutil

import structlog
import trio

from mmserve import Runtime
from mmserve.actors.intake import decode_images
from mmserve.cache.keys import encoder_cache_key, image_identity
from mmserve.models.demo import render_image
from mmserve.models.llava import LlavaAdapter
from mmserve.inputs.request import parse_chat_request
from tests.helpers import ask, data_url


def encoder(rt, model="tiny"):
    return rt.registry.require(model).encoder


def cfg(tiny_config, **cache):
    return tiny_config.replace(encoder_cache=cache)


async def answer(rt, messages, **kw):
    return (await rt.chat_completion(messages, temperature=0, max_tokens=6, **kw)).text


async def test_second_request_for_an_image_hits_and_answers_the_same(tiny_config):
    img = render_image("red", "circle", seed=1)
    async with Runtime.open(tiny_config) as rt:
        with structlog.testing.capture_logs() as logs:
            first = await answer(rt, ask(img))
            await answer(rt, ask(img, "What shape is it?"))  # a hit: the same image
            again = await answer(rt, ask(img))
        stats = encoder(rt).stats()
    assert first == again
    assert (stats["hits"], stats["misses"], stats["inserts"], stats["encoder_runs"]) == (2, 1, 1, 1)
    assert stats["bytes_saved"] == 2 * stats["bytes_in_use"] > 0
    hits = [e for e in logs if e["event"] == "encoder_cache.hit"]
    assert len(hits) == 2 and all(e["key"] and e["request_id"] and e["bytes"] > 0 for e in hits)
    assert [e["event"] for e in logs if e["event"].startswith("encoder_cache.")][:2] == [
        "encoder_cache.miss", "encoder_cache.insert"]


async def test_cache_off_encodes_every_time_with_equal_answers(tiny_config):
    img = render_image("blue", "square", seed=2)
    async with Runtime.open(tiny_config) as rt:
        cached = [await answer(rt, ask(img)) for _ in range(2)]
    async with Runtime.open(cfg(tiny_config, enabled=False)) as rt:
        fresh = [await answer(rt, ask(img)) for _ in range(2)]
        stats = encoder(rt).stats()
    assert cached == fresh
    assert stats["enabled"] is False and stats["encoder_runs"] == 2


async def test_eight_simultaneous_requests_for_one_new_image_encode_once(tiny_config):
    img = render_image("green", "triangle", seed=3)
    async with Runtime.open(tiny_config) as rt:
        answers = []

        async def one():
            answers.append(await answer(rt, ask(img)))

        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(one)
        stats = encoder(rt).stats()
    assert len(set(answers)) == 1 and len(answers) == 8
    assert stats["items_encoded"] == 1 and stats["encoder_runs"] == 1
    assert stats["misses"] + stats["hits"] <= 8 and stats["inserts"] == 1


async def test_misses_from_different_requests_share_one_forward(tiny_config):
    images = [render_image(c, "circle", seed=10 + i) for i, c in enumerate(("red", "green", "blue", "yellow"))]
    async with Runtime.open(cfg(tiny_config, batch_wait_ms=200.0)) as rt:
        async with trio.open_nursery() as n:
            for img in images:
                n.start_soon(answer, rt, ask(img))
        stats = encoder(rt).stats()
    assert stats["items_encoded"] == 4 and stats["encoder_runs"] < 4


async def test_uncacheable_items_are_encoded_fresh_and_never_stored(tiny_config, monkeypatch):
    monkeypatch.setattr("mmserve.models.adapter.image_identity", lambda *a, **k: None)
    img = render_image("red", "square", seed=4)
    async with Runtime.open(tiny_config) as rt:
        for _ in range(2):
            await answer(rt, ask(img))
        stats = encoder(rt).stats()
    assert stats["encoder_runs"] == 2 and stats["entries"] == 0 and stats["inserts"] == 0


async def test_item_larger_than_budget_is_served_not_stored(tiny_config):
    img = render_image("red", "square", seed=5)
    async with Runtime.open(cfg(tiny_config, budget_bytes=100)) as rt:
        a = await answer(rt, ask(img))
        b = await answer(rt, ask(img))
        stats = encoder(rt).stats()
    assert a == b and stats["entries"] == 0 and stats["encoder_runs"] == 2


async def test_lru_eviction_under_a_small_budget(tiny_config):
    imgs = [render_image("red", "circle", seed=20 + i) for i in range(3)]
    async with Runtime.open(tiny_config) as rt:
        per_item = None
        await answer(rt, ask(imgs[0]))
        per_item = encoder(rt).stats()["bytes_in_use"]
    async with Runtime.open(cfg(tiny_config, budget_bytes=2 * per_item)) as rt:
        for i in (0, 1, 0, 2, 0, 1):  # 1 is least recently used when 2 arrives
            await answer(rt, ask(imgs[i]))
        stats = encoder(rt).stats()
    assert stats["bytes_in_use"] <= 2 * per_item
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (2, 4, 2)


def _keys(adapter, body, limits):
    request = parse_chat_request(body, limits, "tiny")
    return [image_identity(adapter.model_sig, adapter.processor_digest, im) for im in decode_images(request, limits)]


def test_identity_png_equals_lossless_webp_and_differs_otherwise(tiny_model_dir, tiny_config, tmp_path):
    limits = tiny_config.limits
    adapter = LlavaAdapter("tiny", tiny_model_dir)
    img, other = render_image("red", "circle", seed=6), render_image("red", "circle", seed=7)
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(img, "PNG")}},
        {"type": "image_url", "image_url": {"url": data_url(img, "WEBP", lossless=True)}},
        {"type": "image_url", "image_url": {"url": data_url(other, "PNG")}},
        {"type": "text", "text": "?"}]}]}
    png, webp, different = _keys(adapter, body, limits)
    assert png == webp and png != different and None not in (png, webp, different)

    changed = tmp_path / "tiny-other-processor"
    shutil.copytree(tiny_model_dir, changed)
    cfg_path = changed / "processor_config.json"
    if not cfg_path.exists():
        cfg_path = changed / "preprocessor_config.json"
    settings = json.loads(cfg_path.read_text())
    target = settings.get("image_processor", settings)
    target["image_mean"] = [0.5, 0.5, 0.5]
    cfg_path.write_text(json.dumps(settings))
    other_adapter = LlavaAdapter("tiny", changed)
    assert other_adapter.processor_digest != adapter.processor_digest
    assert _keys(other_adapter, body, limits)[0] != png


async def test_the_cache_salt_covers_the_encoder_cache(tiny_config):
    """Tenant B's request for an image tenant A sent is an encoder-cache miss (no timing needed:
    the counters say it); A's repeat and B's repeat each hit their own entry, and a request
    without a salt has its own namespace. Prefix caching off, so every request asks the encoder."""
    img = render_image("red", "circle", seed=40)
    config = tiny_config.replace(kv_cache={"prefix_caching": False})
    async with Runtime.open(config) as rt:
        enc = encoder(rt)

        async def counts_after(salt):
            await answer(rt, ask(img), **({} if salt is None else {"cache_salt": salt}))
            s = enc.stats()
            return s["hits"], s["misses"], s["encoder_runs"]

        assert await counts_after("tenant-a") == (0, 1, 1)
        assert await counts_after("tenant-b") == (0, 2, 2)  # A's image, B's salt: a miss, encoded
        assert await counts_after("tenant-a") == (1, 2, 2)  # A's repeat hits A's entry
        assert await counts_after("tenant-b") == (2, 2, 2)  # B's repeat hits B's entry
        assert await counts_after(None) == (2, 3, 3)  # no salt: a namespace of its own
        assert await counts_after(None) == (3, 3, 3)
        mm_hash = enc.adapter.image_key(img.convert("RGB"))
        expected = {encoder_cache_key(mm_hash, salt, algorithm=enc.adapter.hash_algorithm)
                    for salt in ("tenant-a", "tenant-b", None)}
        assert set(enc.cache.keys()) == expected and mm_hash not in expected


async def test_two_tenants_missing_one_image_in_one_batch_are_two_items(tiny_config):
    """In-flight dedup is per encoder key: one tenant's concurrent requests share one encoding,
    two tenants' never do (each is encoded — in the same forward when they arrive together — and
    stored under its own key). Whatever the arrival order, 2 items, never 1 or 3."""
    img = render_image("blue", "circle", seed=41)
    config = tiny_config.replace(kv_cache={"prefix_caching": False}, encoder_cache={"batch_wait_ms": 300.0})
    async with Runtime.open(config) as rt:
        async with trio.open_nursery() as n:
            for salt in ("tenant-a", "tenant-a", "tenant-b"):
                n.start_soon(lambda s=salt: answer(rt, ask(img), cache_salt=s))
        stats = encoder(rt).stats()
    assert (stats["items_encoded"], stats["entries"]) == (2, 2)

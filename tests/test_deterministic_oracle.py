"""`[runtime] deterministic = true` (issue 40): for every served family — LLaVA, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision, Idefics3, Gemma 3 — every generated token's logprobs are
bit-identical with the caches on (a tiny arena: preemptions; 24-token steps: chunked prefills;
concurrent requests; n = 2; a seeded sampled request; a hit ending inside an image; blocks
restored from the Redis tier) and off with the request alone: 0 tolerated flips. The negative
control: with the mode off, the same check fails.

The workloads and the check: tests/deterministic_oracle.py."""

from __future__ import annotations

import pytest

from mmserve import SyncRuntime
from mmserve.config import Config, ModelConfig
from mmserve.models.demo import Q_COLOR, Q_SHAPE, build_untrained
from tests.conftest import _demo_dir, on_device
from tests.deterministic_oracle import Family, Oracle, Request, workload
from tests.redis_server import RedisServer

QWEN = ((96, 96), (112, 48), (40, 96), (72, 56), (32, 32))
SQUARE = (None,) * 5
FAMILIES = {  # model: (preset, image sizes)
    "demo": ("demo", SQUARE),
    "q2": ("tiny-qwen", QWEN),
    "q25": ("tiny-qwen2.5-vl", QWEN),
    "q3": ("tiny-qwen3-vl", QWEN),
    "ov": ("tiny-llava-onevision", ((64, 64), (48, 40), (32, 32), (100, 40), (40, 100))),
    "smol": ("tiny-idefics3", ((64, 64), (50, 30), (100, 20), (30, 50), (20, 100))),
    "g3": ("tiny-gemma3", SQUARE),
}


def family(model: str, tmp_path_factory) -> Family:
    preset, sizes = FAMILIES[model]
    path = _demo_dir("demo") if model == "demo" else \
        str(build_untrained(preset, tmp_path_factory.mktemp(model) / preset, seed=0, random_weights=True))
    return Family(model, str(path), sizes)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_logprob_is_bit_identical_cached_batched_chunked_preempted(model, tmp_path_factory):
    oracle = Oracle(family(model, tmp_path_factory))
    requests = workload(seed=40, images=len(oracle.images))
    with oracle.runtimes(requests) as (on, off, want):
        assert oracle.differences(on, want, requests) == []
        generator = oracle.loaded(on).generator
        stats = on.stats()[model]
        # what the workload reached: prefix hits, evictions, preemptions, chunked prefills
        assert stats["prefix_cache"]["hit_blocks"] > 0, stats
        assert oracle.hit_ends_inside_an_image(on, requests), oracle.cached
        assert generator.preemptions > 0, "the arena was large enough: nothing was preempted"
        assert on.chat_completion([{"role": "user", "content": "hi"}], max_tokens=1).system_fingerprint \
            == "mmserve-det2:batch+prefix_cache+chunking+preemption"


@pytest.mark.slow
@pytest.mark.parametrize("model", list(FAMILIES))
def test_larger_randomized_workloads_are_bit_identical(model, tmp_path_factory):
    """Three more seeds of a larger workload (5 conversations, 4 asks) a family."""
    oracle = Oracle(family(model, tmp_path_factory))
    for seed in (1, 2, 3):
        requests = workload(seed=seed, images=len(oracle.images), conversations=5, asks=4)
        with oracle.runtimes(requests) as (on, off, want):
            assert oracle.differences(on, want, requests) == [], seed


def test_the_same_check_fails_with_the_mode_off(tmp_path_factory):
    oracle = Oracle(family("demo", tmp_path_factory), deterministic=False)
    requests = workload(seed=40, images=len(oracle.images))
    with oracle.runtimes(requests) as (on, off, want):
        assert oracle.differences(on, want, requests)
        assert on.chat_completion([{"role": "user", "content": "hi"}], max_tokens=1).system_fingerprint is None


@pytest.mark.parametrize("model", ["demo", "q2"])
def test_a_prefix_restored_from_the_redis_tier_is_bit_identical(model, tmp_path_factory):
    """Replica A answers a conversation's first turn (its blocks are in a real redis-server before
    the answer ends); replica B, which never saw it, answers the whole conversation from the
    blocks it restores: every logprob equals the conversation's alone with the caches off."""
    oracle = Oracle(family(model, tmp_path_factory))
    conversation = Request((((0, 1), Q_COLOR), ((2,), Q_SHAPE)), 5)
    base = on_device(Config(models=(ModelConfig(model, oracle.family.path, default=True),))) \
        .replace(runtime={"deterministic": True})
    with SyncRuntime(base.replace(kv_cache={"prefix_caching": False}, encoder_cache={"enabled": False})) as off:
        want = oracle.alone(off, conversation)
    with RedisServer(tmp_path_factory.mktemp("redis"), None) as server:
        tier = base.replace(shared_cache={"url": server.url, "secret": "deterministic-oracle",
                                          "lookup_deadline_ms": 3000.0})
        with SyncRuntime(tier) as a, SyncRuntime(tier) as b:
            assert oracle.served(a, Request(conversation.turns[:1], conversation.tokens)) == [want[:1]]
            assert oracle.served(b, conversation) == [[w] for w in want]
            assert oracle.cached[-1] > 0
            assert b.runtime.registry.require(model).prefix_cache.stats()["shared_restored_blocks"] > 0

"""One loaded model's actors, wired at construction: each is handed every channel, runner and
shared resource it will ever use when it is built, and nothing is set on it afterwards (a restart
by the supervisor runs the same actor again; its wiring does not change)."""

from __future__ import annotations

import math

import trio

from mmserve.actors.encoder import Encoder
from mmserve.actors.generator import Generator
from mmserve.actors.prefix_cache import PrefixCacheManager
from mmserve.actors.shared_tier import SharedTier
from mmserve.config import Config
from mmserve.engine.runner import ModelRunner
from mmserve.engine.vision_step import VisionPath, image_buckets_for
from mmserve.engine.arena import KVArena
from mmserve.runtime.sizing import context_tokens, kv_budget


def build_model_actors(config: Config, adapter, metrics=None, kv_events=None) -> dict:
    """The model's actors around its KV arena, by role: the tensors go to the generator's model
    runner, the bookkeeping of the same blocks to the cache manager; with `[shared_cache]` on, the
    model's SharedTier (Redis) beside them, which the encoder and the manager ask and feed.
    `kv_events`: the replica's KVEventPublisher ([kv_events]; None: off)."""
    kv, rt, gen = config.kv_cache, config.runtime, config.generator
    block_bytes = KVArena.block_bytes_for(adapter, kv.block_size)
    budget = kv_budget(config, rt.device, block_bytes, context_tokens(config, adapter))
    runner = ModelRunner(adapter, budget.value, kv.block_size, rt.attention_backend,
                         max_batch=gen.max_running_requests, cuda_graphs=rt.cuda_graphs,
                         max_tokens=gen.max_batched_tokens, token_buckets=rt.graph_token_buckets or None,
                         deterministic=rt.deterministic)
    runner.kv_budget_from = budget.why  # for the load log line
    tier = SharedTier(adapter.name, config.shared_cache) if config.shared_cache.enabled else None
    caching_tier = tier if kv.prefix_caching else None  # KV blocks are shared only where they are cached
    # the manager and the generator send to each other: the manager's inbox is made first
    to_manager = trio.open_memory_channel(math.inf)
    generator = Generator(adapter, to_manager[0], runner, kv, gen, metrics, overlap=rt.overlap,
                          # with a shared tier, a finish waits until the manager says the answer's blocks
                          # are written (`FinishFlushed`), at most finish_flush_ms (None: at once)
                          finish_flush_s=(config.shared_cache.finish_flush_ms / 1000
                                          if caching_tier is not None and config.shared_cache.finish_flush_ms else None))
    # the runner's write fence starts each manager life, with or without a shared tier
    manager = PrefixCacheManager(adapter.name, kv, runner.kv.num_blocks, runner=runner, generator=generator.inbox_send,
                                 shared=caching_tier, events=kv_events if kv.prefix_caching else None,
                                 inbox=to_manager)
    vision = VisionPath(adapter, image_buckets_for(rt.graph_image_buckets, adapter.device,
                                                   config.encoder_cache.max_batch_images), rt.cuda_graphs)
    encoder = Encoder(adapter, generator.inbox_send, config.encoder_cache, manager.inbox_send, vision, shared=tier)
    actors = {"prefix_cache": manager, "encoder": encoder, "generator": generator}
    if tier is not None:
        actors["shared_tier"] = tier
    return actors

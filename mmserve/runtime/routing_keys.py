"""A request's routing keys, for KV-aware routers fed by this replica's KV events ([kv_events]):
the token ids the model sees (images expanded to their placeholders), Dynamo's `block_mm_infos`
(each full block's images by `mm_hash`), the routing group (`cache_salt` there) and the blocks'
routing ids. Made by intake's own preparation and the same block chain the generator commits
with, so what a router is asked and what the replica announced agree by construction."""

from __future__ import annotations

from mmserve.actors.intake import _decode_and_prepare, remote_urls
from mmserve.cache.block_hash import BlockChain
from mmserve.cache.kv_event_records import block_mm_routing, mm_infos, routing_group, routing_id
from mmserve.config import LimitsConfig
from mmserve.errors import BadRequest
from mmserve.inputs.request import ChatRequest
from mmserve.models.adapter import Adapter


def routing_keys(adapter: Adapter, request: ChatRequest, limits: LimitsConfig, block_size: int) -> dict:
    """`{token_ids, block_size, block_mm_infos, cache_salt, block_hashes}` of a chat request (runs
    in a worker thread: images are decoded and preprocessed). `block_mm_infos` has one entry per
    full block (None: no image in it); `block_hashes` are the routing ids of the blocks the replica
    would announce (chains stop at an image without a content key, as caching does)."""
    if remote_urls(request):
        raise BadRequest("routing keys take images as data: URLs only (nothing is fetched)", param="messages")
    prompt, hashes, _, _ = _decode_and_prepare(adapter, request, limits, None, None, block_size)
    ids = list(prompt.input_ids)
    chain = BlockChain.of(adapter.model_sig, request.cache_salt, len(ids), prompt.spans, prompt.mm_keys, block_size,
                          algorithm=adapter.hash_algorithm)
    infos = [mm_infos(block_mm_routing(chain.items, i * block_size, block_size)) for i in range(len(ids) // block_size)]
    return {"token_ids": ids, "block_size": block_size, "block_mm_infos": infos,
            "cache_salt": routing_group(chain.root, request.cache_salt),
            "block_hashes": [routing_id(h) for h in hashes]}

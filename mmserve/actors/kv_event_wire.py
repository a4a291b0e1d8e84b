"""KV events in vLLM's wire format (`vllm/distributed/kv_events.py`): one msgpack `KVEventBatch`
per ZMQ message, its events tagged by class name.

- `"vllm"`: vLLM's positional form (msgspec `array_like`, what llm-d's kv-cache manager decodes):
  a batch is `[ts, [event, ...], data_parallel_rank]`, a stored event
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys]` (`extra_keys` only when a block has images or a routing group: per block,
  `[[mm_hash, start, end], ..., group]`, like vLLM's per-block extra keys), a removal
  `["BlockRemoved", block_hashes, medium]`, a reset `["AllBlocksCleared"]`.
- `"dynamo"`: the batch as above, each event's fields as a map (`{"type": "BlockStored", ...}`:
  Dynamo 1.6's decoder wants the batch a 3-tuple and reads `block_mm_infos` from maps), plus Dynamo's
  `block_mm_infos` — per block `{"mm_objects": [{"mm_hash": u64, "offsets": [[s, e]]}]}` or None —
  and `cache_salt` (the routing group) when the blocks have one. Dynamo drops vLLM's `extra_keys`:
  without `block_mm_infos` two images with the same placeholder tokens would collide there.

Hashes are routing ids (`cache.kv_event_records.routing_id`: signed int64); `medium` is "GPU" (the
arena, whatever the device: routers read it as the device tier), `lora_id`/`lora_name` None.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from mmserve.cache.kv_event_records import AllCleared, BlocksRemoved, BlocksStored, StoredBlock, mm_infos

ENCODINGS = ("vllm", "dynamo")
MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the KV arena's tier


def _extra_keys(block: StoredBlock) -> list | None:
    keys: list[Any] = [[m.mm_hash, m.start, m.end] for m in block.mm]
    if block.group is not None:
        keys.append(block.group)
    return keys or None


def _tokens(e: BlocksStored) -> list[int]:
    return [t for b in e.blocks for t in b.token_ids]


def positional(event) -> list:
    """One event in vLLM's positional form."""
    if isinstance(event, BlocksStored):
        out = ["BlockStored", [b.block for b in event.blocks], event.parent, _tokens(event), event.block_size,
               None, MEDIUM, None]
        extra = [_extra_keys(b) for b in event.blocks]
        if any(k is not None for k in extra):
            out.append(extra)
        return out
    if isinstance(event, BlocksRemoved):
        return ["BlockRemoved", list(event.blocks), MEDIUM]
    if isinstance(event, AllCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def mapped(event) -> dict:
    """One event in the map form, with Dynamo's `block_mm_infos`."""
    if isinstance(event, BlocksStored):
        out = {"type": "BlockStored", "block_hashes": [b.block for b in event.blocks],
               "parent_block_hash": event.parent, "token_ids": _tokens(event), "block_size": event.block_size,
               "lora_id": None, "medium": MEDIUM, "lora_name": None,
               "block_mm_infos": [mm_infos(b.mm) for b in event.blocks]}
        if event.group is not None:
            out["cache_salt"] = event.group
        return out
    if isinstance(event, BlocksRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.blocks), "medium": MEDIUM}
    if isinstance(event, AllCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


class BatchEncoder:
    """Encodes batches in one encoding (msgpack via msgspec; one encoder per publisher thread)."""

    def __init__(self, encoding: str, data_parallel_rank: int = 0):
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown KV event encoding {encoding!r}; known: {ENCODINGS}")
        self.encoding = encoding
        self.rank = data_parallel_rank
        self._pack = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: Sequence) -> bytes:
        if self.encoding == "vllm":
            return self._pack.encode([ts, [positional(e) for e in events], self.rank])
        # Dynamo decodes the batch positionally (a 3-tuple) and each event as a map
        return self._pack.encode([ts, [mapped(e) for e in events], self.rank])

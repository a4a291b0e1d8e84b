"""What KV events say about the arena's cached blocks, before any wire format (`actors.kv_event_wire`
encodes them in vLLM's): a block stored, blocks removed, everything cleared — and the routing ids
external routers key them by.

Routers (Dynamo's, llm-d's) recompute their own keys from each block's token ids (and, Dynamo's,
its `block_mm_infos`); the engine's hashes are only names for later removals. So a block's
**routing id** is the first 8 bytes of its 16-byte block hash read as a signed int64 (Dynamo takes
int64, never bytes), an image's `mm_hash` the first 8 bytes of its content key as a u64. Both go
one way only: nothing here is ever turned back into a cache key, so a routing collision costs a
miss on the router's side, never a wrong answer (the arena keys by the full 16-byte hash).

A tenant (`cache_salt`) is a **routing group** of its own: its blocks carry `group` =
`routing_group(root)`, 16 hex digits of its chain's root hash (over the model signature and the
salt) — the salt itself never leaves the replica. A request without a salt has no group.

Pure and synchronous, like the rest of `cache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mmserve.cache.block_hash import MMPlaceholder


def routing_id(block_hash: bytes) -> int:
    """A block's id for routers: its hash's first 8 bytes as a big-endian signed int64."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


def mm_routing_hash(content_key: bytes) -> int:
    """An image's `mm_hash` for routers: its content key's first 8 bytes as a big-endian u64."""
    return int.from_bytes(content_key[:8], "big")


def routing_group(root: bytes, cache_salt: str | None) -> str | None:
    """The routing group of a chain rooted at `root`: None without a salt, else 16 hex digits of
    the root hash (model signature and salt inside; the salt is never sent)."""
    return None if cache_salt is None else root[:8].hex()


@dataclass(frozen=True)
class MMRouting:
    """One image's placeholders inside one block: its `mm_hash` and [start, end) within the block."""

    mm_hash: int
    start: int
    end: int


def block_mm_routing(items: Sequence[MMPlaceholder], block_start: int, block_size: int) -> tuple[MMRouting, ...]:
    """The images whose placeholder runs overlap block [block_start, block_start + block_size), in
    position order, each with the part of its run inside the block (block-relative offsets)."""
    end = block_start + block_size
    return tuple(MMRouting(mm_routing_hash(it.mm_hash), max(it.start, block_start) - block_start,
                           min(it.end, end) - block_start)
                 for it in sorted(items, key=lambda it: it.start) if it.start < end and it.end > block_start)


def mm_infos(mm: Sequence[MMRouting]) -> dict | None:
    """One block's entry of Dynamo's `block_mm_infos` (None: no image in it)."""
    if not mm:
        return None
    return {"mm_objects": [{"mm_hash": m.mm_hash, "offsets": [[m.start, m.end]]} for m in mm]}


@dataclass(frozen=True)
class BlockRouting:
    """What a `Commit` tells of its blocks beyond their hashes, for KV events: the blocks `hashes`
    (consecutive, from token `start`: the committed ones, and on a request's first commit also the
    cached prefix it started with — blocks restored from the shared tier are announced then), the
    hash of the block before them (None at the start of the prompt), their token ids (flat, in
    order, `block_size` each), the request's images and its routing group. Built by the generator
    from what it hashed the blocks with."""

    parent: bytes | None
    start: int
    token_ids: tuple[int, ...]
    items: tuple[MMPlaceholder, ...]
    group: str | None
    hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class StoredBlock:
    """One block announced: its routing id, its parent's (None: the first block of a prompt), its
    token ids, its images, its group."""

    block: int
    parent: int | None
    token_ids: tuple[int, ...]
    mm: tuple[MMRouting, ...]
    group: str | None


def stored_blocks(routing: BlockRouting, block_size: int) -> dict[bytes, StoredBlock]:
    """Each block a Commit's routing covers, as it would be announced, by its hash (in order)."""
    out, parent = {}, routing.parent
    for k, h in enumerate(routing.hashes):
        lo = k * block_size
        out[h] = StoredBlock(routing_id(h), routing_id(parent) if parent is not None else None,
                             tuple(routing.token_ids[lo:lo + block_size]),
                             block_mm_routing(routing.items, routing.start + lo, block_size), routing.group)
        parent = h
    return out


@dataclass(frozen=True)
class BlocksStored:
    """Event: consecutive blocks of one chain became cached (committed), `blocks[0]` chained from
    `parent`."""

    blocks: tuple[StoredBlock, ...]
    block_size: int

    @property
    def parent(self) -> int | None:
        return self.blocks[0].parent

    @property
    def group(self) -> str | None:
        return self.blocks[0].group


@dataclass(frozen=True)
class BlocksRemoved:
    """Event: these blocks (routing ids) are no longer cached (evicted, or cleared)."""

    blocks: tuple[int, ...]


@dataclass(frozen=True)
class AllCleared:
    """Event: nothing is cached any more (start, reset)."""


def runs(stored: Sequence[StoredBlock], block_size: int) -> list[BlocksStored]:
    """Stored blocks in order, grouped into events: a block joins the previous event when it chains
    from that event's last block in the same group (as vLLM groups a request's new blocks)."""
    events: list[list[StoredBlock]] = []
    for s in stored:
        if events and s.parent == events[-1][-1].block and s.group == events[-1][-1].group:
            events[-1].append(s)
        else:
            events.append([s])
    return [BlocksStored(tuple(run), block_size) for run in events]

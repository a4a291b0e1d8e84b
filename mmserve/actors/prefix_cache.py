"""PrefixCacheManager actor: owns the KV block store and its tensor pool; the only code that
assigns a slot.

The generator asks it to `lookup` a prompt's block hashes (the hit prefix is pinned and its KV
returned), `prepare`s a ticket (nothing consumed), and at the end `commit`s the sequence's full
blocks (slots assigned now, LRU entries evicted and their stale entries erased) or `abort`s (pins
released, nothing else changes). See DESIGN.md F2 and F3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import trio
from transformers.cache_utils import Cache

from mmserve.actors.base import Actor
from mmserve.cache.block_hash import MMPlaceholder, block_hashes, root_hash
from mmserve.cache.keys import key_prefix
from mmserve.cache.kv_store import KVBlockStore
from mmserve.errors import MMServeError
from mmserve.models.llava import ImageSpan, LlavaAdapter
from mmserve.runtime.config import PrefixCacheConfig
from mmserve.runtime.faults import afault

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values), [1, heads, seq, dim]


@dataclass(frozen=True)
class PinnedBlocks:
    """A read-only view of a hit's slots in the pool, valid while the requester holds the pins the
    lookup took: a pinned slot is never evicted, so never rewritten (after a crash the manager
    starts a new pool; the old one is no longer written either). The requester copies from it in
    its own worker thread, into its own cache, saving a hop through this actor."""

    keys: torch.Tensor    # the pool, [layers, heads, slots, block, dim]
    values: torch.Tensor
    slots: tuple[int, ...]

    def copy_into(self, cache: Cache) -> int:
        """Writes the blocks, in order, into the first columns of an empty buffered batch-1
        cache; returns the number of tokens."""
        _, heads, _, block, dim = self.keys.shape
        n = len(self.slots) * block
        idx = torch.tensor(self.slots, device=self.keys.device)
        for i, layer in enumerate(cache.layers):
            layer.reserve(n)
            torch.index_select(self.keys[i], 1, idx, out=layer.kbuf[0, :, :n].view(heads, len(self.slots), block, dim))
            torch.index_select(self.values[i], 1, idx, out=layer.vbuf[0, :, :n].view(heads, len(self.slots), block, dim))
            layer.set_length(n)
        return n


@dataclass(frozen=True)
class LookupResult:
    blocks: int
    source: PinnedBlocks | None = None


@dataclass(frozen=True)
class Lookup:
    request_id: str
    hashes: tuple[bytes, ...]
    reply: trio.MemorySendChannel


@dataclass(frozen=True)
class Prepare:
    request_id: str
    hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class Commit:
    request_id: str
    hashes: tuple[bytes, ...]
    kv: KV


@dataclass(frozen=True)
class Abort:
    request_id: str


def sequence_block_hashes(model_sig: int, cache_salt: str | None, token_ids, spans: tuple[ImageSpan, ...],
                          mm_keys: tuple[bytes | None, ...], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`. Blocks from the first one that reaches an
    uncacheable image (no content key) on are never keyed: their content cannot be identified."""
    limit = len(token_ids)
    items = []
    for span, key in sorted(zip(spans, mm_keys or (None,) * len(spans)), key=lambda p: p[0].start):
        if key is None:
            limit = min(limit, span.start)
            break
        items.append(MMPlaceholder(key, span.start, span.length))
    hashes = block_hashes(root_hash(model_sig, cache_salt), list(token_ids), items, block_size)
    return hashes[: limit // block_size]


class PrefixCacheManager(Actor):
    name = "prefix_cache"

    def __init__(self, adapter: LlavaAdapter, config: PrefixCacheConfig):
        super().__init__(model=adapter.name)
        self.block_size = config.block_size
        self.layers, self.kv_heads, self.head_dim = adapter.kv_layers, adapter.kv_heads, adapter.head_dim
        self.dtype, self.device = adapter.dtype, adapter.device
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.block_bytes = 2 * self.layers * self.kv_heads * self.block_size * self.head_dim * elem
        self.num_slots = max(0, config.budget_bytes // self.block_bytes)
        self._reset()

    def _reset(self) -> None:
        """A fresh, empty store and pool (at start, and after a crash: never trust half-done state)."""
        self.store = KVBlockStore(self.num_slots)
        # slots inside heads: gathering n slots of a layer yields [heads, n, block, dim], which is
        # already the [heads, n*block, dim] layout a KV cache needs — one copy, no re-layout
        shape = (self.layers, self.kv_heads, self.num_slots, self.block_size, self.head_dim)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.pending: dict[str, trio.MemorySendChannel] = {}

    async def run(self) -> None:
        self._reset()
        async for msg in self.inbox:
            self.progressed()
            if isinstance(msg, Commit):
                await afault("prefix.commit")
            await self._handle(msg)
            self.progressed()

    async def _handle(self, msg) -> None:
        if isinstance(msg, Lookup):
            try:
                self._lookup(msg)
            finally:
                msg.reply.close()  # a lookup that failed half-way reads as a miss, never a hang
        elif isinstance(msg, Prepare):
            self.log.info("prefix_cache.prepare", request_id=msg.request_id, blocks=len(msg.hashes))
        elif isinstance(msg, Commit):
            await self._commit(msg)
        elif isinstance(msg, Abort):
            self.store.abort(msg.request_id)
            self.log.info("prefix_cache.abort", request_id=msg.request_id)
        else:
            raise TypeError(f"prefix cache: unexpected message {msg!r}")

    def _lookup(self, msg: Lookup) -> None:
        slots = self.store.lookup(msg.hashes, msg.request_id) if self.num_slots else []
        self.log.info("prefix_cache.lookup", request_id=msg.request_id, queried_blocks=len(msg.hashes),
                      hit_blocks=len(slots), hit_tokens=len(slots) * self.block_size, slots=slots,
                      first_hash=key_prefix(msg.hashes[0]) if msg.hashes else None)
        source = PinnedBlocks(self.keys, self.values, tuple(slots)) if slots else None
        try:
            msg.reply.send_nowait(LookupResult(len(slots), source))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.store.abort(msg.request_id)

    async def _commit(self, msg: Commit) -> None:
        placed = self.store.commit(msg.hashes, msg.request_id) if self.num_slots else []
        for i, slot, evicted in placed:
            if evicted is not None:
                self.log.info("prefix_cache.stale_entry_dropped", request_id=msg.request_id, slot=slot,
                              hash=key_prefix(evicted))
        if placed:
            await trio.to_thread.run_sync(self._write, msg.kv, placed)
        self.store.release(msg.request_id)
        self.log.info("prefix_cache.commit", request_id=msg.request_id, blocks=len(msg.hashes),
                      new_blocks=len(placed), slots=[s for _, s, _ in placed])

    def _write(self, kv: KV, placed: list[tuple[int, int, bytes | None]]) -> None:
        """Copies block i of the sequence's KV into its slot, for each placed block (worker thread)."""
        b = self.block_size
        for i, slot, _ in placed:
            for layer, (k, v) in enumerate(kv):
                self.keys[layer, :, slot] = k[0, :, i * b:(i + 1) * b]
                self.values[layer, :, slot] = v[0, :, i * b:(i + 1) * b]

    def fail_in_flight(self, error: MMServeError) -> int:
        failed = super().fail_in_flight(error)
        self._reset()  # pins of requests that will never finish are dropped with the store
        return failed

    def stats(self) -> dict:
        s = self.store.stats()
        return dict(s.__dict__, block_size=self.block_size, block_bytes=self.block_bytes,
                    hit_tokens=s.hit_blocks * self.block_size, query_tokens=s.queries_blocks * self.block_size)

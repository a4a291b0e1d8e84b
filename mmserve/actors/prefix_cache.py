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
class LookupResult:
    blocks: int
    kv: KV | None = None


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
        tc = adapter.text_config
        self.block_size = config.block_size
        self.layers = int(tc.num_hidden_layers)
        self.kv_heads = int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)
        self.head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
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
                await self._lookup(msg)
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

    async def _lookup(self, msg: Lookup) -> None:
        slots = self.store.lookup(msg.hashes, msg.request_id) if self.num_slots else []
        kv = await trio.to_thread.run_sync(self._gather, slots) if slots else None
        self.log.info("prefix_cache.lookup", request_id=msg.request_id, queried_blocks=len(msg.hashes),
                      hit_blocks=len(slots), hit_tokens=len(slots) * self.block_size, slots=slots,
                      first_hash=key_prefix(msg.hashes[0]) if msg.hashes else None)
        try:
            msg.reply.send_nowait(LookupResult(len(slots), kv))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.store.abort(msg.request_id)

    def _gather(self, slots: list[int]) -> KV:
        idx = torch.tensor(slots, device=self.device)
        n = len(slots) * self.block_size
        shape = (1, self.kv_heads, n, self.head_dim)
        return tuple((self.keys[layer].index_select(1, idx).view(shape),
                      self.values[layer].index_select(1, idx).view(shape)) for layer in range(self.layers))

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

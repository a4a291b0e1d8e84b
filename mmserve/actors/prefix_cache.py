"""PrefixCacheManager actor: owns the KV block store and its tensor pool; the only code that
assigns a slot.

The intake asks it to `lookup` a prompt's block hashes, before any image is encoded: the hit prefix is pinned and returned
as a read-only view of its slots. A miss registers the request as computing the missing blocks
(the "prepare" ticket: nothing is consumed); a later request missing the same blocks waits for
that one's commit instead of computing them again (in-flight dedup), and computes them itself if
it aborts or the wait times out. `commit` assigns slots (evicting LRU entries and erasing their
stale hashes) to the sequence's full blocks; `abort` releases pins and changes nothing else. See
DESIGN.md F2 and F3.
"""

from __future__ import annotations

import torch
import trio

from mmserve.actors.base import Actor
from mmserve.actors.messages import KV, Abort, ClearCache, Commit, Lookup, LookupResult, PinnedBlocks, PrefixFailed
from mmserve.cache.keys import key_prefix
from mmserve.cache.inflight import InFlightBlocks
from mmserve.cache.kv_store import KVBlockStore
from mmserve.errors import MMServeError
from mmserve.models.llava import LlavaAdapter
from mmserve.config import PrefixCacheConfig
from mmserve.actors import compute
from mmserve.actors.faults import afault, fault


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
        self.wait_s = config.inflight_wait_s
        self.dedup_waits = 0  # lookups that waited for another request's blocks
        self._reset()

    def _reset(self) -> None:
        """A fresh, empty store and pool (at start, and after a crash: never trust half-done state)."""
        self.store = KVBlockStore(self.num_slots)
        self.inflight: InFlightBlocks[Lookup] = InFlightBlocks()
        # slots inside heads: gathering n slots of a layer yields [heads, n, block, dim], which is
        # already the [heads, n*block, dim] layout a KV cache needs — one copy, no re-layout
        shape = (self.layers, self.kv_heads, self.num_slots, self.block_size, self.head_dim)
        # empty, not zeros: a slot is written before any entry names it, and filling the pool
        # here, on the event loop, would start a parallel op outside the compute thread
        self.keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.values = torch.empty(shape, dtype=self.dtype, device=self.device)

    async def run(self) -> None:
        self._reset()
        while True:
            msg = None
            with trio.move_on_at(self.inflight.next_deadline()):  # only the wait, never a handler
                msg = await self.inbox.receive()
            self.progressed()
            if msg is not None:
                await self._handle(msg)
            for parked in self.inflight.expired(trio.current_time()):
                self.log.info("prefix_cache.wait_expired", request_id=parked.waiter, owner=parked.owner)
                self._lookup(parked.payload, waited_since=parked.deadline - self.wait_s, may_wait=False)
            self.progressed()

    async def _handle(self, msg) -> None:
        if isinstance(msg, (Lookup, Commit)):
            try:
                await self._for_request(msg)
            except Exception as e:
                self._contain(msg, e)
        elif isinstance(msg, Abort):
            self.store.abort(msg.request_id)
            self.log.info("prefix_cache.abort", request_id=msg.request_id)
            self._done(msg.request_id)
        elif isinstance(msg, ClearCache):
            n = self.store.clear()
            self.log.info("prefix_cache.cleared", entries=n, kept_pinned=self.store.stats().pinned_slots)
            _send(msg.reply, n)
        else:
            raise TypeError(f"prefix cache: unexpected message {msg!r}")

    async def _for_request(self, msg: Lookup | Commit) -> None:
        if isinstance(msg, Lookup):
            await afault("prefix.lookup", msg.label)
            self._lookup(msg)
        else:
            await afault("prefix.commit", msg.label)
            await self._commit(msg)
            self._done(msg.request_id)

    def _contain(self, msg: Lookup | Commit, exc: Exception) -> None:
        """Handling one request's message raised: that request is forgotten (pins released,
        registrations dropped, its waiters answered again) and fails alone. Only a store whose
        own invariants broke is a fault of this actor: then it raises, and the restart starts
        afresh."""
        self.store.check_invariants()
        self.inflight.check_invariants()
        rid, stage = msg.request_id, "prefix cache " + ("lookup" if isinstance(msg, Lookup) else "commit")
        self.store.abort(rid)
        self._done(rid)
        self.log.error("prefix_cache.request_failed", request_id=rid, client_request_id=msg.label, stage=stage,
                       error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        if msg.reply is not None:
            _send(msg.reply, PrefixFailed(rid, stage, exc))

    def _lookup(self, msg: Lookup, waited_since: float | None = None, may_wait: bool = True) -> None:
        rid, hashes = msg.request_id, msg.hashes
        slots = self.store.lookup(hashes, rid) if self.num_slots else []
        if len(slots) < len(hashes) and self.num_slots:
            owner = self.inflight.owner_of(hashes[len(slots)])
            if may_wait and self.wait_s > 0 and owner is not None and owner != rid:
                self.store.release(rid)  # taken again when the lookup is answered
                self.inflight.park(rid, owner, trio.current_time() + self.wait_s, msg)
                self.dedup_waits += 1
                self.log.info("prefix_cache.wait", request_id=rid, owner=owner, hit_blocks=len(slots),
                              first_hash=key_prefix(hashes[len(slots)]))
                return
            registered = self.inflight.register(rid, hashes[len(slots):])
            self.log.info("prefix_cache.prepare", request_id=rid, blocks=len(hashes) - len(slots),
                          registered=registered)
        waited = trio.current_time() - waited_since if waited_since is not None else 0.0
        self.log.info("prefix_cache.lookup", request_id=rid, queried_blocks=len(hashes),
                      hit_blocks=len(slots), hit_tokens=len(slots) * self.block_size, slots=slots,
                      first_hash=key_prefix(hashes[0]) if hashes else None, waited_s=round(waited, 6))
        source = PinnedBlocks(self.keys, self.values, tuple(slots)) if slots else None
        if not _send(msg.reply, LookupResult(rid, len(slots), source, waited)):
            self.store.abort(rid)
            self._done(rid)

    def _done(self, request_id: str) -> None:
        """`request_id` computes nothing any more: lookups parked on it are answered again."""
        for parked in self.inflight.done(request_id):
            self._lookup(parked.payload, waited_since=parked.deadline - self.wait_s)

    async def _commit(self, msg: Commit) -> None:
        placed = self.store.commit(msg.hashes, msg.request_id) if self.num_slots else []
        reused = [(slot, evicted) for _, slot, evicted in placed if evicted is not None]
        if reused:  # no free slot was left: least recently used entries made room
            self.log.info("prefix_cache.evict", request_id=msg.request_id, entries=len(reused),
                          slots=[slot for slot, _ in reused])
        for slot, evicted in reused:
            self.log.info("prefix_cache.stale_entry_dropped", request_id=msg.request_id, slot=slot,
                          hash=key_prefix(evicted))
        try:
            if placed:
                await compute.run(self._write, msg.kv, placed, msg.label, owner=self.key)
        except Exception:  # no entry may name a slot its KV never reached
            self.store.release(msg.request_id)
            self.store.discard([slot for _, slot, _ in placed])
            raise
        self.store.release(msg.request_id)
        self.log.info("prefix_cache.commit", request_id=msg.request_id, blocks=len(msg.hashes),
                      new_blocks=len(placed), slots=[s for _, s, _ in placed],
                      hashes=[key_prefix(msg.hashes[i]) for i, _, _ in placed])

    def _write(self, kv: KV, placed: list[tuple[int, int, bytes | None]], label: str | None = None) -> None:
        """Copies block i of the sequence's KV into its slot, for each placed block (worker thread)."""
        b = self.block_size
        for n, (i, slot, _) in enumerate(placed):
            if n:  # after the first block: a failure here leaves a half-written commit to undo
                fault("prefix.write", label)
            for layer, (k, v) in enumerate(kv):
                self.keys[layer, :, slot] = k[0, :, i * b:(i + 1) * b]
                self.values[layer, :, slot] = v[0, :, i * b:(i + 1) * b]

    def fail_in_flight(self, error: MMServeError) -> int:
        failed = super().fail_in_flight(error)
        for parked in self.inflight.clear():  # answered as misses: nothing of this store is trusted
            _send(parked.payload.reply, LookupResult(parked.waiter, 0))
        self._reset()  # pins of requests that will never finish are dropped with the store
        return failed

    def stats(self) -> dict:
        s = self.store.stats()
        return dict(s.__dict__, block_size=self.block_size, block_bytes=self.block_bytes,
                    waiting_lookups=len(self.inflight), inflight_blocks=self.inflight.registered_blocks,
                    dedup_waits=self.dedup_waits,
                    hit_tokens=s.hit_blocks * self.block_size, query_tokens=s.queries_blocks * self.block_size)


def _send(channel: trio.MemorySendChannel, message) -> bool:
    try:
        channel.send_nowait(message)
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False

"""PrefixCacheManager actor: owns the bookkeeping of its model's KV arena — which block belongs to
whom, which hash names which block — and is the only code that assigns a block (DESIGN.md F3).

One arena holds running sequences' KV and cached prefixes alike (`cache.block_arena`): a lookup
puts the cached blocks of a prompt's prefix at the start of the request's block table (zero
bytes copied), `Allocate` gives each running sequence the blocks its next tokens need (once per
step, evicting least-recently-used cached blocks nobody references), `Commit` records that a
full block holds what its hash names (bookkeeping), `Release` drops a request's references (its
committed blocks stay cached). A miss registers the request as computing the missing blocks; a
later request missing the same blocks waits for its commit instead (in-flight dedup), and
computes them itself if it releases first or the wait times out. The tensors live with the
generator, which writes only into blocks granted here.
"""

from __future__ import annotations

import trio

from mmserve.actors.base import Actor
from mmserve.actors.faults import afault
from mmserve.actors.messages import (
    Allocate, Allocated, ClearCache, Commit, KVEpoch, Lookup, LookupResult, PrefixFailed, Release)
from mmserve.cache.block_arena import BlockArena
from mmserve.cache.inflight import InFlightBlocks
from mmserve.cache.keys import key_prefix
from mmserve.config import KVCacheConfig
from mmserve.errors import MMServeError


class PrefixCacheManager(Actor):
    name = "prefix_cache"

    def __init__(self, model: str, config: KVCacheConfig, num_blocks: int):
        super().__init__(model=model)
        self.block_size = config.block_size
        self.caching = config.prefix_caching
        self.num_blocks = num_blocks
        self.wait_s = config.inflight_wait_s
        self.dedup_waits = 0  # lookups that waited for another request's blocks
        self.epoch = 0
        self.generator: trio.MemorySendChannel | None = None  # told when a restart voids its tables
        self._reset()

    def _reset(self) -> None:
        """Fresh bookkeeping (at start, and after a crash: never trust half-done state). The epoch
        tells the generator that every block table it holds died with the old one."""
        self.arena = BlockArena(self.num_blocks)
        self.inflight: InFlightBlocks[Lookup] = InFlightBlocks()
        self.epoch += 1

    async def run(self) -> None:
        if self.epoch > 1 and self.generator is not None:  # restarted: the generator's tables are void
            self.generator.send_nowait(KVEpoch(self.epoch))
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
        if isinstance(msg, Allocate):
            self._allocate(msg)
        elif isinstance(msg, (Lookup, Commit)):
            try:
                await self._for_request(msg)
            except Exception as e:
                self._contain(msg, e)
        elif isinstance(msg, Release):
            self._release(msg)
        elif isinstance(msg, ClearCache):
            n = self.arena.clear()
            self.log.info("prefix_cache.cleared", entries=n, kept_referenced=self.arena.num_used())
            _send(msg.reply, n)
        else:
            raise TypeError(f"prefix cache: unexpected message {msg!r}")

    async def _for_request(self, msg: Lookup | Commit) -> None:
        if isinstance(msg, Lookup):
            await afault("prefix.lookup", msg.label)
            self._lookup(msg)
        else:
            await afault("prefix.commit", msg.label)
            self._commit(msg)

    def _contain(self, msg: Lookup | Commit, exc: Exception) -> None:
        """Handling one request's message raised: that request is forgotten (registrations dropped,
        its waiters answered again; a lookup's blocks released) and fails alone. Only bookkeeping whose
        own invariants broke is a fault of this actor: then it raises, and the restart starts
        afresh."""
        self.arena.check_invariants()
        self.inflight.check_invariants()
        rid, stage = msg.request_id, "prefix cache " + ("lookup" if isinstance(msg, Lookup) else "commit")
        if isinstance(msg, Lookup):  # the generator never saw these blocks
            self.arena.free(rid)
        # a failed commit's blocks stay the generator's until its Release: freed now, they could be
        # granted to another request while this one still writes into them
        self._done(rid)
        self.log.error("prefix_cache.request_failed", request_id=rid, client_request_id=msg.label, stage=stage,
                       error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        if msg.reply is not None:
            _send(msg.reply, PrefixFailed(rid, stage, exc))

    # -- lookups and in-flight dedup ---------------------------------------------------------------

    def _lookup(self, msg: Lookup, waited_since: float | None = None, may_wait: bool = True) -> None:
        rid, hashes = msg.request_id, msg.hashes
        blocks = self.arena.lookup(hashes, rid) if self.caching else []
        if len(blocks) < len(hashes) and self.caching:
            owner = self.inflight.owner_of(hashes[len(blocks)])
            if may_wait and self.wait_s > 0 and owner is not None and owner != rid:
                self.arena.free(rid)  # looked up again when the wait ends
                self.inflight.park(rid, owner, trio.current_time() + self.wait_s, msg)
                self.dedup_waits += 1
                self.log.info("prefix_cache.wait", request_id=rid, owner=owner, hit_blocks=len(blocks),
                              first_hash=key_prefix(hashes[len(blocks)]))
                return
            registered = self.inflight.register(rid, hashes[len(blocks):])
            self.log.info("prefix_cache.prepare", request_id=rid, blocks=len(hashes) - len(blocks),
                          registered=registered)
        waited = trio.current_time() - waited_since if waited_since is not None else 0.0
        self.log.info("prefix_cache.lookup", request_id=rid, queried_blocks=len(hashes),
                      hit_blocks=len(blocks), hit_tokens=len(blocks) * self.block_size, blocks=blocks,
                      first_hash=key_prefix(hashes[0]) if hashes else None, waited_s=round(waited, 6))
        if not _send(msg.reply, LookupResult(rid, tuple(blocks), waited, self.epoch)):
            self.arena.free(rid)  # the requester stopped waiting: it holds nothing here
            self._done(rid)

    def _done(self, request_id: str) -> None:
        """`request_id` computes nothing more: lookups parked on it are answered again."""
        for parked in self.inflight.done(request_id):
            self._lookup(parked.payload, waited_since=parked.deadline - self.wait_s)

    # -- the generator's blocks ----------------------------------------------------------------------

    def _allocate(self, msg: Allocate) -> None:
        granted, refused = [], []
        for rid, n in msg.needs:
            if refused or not self.arena.can_allocate(n):
                refused.append(rid)
                continue
            taken = self.arena.allocate_evicting(rid, n)
            evicted = [(block, h) for block, h in taken if h is not None]
            if evicted:  # no free block was left: least recently used cached blocks made room
                self.log.info("prefix_cache.evict", request_id=rid, blocks=[b for b, _ in evicted],
                              hashes=[key_prefix(h) for _, h in evicted])
            granted.append((rid, tuple(block for block, _ in taken)))
        if not _send(msg.reply, Allocated(tuple(granted), tuple(refused), self.epoch, self.arena.num_free())):
            for rid, blocks in granted:  # the generator stopped waiting: it never learned of them
                self.arena.truncate(rid, len(self.arena.table(rid)) - len(blocks))

    def _commit(self, msg: Commit) -> None:
        if self.caching:
            new = [(i, h) for i, h in msg.blocks if self.arena.commit(msg.request_id, i, h)]
            table = self.arena.table(msg.request_id)
            self.log.info("prefix_cache.commit", request_id=msg.request_id, blocks=len(msg.blocks),
                          new_blocks=len(new), block_ids=[table[i] for i, _ in new],
                          hashes=[key_prefix(h) for _, h in new])
        self._done(msg.request_id)

    def _release(self, msg: Release) -> None:
        if msg.keep:
            self.arena.truncate(msg.request_id, msg.keep)
        else:
            self.arena.free(msg.request_id)
        self.log.info("prefix_cache.release", request_id=msg.request_id, kept=msg.keep)
        self._done(msg.request_id)

    def fail_in_flight(self, error: MMServeError) -> int:
        failed = super().fail_in_flight(error)
        for parked in self.inflight.clear():  # answered as misses: nothing of this arena is trusted
            _send(parked.payload.reply, LookupResult(parked.waiter, (), 0.0, self.epoch + 1))
        self._reset()  # references of requests that will never finish go with the bookkeeping
        return failed

    def stats(self) -> dict:
        s = self.arena.stats()
        return dict(s.__dict__, block_size=self.block_size, waiting_lookups=len(self.inflight),
                    inflight_blocks=self.inflight.registered_blocks, dedup_waits=self.dedup_waits,
                    hit_tokens=s.hit_blocks * self.block_size, query_tokens=s.queries_blocks * self.block_size)


def _send(channel: trio.MemorySendChannel, message) -> bool:
    try:
        channel.send_nowait(message)
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False

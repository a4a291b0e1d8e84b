"""PrefixCacheManager actor: owns the bookkeeping of its model's KV arena — which block belongs to
whom, which hash names which block — and is the only code that assigns a block (DESIGN.md F3).

One arena holds running sequences' KV and cached prefixes alike (`cache.block_arena`): a lookup
puts the cached blocks of a prompt's prefix at the start of the request's block table (zero
bytes copied). The generator's fresh blocks come from a **reservation**: blocks this manager
holds under an owner of its own (`Reservation(epoch, lease)`) and hands the generator in
`Refill`s; the generator draws from it locally, at plan time, with no message, and tells what
each step did in one `StepReport` (never awaited): the draws (moved here from the reservation
to the request), `Commit`s (a full block holds what its hash names: bookkeeping), `Release`s (a
request's references dropped; its committed blocks stay cached), and how many blocks it wants in
reserve. At most one `Refill` answers a report — a running sequence's next blocks when the
report hints them and they are free (earmarked for it, so its table stays consecutive), then
blocks placed as a new table's would be (free ones with room to grow first, then least-recently-used
cached blocks nobody references, evicted). So a step costs one message each way, never a round trip. A
miss registers the request as computing the missing blocks; a later request missing the same
blocks waits for its commit instead (in-flight dedup), and computes them itself if it releases
first or the wait times out. The tensors live with the generator, which writes only into blocks
it holds here (its requests' and its reservation's).

Ownership is a rule of the bookkeeping, not of message timing (DESIGN.md): a block granted to a
request stays that request's until its own Release, or until the epoch that granted it dies. So
a lookup's hits are held under a pin of their own (`lookup_pin`) until its answer is delivered,
and only then start the request's (empty) table; an answer nobody takes — the requester stopped
waiting, or was answered already, or holds blocks the generator granted meanwhile — drops the pin
and nothing else. Every answer to the generator that it did not take (a closed reply channel)
takes back exactly what that answer gave. A block in the reservation belongs to it alone; a
report's draw moves only blocks the reservation really holds (any other draw is refused: that
request fails alone with a 503, and nothing it names changes owner); a duplicate or replayed
report (its number is not new) changes nothing; a report of a dead manager life moves nothing;
a newer lease gives the older reservation back whole (the generator dropped it, and drops its
refills still on their way); a restart voids the reservation with every table of its life.
"""

from __future__ import annotations

import trio

from mmserve.actors import compute
from mmserve.actors.base import Actor
from mmserve.actors.quarantine_side import QuarantineSide
from mmserve.actors.reservation_side import ReservationSide, send as _send
from mmserve.actors.compute import single_threaded
from mmserve.actors.faults import afault
from mmserve.actors.kv_event_side import KVEventSide
from mmserve.actors.messages import (
    ClearCache, Commit, FinishFlushed, Fork, Forked, KVEpoch, Lookup, LookupResult, PrefixFailed, Release, Resume, Resumed,
    StepFence, StepReport, StepReturned, copy_pin, lookup_pin)
from mmserve.actors.shared_tier import FetchBlocks, SharedBlocks
from mmserve.cache.block_arena import BlockArena
from mmserve.cache.inflight import InFlightBlocks
from mmserve.cache.keys import key_prefix
from mmserve.cache.shared_values import KIND_KV_BLOCK, block_key
from mmserve.config import KVCacheConfig
from mmserve.errors import MMServeError


class PrefixCacheManager(ReservationSide, QuarantineSide, KVEventSide, Actor):
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
        self.shared = None  # the model's SharedTier (Redis), when [shared_cache] is on
        self.kv = None  # the generator's ModelRunner: reads committed blocks to export, writes restored ones
        self.shared_restored = 0  # blocks restored from the shared tier
        self.last_report = -1  # the latest step report handled: kept across restarts (never reused)
        self.refused_draws = 0  # draws of blocks the reservation did not hold (each failed its request)
        # abandoned steps still running → the blocks they may write: held under `StepFence(step)`
        # in the arena (so never allocated) until `StepReturned(step)`; kept across restarts
        self.quarantined: dict[int, tuple[int, ...]] = {}
        self.returned_steps: set[int] = set()  # returned before their quarantine came: none is needed
        self._reset()

    def _reset(self) -> None:
        """Fresh bookkeeping (at start, and after a crash: never trust half-done state). The epoch
        tells the generator that every block table it holds died with the old one."""
        self.arena = BlockArena(self.num_blocks)
        self.inflight: InFlightBlocks[Lookup] = InFlightBlocks()
        self.remote: dict[str, tuple[Lookup, int, float | None]] = {}  # lookups asking the shared tier
        self.looked_up: set[str] = set()  # requests whose lookup came, until their Release
        self.lease: int | None = None  # the generator's reservation lease (None: none in this life yet)
        self.broken: set[str] = set()  # requests a draw was refused for: their tables are not trusted
        self.epoch += 1
        for step, blocks in self.quarantined.items():  # an abandoned step writes on, whatever life this is
            self.arena.hold(StepFence(step), blocks)
        self._events_reset()  # KV events: what routers were told of the old arena is void
        self._fence_writers()  # a writer of the arena still in flight writes on too: held until it returns

    def attach_kv(self, runner) -> None:
        """The generator's model runner: its arena's epoch is this manager's life from now on (the
        fence a step checks before it writes, shared tier or not); exports and restores use it."""
        self.kv = runner
        self._fence_writers()

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
                self._relook(parked, may_wait=False)
            self._flush_events()  # what this message did to the arena's entries, in its order
            self.progressed()

    async def _handle(self, msg) -> None:
        """One message. A failure handling one request's Lookup or Commit fails that request alone;
        one anywhere else is a fault of the actor: it dies, and the restart voids every table of
        this epoch (the generator fails the requests that held blocks, the others go on)."""
        if isinstance(msg, StepReport):
            await self._report(msg)
        elif isinstance(msg, (Lookup, Commit)):
            try:
                await self._for_request(msg)
            except Exception as e:
                self._contain(msg, e)
        elif isinstance(msg, Release):
            await afault("prefix.release", msg.request_id)
            self._release(msg)
        elif isinstance(msg, StepReturned):
            self._step_returned(msg)
        elif isinstance(msg, SharedBlocks):
            await self._restore(msg)
        elif isinstance(msg, Fork):
            await afault("prefix.fork", msg.parent)
            self._fork(msg)
        elif isinstance(msg, Resume):
            await afault("prefix.resume")
            self._resume(msg)
        elif isinstance(msg, ClearCache):
            n = self.arena.clear()
            self._flush_events(reset=True)
            self.log.info("prefix_cache.cleared", entries=n, kept_referenced=self.arena.num_used())
            _send(msg.reply, n)
        else:
            raise TypeError(f"prefix cache: unexpected message {msg!r}")

    async def _for_request(self, msg: Lookup | Commit) -> None:
        if isinstance(msg, Lookup):
            if msg.request_id in self.looked_up:  # a duplicate: its first lookup is answered, or will be
                self.log.warning("prefix_cache.duplicate_lookup", request_id=msg.request_id)
                return
            self.looked_up.add(msg.request_id)
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
        if isinstance(msg, Lookup):  # only the lookup's own hits: never blocks the generator was granted
            self.arena.free(lookup_pin(rid))
            # `looked_up` keeps it: intake settles a failed lookup with a Release too
        # a failed commit's blocks stay the generator's until its Release: freed now, they could be
        # granted to another request while this one still writes into them
        self._done(rid)
        self.log.error("prefix_cache.request_failed", request_id=rid, client_request_id=msg.label, stage=stage,
                       error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        if msg.reply is not None:
            _send(msg.reply, PrefixFailed(rid, stage, exc))

    # -- lookups and in-flight dedup ---------------------------------------------------------------

    def _lookup(self, msg: Lookup, waited_since: float | None = None, deadline: float | None = None,
                may_wait: bool = True) -> None:
        """Answers `msg` (or parks it, or asks the shared tier). Its hits are pinned under
        `lookup_pin`, not the request: nothing the request holds is touched until the answer is
        delivered. A wait keeps its first deadline however often it is parked again."""
        rid, hashes, pin = msg.request_id, msg.hashes, lookup_pin(msg.request_id)
        self.arena.free(pin)  # a lookup looked up again: its earlier hits go back first
        blocks = self.arena.lookup(hashes, pin) if self.caching else []
        if len(blocks) < len(hashes) and self.caching:
            owner = self.inflight.owner_of(hashes[len(blocks)])
            now = trio.current_time()
            deadline = now + self.wait_s if deadline is None else deadline
            if may_wait and self.wait_s > 0 and owner is not None and owner != rid and deadline > now:
                self.arena.free(pin)  # looked up again when the wait ends
                self.inflight.park(rid, owner, deadline, msg)
                self.dedup_waits += 1
                self.log.info("prefix_cache.wait", request_id=rid, owner=owner, hit_blocks=len(blocks),
                              first_hash=key_prefix(hashes[len(blocks)]))
                return
            registered = self.inflight.register(rid, hashes[len(blocks):])
            self.log.info("prefix_cache.prepare", request_id=rid, blocks=len(hashes) - len(blocks),
                          registered=registered)
            if self._ask_shared(msg, len(blocks), waited_since):
                return  # answered when the shared tier's answer comes (SharedBlocks)
        self._answer(msg, waited_since)

    def _relook(self, parked, may_wait: bool = True) -> None:
        """A parked lookup looked up again (its owner is done, or its wait ended). What it raises
        fails that lookup's request alone — never the request whose commit or release woke it."""
        try:
            self._lookup(parked.payload, waited_since=parked.deadline - self.wait_s, deadline=parked.deadline,
                         may_wait=may_wait)
        except Exception as e:
            self._contain(parked.payload, e)

    def _answer(self, msg: Lookup, waited_since: float | None, restored: int = 0) -> None:
        """Delivers the hits pinned for `msg`; they become the request's table only once delivered.
        An answer nobody takes — the requester stopped waiting, or the generator already holds
        blocks for it (intake gave up and went on) — drops the pin, and nothing else."""
        rid, hashes, pin = msg.request_id, msg.hashes, lookup_pin(msg.request_id)
        blocks = self.arena.table(pin)
        waited = trio.current_time() - waited_since if waited_since is not None else 0.0
        self.log.info("prefix_cache.lookup", request_id=rid, queried_blocks=len(hashes),
                      hit_blocks=len(blocks), hit_tokens=len(blocks) * self.block_size, blocks=list(blocks),
                      first_hash=key_prefix(hashes[0]) if hashes else None, waited_s=round(waited, 6),
                      **({"shared_blocks": restored} if self.shared is not None else {}))
        if not self.arena.table(rid) and _send(msg.reply, LookupResult(rid, blocks, waited, self.epoch)):
            self.arena.transfer(pin, rid)
            return
        self.arena.free(pin)
        self.log.info("prefix_cache.answer_dropped", request_id=rid, hit_blocks=len(blocks))
        self._done(rid)

    def _done(self, request_id: str) -> None:
        """`request_id` computes nothing more: lookups parked on it are answered again."""
        self.remote.pop(request_id, None)  # a shared-tier answer for it comes too late: dropped
        for parked in self.inflight.done(request_id):
            self._relook(parked)

    def _resume(self, msg: Resume) -> None:
        """Preempted (empty) tables get back what is still cached of their blocks, pinned until the
        answer is delivered; an owner that holds blocks already gets none (hits only ever start an
        empty table)."""
        tables = []
        for rid, hashes in msg.wants:
            pin = lookup_pin(rid)
            self.arena.free(pin)
            blocks = self.arena.lookup(hashes, pin) if self.caching and not self.arena.table(rid) else []
            self.log.info("prefix_cache.resume", request_id=rid, queried_blocks=len(hashes), hit_blocks=len(blocks))
            tables.append((rid, tuple(blocks)))
        delivered = _send(msg.reply, Resumed(tuple(tables), self.epoch))
        for rid, _ in tables:  # not delivered: the generator never learned of them, they go back
            if delivered:
                self.arena.transfer(lookup_pin(rid), rid)
            else:
                self.arena.free(lookup_pin(rid))

    def _fork(self, msg: Fork) -> None:
        tables = []
        try:
            for child in msg.children:
                blocks = self.arena.share(msg.parent, child, 0, msg.shared)
                source = None
                if msg.copy_last and self.arena.can_allocate(1):
                    source = self.arena.share(msg.parent, copy_pin(child), msg.shared, 1)[0]
                    blocks += [block for block, _ in self.arena.allocate_evicting(child, 1)]
                tables.append((child, tuple(blocks), source))
        except ValueError as e:  # the parent no longer holds those blocks: the children compute their own
            self.log.error("prefix_cache.fork_failed", request_id=msg.parent, error=str(e))
            for child in msg.children:
                self.arena.free(child)
                self.arena.free(copy_pin(child))
            tables = [(child, (), None) for child in msg.children]
        self.log.info("prefix_cache.fork", request_id=msg.parent, children=len(msg.children),
                      shared_blocks=msg.shared, copied_blocks=sum(s is not None for _, _, s in tables))
        if not _send(msg.reply, Forked(tuple(tables), self.epoch)):
            for child in msg.children:  # the generator stopped waiting: it never learned of them
                self.arena.free(child)
                self.arena.free(copy_pin(child))

    def _commit(self, msg: Commit) -> None:
        if self.caching:
            self._note_commit(msg)  # its blocks' token ids: announced if this commit caches them
            new = [(i, h) for i, h in msg.blocks if self.arena.commit(msg.request_id, i, h)]
            table = self.arena.table(msg.request_id)
            self.log.info("prefix_cache.commit", request_id=msg.request_id, blocks=len(msg.blocks),
                          new_blocks=len(new), block_ids=[table[i] for i, _ in new],
                          hashes=[key_prefix(h) for _, h in new])
            if new and self.shared is not None:
                self._export(table, new)
        self._done(msg.request_id)

    def _release(self, msg: Release) -> None:
        if msg.flushed is not None:  # first: the answer ends even if the bookkeeping below raises
            done = FinishFlushed(msg.request_id)  # its commits (earlier in this inbox) are queued for Redis by now
            if self.shared is not None:
                self.shared.notify_after_writes(msg.flushed, done)
            else:
                _send(msg.flushed, done)
        rid = msg.request_id
        self.arena.free(rid)
        self.broken.discard(rid)  # it holds nothing: its next table starts afresh
        self.arena.free(lookup_pin(rid))  # a lookup still pending for it (parked: `_done`) answers no one
        if msg.final:  # a preempted request runs again: a lookup for it is still a duplicate
            self.looked_up.discard(rid)
        self.log.info("prefix_cache.release", request_id=rid)
        self._done(rid)

    # -- the shared tier (Redis) under the arena ------------------------------------------------------

    def _ask_shared(self, msg: Lookup, local: int, waited_since: float | None) -> bool:
        """A local miss goes on in the shared tier: the hashes after the local hit are asked for, the
        answer (SharedBlocks, within the tier's deadline) restores them. False when the tier is off."""
        tier, kv = self.shared, self.kv
        if tier is None or kv is None or not tier.active():
            return False
        shape = kv.block_shape
        self.remote[msg.request_id] = (msg, local, waited_since)
        tier.inbox_send.send_nowait(FetchBlocks(msg.request_id, msg.hashes[local:], kv.dtype, shape,
                                                self.epoch, self.inbox_send))
        return True

    async def _restore(self, answer: SharedBlocks) -> None:
        """The blocks the tier found are given to the request (allocated here, like any block), their
        KV written into them, and committed: its lookup is answered with the longer prefix."""
        pending = self.remote.pop(answer.request_id, None)
        if pending is None or answer.epoch != self.epoch:
            return  # the request went on without it (or ended), or the arena restarted
        msg, local, waited_since = pending
        rid, pin, restored = msg.request_id, lookup_pin(msg.request_id), 0
        if answer.blocks and len(self.arena.table(pin)) == local:
            try:
                restored = await self._write_restored(pin, msg.hashes, local, answer.blocks)
            except Exception as e:  # a miss, never a failed request: the fresh blocks are dropped
                self.arena.check_invariants()
                self.arena.truncate(pin, local)
                self.log.error("prefix_cache.shared_restore_failed", request_id=rid,
                               error=f"{type(e).__name__}: {e}", exc_info=e)
        self._answer(msg, waited_since, restored)

    async def _write_restored(self, pin: str, hashes, local: int, tensors) -> int:
        """Fresh blocks for the found KV, written on the compute thread inside the runner's write
        fence: a writer of an earlier life still in flight holds its blocks in quarantine (so they
        cannot be these), and the restore writes nothing if this life ends before it starts."""
        n = min(len(tensors), self.arena.num_free())
        taken = self.arena.allocate_evicting(pin, n)
        if evicted := [(b, h) for b, h in taken if h is not None]:
            self.log.info("prefix_cache.evict", request_id=pin, blocks=[b for b, _ in evicted],
                          hashes=[key_prefix(h) for _, h in evicted])
        written = await compute.run(self.kv.write_blocks, [block for block, _ in taken], tensors[:n], self.epoch,
                                    owner=self.key)
        if not written:  # this life ended meanwhile (its tables went with it): nothing was written
            raise RuntimeError("the cache manager restarted during the restore")
        for i in range(n):
            self.arena.commit(pin, local + i, hashes[local + i])
        self.shared_restored += n
        self.log.info("prefix_cache.shared_restore", request_id=pin, blocks=[b for b, _ in taken],
                      hashes=[key_prefix(h) for h in hashes[local:local + n]], found=len(tensors))
        return n

    def _export(self, table: tuple[int, ...], new: list[tuple[int, bytes]]) -> None:
        """Newly committed blocks go to the shared tier, once: their KV is copied out now, while the
        committing request still references them (no one can be writing them), and written to
        Redis in the background."""
        kv = self.kv
        if kv is None or not self.shared.active():
            return
        with single_threaded():
            data = kv.read_blocks([table[i] for i, _ in new])  # [2, L, n, ...]
        for j, (_, h) in enumerate(new):
            self.shared.put_soon(KIND_KV_BLOCK, block_key(h), data[:, :, j])

    def fail_in_flight(self, error: MMServeError) -> int:
        failed = super().fail_in_flight(error)
        for parked in self.inflight.clear():  # answered as misses: nothing of this arena is trusted
            _send(parked.payload.reply, LookupResult(parked.waiter, (), 0.0, self.epoch + 1))
        for lookup, _, _ in self.remote.values():
            _send(lookup.reply, LookupResult(lookup.request_id, (), 0.0, self.epoch + 1))
        self._reset()  # references of requests that will never finish go with the bookkeeping
        if self.generator is not None:  # at once, not at the restart: it stops writing the void tables now
            _send(self.generator, KVEpoch(self.epoch))
        return failed

    def stats(self) -> dict:
        s = self.arena.stats()
        reserved = len(self.arena.table(self.reservation)) if self.lease is not None else 0
        # blocks held by requests (and pins); the reservation's, not yet anyone's, apart
        return dict(s.__dict__, referenced_blocks=s.referenced_blocks - reserved, reserved_blocks=reserved,
                    refused_draws=self.refused_draws, block_size=self.block_size, waiting_lookups=len(self.inflight),
                    inflight_blocks=self.inflight.registered_blocks, dedup_waits=self.dedup_waits,
                    hit_tokens=s.hit_blocks * self.block_size, query_tokens=s.queries_blocks * self.block_size,
                    shared_restored_blocks=self.shared_restored, quarantined_blocks=self.quarantined_blocks,
                    quarantined_steps=len(self.quarantined))

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

The manager is wired at construction and holds its parts as objects, each the one owner of its
state: its `ReservationLedger` (the generator's reservation: lease, reports, refused draws), its
`StepQuarantine` (blocks abandoned steps may still write), with `[kv_events]` its `KVEventSource`
(what routers were told), and with `[shared_cache]` its `SharedKV` (lookups asking the shared
tier, restores, exports). The arena and the life (epoch) are the manager's; a part is handed them
by each call, never the manager.
"""

from __future__ import annotations

import trio

from mmserve.actors.base import Actor
from mmserve.actors.faults import afault
from mmserve.actors.kv_event_source import KVEventSource
from mmserve.actors.messages import (
    ClearCache, Commit, Draw, FinishFlushed, Fork, Forked, KVEpoch, Lookup, LookupResult, PrefixFailed, Quarantine, Release,
    Reservation, Resume, Resumed, StepReport, StepReturned, copy_pin, lookup_pin)
from mmserve.actors.reservation_ledger import ReservationLedger, send as _send
from mmserve.actors.shared_kv import SharedKV
from mmserve.actors.step_fences import step_returned_sender
from mmserve.actors.step_quarantine import StepQuarantine
from mmserve.actors.kv_messages import SharedBlocks
from mmserve.cache.block_arena import BlockArena
from mmserve.cache.inflight import InFlightBlocks
from mmserve.cache.keys import key_prefix
from mmserve.config import KVCacheConfig
from mmserve.errors import MMServeError


class PrefixCacheManager(Actor):
    name = "prefix_cache"

    def __init__(self, model: str, config: KVCacheConfig, num_blocks: int, *, runner=None,
                 generator: trio.MemorySendChannel | None = None, shared=None, events=None,
                 inbox: tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel] | None = None):
        """`runner`: the generator's ModelRunner — its write fence starts each life of this manager
        (shared tier or not), exports read committed blocks through it and restores write through
        it (None: bookkeeping alone, as in tests). `generator`: its inbox, told when a restart voids
        its tables. `shared`: the model's SharedTier (Redis), with `[shared_cache]` and prefix
        caching on. `events`: the replica's KVEventPublisher, with `[kv_events]` and prefix caching
        on. `inbox`: this actor's channel pair when made before it (the generator is built first
        and sends here)."""
        super().__init__(model=model, inbox=inbox)
        self.block_size = config.block_size
        self.caching = config.prefix_caching
        self.num_blocks = num_blocks
        self.wait_s = config.inflight_wait_s
        self.dedup_waits = 0  # lookups that waited for another request's blocks
        self.epoch = 0
        self.generator = generator
        self.runner = runner
        if shared is not None and runner is None:
            raise ValueError("a shared tier needs the model runner: restores and exports go through it")
        self.shared = SharedKV(shared, runner, self.log, self.key) if shared is not None else None
        self.ledger = ReservationLedger(num_blocks, self.log)
        self.quarantine = StepQuarantine(num_blocks, self.log)  # kept across restarts
        self.events = KVEventSource(events, self.block_size) if events is not None else None
        self._reset()

    def _reset(self) -> None:
        """Fresh bookkeeping (at start, and after a crash: never trust half-done state). The epoch
        tells the generator that every block table it holds died with the old one."""
        if self.events is not None and self.epoch > 0:  # KV events: what routers were told of the old arena is void
            self.events.new_arena()
        self.arena = BlockArena(self.num_blocks, journal=self.events.journal if self.events is not None else None)
        self.inflight: InFlightBlocks[Lookup] = InFlightBlocks()
        self.looked_up: set[str] = set()  # requests whose lookup came, until their Release
        self.ledger.new_life()
        if self.shared is not None:  # lookups asking the shared tier
            self.shared.new_life()
        self.epoch += 1
        self.quarantine.hold_in(self.arena)  # an abandoned step writes on, whatever life this is
        if self.runner is not None:  # a writer of the arena still in flight writes on too: held until it returns
            self.quarantine.fence_writers(self.arena, self.runner.fence, self.epoch,
                                          step_returned_sender(self.inbox_send))

    @property
    def reservation(self) -> Reservation | None:
        """The owner holding the generator's reservation in this life (None before its first report)."""
        return self.ledger.owner(self.epoch)

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
            if self.events is not None:  # what this message did to the arena's entries, in its order
                self.events.flush(self.arena)
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
            self.quarantine.release(self.arena, msg.step)
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
            if self.events is not None:
                self.events.flush(self.arena, reset=True)
            self.log.info("prefix_cache.cleared", entries=n, kept_referenced=self.arena.num_used())
            _send(msg.reply, n)
        else:
            raise TypeError(f"prefix cache: unexpected message {msg!r}")

    async def _report(self, msg: StepReport) -> None:
        """One step of the generator: its entries in order, then at most one refill. A commit that
        raises fails its request alone (PrefixFailed); a release that raises is this actor's fault."""
        current = self.ledger.open(self.arena, msg, self.epoch)
        if current is None:
            return  # a duplicate, or a replay: everything in it was done
        for entry in msg.entries:
            if isinstance(entry, Quarantine):  # in any life: the step writes whatever life granted them
                self.quarantine.hold(self.arena, entry.step, entry.blocks)
            elif isinstance(entry, Release):
                await afault("prefix.release", entry.request_id)
                self._release(entry)
            elif not current:
                continue  # a draw or commit into a table of a dead life: void, like the table
            elif isinstance(entry, Draw):
                self.ledger.draw(self.arena, entry, msg, self.epoch)
            elif isinstance(entry, Commit):
                if not self.ledger.trusts(entry.request_id):
                    continue  # its table here is not the one the generator believes: nothing is keyed by it
                try:
                    await self._for_request(entry)
                except Exception as e:
                    self._contain(entry, e)
            else:
                raise TypeError(f"prefix cache: unexpected step report entry {entry!r}")
        if current:
            await self.ledger.refill(self.arena, msg, self.epoch)

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
            if self.shared is not None and self.shared.ask(msg, len(blocks), waited_since, self.epoch,
                                                           self.inbox_send):
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
        if self.shared is not None:  # a shared-tier answer for it comes too late: dropped
            self.shared.drop(request_id)
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
            if self.events is not None:  # its blocks' token ids: announced if this commit caches them
                self.events.note_commit(self.arena, msg)
            new = [(i, h) for i, h in msg.blocks if self.arena.commit(msg.request_id, i, h)]
            table = self.arena.table(msg.request_id)
            self.log.info("prefix_cache.commit", request_id=msg.request_id, blocks=len(msg.blocks),
                          new_blocks=len(new), block_ids=[table[i] for i, _ in new],
                          hashes=[key_prefix(h) for _, h in new])
            if new and self.shared is not None:
                self.shared.export(table, new)
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
        self.ledger.released(rid)  # it holds nothing: its next table starts afresh
        self.arena.free(lookup_pin(rid))  # a lookup still pending for it (parked: `_done`) answers no one
        if msg.final:  # a preempted request runs again: a lookup for it is still a duplicate
            self.looked_up.discard(rid)
        self.log.info("prefix_cache.release", request_id=rid)
        self._done(rid)

    async def _restore(self, answer: SharedBlocks) -> None:
        """The blocks the tier found are given to the request (allocated here, like any block), their
        KV written into them, and committed: its lookup is answered with the longer prefix."""
        pending = self.shared.answered(answer, self.epoch)
        if pending is None:
            return  # the request went on without it (or ended), or the arena restarted
        msg, local, waited_since = pending
        rid, pin, restored = msg.request_id, lookup_pin(msg.request_id), 0
        if answer.blocks and len(self.arena.table(pin)) == local:
            try:
                restored = await self.shared.restore(self.arena, pin, msg.hashes, local, answer.blocks, self.epoch)
            except Exception as e:  # a miss, never a failed request: the fresh blocks are dropped
                self.arena.check_invariants()
                self.arena.truncate(pin, local)
                self.log.error("prefix_cache.shared_restore_failed", request_id=rid,
                               error=f"{type(e).__name__}: {e}", exc_info=e)
        self._answer(msg, waited_since, restored)

    def fail_in_flight(self, error: MMServeError) -> int:
        failed = super().fail_in_flight(error)
        for parked in self.inflight.clear():  # answered as misses: nothing of this arena is trusted
            _send(parked.payload.reply, LookupResult(parked.waiter, (), 0.0, self.epoch + 1))
        for lookup in self.shared.waiting() if self.shared is not None else ():
            _send(lookup.reply, LookupResult(lookup.request_id, (), 0.0, self.epoch + 1))
        self._reset()  # references of requests that will never finish go with the bookkeeping
        if self.generator is not None:  # at once, not at the restart: it stops writing the void tables now
            _send(self.generator, KVEpoch(self.epoch))
        return failed

    def detach_events(self) -> None:
        """The model is unloaded (its `fail_in_flight` reset the arena: what it announced is
        withdrawn already): it publishes no more KV events."""
        if self.events is not None:
            self.events.close()
            self.events = None
            self.arena.journal = None

    def stats(self) -> dict:
        s = self.arena.stats()
        reserved = self.ledger.reserved(self.arena, self.epoch)
        # blocks held by requests (and pins); the reservation's, not yet anyone's, apart
        return dict(s.__dict__, referenced_blocks=s.referenced_blocks - reserved, reserved_blocks=reserved,
                    refused_draws=self.ledger.refused_draws, block_size=self.block_size, waiting_lookups=len(self.inflight),
                    inflight_blocks=self.inflight.registered_blocks, dedup_waits=self.dedup_waits,
                    hit_tokens=s.hit_blocks * self.block_size, query_tokens=s.queries_blocks * self.block_size,
                    shared_restored_blocks=self.shared.restored if self.shared is not None else 0, quarantined_blocks=self.quarantine.blocks,
                    quarantined_steps=len(self.quarantine))

"""The cache manager's side of the block reservation (a part of `PrefixCacheManager`): the
generator's one `StepReport` a step — its draws from the reservation, commits and releases, in
order — and the one `Refill` that tops the reservation up (see `actors.block_grants` for the
generator's side, and `prefix_cache` for the ownership rules)."""

from __future__ import annotations

import trio

from mmserve.actors.faults import afault
from mmserve.actors.messages import (
    Commit, Draw, PrefixFailed, Quarantine, Refill, Release, Reservation, StepReport)
from mmserve.cache.keys import key_prefix
from mmserve.errors import ServiceUnavailable


class ReservationSide:
    """PrefixCacheManager methods: step reports, draws, refills."""

    @property
    def reservation(self) -> Reservation | None:
        """The owner holding the generator's reservation in this life (None before its first report)."""
        return Reservation(self.epoch, self.lease) if self.lease is not None else None

    async def _report(self, msg: StepReport) -> None:
        """One step of the generator: its entries in order, then at most one refill. A commit that
        raises fails its request alone (PrefixFailed); a release that raises is this actor's fault."""
        if msg.number <= self.last_report:  # a duplicate, or a replay: everything in it was done
            self.log.warning("prefix_cache.report_duplicate", number=msg.number, last=self.last_report)
            return
        self.last_report = msg.number
        current = msg.epoch is None or msg.epoch == self.epoch  # else its tables died with their life
        if current and (self.lease is None or msg.lease > self.lease):
            if self.lease is not None:  # the generator dropped the older lease, and every refill of it
                self.log.info("prefix_cache.reservation_returned", lease=self.lease,
                              blocks=len(self.arena.table(self.reservation)))
                self.arena.free(self.reservation)
            self.lease = msg.lease
        for entry in msg.entries:
            if isinstance(entry, Quarantine):  # in any life: the step writes whatever life granted them
                self._quarantine(entry)
            elif isinstance(entry, Release):
                await afault("prefix.release", entry.request_id)
                self._release(entry)
            elif not current:
                continue  # a draw or commit into a table of a dead life: void, like the table
            elif isinstance(entry, Draw):
                self._draw(entry, msg)
            elif isinstance(entry, Commit):
                if entry.request_id in self.broken:
                    continue  # its table here is not the one the generator believes: nothing is keyed by it
                try:
                    await self._for_request(entry)
                except Exception as e:
                    self._contain(entry, e)
            else:
                raise TypeError(f"prefix cache: unexpected step report entry {entry!r}")
        if current and msg.lease == self.lease:
            await self._refill(msg)

    def _draw(self, entry: Draw, msg: StepReport) -> None:
        """The drawn blocks move from the reservation to the request — only blocks the reservation
        really holds: any other draw is refused, and the request fails alone (a 503 to retry)
        rather than share a block with its owner. Blocks drawn later for a refused request still
        move (they are the reservation's), and its Release settles them."""
        rid, owner = entry.request_id, self.reservation
        held = set(self.arena.table(owner)) if msg.lease == self.lease else set()
        if rid not in self.broken and set(entry.blocks) <= held and len(set(entry.blocks)) == len(entry.blocks):
            self.arena.move(owner, rid, entry.blocks)
            return
        if rid in self.broken:
            self.arena.move(owner, rid, [b for b in dict.fromkeys(entry.blocks) if b in held])
            return
        self.broken.add(rid)
        self.refused_draws += 1
        self.log.error("prefix_cache.draw_refused", request_id=rid, blocks=list(entry.blocks), lease=msg.lease,
                       reservation=sorted(held))
        send(msg.reply, PrefixFailed(rid, "kv reservation", ServiceUnavailable(
            "the KV cache refused blocks this request was given; retry", retry_after_s=1.0)))

    async def _refill(self, msg: StepReport) -> None:
        """Tops the reservation up to what the generator wants, as far as free and evictable blocks
        allow (nothing when it holds enough): hinted blocks first — the free ones after a running
        table, a placed run for a new one — earmarked for their sequence, then the rest placed as
        a new table's run. A refill the generator cannot take (closed channel) goes back at once."""
        owner = self.reservation
        before = len(self.arena.table(owner))
        general = max(0, msg.want - before)  # unmarked blocks asked for (new tables' runs among them)
        if not general and not msg.hints:
            return
        await afault("prefix.refill")
        budget = min(general + sum(n for *_, n in msg.hints), self.arena.num_free())
        earmarks = []
        for rid, last, n in msg.hints:
            got = []
            if last is None:  # a new table: a run placed as `cache.free_blocks` places one
                placed = self.arena.allocate_evicting(("placing", owner), max(0, min(n, budget)))
                got = [block for block, _ in placed]
                self.arena.move(("placing", owner), owner, got)
                general -= len(got)
            else:  # the free blocks after a running table — while free blocks are plentiful: held
                # ahead, they would otherwise make the arena evict cached blocks sooner
                for block in range(last + 1, min(last + 1 + n, self.num_blocks)):
                    if (len(got) >= budget or self.arena.num_unused() <= general + self.num_blocks // 8
                            or not self.arena.claim(owner, block)):
                        break
                    got.append(block)
            budget -= len(got)
            if got:
                earmarks.append((rid, tuple(got)))
        placing = ("placing", owner)  # the rest as a new table's run, then moved to the reservation
        # the spare part of the reserve comes from free blocks only: evicting for it would throw away
        # cached blocks (a just-preempted request's, which its resume would have taken back) for
        # blocks nobody may draw
        n = max(0, min(budget, general))
        n = min(n, max(general - msg.slack, self.arena.num_unused()))
        taken = self.arena.allocate_evicting(placing, max(0, n))
        self.arena.move(placing, owner, [block for block, _ in taken])
        evicted = [(block, h) for block, h in taken if h is not None]
        if evicted:  # no free block was left: least recently used cached blocks made room
            self.log.info("prefix_cache.evict", request_id=str(owner), blocks=[b for b, _ in evicted],
                          hashes=[key_prefix(h) for _, h in evicted])
        blocks = self.arena.table(owner)[before:]
        if not blocks and msg.want <= before and all(last is not None for _, last, _ in msg.hints):
            return  # only hints after running tables, none of them free: nothing to say
        if not send(msg.reply, Refill(self.epoch, self.lease, msg.number, blocks, self.arena.num_free(),
                                       tuple(earmarks))):
            self.arena.truncate(owner, before)  # nobody will draw them


def send(channel: trio.MemorySendChannel, message) -> bool:
    """Sends without waiting; False when nobody listens any more (the channel was closed)."""
    try:
        channel.send_nowait(message)
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False

"""The cache manager's reservation ledger (a part `PrefixCacheManager` holds): the generator's
reservation — the blocks held for it under `Reservation(epoch, lease)` — its draws from it, and the
one `Refill` that tops it up after a `StepReport` (see `actors.block_grants` for the generator's
side, and `prefix_cache` for the ownership rules).

The ledger owns the lease, the reports already handled, and the requests a draw was refused for;
the blocks themselves are the manager's arena's, handed in by each call with the manager's life
(epoch), which the manager alone moves."""

from __future__ import annotations

import trio

from mmserve.actors.faults import afault
from mmserve.actors.messages import Draw, PrefixFailed, Refill, Reservation, StepReport
from mmserve.cache.block_arena import BlockArena
from mmserve.cache.keys import key_prefix
from mmserve.errors import ServiceUnavailable


class ReservationLedger:
    """The generator's reservation in the manager's arena: opened reports, draws, refills."""

    def __init__(self, num_blocks: int, log):
        self.num_blocks = num_blocks
        self.log = log  # the manager's: its events are `prefix_cache.*`
        self.last_report = -1  # the latest step report handled: kept across restarts (never reused)
        self.refused_draws = 0  # draws of blocks the reservation did not hold (each failed its request)
        self.new_life()

    def new_life(self) -> None:
        """A fresh arena: no lease in it yet, and no table it could distrust."""
        self.lease: int | None = None  # the generator's reservation lease (None: none in this life yet)
        self.broken: set[str] = set()  # requests a draw was refused for: their tables are not trusted

    def owner(self, epoch: int) -> Reservation | None:
        """The arena's owner of the reservation in life `epoch` (None before its first report)."""
        return Reservation(epoch, self.lease) if self.lease is not None else None

    def reserved(self, arena: BlockArena, epoch: int) -> int:
        """Blocks the reservation holds (not yet anyone's)."""
        return len(arena.table(self.owner(epoch))) if self.lease is not None else 0

    def trusts(self, request_id: str) -> bool:
        """False for a request a draw was refused for: its table here is not the one the generator
        believes, so nothing is keyed by it."""
        return request_id not in self.broken

    def released(self, request_id: str) -> None:
        """The request holds nothing any more: its next table starts afresh."""
        self.broken.discard(request_id)

    def open(self, arena: BlockArena, msg: StepReport, epoch: int) -> bool | None:
        """Starts handling report `msg`: None for a duplicate or a replay (everything in it was
        done), else whether it is of life `epoch` (a report of a dead life moves nothing: its tables
        died with it). A newer lease gives the older reservation back whole (the generator dropped
        it, and drops every refill of it)."""
        if msg.number <= self.last_report:
            self.log.warning("prefix_cache.report_duplicate", number=msg.number, last=self.last_report)
            return None
        self.last_report = msg.number
        current = msg.epoch is None or msg.epoch == epoch
        if current and (self.lease is None or msg.lease > self.lease):
            if self.lease is not None:
                owner = self.owner(epoch)
                self.log.info("prefix_cache.reservation_returned", lease=self.lease, blocks=len(arena.table(owner)))
                arena.free(owner)
            self.lease = msg.lease
        return current

    def draw(self, arena: BlockArena, entry: Draw, msg: StepReport, epoch: int) -> None:
        """The drawn blocks move from the reservation to the request — only blocks the reservation
        really holds: any other draw is refused, and the request fails alone (a 503 to retry)
        rather than share a block with its owner. Blocks drawn later for a refused request still
        move (they are the reservation's), and its Release settles them."""
        rid, owner = entry.request_id, self.owner(epoch)
        held = set(arena.table(owner)) if msg.lease == self.lease else set()
        if rid not in self.broken and set(entry.blocks) <= held and len(set(entry.blocks)) == len(entry.blocks):
            arena.move(owner, rid, entry.blocks)
            return
        if rid in self.broken:
            arena.move(owner, rid, [b for b in dict.fromkeys(entry.blocks) if b in held])
            return
        self.broken.add(rid)
        self.refused_draws += 1
        self.log.error("prefix_cache.draw_refused", request_id=rid, blocks=list(entry.blocks), lease=msg.lease,
                       reservation=sorted(held))
        send(msg.reply, PrefixFailed(rid, "kv reservation", ServiceUnavailable(
            "the KV cache refused blocks this request was given; retry", retry_after_s=1.0)))

    async def refill(self, arena: BlockArena, msg: StepReport, epoch: int) -> None:
        """Tops the reservation up to what the generator wants, as far as free and evictable blocks
        allow (nothing when it holds enough): hinted blocks first — the free ones after a running
        table, a placed run for a new one — earmarked for their sequence, then the rest placed as
        a new table's run. A refill the generator cannot take (closed channel) goes back at once.
        Only for a report of this life and lease."""
        if msg.lease != self.lease:
            return
        owner = self.owner(epoch)
        before = len(arena.table(owner))
        general = max(0, msg.want - before)  # unmarked blocks asked for (new tables' runs among them)
        if not general and not msg.hints:
            return
        await afault("prefix.refill")
        budget = min(general + sum(n for *_, n in msg.hints), arena.num_free())
        earmarks = []
        for rid, last, n in msg.hints:
            got = []
            if last is None:  # a new table: a run placed as `cache.free_blocks` places one
                placed = arena.allocate_evicting(("placing", owner), max(0, min(n, budget)))
                got = [block for block, _ in placed]
                arena.move(("placing", owner), owner, got)
                general -= len(got)
            else:  # the free blocks after a running table — while free blocks are plentiful: held
                # ahead, they would otherwise make the arena evict cached blocks sooner
                for block in range(last + 1, min(last + 1 + n, self.num_blocks)):
                    if (len(got) >= budget or arena.num_unused() <= general + self.num_blocks // 8
                            or not arena.claim(owner, block)):
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
        n = min(n, max(general - msg.slack, arena.num_unused()))
        taken = arena.allocate_evicting(placing, max(0, n))
        arena.move(placing, owner, [block for block, _ in taken])
        evicted = [(block, h) for block, h in taken if h is not None]
        if evicted:  # no free block was left: least recently used cached blocks made room
            self.log.info("prefix_cache.evict", request_id=str(owner), blocks=[b for b, _ in evicted],
                          hashes=[key_prefix(h) for _, h in evicted])
        blocks = arena.table(owner)[before:]
        if not blocks and msg.want <= before and all(last is not None for _, last, _ in msg.hints):
            return  # only hints after running tables, none of them free: nothing to say
        if not send(msg.reply, Refill(epoch, self.lease, msg.number, blocks, arena.num_free(), tuple(earmarks))):
            arena.truncate(owner, before)  # nobody will draw them


def send(channel: trio.MemorySendChannel, message) -> bool:
    """Sends without waiting; False when nobody listens any more (the channel was closed)."""
    try:
        channel.send_nowait(message)
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False

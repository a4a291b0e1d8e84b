"""The cache manager's KV events (a part `PrefixCacheManager` holds, when `[kv_events]` is on): what
its arena's hash entries did, in the arena's own order, handed to the replica's `KVEventPublisher`
once per message handled. It owns what was announced and the journal the manager's arena writes
into (`BlockArena(journal=...)`); the arena is the manager's, handed in by each call that reads it.

Order is a property of the arena, not of message timing: the arena journals every hash entry it
makes (`commit`) or erases (an eviction in `allocate_evicting`, `clear`) as it happens, and the
events are read from that journal. So a block is announced (`BlockStored`) only once it is
committed, and withdrawn (`BlockRemoved`) in the same batch as, and before, anything that
reuses it — the eviction that frees it is journaled before its new owner can commit it.

A block is announced only with the token ids a `Commit` carried (`Commit.routing`). A block cached
without them (restored from the shared tier: its lookup carries hashes only) is announced when
the request it was restored for commits its first block (its routing then covers its whole
cached prefix) — routers (Dynamo's) skip a block whose parent they do not know, so a restored
prefix left unannounced would hide every block after it. The same covers blocks routers forgot
after a dropped batch, as requests hit them. A reset of the arena (a restart after a
fault) or an admin cache reset that leaves nothing cached says `AllBlocksCleared` when this is the
only model publishing on the replica's stream, else withdraws this model's announced blocks.
"""

from __future__ import annotations

from mmserve.cache.kv_event_records import AllCleared, BlocksRemoved, runs, stored_blocks


class KVEventSource:
    """One model's source of events on the replica's publisher (`publisher.sources` counts them)."""

    def __init__(self, publisher, block_size: int):
        self.publisher = publisher
        self.block_size = block_size
        publisher.add_source()
        self._announced: dict[bytes, int] = {}  # block hash → routing id, for blocks announced
        self._routing: dict = {}  # block hash → StoredBlock, from the commits of the message being handled
        self._journal: list = []  # (kind, block, hash) as the arena made or erased its entries
        self._generation = publisher.generation

    @property
    def journal(self) -> list:
        """Where the manager's arena journals its hash entries (`BlockArena(journal=...)`), every
        arena of every life: (kind, block, hash), read by `flush`."""
        return self._journal

    def new_arena(self) -> None:
        """The manager replaces its arena (a reset after a fault): every announcement is void,
        withdrawn, and the journal starts empty."""
        self._journal.clear()
        self._routing.clear()
        self._withdraw_all()

    def note_commit(self, arena, msg) -> None:
        """The token ids of a commit's blocks, for their announcement (read in `flush`). Blocks of
        the request's cached prefix that are cached and were never announced (restored from the
        shared tier, or forgotten by routers after a dropped batch) are announced now, first."""
        if msg.routing is None:
            return
        blocks = stored_blocks(msg.routing, self.block_size)
        self._routing.update(blocks)
        committing = {h for _, h in msg.blocks}
        for h in blocks:
            block = arena.block_of(h)
            if h not in committing and h not in self._announced and block is not None:
                self._journal.append(("stored", block, h))

    def flush(self, arena, reset: bool = False) -> None:
        """The journal since the last flush, as one batch: stored blocks in chained runs, removals of
        announced blocks. `reset`: an admin cache reset — all cleared when nothing is cached."""
        if not (self._journal or reset):  # nothing cached or evicted (commits of blocks cached already)
            self._routing.clear()
            return
        if self.publisher.generation != self._generation:  # a batch was dropped: the router forgot it all
            self._generation = self.publisher.generation
            self._announced.clear()
        entries, out, stored = list(self._journal), [], []
        self._journal.clear()
        for kind, _, h in entries:
            if kind == "stored":
                block = self._routing.get(h)
                if block is not None and h not in self._announced:  # (a prefix's block, announced once)
                    stored.append(block)
                    self._announced[h] = block.block
                continue
            gone = self._announced.pop(h, None)
            if gone is None:
                continue
            out += runs(stored, self.block_size)
            stored = []
            if out and isinstance(out[-1], BlocksRemoved):
                out[-1] = BlocksRemoved(out[-1].blocks + (gone,))
            else:
                out.append(BlocksRemoved((gone,)))
        out += runs(stored, self.block_size)
        self._routing.clear()
        if reset and self.publisher.sources == 1 and arena.num_cached() == 0:
            out = [AllCleared()]
        if out:
            self.publisher.publish(out)

    def _withdraw_all(self) -> None:
        if self.publisher.sources == 1:
            self._announced.clear()
            self.publisher.publish([AllCleared()])
        elif self._announced:
            gone = tuple(self._announced.values())
            self._announced.clear()
            self.publisher.publish([BlocksRemoved(gone)])

    def close(self) -> None:
        """The model is unloaded (its `fail_in_flight` reset the arena: what it announced is
        withdrawn already): it publishes no more."""
        self.publisher.remove_source()
        self._journal.clear()

"""The KV arena's bookkeeping: blocks, block tables, refcounts, hash → block, LRU (DESIGN.md F3, F5).

Pure and synchronous: no trio, no logging, no tensors. The PrefixCacheManager actor owns one per
model; the Generator holds the KV tensors (indexed by block id) and writes only into blocks granted
here. Every change is reported by return value so the actor can log it.

One arena of `num_blocks` fixed-size blocks holds the KV of running sequences **and** of cached
prefixes alike (no separate pool, nothing copied between the two). Each owner (a request's internal
id, any hashable) has a block table, the ordered block ids its KV lives in. A block is either:

- free: holds nothing anyone can name (no hash, no reference); handed out so that each table
  stays one run of consecutive ids where it can (see `allocate_evicting`);
- referenced: in at least one block table (refcount = the number of (owner, table position)
  references to it); maybe cached too (it has a hash) and then shared by every owner that hit it;
- evictable: cached (it has a hash) and referenced by nobody; kept in LRU order, and reused by
  `allocate` only when no free block is left.

A cache hit is block ids that start the hitting owner's (empty) table: zero bytes copied. A commit
records that an owner's full block holds the content its hash names, so a later `lookup` shares it.

Rules, and the failure each closes: blocks are assigned only by `allocate` (F3), free ones first
(placed to keep tables consecutive), then the least recently released evictable one, its hash
entry erased in the same step; `allocate` is all-or-nothing (`ArenaFull` changes nothing);
`free`/`truncate` only drop references (an abort erases, evicts, reassigns nothing); `commit`
registers a hash at most once (a duplicate stays private), one content per block; `lookup` only
starts an empty table and `transfer` hands a table to an owner holding nothing (hits never shift
the indices of blocks an owner holds); eviction is least recently *released* first, a chain
from its tail, and a hit takes a block out of the LRU order (F5); `can_allocate(n)` is true
exactly when `allocate(owner, n)` would succeed; `claim` takes one named free block as `allocate`
would, and `move` hands blocks from one table to another without touching a refcount (a
reservation's blocks drawn by a request); `hold` references named blocks whatever their state, so
that none of them is allocated while its owner holds them (an abandoned step's quarantine).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Sequence

from mmserve.cache.arena_types import (  # noqa: F401  (re-exported: the arena's own values)
    EVICTABLE, FREE, REFERENCED, ArenaBlockInfo, ArenaFull, ArenaStats)
from mmserve.cache.free_blocks import FreeBlocks
from mmserve.cache import arena_invariants
from mmserve.cache.keys import key_prefix


class BlockArena:
    """Bookkeeping of a paged KV arena of `num_blocks` blocks (0 is allowed: nothing fits)."""

    def __init__(self, num_blocks: int, journal: list | None = None):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._tables: dict[Hashable, list[int]] = {}  # owner → its block table (never empty)
        self._refs: list[int] = [0] * num_blocks  # block → (owner, position) references
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._free = FreeBlocks(num_blocks)
        self._lru: OrderedDict[int, int] = OrderedDict()  # evictable block → release stamp, LRU first
        self._clock = 0
        self._referenced = 0  # blocks with refcount > 0
        self._queries_blocks = 0
        self._hit_blocks = 0
        self._allocated_blocks = 0
        self._evictions = 0
        self._commits = 0
        self._duplicate_commits = 0
        self._cleared = 0
        # every hash entry made or erased, in order — ("stored" | "removed", block, hash) — when a list
        # is given: KV events are read from it (`actors.kv_event_source`), so they follow this order
        self.journal = journal

    # -- queries -------------------------------------------------------------------------------

    def peek(self, hashes: Sequence[bytes]) -> int:
        """Length of the cached prefix of `hashes`; changes nothing."""
        _check_hashes(hashes)
        n = 0
        for h in hashes:
            if h not in self._block_of:
                break
            n += 1
        return n

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(owner, n)` would succeed now: n blocks are free or evictable."""
        _check_count(n)
        return n <= self.num_free()

    # -- changes -------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], owner: Hashable) -> list[int]:
        """Blocks of the longest cached prefix of `hashes`: they start `owner`'s table.

        Only ever at the start of an empty table (ValueError otherwise, changing nothing): after
        blocks the owner holds, hits would shift the indices it commits by. Each found block gets
        one more reference (an evictable one leaves the LRU order); a miss changes nothing.
        """
        _check_hashes(hashes)
        if owner in self._tables:
            raise ValueError(f"owner {owner!r} holds blocks: a lookup starts an empty table")
        blocks: list[int] = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            self._ref(block)
        if blocks:
            self._tables[owner] = blocks
        self._queries_blocks += len(hashes)
        self._hit_blocks += len(blocks)
        return list(blocks)

    def transfer(self, src: Hashable, dst: Hashable) -> list[int]:
        """`src`'s whole table becomes `dst`'s, which must hold nothing (ValueError otherwise,
        changing nothing); refcounts are unchanged (a lookup's pinned hits, once delivered)."""
        if src == dst or dst in self._tables:
            raise ValueError(f"cannot transfer {src!r}'s table to {dst!r}: a transfer starts an empty table")
        table = self._tables.pop(src, [])
        if table:
            self._tables[dst] = table
        return list(table)

    def allocate(self, owner: Hashable, n: int) -> list[int]:
        """`n` new blocks appended to `owner`'s table (refcount 1, no hash); all or `ArenaFull`."""
        return [block for block, _ in self.allocate_evicting(owner, n)]

    def allocate_evicting(self, owner: Hashable, n: int) -> list[tuple[int, bytes | None]]:
        """`allocate`, also naming the entry erased from each block: (block, evicted hash or None).

        Free blocks are taken first, placed to keep the owner's table one run of consecutive ids
        (`FreeBlocks`: its KV is then read in place, not gathered). Then evictable
        blocks, least recently released first; each one's hash entry is erased at once (F3).
        Raises `ArenaFull` and changes nothing when fewer than `n` blocks are free or evictable.
        """
        _check_count(n)
        hash(owner)  # an unhashable owner fails here, before anything changed
        available = self.num_free()
        if n > available:
            raise ArenaFull(n, available)
        if n == 0:
            return []
        table = self._tables.setdefault(owner, [])
        out: list[tuple[int, bytes | None]] = []
        for i in range(n):
            if self._free:
                block = self._free.take_next(table[-1] if table else None, n - i)
                out.append((block, None))
            else:
                block, _ = self._lru.popitem(last=False)
                out.append((block, self._drop_entry(block)))
                self._evictions += 1
            self._refs[block] = 1
            table.append(block)
        self._referenced += n
        self._allocated_blocks += n
        return out

    def claim(self, owner: Hashable, block: int) -> bool:
        """`block` appended to `owner`'s table when it is free (refcount 1, no hash), as `allocate`
        would give it; False, changing nothing, when it is not free (referenced or evictable)."""
        self._check_block(block)
        hash(owner)
        if block not in self._free:
            return False
        self._free.take(block)
        self._refs[block] = 1
        self._tables.setdefault(owner, []).append(block)
        self._referenced += 1
        self._allocated_blocks += 1
        return True

    def hold(self, owner: Hashable, blocks: Iterable[int]) -> list[int]:
        """Each of `blocks` (duplicates once) gets one reference more, under `owner`, whatever its
        state: a free one is taken as `claim` takes it, an evictable one leaves the LRU order (its
        entry stays: hits may still share it), a referenced one is shared. So none of them can be
        allocated until `owner` is freed — the blocks an abandoned step may still write (a
        quarantine). `owner` must hold nothing (ValueError, changing nothing); returns its table."""
        hash(owner)
        wanted = list(dict.fromkeys(blocks))
        for block in wanted:
            self._check_block(block)
        if owner in self._tables:
            raise ValueError(f"owner {owner!r} holds blocks: a hold starts an empty table")
        for block in wanted:
            if block in self._free:
                self._free.take(block)
            self._ref(block)
        if wanted:
            self._tables[owner] = wanted
        return list(wanted)

    def move(self, src: Hashable, dst: Hashable, blocks: Sequence[int]) -> None:
        """`blocks`, each in `src`'s table, leave it and are appended to `dst`'s table in this order
        (blocks drawn from a reservation: refcounts unchanged). ValueError, changing nothing, when
        one is not in `src`'s table, is named twice, or `src` is `dst`."""
        table = self._tables.get(src, [])
        if src == dst or len(set(blocks)) != len(blocks) or not set(blocks) <= set(table):
            raise ValueError(f"cannot move blocks {list(blocks)} from {src!r} (holding {table}) to {dst!r}")
        if not blocks:
            return
        gone = set(blocks)
        table[:] = [b for b in table if b not in gone]
        if not table:
            del self._tables[src]
        self._tables.setdefault(dst, []).extend(blocks)

    def share(self, src: Hashable, dst: Hashable, start: int, count: int) -> list[int]:
        """Blocks [start, start + count) of `src`'s table appended to `dst`'s, each with one more
        reference (the choices of one request share its prompt's blocks: zero bytes copied)."""
        for n in (start, count):
            _check_count(n)
        table = self._tables.get(src, [])
        if start + count > len(table) or src == dst:
            raise ValueError(f"owner {src!r} holds {len(table)} blocks: cannot share [{start}, {start + count}) with {dst!r}")
        blocks = table[start:start + count]
        for block in blocks:
            self._ref(block)
        if blocks:
            self._tables.setdefault(dst, []).extend(blocks)
        return blocks

    def commit(self, owner: Hashable, index: int, block_hash: bytes) -> bool:
        """Record that `owner`'s table[index] is full and holds the content `block_hash` names:
        True when hash → block was registered; False, changing nothing, when the hash is cached in
        another block (this one stays private) or names this one already; ValueError when the
        block has another hash."""
        _check_hashes([block_hash])
        table = self._tables.get(owner)
        if not table:
            raise ValueError(f"owner {owner!r} holds no blocks to commit")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(table):
            raise ValueError(f"index must be an int in [0, {len(table)}), got {index!r}")
        block = table[index]
        old = self._hash_of.get(block)
        if old is not None:
            if old == block_hash:
                return False  # already committed with this content (e.g. a lookup hit)
            raise ValueError(f"block {block} holds {key_prefix(old)}: it cannot be committed as {key_prefix(block_hash)}")
        if block_hash in self._block_of:
            self._duplicate_commits += 1
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self._commits += 1
        if self.journal is not None:
            self.journal.append(("stored", block, block_hash))
        return True

    def free(self, owner: Hashable) -> None:
        """Drop every reference `owner` holds (finish, abort, preemption). Blocks left with no
        reference become evictable (hashed; tail of the table first) or free. Touches no entry;
        an unknown owner is harmless."""
        self.truncate(owner, 0)

    def truncate(self, owner: Hashable, keep: int) -> None:
        """Drop the references of `owner`'s table after its first `keep` blocks (blocks given it
        that it never learned of, taken back), as `free` does; `keep` 0 frees it all."""
        _check_count(keep)
        table = self._tables.get(owner)
        if not table or keep >= len(table):
            return
        dropped = table[keep:]
        if keep:
            del table[keep:]
        else:
            del self._tables[owner]
        for block in reversed(dropped):
            left = self._refs[block] - 1
            self._refs[block] = left
            if left:
                continue
            self._referenced -= 1
            if block in self._hash_of:
                self._clock += 1
                self._lru[block] = self._clock
            else:
                self._free.give(block)

    def clear(self) -> int:
        """Drop every evictable entry (referenced blocks keep theirs); return how many."""
        n = len(self._lru)
        for block in self._lru:
            self._drop_entry(block)
            self._free.give(block)
        self._lru.clear()
        self._cleared += n
        return n

    # -- inspection ----------------------------------------------------------------------------

    def table(self, owner: Hashable) -> tuple[int, ...]:
        """`owner`'s block table; () when it holds nothing."""
        return tuple(self._tables.get(owner, ()))

    def refcount(self, block: int) -> int:
        self._check_block(block)
        return self._refs[block]

    def hash_of(self, block: int) -> bytes | None:
        self._check_block(block)
        return self._hash_of.get(block)

    def block_of(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def owners(self) -> set:
        """Owners holding at least one block."""
        return set(self._tables)

    def num_free(self) -> int:
        """Blocks `allocate` can give: free plus evictable."""
        return len(self._free) + len(self._lru)

    def num_unused(self) -> int:
        """Free blocks only (no hash, no reference): what `claim` can take without evicting."""
        return len(self._free)

    def num_used(self) -> int:
        """Blocks referenced by at least one block table."""
        return self._referenced

    def num_cached(self) -> int:
        """Blocks with a hash (cache entries), referenced or evictable."""
        return len(self._hash_of)

    def free_blocks(self) -> list[int]:
        """Free blocks (no hash, no reference), ascending."""
        return self._free.blocks()

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks (hash, no reference), the next eviction candidate first."""
        return list(self._lru)

    def stats(self) -> ArenaStats:
        return ArenaStats(  # in field order
            self.num_blocks, len(self._free), len(self._lru), self._referenced, len(self._hash_of),
            len(self._tables), self._queries_blocks, self._hit_blocks, self._allocated_blocks,
            self._evictions, self._commits, self._duplicate_commits, self._cleared)

    def snapshot(self) -> list[ArenaBlockInfo]:
        """Every block that is not free, by id: (block, state, refcount, hash prefix, LRU rank)."""
        rank = {block: r for r, block in enumerate(self._lru)}
        free = set(self.free_blocks())
        rows = []
        for block in range(self.num_blocks):
            if block in free:
                continue
            h = self._hash_of.get(block)
            state = REFERENCED if self._refs[block] else EVICTABLE
            rows.append(ArenaBlockInfo(block, state, self._refs[block],
                                       key_prefix(h) if h is not None else None, rank.get(block)))
        return rows

    def check_invariants(self) -> None:
        """Raise ValueError naming the first broken invariant, if any (`arena_invariants`)."""
        arena_invariants.check_invariants(self)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"BlockArena(num_blocks={s.num_blocks}, free={s.free_blocks}, evictable={s.evictable_blocks}, "
                f"referenced={s.referenced_blocks}, cached={s.cached_blocks})")

    # -- internals -----------------------------------------------------------------------------

    def _ref(self, block: int) -> None:
        if not self._refs[block]:
            self._referenced += 1
            self._lru.pop(block, None)  # a cached block found by lookup: evictable until now
        self._refs[block] += 1

    def _drop_entry(self, block: int) -> bytes:
        h = self._hash_of.pop(block)
        del self._block_of[h]
        if self.journal is not None:
            self.journal.append(("removed", block, h))
        return h

    def _check_block(self, block: int) -> None:
        if not _in_range(block, self.num_blocks):
            raise ValueError(f"block must be an int in [0, {self.num_blocks}), got {block!r}")


def _in_range(block: object, n: int) -> bool:
    return not isinstance(block, bool) and isinstance(block, int) and 0 <= block < n


def _check_count(n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a block count must be an int >= 0, got {n!r}")


def _check_hashes(hashes: Iterable[bytes]) -> None:
    if isinstance(hashes, (bytes, bytearray, str)):
        raise TypeError("hashes must be a sequence of block hashes, not a single bytes/str object")
    for h in hashes:
        if type(h) is not bytes:
            raise TypeError(f"block hashes must be bytes, got {type(h).__name__}")

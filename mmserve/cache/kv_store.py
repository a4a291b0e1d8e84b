"""The prefix (KV) cache's bookkeeping: chained block hash → slot, pins, LRU (DESIGN.md F2, F3).

Pure and synchronous: no trio, no logging, no tensors. The owning PrefixCacheManager actor keeps
the KV pool indexed by slot and copies KV in and out; this store only decides which slot holds
which block, and reports every change so the actor can log it.

Rules (each one closes a hole seen in real servers, failure F3):

- Slots are assigned only by `commit`, and only to blocks being written: a free slot (lowest
  first), else the least-recently-used unpinned slot, whose old entry is erased at once. A slot is
  never described by two entries, so an entry's hash always names what its slot holds.
- `lookup` and `commit` pin the slots they return or register for their owner; a pinned slot is
  never evicted nor reassigned. Pins are per owner: an owner pins a slot at most once, and a
  slot's refcount is the number of distinct owners pinning it. `release(owner)` drops them all.
- `abort` is exactly `release`: it never consumes, frees nor reorders anything else.
- A commit pins its own chain as it goes, so it never evicts an earlier block of the same chain;
  when every slot is pinned it stops, since later blocks of a chain are unreachable without it.

Recency: each `lookup` / `commit` is one use of the slots it touches. Within one call, earlier
blocks of the chain count as more recently used than later ones, so a chain is evicted from its
tail first and its cached part stays a usable prefix (evicting block 0 first would leave every
later block unreachable). Only unpinned occupied slots are in the LRU order; a slot whose last pin
is released re-enters it at the place of its last use, not as if it had just been used.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, NamedTuple, Sequence

from mmserve.cache.keys import key_prefix


@dataclass(frozen=True)
class KVStoreStats:
    num_slots: int
    entries: int
    free_slots: int
    pinned_slots: int
    queries_blocks: int  # blocks asked for by `lookup`
    hit_blocks: int  # blocks `lookup` answered from the cache
    commits_blocks: int  # new blocks registered by `commit` (already cached ones not counted)
    evictions: int  # entries evicted: reassigned by `commit` plus explicit `evict`
    stale_entries_dropped: int  # of `evictions`: entries erased because `commit` reassigned their slot
    explicit_evictions: int  # of `evictions`: entries evicted by `evict`
    uncommitted_blocks: int  # blocks `commit` could not register because every slot was pinned
    cleared_entries: int  # entries dropped by `clear`


class KVSlotInfo(NamedTuple):
    """One row of `snapshot()`; lru_rank 0 is the next eviction candidate, None when pinned."""

    slot: int
    hash_prefix: str
    pins: int
    lru_rank: int | None


class KVBlockStore:
    """Block hash → KV slot bookkeeping over `num_slots` slots (0 is allowed: nothing is cached)."""

    def __init__(self, num_slots: int):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        self._slot_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._free: list[int] = list(range(num_slots))  # a min-heap (a sorted list is one)
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned occupied slots, LRU first
        self._last_use: dict[int, int] = {}  # occupied slot → clock of its last use
        self._clock = 0
        self._refs: Counter[int] = Counter()  # pinned slot → number of owners pinning it (> 0 only)
        self._held: dict[Hashable, set[int]] = {}  # owner → slots it pins (never empty)
        self._queries_blocks = 0
        self._hit_blocks = 0
        self._commits_blocks = 0
        self._stale_dropped = 0
        self._explicit_evictions = 0
        self._uncommitted_blocks = 0
        self._cleared = 0

    # -- queries -------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], owner: Hashable) -> list[int]:
        """Slots of the longest cached prefix of `hashes`, each pinned for `owner`."""
        _check_hashes(hashes)
        slots: list[int] = []
        for h in hashes:
            slot = self._slot_of.get(h)
            if slot is None:
                break
            slots.append(slot)
        for slot in slots:
            self._pin(slot, owner)
        self._touch(slots)
        self._queries_blocks += len(hashes)
        self._hit_blocks += len(slots)
        return slots

    def peek(self, hashes: Sequence[bytes]) -> int:
        """Length of the cached prefix of `hashes`; changes nothing."""
        _check_hashes(hashes)
        n = 0
        for h in hashes:
            if h not in self._slot_of:
                break
            n += 1
        return n

    # -- changes -------------------------------------------------------------------------------

    def commit(self, hashes: Sequence[bytes], owner: Hashable) -> list[tuple[int, int, bytes | None]]:
        """Register the chain `hashes`; return (index, slot, evicted hash or None) per new block.

        The caller must write block `index`'s KV into `slot` for every returned row. Blocks already
        cached are pinned for `owner`, not returned. Stops at the first block no slot can be had for.
        """
        _check_hashes(hashes)
        placed: list[tuple[int, int, bytes | None]] = []
        touched: list[int] = []
        for i, h in enumerate(hashes):
            slot = self._slot_of.get(h)
            if slot is None:
                taken = self._take_slot()
                if taken is None:
                    self._uncommitted_blocks += len(hashes) - i
                    break
                slot, evicted = taken
                self._slot_of[h] = slot
                self._hash_of[slot] = h
                placed.append((i, slot, evicted))
            self._pin(slot, owner)  # before the next block: a commit never evicts its own chain
            touched.append(slot)
        self._touch(touched)
        self._commits_blocks += len(placed)
        return placed

    def release(self, owner: Hashable) -> None:
        """Drop every pin of `owner`; slots left unpinned re-enter the LRU order by last use."""
        held = self._held.pop(owner, None)
        if not held:
            return
        unpinned = []
        for slot in held:
            left = self._refs[slot] - 1
            if left:
                self._refs[slot] = left
            else:
                del self._refs[slot]
                unpinned.append(slot)
        if unpinned:
            self._requeue(unpinned)

    def abort(self, owner: Hashable) -> None:
        """Same as `release`: an abort consumes, frees and reorders nothing else."""
        self.release(owner)

    def evict(self, n: int = 1) -> list[tuple[int, bytes]]:
        """Evict up to `n` least-recently-used unpinned entries; return their (slot, hash)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[tuple[int, bytes]] = []
        while len(out) < n and self._lru:
            slot, _ = self._lru.popitem(last=False)
            out.append((slot, self._drop_entry(slot)))
            heapq.heappush(self._free, slot)
        self._explicit_evictions += len(out)
        return out

    def discard(self, slots: Iterable[int]) -> list[bytes]:
        """Drop the entries of `slots` — a commit whose KV never reached them (its write failed):
        their hashes must name nothing. Returns the dropped hashes; the slots are free again.
        The caller releases its pins first; a slot still pinned is refused, and nothing changes."""
        slots = list(dict.fromkeys(slots))
        for slot in slots:
            self._check_slot(slot)
            if self._refs.get(slot):
                raise ValueError(f"slot {slot} is pinned; release it before discarding its entry")
        dropped = []
        for slot in slots:
            if slot in self._hash_of:
                del self._lru[slot]
                dropped.append(self._drop_entry(slot))
                heapq.heappush(self._free, slot)
        return dropped

    def clear(self) -> int:
        """Drop every unpinned entry (pinned ones stay); return how many were dropped."""
        n = len(self._lru)
        for slot in self._lru:
            self._drop_entry(slot)
            self._free.append(slot)
        self._lru.clear()
        heapq.heapify(self._free)
        self._cleared += n
        return n

    # -- inspection ----------------------------------------------------------------------------

    def slot_of(self, block_hash: bytes) -> int | None:
        return self._slot_of.get(block_hash)

    def hash_of(self, slot: int) -> bytes | None:
        self._check_slot(slot)
        return self._hash_of.get(slot)

    def pins(self, slot: int) -> int:
        """Number of distinct owners pinning `slot`."""
        self._check_slot(slot)
        return self._refs.get(slot, 0)

    def owners(self) -> set:
        """Owners holding at least one pin."""
        return set(self._held)

    def __len__(self) -> int:
        return len(self._slot_of)

    def free_slots(self) -> int:
        return len(self._free)

    def stats(self) -> KVStoreStats:
        return KVStoreStats(
            num_slots=self.num_slots,
            entries=len(self._slot_of),
            free_slots=len(self._free),
            pinned_slots=len(self._refs),
            queries_blocks=self._queries_blocks,
            hit_blocks=self._hit_blocks,
            commits_blocks=self._commits_blocks,
            evictions=self._stale_dropped + self._explicit_evictions,
            stale_entries_dropped=self._stale_dropped,
            explicit_evictions=self._explicit_evictions,
            uncommitted_blocks=self._uncommitted_blocks,
            cleared_entries=self._cleared,
        )

    def snapshot(self) -> list[KVSlotInfo]:
        """Every occupied slot, by slot number: (slot, hash prefix, pins, LRU rank or None)."""
        rank = {slot: r for r, slot in enumerate(self._lru)}
        return [KVSlotInfo(slot, key_prefix(h), self._refs.get(slot, 0), rank.get(slot))
                for slot, h in sorted(self._hash_of.items())]

    def check_invariants(self) -> None:
        """Raise ValueError naming the first broken invariant, if any."""
        n = self.num_slots
        occupied = set(self._hash_of)
        free = set(self._free)
        if len(free) != len(self._free):
            raise ValueError(f"free list holds a slot twice: {sorted(self._free)}")
        for i in range(1, len(self._free)):
            if self._free[(i - 1) // 2] > self._free[i]:
                raise ValueError(f"free list is not a min-heap at index {i}: {self._free}")
        if bad := sorted(s for s in occupied | free if not (isinstance(s, int) and 0 <= s < n)):
            raise ValueError(f"slots out of range [0, {n}): {bad}")
        if both := occupied & free:
            raise ValueError(f"slots both free and occupied: {sorted(both)}")
        if len(self._slot_of) + len(free) != n:
            raise ValueError(f"{len(self._slot_of)} entries + {len(free)} free slots != {n} slots")
        if len(self._slot_of) != len(self._hash_of):
            raise ValueError(f"{len(self._slot_of)} hash→slot entries but {len(self._hash_of)} slot→hash")
        for h, slot in self._slot_of.items():
            if self._hash_of.get(slot) != h:
                other = self._hash_of.get(slot)
                raise ValueError(f"entry {key_prefix(h)} → slot {slot}, but slot {slot} is described by "
                                 f"{key_prefix(other) if other is not None else None}")
        if set(self._last_use) != occupied:
            raise ValueError(f"last-use clock kept for {sorted(self._last_use)}, occupied {sorted(occupied)}")
        for owner, held in self._held.items():
            if not held:
                raise ValueError(f"owner {owner!r} kept with no pins")
        expected = Counter(slot for held in self._held.values() for slot in held)
        if expected != self._refs:
            raise ValueError(f"refcounts {dict(self._refs)} != pins summed over owners {dict(expected)}")
        if bad := sorted(s for s, c in self._refs.items() if c <= 0):
            raise ValueError(f"non-positive refcount kept for slots {bad}")
        if bad := sorted(set(self._refs) - occupied):
            raise ValueError(f"pins on unoccupied slots {bad}")
        if set(self._lru) != occupied - set(self._refs):
            raise ValueError(f"LRU order {list(self._lru)} != unpinned occupied slots "
                             f"{sorted(occupied - set(self._refs))}")
        stamps = [self._last_use[s] for s in self._lru]
        if any(a >= b for a, b in zip(stamps, stamps[1:])):
            raise ValueError(f"LRU order {list(self._lru)} is not by last use {stamps}")

    def __repr__(self) -> str:
        s = self.stats()
        return (f"KVBlockStore(num_slots={s.num_slots}, entries={s.entries}, free={s.free_slots}, "
                f"pinned={s.pinned_slots})")

    # -- internals -----------------------------------------------------------------------------

    def _pin(self, slot: int, owner: Hashable) -> None:
        held = self._held.setdefault(owner, set())
        if slot in held:
            return
        held.add(slot)
        if not self._refs[slot]:
            self._lru.pop(slot, None)  # a slot just taken by commit is in no LRU order yet
        self._refs[slot] += 1

    def _touch(self, chain_slots: list[int]) -> None:
        """One use of a chain's (pinned) slots: block 0 ends up the most recently used."""
        for slot in reversed(chain_slots):
            self._clock += 1
            self._last_use[slot] = self._clock

    def _take_slot(self) -> tuple[int, bytes | None] | None:
        """The lowest free slot, else the LRU unpinned slot with its entry erased; None if all pinned."""
        if self._free:
            return heapq.heappop(self._free), None
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        self._stale_dropped += 1
        return slot, self._drop_entry(slot)

    def _drop_entry(self, slot: int) -> bytes:
        h = self._hash_of.pop(slot)
        del self._slot_of[h]
        del self._last_use[slot]
        return h

    def _requeue(self, slots: list[int]) -> None:
        """Put newly unpinned slots into the LRU order at the place of their last use.

        The LRU order is sorted by last use; only its tail younger than the oldest returning slot
        is taken off and merged back, so the common case costs little more than an append.
        """
        stamp = self._last_use.__getitem__
        oldest = min(map(stamp, slots))
        lru = self._lru
        while lru:
            last, _ = lru.popitem(last=True)
            if stamp(last) < oldest:
                lru[last] = None  # put back: it and everything before it are older
                break
            slots.append(last)
        slots.sort(key=stamp)
        lru.update(dict.fromkeys(slots))

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots}), got {slot!r}")


def _check_hashes(hashes: Iterable[bytes]) -> None:
    if isinstance(hashes, (bytes, bytearray, str)):
        raise TypeError("hashes must be a sequence of block hashes, not a single bytes/str object")
    for h in hashes:
        if type(h) is not bytes:
            raise TypeError(f"block hashes must be bytes, got {type(h).__name__}")

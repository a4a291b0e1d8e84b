"""The invariants of a `BlockArena`'s bookkeeping (its own `check_invariants` calls this; the
property tests call it after every operation)."""

from __future__ import annotations

from collections import Counter

from mmserve.cache.keys import key_prefix


def check_invariants(arena) -> None:
    """Raise ValueError naming the first broken invariant of `arena`, if any."""
    n = arena.num_blocks
    if len(arena._refs) != n:
        raise ValueError(f"{len(arena._refs)} refcounts kept for {n} blocks")
    if bad := [b for b, c in enumerate(arena._refs) if c < 0]:
        raise ValueError(f"negative refcount for blocks {bad}")
    for owner, table in arena._tables.items():
        if not table:
            raise ValueError(f"owner {owner!r} kept with an empty block table")
        if bad := [b for b in table if not _in_range(b, n)]:
            raise ValueError(f"owner {owner!r}'s table holds blocks out of range [0, {n}): {bad}")
    expected = Counter(b for table in arena._tables.values() for b in table)
    if bad := [b for b in range(n) if arena._refs[b] != expected.get(b, 0)]:
        b = bad[0]
        raise ValueError(f"refcount of block {b} is {arena._refs[b]}, but {expected.get(b, 0)} "
                         "table positions reference it")
    referenced = {b for b in range(n) if arena._refs[b] > 0}
    if arena._referenced != len(referenced):
        raise ValueError(f"referenced count {arena._referenced} != {len(referenced)} referenced blocks")
    arena._free.check(n)
    free = set(arena.free_blocks())
    evictable = set(arena._lru)
    if bad := sorted(b for b in free | evictable | set(arena._hash_of) if not _in_range(b, n)):
        raise ValueError(f"blocks out of range [0, {n}): {bad}")
    if both := free & referenced:
        raise ValueError(f"blocks both free and referenced: {sorted(both)}")
    if both := evictable & referenced:
        raise ValueError(f"blocks both evictable and referenced: {sorted(both)}")
    if both := free & evictable:
        raise ValueError(f"blocks both free and evictable: {sorted(both)}")
    if lost := sorted(set(range(n)) - free - evictable - referenced):
        raise ValueError(f"blocks neither free, evictable nor referenced: {lost}")
    if len(arena._block_of) != len(arena._hash_of):
        raise ValueError(f"{len(arena._block_of)} hash→block entries but {len(arena._hash_of)} block→hash")
    for h, block in arena._block_of.items():
        if arena._hash_of.get(block) != h:
            other = arena._hash_of.get(block)
            raise ValueError(f"entry {key_prefix(h)} → block {block}, but block {block} is described "
                             f"by {key_prefix(other) if other is not None else None}")
    if bad := sorted(free & set(arena._hash_of)):
        raise ValueError(f"free blocks with a hash: {bad}")
    if evictable != set(arena._hash_of) - referenced:
        raise ValueError(f"evictable blocks {sorted(evictable)} != hashed unreferenced blocks "
                         f"{sorted(set(arena._hash_of) - referenced)}")
    stamps = list(arena._lru.values())
    if any(a >= b for a, b in zip(stamps, stamps[1:])):
        raise ValueError(f"LRU order {list(arena._lru)} is not by release {stamps}")


def _in_range(block: object, n: int) -> bool:
    return isinstance(block, int) and not isinstance(block, bool) and 0 <= block < n

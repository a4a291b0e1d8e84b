"""The plain values a `BlockArena` reports: block states, its counters, one block's row of a
snapshot, and the error of an allocation that cannot be met. Pure: no logic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

FREE = "free"
EVICTABLE = "evictable"
REFERENCED = "referenced"


class ArenaFull(ValueError):
    """`allocate` cannot give all the blocks asked for; nothing was changed."""

    def __init__(self, wanted: int, available: int):
        super().__init__(f"cannot allocate {wanted} blocks: only {available} free or evictable")
        self.wanted = wanted
        self.available = available


@dataclass(frozen=True)
class ArenaStats:
    num_blocks: int
    free_blocks: int  # no hash, no reference
    evictable_blocks: int  # hash, no reference
    referenced_blocks: int  # in at least one block table
    cached_blocks: int  # blocks with a hash (entries), referenced or evictable
    owners: int  # owners with a non-empty block table
    queries_blocks: int  # blocks asked for by `lookup`
    hit_blocks: int  # blocks `lookup` answered from the cache
    allocated_blocks: int  # blocks handed out by `allocate`
    evictions: int  # entries erased because `allocate` reused their block
    commits: int  # entries registered by `commit`
    duplicate_commits: int  # commits refused because the hash was cached in another block
    cleared_entries: int  # entries dropped by `clear`


class ArenaBlockInfo(NamedTuple):
    """One row of `snapshot()`; lru_rank 0 is the next eviction candidate, None unless evictable."""

    block: int
    state: str  # FREE, EVICTABLE or REFERENCED
    refcount: int
    hash_prefix: str | None
    lru_rank: int | None

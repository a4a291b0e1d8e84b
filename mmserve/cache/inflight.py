"""In-flight dedup of prefix-cache blocks: who is computing which block right now, and who waits.

Pure and synchronous bookkeeping for the PrefixCacheManager. A request whose lookup misses
*registers* the block hashes it is about to compute. A later request whose first missing block is
registered by another request *parks* its lookup on that owner instead of computing the same
blocks again; when the owner commits or aborts (`done`), or the wait reaches its deadline
(`expired`), the parked lookups are handed back to be looked up again — by then the blocks are
cached, or the waiter computes them itself.

Rules: the first registration of a hash wins; a parked request registers nothing, so waits form
chains, never cycles (a request only ever waits on one that registered before it parked); `done`
forgets every registration and parked lookup of its owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Hashable, Iterable, TypeVar

T = TypeVar("T")


@dataclass
class Parked(Generic[T]):
    waiter: Hashable
    owner: Hashable
    deadline: float
    payload: T  # what the manager needs to answer the lookup later (the message itself)


@dataclass
class InFlightBlocks(Generic[T]):
    _owner_of: dict[bytes, Hashable] = field(default_factory=dict)
    _registered: dict[Hashable, list[bytes]] = field(default_factory=dict)
    _parked: dict[Hashable, Parked[T]] = field(default_factory=dict)  # waiter → its parked lookup

    def owner_of(self, block_hash: bytes) -> Hashable | None:
        return self._owner_of.get(block_hash)

    def register(self, owner: Hashable, hashes: Iterable[bytes]) -> int:
        """Records that `owner` is computing `hashes` (those nobody else registered); returns how many."""
        if owner in self._parked:
            raise ValueError(f"{owner!r} is waiting; a waiting request registers nothing")
        mine = [h for h in dict.fromkeys(hashes) if h not in self._owner_of]
        for h in mine:
            self._owner_of[h] = owner
        if mine:
            self._registered.setdefault(owner, []).extend(mine)
        return len(mine)

    def park(self, waiter: Hashable, owner: Hashable, deadline: float, payload: T) -> None:
        if waiter == owner:
            raise ValueError("a request cannot wait on itself")
        if waiter in self._parked or waiter in self._registered:
            raise ValueError(f"{waiter!r} already waits or computes")
        self._parked[waiter] = Parked(waiter, owner, deadline, payload)

    def is_parked(self, waiter: Hashable) -> bool:
        return waiter in self._parked

    def done(self, owner: Hashable) -> list[Parked[T]]:
        """Forgets `owner` (it committed, aborted or failed); returns the lookups parked on it."""
        for h in self._registered.pop(owner, []):
            del self._owner_of[h]
        self._parked.pop(owner, None)
        woken = [p for p in self._parked.values() if p.owner == owner]
        for p in woken:
            del self._parked[p.waiter]
        return woken

    def expired(self, now: float) -> list[Parked[T]]:
        """Removes and returns the parked lookups whose deadline has passed."""
        late = [p for p in self._parked.values() if p.deadline <= now]
        for p in late:
            del self._parked[p.waiter]
        return late

    def next_deadline(self) -> float:
        return min((p.deadline for p in self._parked.values()), default=float("inf"))

    def clear(self) -> list[Parked[T]]:
        """Forgets everything; returns the lookups that were parked (to be answered)."""
        parked = list(self._parked.values())
        self._owner_of.clear()
        self._registered.clear()
        self._parked.clear()
        return parked

    def check_invariants(self) -> None:
        """Raise ValueError naming the first broken invariant, if any."""
        owners = {h: o for o, hs in self._registered.items() for h in hs}
        if owners != self._owner_of:
            raise ValueError("the hash → owner index disagrees with the owners' registrations")
        if empty := [o for o, hs in self._registered.items() if not hs]:
            raise ValueError(f"owners registered with no block: {empty!r}")
        for p in self._parked.values():
            if p.waiter in self._registered:
                raise ValueError(f"{p.waiter!r} both waits and computes")
            if p.waiter == p.owner:
                raise ValueError(f"{p.waiter!r} waits on itself")

    def __len__(self) -> int:
        return len(self._parked)

    @property
    def registered_blocks(self) -> int:
        return len(self._owner_of)

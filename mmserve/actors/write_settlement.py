"""Which of the values queued for a write have settled (written, failed or dropped), in queue
order, and an event for "every value queued so far has settled": a response that committed blocks
ends once any replica can find them (`SharedTier.notify_after_writes`)."""

from __future__ import annotations

import trio


class WriteSettlement:
    def __init__(self):
        self._queued = 0  # values ever queued; the n-th one queued is settled once _settled >= n
        self._settled = 0
        self._waits: list[tuple[int, trio.Event]] = []

    def queued(self) -> None:
        self._queued += 1

    def settled(self, n: int) -> None:
        self._settled += n
        ready = [e for target, e in self._waits if target <= self._settled]
        self._waits = [(t, e) for t, e in self._waits if t > self._settled]
        for e in ready:
            e.set()

    def all_queued_so_far(self) -> trio.Event:
        """Set once every value queued until now has settled (at once when none is pending)."""
        done = trio.Event()
        if self._settled >= self._queued:
            done.set()
        else:
            self._waits.append((self._queued, done))
        return done

    @property
    def pending(self) -> int:
        """Values queued and not yet settled (a value handed straight to the waiting writer is in
        neither the channel's buffer nor a batch yet, and still counts)."""
        return self._queued - self._settled

"""Which blocks of a KV arena are free, and which free block a block table grows by.

Pure bookkeeping for `BlockArena`. The choice keeps block tables consecutive: attention reads a
sequence whose blocks are one run of consecutive ids straight from the arena, where a scattered
table must first be gathered into a copy (on the CPU, a 16-sequence decode step of the bench model
takes 39 ms gathering, 27 ms reading in place). So a table grows by the block right after its last
one when that is free; otherwise — a new table, or a neighbour in the way — its blocks go into the
largest run of free blocks, the slack split evenly around them: the table before keeps room to
grow, and so does this one.
"""

from __future__ import annotations

import re

_RUN = re.compile(b"\x01+")  # consecutive free blocks in the map


class FreeBlocks:
    """The free blocks of an arena of `num_blocks` (all free at first)."""

    def __init__(self, num_blocks: int):
        self._map = bytearray(b"\x01" * num_blocks)  # block → 1 when free
        self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block: int) -> bool:
        return 0 <= block < len(self._map) and bool(self._map[block])

    def blocks(self) -> list[int]:
        """The free blocks, ascending."""
        return [b for b, free in enumerate(self._map) if free]

    def take_next(self, last: int | None, wanted: int) -> int:
        """Takes and returns the free block a table whose last block is `last` (None: an empty
        table) grows by, `wanted` blocks (this one included) still to come. At least one must be free."""
        if not self._count:
            raise ValueError("no free block to take")
        block = last + 1 if last is not None and last + 1 in self else self._placed(wanted)
        self.take(block)
        return block

    def take(self, block: int) -> None:
        """`block` (free) is free no more."""
        if block not in self:
            raise ValueError(f"block {block} is not free")
        self._map[block] = 0
        self._count -= 1

    def give(self, block: int) -> None:
        """`block` is free again."""
        if self._map[block]:
            raise ValueError(f"block {block} is already free")
        self._map[block] = 1
        self._count += 1

    def _placed(self, wanted: int) -> int:
        start, length = 0, 0
        for run in _RUN.finditer(self._map):  # the first of the largest runs
            if run.end() - run.start() > length:
                start, length = run.start(), run.end() - run.start()
        return start if start == 0 else start + max(0, length - wanted) // 2

    def check(self, num_blocks: int) -> None:
        """Raise ValueError when the map and the count disagree, or the map has the wrong size."""
        if len(self._map) != num_blocks or set(self._map) - {0, 1}:
            raise ValueError(f"the free map is not one 0/1 flag per block: {bytes(self._map)!r}")
        if self._count != sum(self._map):
            raise ValueError(f"free count {self._count} != {sum(self._map)} blocks flagged free")

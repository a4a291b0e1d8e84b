"""The reserve the generator draws its blocks from (`Reserve`, a part of `actors.block_grants`'s
`BlockGrants`), and how a prefill chunk is cut at a bidirectional span. Pure: no messages, no trio."""

from __future__ import annotations

RESERVE_SHARE = 8  # the reservation holds at most 1/RESERVE_SHARE of the arena
RESERVE_SLACK = 2  # blocks beyond the next step's estimate: a request that arrives meanwhile runs at once


def whole_spans(seq, start: int, tokens: int) -> int:
    """`tokens` from `start`, grown to the end of a bidirectional span it would end inside when the
    chunk starts at (or in) that span — the scheduler plans such a span whole — or cut before one
    that starts later."""
    end = start + tokens
    for lo, hi in getattr(seq, "bidirectional", ()):
        if lo < end < hi:
            end = hi if lo <= start else lo
            break
    return max(0, end - start)


class Reserve:
    """The reservation's blocks the generator has not drawn yet, some earmarked for a sequence (the
    blocks after its table's last one: the manager gave them for that, when they were free). A
    table grows by the block right after its last one when the reserve holds it (and it is not
    earmarked for another); otherwise from the start of the largest run of unmarked consecutive
    blocks (the manager placed it as `cache.free_blocks` places a table: with room to grow after
    it); a marked block goes last."""

    def __init__(self):
        self._blocks: set[int] = set()
        self._marks: dict[int, str] = {}  # block → the sequence (kv owner) it is earmarked for

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def blocks(self) -> list[int]:
        return sorted(self._blocks)

    def add(self, blocks, earmarks=()) -> None:
        self._blocks.update(blocks)
        for owner, marked in earmarks:
            self._marks.update((b, owner) for b in marked if b in self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self._marks.clear()

    def marked_for(self, owner: str) -> bool:
        return owner in self._marks.values()

    def draw(self, owner: str, last: int | None, n: int) -> list[int]:
        """`n` blocks (at most len(self)) for `owner`'s table, whose last block is `last` (None: empty)."""
        out: list[int] = []
        mine = sorted(b for b, o in self._marks.items() if o == owner)
        while len(out) < n:
            block = last + 1 if last is not None else (mine[0] if mine else None)
            if block not in self._blocks or self._marks.get(block, owner) != owner:
                block = self._placed(n - len(out))
            self._blocks.remove(block)
            self._marks.pop(block, None)
            out.append(block)
            last = block
        return out

    def _placed(self, wanted: int) -> int:
        free = sorted(b for b in self._blocks if b not in self._marks) or sorted(self._blocks)
        start, length, run_start, prev = 0, 0, None, None
        for b in free:
            if prev is None or b != prev + 1:
                run_start = b
            prev = b
            if b - run_start + 1 > length:
                start, length = run_start, b - run_start + 1
        return start  # the manager placed each run with room to grow after it

"""The cache manager's quarantine (a part `PrefixCacheManager` holds): the blocks a step the
generator abandoned may still write — or any writer of the arena still in flight when the manager
starts a new life (`engine.write_fence`) — are held in the arena under `StepFence(step)`: never
allocated, kept across the manager's restarts, until that step's `StepReturned` (see
`actors.step_fences`).

The quarantine owns which steps are held and with which blocks; the arena it holds them in is the
manager's, handed in by each call (a restart makes a fresh one, and the quarantine holds its steps
in that one too)."""

from __future__ import annotations

from collections.abc import Callable

from mmserve.actors.messages import StepFence
from mmserve.cache.block_arena import BlockArena


class StepQuarantine:
    """Abandoned steps still running → the blocks they may write."""

    def __init__(self, num_blocks: int, log):
        self.num_blocks = num_blocks
        self.log = log  # the manager's: its events are `prefix_cache.*`
        self.steps: dict[int, tuple[int, ...]] = {}
        self.returned: set[int] = set()  # returned before their quarantine came: none is needed

    def hold(self, arena: BlockArena, step: int, blocks: tuple[int, ...]) -> None:
        """The step was abandoned while it ran: its blocks stay held (under `StepFence`), whoever
        releases them, until it returns. One that has returned already needs nothing."""
        if step in self.returned:
            self.returned.discard(step)
            return
        if step in self.steps or not blocks:
            return  # a duplicate
        blocks = tuple(b for b in dict.fromkeys(blocks) if 0 <= b < self.num_blocks)
        self.steps[step] = blocks
        arena.hold(StepFence(step), blocks)
        self.log.warning("prefix_cache.quarantined", step=step, blocks=list(blocks),
                         quarantined_blocks=self.blocks)

    def release(self, arena: BlockArena, step: int) -> None:
        """The abandoned step returned: it writes nothing any more, its blocks go back (those
        others still hold stay theirs). A late or duplicate message changes nothing."""
        blocks = self.steps.pop(step, None)
        if blocks is None:
            self.returned.add(step)  # its quarantine, if it comes, is void
            return
        arena.free(StepFence(step))
        self.log.info("prefix_cache.quarantine_released", step=step, blocks=list(blocks),
                      quarantined_blocks=self.blocks)

    def hold_in(self, arena: BlockArena) -> None:
        """A fresh arena (a new life): an abandoned step writes on, whatever life this is."""
        for step, blocks in self.steps.items():
            arena.hold(StepFence(step), blocks)

    def fence_writers(self, arena: BlockArena, fence, epoch: int, on_return: Callable[[int], None]) -> None:
        """Life `epoch` begins on the runner's write fence (`engine.write_fence`): a writer of
        the arena still in flight from an earlier life — a step, a restore — is quarantined like an
        abandoned step, before anything of this life is granted, until it returns (`on_return`)."""
        for writer, blocks in fence.new_epoch(epoch, on_return):
            self.hold(arena, writer, blocks)

    @property
    def blocks(self) -> int:
        """Blocks held only for abandoned steps still running (never granted meanwhile)."""
        return len({b for blocks in self.steps.values() for b in blocks})

    def __len__(self) -> int:
        """Abandoned steps still running."""
        return len(self.steps)

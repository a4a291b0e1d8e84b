"""The manager's half of the step fence (a part of `PrefixCacheManager`): the blocks a step the
generator abandoned may still write — or any writer of the arena still in flight when the manager
starts a new life (`engine.write_fence`) — are held under `StepFence(step)`: never allocated,
kept across the manager's restarts, until that step's `StepReturned` (see `actors.step_fences`)."""

from __future__ import annotations

from mmserve.actors.messages import Quarantine, StepFence, StepReturned
from mmserve.actors.step_fences import step_returned_sender


class QuarantineSide:
    """PrefixCacheManager methods: quarantines and their end."""

    def _quarantine(self, entry: Quarantine) -> None:
        """The step was abandoned while it ran: its blocks stay held (under `StepFence`), whoever
        releases them, until it returns. One that has returned already needs nothing."""
        if entry.step in self.returned_steps:
            self.returned_steps.discard(entry.step)
            return
        if entry.step in self.quarantined or not entry.blocks:
            return  # a duplicate
        blocks = tuple(b for b in dict.fromkeys(entry.blocks) if 0 <= b < self.num_blocks)
        self.quarantined[entry.step] = blocks
        self.arena.hold(StepFence(entry.step), blocks)
        self.log.warning("prefix_cache.quarantined", step=entry.step, blocks=list(blocks),
                         quarantined_blocks=self.quarantined_blocks)

    def _step_returned(self, msg: StepReturned) -> None:
        """The abandoned step returned: it writes nothing any more, its blocks go back (those
        others still hold stay theirs). A late or duplicate message changes nothing."""
        blocks = self.quarantined.pop(msg.step, None)
        if blocks is None:
            self.returned_steps.add(msg.step)  # its quarantine, if it comes, is void
            return
        self.arena.free(StepFence(msg.step))
        self.log.info("prefix_cache.quarantine_released", step=msg.step, blocks=list(blocks),
                      quarantined_blocks=self.quarantined_blocks)

    def _fence_writers(self) -> None:
        """This life begins on the runner's write fence (`engine.write_fence`): a writer of the
        arena still in flight from an earlier life — a step, a restore — is quarantined like an
        abandoned step, before anything of this life is granted, until it returns."""
        if self.kv is None:
            return
        for writer, blocks in self.kv.fence.new_epoch(self.epoch, step_returned_sender(self.inbox_send)):
            self._quarantine(Quarantine(writer, blocks))

    @property
    def quarantined_blocks(self) -> int:
        """Blocks held only for abandoned steps still running (never granted meanwhile)."""
        return len({b for blocks in self.quarantined.values() for b in blocks})

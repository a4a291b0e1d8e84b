"""The generator's side of the KV reservation protocol, for tests that drive a real
`PrefixCacheManager` alone: step reports (draws, commits, releases, the reserve wanted) and the
refills that answer them (`actors.block_grants` is the real one)."""

from __future__ import annotations

import itertools
import math

import trio
import trio.testing

from mmserve.actors.messages import Draw, Refill, StepReport


class GeneratorSide:
    def __init__(self, manager):
        self.manager = manager
        self.lease = 0
        self.numbers = itertools.count()
        self.inbox_send, self.inbox = trio.open_memory_channel(math.inf)
        self.reserve: list[int] = []

    def report(self, entries=(), want: int = 0, epoch: int | None = None, reply=None) -> StepReport:
        msg = StepReport(next(self.numbers), self.manager.epoch if epoch is None else epoch, self.lease,
                         tuple(entries), want, self.inbox_send if reply is None else reply)
        self.manager.inbox_send.send_nowait(msg)
        return msg

    async def refill(self, want: int) -> Refill:
        """Asks for `want` blocks in reserve and takes the refill."""
        self.report(want=want)
        with trio.fail_after(5):
            msg = await self.inbox.receive()
        assert isinstance(msg, Refill), msg
        self.reserve += msg.blocks
        return msg

    async def grant(self, needs) -> tuple[dict[str, tuple[int, ...]], int]:
        """Draws `needs` [(request id, blocks)] from a reserve refilled for them, reported to the
        manager: {request id: its blocks}, and the manager's epoch."""
        refill = await self.refill(sum(n for _, n in needs) + len(self.reserve))
        granted, entries = {}, []
        for rid, n in needs:
            blocks, self.reserve = tuple(self.reserve[:n]), self.reserve[n:]
            granted[rid] = blocks
            entries.append(Draw(rid, blocks))
        self.report(entries, want=len(self.reserve))
        await trio.testing.wait_all_tasks_blocked()
        return granted, refill.epoch

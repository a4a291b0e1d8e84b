"""The generator's half of the step fence (`StepFences`, a part the generator holds): a step abandoned while it still
runs — the stall watchdog restarted the generator and replaced the compute thread — may write on,
so its blocks are quarantined by the manager until it has really returned (`prefix_cache`'s
`StepQuarantine` holds them; see docs/design.md, "No write without ownership")."""

from __future__ import annotations

from typing import Callable

import trio

from mmserve.actors.messages import Quarantine, StepReturned
from mmserve.generation.scheduler import Planned
from mmserve.engine.write_fence import STEP_IDS


def step_returned_sender(manager: trio.MemorySendChannel):
    """`send(step)`, callable from any thread (a compute thread, as a step settles): `StepReturned(step)`
    to the manager's inbox, through the event loop of the caller of this function."""
    token = trio.lowlevel.current_trio_token()

    def send(step: int) -> None:
        def deliver() -> None:
            try:
                manager.send_nowait(StepReturned(step))
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                pass  # the manager is gone, and its arena with it
        try:
            token.run_sync_soon(deliver)
        except trio.RunFinishedError:
            pass  # the process is ending: nobody will grant those blocks again
    return send


def written_blocks(plan: list[Planned], copies) -> tuple[int, ...]:
    """Every block a step may write: its sequences' tables (only their new tokens' blocks are
    written, the rest read) and its block copies' targets."""
    return tuple(dict.fromkeys([b for p in plan for b in p.seq.table] + [c.target for c in copies]))


class StepFences:
    """What to do if a step is abandoned (`compute.run`'s `if_abandoned`). Owns the steps' numbers
    (one space with the runner's fence's writers: `STEP_IDS`)."""

    def __init__(self, manager: trio.MemorySendChannel, log):
        self.manager, self.log = manager, log
        self.step_ids = STEP_IDS  # each step's own number (the quarantine of an abandoned one)

    def quarantine(self, plan: list[Planned], copies, settle: Callable[[Quarantine], None]):
        """What to do if this step is abandoned while it still runs (a restart by the stall
        watchdog): every block it may write — its sequences' tables (only their new tokens' blocks
        are written, the rest read) and its block copies' targets — is quarantined by the manager,
        in a report sent at once (`settle`: the entry noted, the report sent), before the releases
        of its sequences; the step's own return (the compute thread's call really finished, or
        dropped unrun) ends the quarantine."""
        step, copies = next(self.step_ids), list(copies)
        report_return = step_returned_sender(self.manager)

        def returned() -> None:  # on the compute thread (or wherever the step settles)
            report_return(step)

        def abandoned():  # in the cancelled generator, before anything it holds is released
            written = written_blocks(plan, copies)
            self.log.warning("generator.step_abandoned", step=step, blocks=len(written),
                             request_ids=[p.seq.request_id for p in plan])
            settle(Quarantine(step, written))
            return returned
        return abandoned

"""Overlap scheduling (`[runtime] overlap`, on by default): step n+1 is planned, its blocks drawn
and the whole step built (inputs, attention metadata, sampling plan: `engine.step_inputs`) on the
event loop while step n runs on the compute thread, and queued behind it, so the compute thread
goes from one forward to the next without waiting for the event loop; step n's results
(streaming, stops, grammar, finishing) are unpacked and handled while step n+1 runs (`StepOverlap`,
a part the generator holds).

What a step reads is frozen when it is launched (`SeqView`: the sequence's ids, KV length, block
table and manager life as the step sees them), so the event loop may apply an earlier step's
results to the same sequences meanwhile. A step launched *ahead* (before the previous step's
tokens are on the host) carries only decode tokens of sequences that decoded in the step before:
its new token is `CARRIED` — a placeholder in its ids, the token itself gathered on the device from
the ids the previous step sampled there (`StepInputs.carry`): no host
round trip between the two steps (`StepExecutor`). Everything that needs the previous step's results on the host
first runs serially — the chain waits for the step in flight and the next step is planned as
without overlap: prefill chunks and admissions (a prefill's end forks n > 1 choices, a round
trip), grammar masks (the matcher must consume the token first), penalties (they read the answer
so far), a preemption (never while a step may write the victim's blocks), forked choices' block
copies, and a reservation too small for the next draws.

Ownership: a sequence that ends while a step that carries it is in flight (a stop found at step
n, with n+1 already launched, or a cancellation) keeps its blocks until every such step has
returned — its `Release` waits in `held` (`hold_release`), so no block is handed out while a step
may still write it; the extra token computed for it is discarded (`Answers.apply` ignores a
sequence that has ended). A sequence that finished at step n is in no plan after n+1.

`StepOverlap` owns the steps in flight and the releases held for them; the generator hands it the
sequences and, per chain, what to do with a step that returned (`after_step`: its results, its
messages) and how to send a report (`report`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from mmserve.actors import compute
from mmserve.actors.block_grants import BlockGrants
from mmserve.actors.messages import Release
from mmserve.actors.sequence import LIVE, SeqState
from mmserve.actors.step_executor import StepExecutor
from mmserve.actors.step_fences import StepFences
from mmserve.engine.step_inputs import SeqView
from mmserve.generation.scheduler import Planned, blocks_for

ENTER_WAIT_S = 0.005
"""How long the event loop waits, once step n returned, for the compute thread to reach step n+1's
forward before it handles step n's results (`chain`): the most it ever delays them."""


@dataclass(eq=False)
class Flight:
    """A step launched on the compute thread: its plan (the sequences themselves), what it was
    handed (views), the block copies it makes, and its results once it returned."""

    plan: list[Planned]
    views: list[Planned]
    copies: list = field(default_factory=list)
    launched: float = field(default_factory=time.monotonic)
    done: trio.Event = field(default_factory=trio.Event)
    queued: trio.Event = field(default_factory=trio.Event)  # in the compute thread's queue
    entered: trio.Event = field(default_factory=trio.Event)  # the compute thread reached its forward
    out: object = None  # what the compute thread handed back (`StepOutput`)
    results: list | None = None
    report: list[Planned] = field(default_factory=list)  # what the step report says of the next draws
    returned: float | None = None


class StepOverlap:
    """The chain of overlapped steps, and the releases held while they fly."""

    def __init__(self, enabled: bool, executor: StepExecutor, fences: StepFences, grants: BlockGrants,
                 block_size: int, max_positions: int):
        self.enabled = enabled
        self.executor, self.fences, self.grants = executor, fences, grants
        self.block_size, self.max_positions = block_size, max_positions
        self.flying: Counter[int] = Counter()  # id(sequence) -> steps in flight that carry it
        self.held: list[tuple[int, Release]] = []  # (id(sequence), Release) waiting for those steps

    async def chain(self, plan: list[Planned], seqs: list, owner: str | None, host_s: float | None,
                    report: Callable[[list[Planned]], None],
                    after_step: Callable[[Flight, float, float | None], Awaitable[None]]) -> None:
        """Runs `plan` (planned serially: nothing is in flight) and, while each step runs, launches
        the next one ahead when it can be (module docstring); each step's results are handled once
        it returned, while the next one runs (`after_step(flight, forward_s, host_s)`). `seqs`: the
        generator's live sequences (read when deciding the next step); `owner`: the compute
        thread's name for the generator; `host_s`: the event loop's time before this chain."""
        def settle(entry) -> None:  # a step abandoned: its quarantine goes out in a report at once
            self.grants.note(entry)
            report(())
        async with trio.open_nursery() as nursery:
            flight = self._launch(nursery, plan, [Planned(SeqView.of(p.seq), p.tokens, p.new_blocks, p.decode)
                                                  for p in plan], owner, settle, copies=True)
            flight.report = plan
            previous_end = None
            while flight is not None:
                nxt = self._ahead(nursery, flight, seqs, owner, settle)
                if nxt is not None or previous_end is None:  # one report per step launched
                    report((nxt or flight).report)
                if previous_end is not None:  # the event loop's work since the last step returned
                    host_s = time.monotonic() - previous_end
                await flight.done.wait()
                if nxt is not None:
                    # the compute thread goes from step n to n+1's forward first: every torch op of
                    # its few between them lets the GIL go, and the event loop, busy with step n's
                    # results, would keep it for up to the switch interval each time
                    with trio.move_on_after(ENTER_WAIT_S):
                        await nxt.entered.wait()
                forward = flight.returned - max(flight.launched, previous_end or flight.launched)
                previous_end = time.monotonic()
                await after_step(flight, forward, host_s)
                host_s = None
                flight = nxt

    def _launch(self, nursery, plan: list[Planned], views: list[Planned], owner: str | None, settle,
                copies: bool = False, after: Flight | None = None, built=None) -> Flight:
        """Starts a step on the compute thread; `after`: the step it must be queued behind (trio
        starts tasks in no fixed order, the compute thread runs its queue in order)."""
        executor = self.executor
        flight = Flight(plan, views, executor.take_copies() if copies else [])
        for p in plan:
            self.flying[id(p.seq)] += 1
        abandoned = self.fences.quarantine(views, flight.copies, settle)

        async def run() -> None:
            if after is not None:
                await after.queued.wait()
            try:
                out = await compute.run(executor.step, views, flight.copies, executor.incarnation, built,
                                        abandon_on_cancel=True, owner=owner, if_abandoned=abandoned,
                                        submitted=flight.queued.set)
            finally:
                for c in flight.copies:  # made (or never to be): their sources go back in the next report
                    self.grants.note(Release(c.pin))
            flight.returned = time.monotonic()
            flight.out = out
            flight.done.set()

        nursery.start_soon(run)
        return flight

    def _ahead(self, nursery, flight: Flight, seqs: list, owner: str | None, settle) -> Flight | None:
        """The next step, launched now behind `flight` when every live sequence decodes in it and
        none needs its result on the host first; else None (the next step is planned serially)."""
        if not self.enabled or flight.copies or self.executor.copies or not flight.plan:
            return None
        live = [s for s in seqs if s.state in LIVE]
        flying = {id(p.seq) for p in flight.plan}
        if any(not p.decode for p in flight.plan) or any(id(s) not in flying for s in live):
            return None  # a prefill's end, or someone waiting: its state must come back first
        if any(s.matcher is not None or s.params.penalized or s.resumable or s.state is not SeqState.DECODING
               for s in live):
            return None
        # a sequence whose step in flight is certainly its last (its length) computes nothing more
        going = [s for s in live if len(s.tokens) + 1 < s.params.max_tokens and len(s.ids) + 1 < self.max_positions]
        if not going:
            return None
        needs = [max(0, blocks_for(s.kv_len + 2, self.block_size) - s.table_len) for s in going]
        if sum(needs) > len(self.grants.reserve):
            return None  # the refill, or a preemption, is decided serially
        plan = []
        for s, n in zip(going, needs):
            self.grants.draw(s, n)
            plan.append(Planned(s, 1, n, True))
        views = [Planned(SeqView.ahead(p.seq), 1, p.new_blocks, True) for p in plan]
        # the whole step built here, while the step before it runs — inputs, attention metadata,
        # sampling plan (the compute thread gathers the tokens that step samples on the device)
        built = self.executor.builder.build(views)
        ahead = self._launch(nursery, plan, views, owner, settle, after=flight, built=built)
        built.entered = _from_thread(ahead.entered.set)  # called on the compute thread
        # what the step after this one will draw: these sequences are two tokens further than their state
        ahead.report = [Planned(s, 2, 0, True) for s in going]
        return ahead

    def landed(self, flight: Flight) -> None:
        """`flight` returned: the releases held for sequences no longer in any step in flight go out."""
        for p in flight.plan:
            self.flying[id(p.seq)] -= 1
            if self.flying[id(p.seq)] <= 0:
                del self.flying[id(p.seq)]
        self.flush_held()

    def flush_held(self, everything: bool = False) -> None:
        """The held releases of sequences no step in flight carries go to the next report (all of
        them with `everything`: no step is in flight any more, or those are fenced)."""
        if everything:
            self.flying.clear()
        keep = []
        for key, entry in self.held:
            if self.flying.get(key):
                keep.append((key, entry))
            else:
                self.grants.note(entry)
        self.held = keep

    def hold_release(self, seq, entry: Release) -> bool:
        """Holds `entry` (the Release of `seq`) while a step in flight carries `seq`; False: none does."""
        if not self.flying.get(id(seq)):
            return False
        self.held.append((id(seq), entry))
        return True


def _from_thread(fn):
    """`fn` as a callable another thread may call: it runs on this trio loop (nothing once the loop
    ended: an abandoned step may reach its forward after the runtime closed)."""
    token = trio.lowlevel.current_trio_token()

    def call() -> None:
        try:
            token.run_sync_soon(fn)
        except trio.RunFinishedError:
            pass
    return call

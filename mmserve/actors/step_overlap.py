"""Overlap scheduling (`[runtime] overlap`, on by default): step n+1 is planned, its blocks drawn
and the whole step built (inputs, attention metadata, sampling plan: `Generator._build`) on the
event loop while step n runs on the compute thread, and queued behind it, so the compute thread
goes from one forward to the next without waiting for the event loop; step n's results
(streaming, stops, grammar, finishing) are unpacked and handled while step n+1 runs (a part of
`Generator`).

What a step reads is frozen when it is launched (`SeqView`: the sequence's ids, KV length, block
table and manager life as the step sees them), so the event loop may apply an earlier step's
results to the same sequences meanwhile. A step launched *ahead* (before the previous step's
tokens are on the host) carries only decode tokens of sequences that decoded in the step before:
its new token is `CARRIED` — a placeholder in its ids, the token itself gathered on the device from
the ids the previous step sampled there (`Generator._gather_carried`, `StepInputs.carry`): no host
round trip between the two steps. Everything that needs the previous step's results on the host
first runs serially — the chain waits for the step in flight and the next step is planned as
without overlap: prefill chunks and admissions (a prefill's end forks n > 1 choices, a round
trip), grammar masks (the matcher must consume the token first), penalties (they read the answer
so far), a preemption (never while a step may write the victim's blocks), forked choices' block
copies, and a reservation too small for the next draws.

Ownership: a sequence that ends while a step that carries it is in flight (a stop found at step
n, with n+1 already launched, or a cancellation) keeps its blocks until every such step has
returned — its `Release` waits in `_held` (`_release`), so no block is handed out while a step
may still write it; the extra token computed for it is discarded (`_apply` ignores a sequence
that has ended). A sequence that finished at step n is in no plan after n+1.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import trio

from mmserve.actors import compute
from mmserve.actors.sequence import LIVE, SeqState
from mmserve.generation.scheduler import Planned, blocks_for

CARRIED = -2
"""The token id of a step's input that is the token the previous step sampled for that sequence."""

ENTER_WAIT_S = 0.005
"""How long the event loop waits, once step n returned, for the compute thread to reach step n+1's
forward before it handles step n's results (`_chain`): the most it ever delays them."""


class SeqView:
    """A sequence as one step sees it: its ids, KV length, block table and manager life frozen at
    launch; everything else is read from (and written to) the sequence itself."""

    __slots__ = ("origin", "ids", "kv_len", "table", "epoch")

    def __init__(self, origin, ids: tuple[int, ...], kv_len: int, table: tuple[int, ...], epoch):
        for name, value in (("origin", origin), ("ids", ids), ("kv_len", kv_len), ("table", table), ("epoch", epoch)):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, seq) -> "SeqView":
        return cls(seq, tuple(seq.ids), seq.kv_len, tuple(seq.table), seq.epoch)

    @classmethod
    def ahead(cls, seq) -> "SeqView":
        """`seq` one decode step further than its host state: its next token is the one the step
        now in flight samples (`CARRIED`)."""
        return cls(seq, (*seq.ids, CARRIED), seq.kv_len + 1, tuple(seq.table), seq.epoch)

    def __getattr__(self, name):
        return getattr(self.origin, name)

    def __setattr__(self, name, value) -> None:
        setattr(self.origin, name, value)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.ids[self.origin.prompt_len:]

    @property
    def target_len(self) -> int:
        return len(self.ids)

    @property
    def table_len(self) -> int:
        return len(self.table)


def origin(seq):
    """The sequence behind a step's view (or the sequence itself)."""
    return seq.origin if isinstance(seq, SeqView) else seq


@dataclass(eq=False)
class Flight:
    """A step launched on the compute thread: its plan (the sequences themselves), what it was
    handed (views), and its results once it returned."""

    plan: list[Planned]
    views: list[Planned]
    launched: float = field(default_factory=time.monotonic)
    done: trio.Event = field(default_factory=trio.Event)
    queued: trio.Event = field(default_factory=trio.Event)  # in the compute thread's queue
    entered: trio.Event = field(default_factory=trio.Event)  # the compute thread reached its forward
    out: object = None  # what the compute thread handed back (`StepOutput`)
    results: list | None = None
    report: list[Planned] = field(default_factory=list)  # what the step report says of the next draws
    returned: float | None = None


class StepOverlap:
    """Generator methods: the chain of overlapped steps, and the releases held while they fly."""

    overlap: bool = True

    def _overlap_state(self) -> None:
        self._flying: Counter[int] = Counter()  # id(sequence) -> steps in flight that carry it
        self._held: list[tuple[int, object]] = []  # (id(sequence), Release) waiting for those steps
        # compute thread: the last step's sampled ids, on the device, and id(sequence) -> its row there
        self._carried: tuple | None = None
        self._host_time: float | None = None  # the event loop's time before the next step's wait

    async def _chain(self, plan: list[Planned]) -> None:
        """Runs `plan` (planned serially: nothing is in flight) and, while each step runs, launches
        the next one ahead when it can be (module docstring); each step's results are applied once
        it returned, while the next one runs."""
        async with trio.open_nursery() as nursery:
            flight = self._launch(nursery, plan, [Planned(SeqView.of(p.seq), p.tokens, p.new_blocks, p.decode)
                                                  for p in plan], copies=True)
            flight.report = plan
            previous_end = None
            while flight is not None:
                nxt = self._ahead(nursery, flight)
                if nxt is not None or previous_end is None:  # one report per step launched
                    self._report((nxt or flight).report)
                if previous_end is not None:  # the event loop's work since the last step returned
                    self._host_time = time.monotonic() - previous_end
                await flight.done.wait()
                if nxt is not None:
                    # the compute thread goes from step n to n+1's forward first: every torch op of
                    # its few between them lets the GIL go, and the event loop, busy with step n's
                    # results, would keep it for up to the switch interval each time
                    with trio.move_on_after(ENTER_WAIT_S):
                        await nxt.entered.wait()
                forward = flight.returned - max(flight.launched, previous_end or flight.launched)
                previous_end = time.monotonic()
                self._count_step(forward, self._host_time)
                self._host_time = None
                flight.results = await self._results(flight.out)  # its tokens' host copy, awaited here
                await self._apply_results(flight.plan, flight.results, round(forward, 6))
                self._landed(flight)
                self._take_waiting()
                self._drop_aborted()
                self.progressed()  # a step returned: the stall watchdog times the next one from here
                flight = nxt
        self._step_end = time.monotonic()

    def _launch(self, nursery, plan: list[Planned], views: list[Planned], copies: bool = False,
                after: Flight | None = None, built=None) -> Flight:
        """Starts a step on the compute thread; `after`: the step it must be queued behind (trio
        starts tasks in no fixed order, the compute thread runs its queue in order)."""
        flight = Flight(plan, views)
        for p in plan:
            self._flying[id(p.seq)] += 1
        taken = self._copies if copies else []
        abandoned = self._quarantine(views, taken)

        async def run() -> None:
            if after is not None:
                await after.queued.wait()
            try:
                out = await compute.run(self._step, views, taken, self._incarnation, built,
                                        abandon_on_cancel=True, owner=self.key, if_abandoned=abandoned,
                                        submitted=flight.queued.set)
            finally:
                if copies:
                    self._release_copies()
            flight.returned = time.monotonic()
            flight.out = out
            flight.done.set()

        nursery.start_soon(run)
        return flight

    def _ahead(self, nursery, flight: Flight) -> Flight | None:
        """The next step, launched now behind `flight` when every live sequence decodes in it and
        none needs its result on the host first; else None (the next step is planned serially)."""
        if not self.overlap or self._copies or not flight.plan:
            return None
        live = [s for s in self.seqs if s.state in LIVE]
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
            self._draw(s, n)
            plan.append(Planned(s, 1, n, True))
        views = [Planned(SeqView.ahead(p.seq), 1, p.new_blocks, True) for p in plan]
        # the whole step built here, while the step before it runs — inputs, attention metadata,
        # sampling plan (the compute thread gathers the tokens that step samples on the device)
        built = self._build(views)
        ahead = self._launch(nursery, plan, views, after=flight, built=built)
        built.entered = _from_thread(ahead.entered.set)  # called on the compute thread
        # what the step after this one will draw: these sequences are two tokens further than their state
        ahead.report = [Planned(s, 2, 0, True) for s in going]
        return ahead

    def _landed(self, flight: Flight) -> None:
        """`flight` returned: the releases held for sequences no longer in any step in flight go out."""
        for p in flight.plan:
            self._flying[id(p.seq)] -= 1
            if self._flying[id(p.seq)] <= 0:
                del self._flying[id(p.seq)]
        self._flush_held()

    def _flush_held(self, everything: bool = False) -> None:
        if everything:
            self._flying.clear()
        keep = []
        for key, entry in self._held:
            if self._flying.get(key):
                keep.append((key, entry))
            else:
                self._note(entry)
        self._held = keep

    def _hold_release(self, seq, entry) -> bool:
        """Holds `entry` (the Release of `seq`) while a step in flight carries `seq`; False: none does."""
        if not self._flying.get(id(seq)):
            return False
        self._held.append((id(seq), entry))
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

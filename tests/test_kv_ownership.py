"""One owner per KV block, whatever the timing of the messages (issue 28, DESIGN.md "Ownership rule"),
under the reservation protocol (issue 29: one message each way per step).

A hypothesis state machine drives a real `PrefixCacheManager` — its own message loop, on a trio
loop with a mock clock — with random interleavings of what intake and the generator send it:
lookups (hits, misses, parked waits), intake answers received or given up on (a closed reply
channel: a late answer); the generator's side of the reservation — blocks drawn from its reserve
with no message, step reports (draws, commits, releases, the reserve wanted) sent with the reply
channel open or closed (a dropped refill), reports sent again (duplicates), refills taken late or
twice, draws of blocks the reservation does not hold, leases dropped (idle, generator restart),
reports of a manager life that died; preemptions and resumes, the clock moving past wait
deadlines, faults, and manager restarts. Beside it, a small reference model keeps what each
request *believes* it holds, and what the generator believes its reserve holds (what
`actors.block_grants` would hold after the messages it took).

After every step: the arena's own invariants hold (refcounts equal table membership); every block
a live request believes it holds is in its manager table (at the same place once reported; in the
reservation's while its draw is unreported) and is neither free nor evictable; every block the
generator believes its current reserve holds is the reservation's alone; a block nobody has
committed is in one table at most. At the end, once everything is released and the lease given
back, nothing is referenced: no block leaked.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mmserve.actors import faults
from mmserve.actors.messages import (
    Commit, Draw, KVEpoch, Lookup, LookupResult, PrefixFailed, Refill, Release, Resume, Resumed,
    StepReport)
from mmserve.actors.prefix_cache import PrefixCacheManager
from mmserve.config import KVCacheConfig
from tests.kv_protocol import GeneratorSide

BLOCK = 4
NUM_BLOCKS = 12
WAIT_S = 2.0


def _h(*parts: int) -> bytes:
    return bytes(parts).ljust(16, b"\x00")


# three prompts: the first two share their first two blocks, the third shares nothing
PROMPTS = (
    tuple(_h(1, i) for i in range(4)),
    (_h(1, 0), _h(1, 1), _h(2, 2), _h(2, 3), _h(2, 4)),
    tuple(_h(3, i) for i in range(3)),
)


class Portal:
    """A trio loop (mock clock) on a thread of its own; the state machine's rules call into it."""

    def __init__(self):
        self.clock = trio.testing.MockClock()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), kwargs={"clock": self.clock},
                                        daemon=True)
        self._thread.start()
        self._ready.wait(10)

    async def _main(self):
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def call(self, async_fn, *args):
        return trio.from_thread.run(async_fn, *args, trio_token=self.token)

    def close(self):
        trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(10)


@dataclass
class Req:
    rid: str
    hashes: tuple[bytes, ...]
    reply: trio.MemorySendChannel = field(repr=False)
    answers: trio.MemoryReceiveChannel = field(repr=False)
    stage: str = "intake"  # intake (its lookup not answered yet) → generator → done
    table: list[int] = field(default_factory=list)  # what it believes it holds
    epoch: int | None = None
    committed: int = 0
    lookup_epoch: int = 0  # the manager life its lookup reached
    pending: bool = False  # entries of it wait in the next step report

    def hash_at(self, i: int) -> bytes:
        """Block i's key: the prompt's, then its own answer's (answers are private content)."""
        return self.hashes[i] if i < len(self.hashes) else _h(9, int(self.rid[1:]), i)


class OwnershipMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.portal = Portal()
        self.to_generator, self.generator_inbox = trio.open_memory_channel(math.inf)
        self.manager = PrefixCacheManager("ownership", KVCacheConfig(block_size=BLOCK, inflight_wait_s=WAIT_S),
                                          NUM_BLOCKS, generator=self.to_generator)
        self.reqs: dict[str, Req] = {}
        self.next_id = 0
        self.known_epoch: int | None = None  # the latest manager life the generator has heard of
        self.scope: trio.CancelScope | None = None
        # the generator's side of the reservation (`block_grants.BlockGrants`)
        self.lease = 0
        self.reserve: list[int] = []
        self.numbers = itertools.count()
        self.entries: list = []
        self.last_refill = -1
        self.sent: list[StepReport] = []
        self.refills: list[Refill] = []

    # -- the trio side ---------------------------------------------------------------------------

    @initialize()
    def start(self):
        self.portal.call(self._start_manager)

    async def _start_manager(self):
        self.scope = trio.CancelScope()

        async def run():
            with self.scope:
                try:
                    await self.manager.run()
                except Exception as e:  # the supervisor's part: the actor died of it
                    self.died = e

        self.died = None
        self.portal.nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()

    async def _send(self, msg):
        self.manager.inbox_send.send_nowait(msg)
        await trio.testing.wait_all_tasks_blocked()

    def send(self, msg, faulty: bool = False):
        self.portal.call(self._send, msg)
        if self.died is not None:  # restarted as the supervisor does: fail, reset, run again
            assert faulty, f"the manager died of {msg!r} with no fault injected: {self.died!r}"
            self.restart()

    def send_crashing(self, msg, point: str | None):
        """`send`, with the manager's handling of it raising at fault point `point` (it dies)."""
        faults.configure(point)
        try:
            self.send(msg, faulty=point is not None)
        finally:
            faults.configure(None)

    async def _jump(self, dt):
        self.portal.clock.jump(dt)
        await trio.testing.wait_all_tasks_blocked()

    def teardown(self):
        try:
            if self.scope is not None:
                for r in list(self.reqs.values()):
                    if r.stage == "intake":
                        self._give_up(r)
                    if r.stage == "generator":
                        self._end(r)
                self._new_lease()  # idle: the reservation goes back
                self.report_now()
                self.portal.call(self._jump, WAIT_S * 3)  # parked lookups expire, late answers go nowhere
                self.take_messages()
                self.report_now()  # releases of requests failed by what came last
                if self.died is None:
                    assert self.manager.arena.num_used() == 0, f"blocks leaked: {self.manager.arena.snapshot()}"
                    self.manager.arena.check_invariants()
        finally:
            faults.configure(None)
            self.portal.close()

    # -- the generator's bookkeeping ---------------------------------------------------------------

    def pick(self, data, reqs: list[Req]) -> Req:
        return self.reqs[data.draw(st.sampled_from([r.rid for r in reqs]))]

    def live(self):
        return [r for r in self.reqs.values() if r.stage == "generator"]

    def _new_lease(self):
        """Only when no live request holds an unreported draw (`BlockGrants.new_lease`): those go."""
        assert not any(r.pending and r.table for r in self.live() if r.epoch == self.known_epoch), \
            "a lease dropped under a live request's unreported draws"
        self.lease += 1
        self.reserve = []
        self.entries = [e for e in self.entries if not isinstance(e, Draw)]

    def _heard_epoch(self, epoch: int):
        """The generator's `_check_epoch`: tables (and the reserve) of an earlier manager life are void."""
        old = self.known_epoch
        self.known_epoch = max(epoch, old or 0)
        if old is not None and old != self.known_epoch:
            self._new_lease()
        for r in self.live():
            if r.epoch is not None and r.epoch != self.known_epoch:
                self._end(r)  # failed with a 503; its Release reaches the new life, harmlessly

    def _take(self, msg):
        """One message from the generator's inbox (`Generator._on_message`)."""
        if isinstance(msg, KVEpoch):
            self._heard_epoch(msg.epoch)
        elif isinstance(msg, Refill):
            self.refills.append(msg)
            self._refilled(msg)
        elif isinstance(msg, PrefixFailed):  # a failed commit, or a refused draw: that request fails alone
            r = self.reqs[msg.request_id]
            if r.stage == "generator":
                self._end(r)
        else:
            raise AssertionError(f"unexpected message to the generator: {msg!r}")

    def _refilled(self, msg: Refill):
        if self.known_epoch is None or msg.epoch > self.known_epoch:
            self._heard_epoch(msg.epoch)
        if msg.epoch != self.known_epoch or msg.lease != self.lease or msg.number <= self.last_refill:
            event("refill dropped")
            return  # dropped: the manager took (or will take) it back, or it died with its life
        event("refill taken" if msg.blocks else "refill empty")
        if msg.earmarks:
            event("refill with earmarks")
        self.last_refill = msg.number
        self.reserve += msg.blocks

    def _drain(self):
        while True:
            try:
                msg = self.generator_inbox.receive_nowait()
            except trio.WouldBlock:
                return
            self._take(msg)

    def _end(self, r: Req, final: bool = True):
        r.stage = "done"
        r.table, r.epoch = [], None
        self.entries.append(Release(r.rid, final=final))
        r.pending = True

    def _admit(self, r: Req, blocks, epoch):
        r.stage, r.table, r.committed = "generator", list(blocks), len(blocks)
        r.epoch = epoch if blocks else None
        self._drain()  # a restart's KVEpoch comes before any answer of the new life
        if r.epoch is not None and self.known_epoch is not None and r.epoch != self.known_epoch:
            self._end(r)

    def _give_up(self, r: Req):
        """Intake's lookup timeout: it stops waiting (closes its channel) and goes on with no hit."""
        try:
            answer = r.answers.receive_nowait()
        except trio.WouldBlock:
            r.answers.close()
            self._admit(r, (), None)
            return
        self._received(r, answer)

    def _received(self, r: Req, answer):
        r.answers.close()
        if isinstance(answer, PrefixFailed):
            r.stage = "done"  # the manager forgot it; intake settles the lookup with a Release
            self.send(Release(r.rid))
            return
        assert isinstance(answer, LookupResult) and answer.request_id == r.rid
        self._admit(r, answer.blocks, answer.epoch)

    def _report(self, want: int, reply=None, point: str | None = None, hints=()) -> StepReport:
        msg = StepReport(next(self.numbers), self.known_epoch, self.lease, tuple(self.entries), want,
                         self.to_generator if reply is None else reply, tuple(hints))
        if self.known_epoch != self.manager.epoch and any(isinstance(e, Draw) for e in self.entries):
            event("draws reported to a dead life")
        failing = [f"prefix.commit[{e.label}]=raise" for e in self.entries
                   if isinstance(e, Commit) and e.label.endswith("-fails")]
        self.entries = []
        for r in self.reqs.values():
            r.pending = False
        self.sent.append(msg)
        self.send_crashing(msg, ",".join(failing + ([point] if point else [])) or None)
        return msg

    def report_now(self):
        """The report a round trip (Resume) or going idle sends first, when there is anything to say."""
        if self.entries or not self.sent or self.sent[-1].lease != self.lease:
            self._report(want=0 if not self.live() else len(self.reserve))

    # -- rules: intake ----------------------------------------------------------------------------

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), cut=st.integers(1, 5), fail=st.integers(0, 9),
          then=st.sampled_from(["wait", "receive", "receive", "give up"]))
    def lookup(self, prompt, cut, fail, then):
        rid = f"r{self.next_id}"
        self.next_id += 1
        send, receive = trio.open_memory_channel(1)
        r = self.reqs[rid] = Req(rid, PROMPTS[prompt][:cut], send, receive)
        r.lookup_epoch = self.manager.epoch
        faults.configure(f"prefix.lookup[{rid}]=raise" if fail == 0 else None)
        self.send(Lookup(rid, r.hashes, send, label=rid), faulty=fail == 0)
        faults.configure(None)
        if then == "give up" or (then == "receive" and send.statistics().current_buffer_used):
            self._give_up(r)  # takes the answer when there is one
    @rule(data=st.data())
    @precondition(lambda m: any(r.stage == "intake" for r in m.reqs.values()))
    def intake_receives(self, data):
        waiting = [r for r in self.reqs.values() if r.stage == "intake"]
        if not waiting:
            return
        r = self.pick(data, waiting)
        try:
            answer = r.answers.receive_nowait()
        except trio.WouldBlock:
            return  # still parked on another request's blocks
        self._received(r, answer)

    @rule(data=st.data())
    @precondition(lambda m: any(r.stage == "intake" for r in m.reqs.values()))
    def intake_gives_up(self, data):
        waiting = [r for r in self.reqs.values() if r.stage == "intake"]
        if waiting:
            self._give_up(self.pick(data, waiting))

    @rule(data=st.data())
    @precondition(lambda m: any(r.stage != "done" for r in m.reqs.values()))
    def duplicate_lookup(self, data):
        """A lookup sent again for a request the manager already knows changes nothing (within the
        life that saw the first: a restart forgets every request)."""
        if known := [r for r in self.reqs.values() if r.stage != "done" and r.lookup_epoch == self.manager.epoch]:
            r = self.pick(data, known)
            send, receive = trio.open_memory_channel(1)
            self.send(Lookup(r.rid, r.hashes, send, label=r.rid))
            with pytest.raises(trio.WouldBlock):  # never answered: its first lookup was
                receive.receive_nowait()

    # -- rules: the generator's side, local ----------------------------------------------------------

    @rule(data=st.data())
    @precondition(lambda m: m.reserve and m.live())
    def draw(self, data):
        """Blocks for a request's next tokens, from the reserve: no message."""
        live = self.live()
        if not live or not self.reserve:
            return
        r = self.pick(data, live)
        n = data.draw(st.integers(1, len(self.reserve)))
        self._draw(r, data.draw(st.permutations(self.reserve))[:n])

    def _draw(self, r: Req, taken: list[int]):
        self.reserve = [b for b in self.reserve if b not in taken]
        r.table += taken
        r.epoch = self.known_epoch
        r.pending = True
        self.entries.append(Draw(r.rid, tuple(taken)))
        event("draw")

    @rule(data=st.data(), want=st.integers(1, 6))
    def generator_step(self, data, want):
        """A whole step, as the generator runs it: its messages taken, blocks drawn for some live
        requests and full ones committed, the report sent, the refill taken."""
        self._drain()
        for r in self.live():
            if self.reserve and data.draw(st.booleans()):
                self._draw(r, self.reserve[:data.draw(st.integers(1, min(2, len(self.reserve))))])
            if r.committed < len(r.table) and data.draw(st.booleans()):
                blocks = tuple((i, r.hash_at(i)) for i in range(r.committed, len(r.table)))
                r.committed = len(r.table)
                self.entries.append(Commit(r.rid, blocks, self.to_generator, r.rid))
        self._report(want, hints=self._hints(data))
        self._drain()

    @rule(data=st.data(), fail=st.integers(0, 9))
    @precondition(lambda m: any(r.committed < len(r.table) for r in m.live()))
    def commit(self, data, fail):
        live = [r for r in self.live() if r.committed < len(r.table)]
        if not live:
            return
        r = self.pick(data, live)
        upto = data.draw(st.integers(r.committed + 1, len(r.table)))
        blocks = tuple((i, r.hash_at(i)) for i in range(r.committed, upto))
        r.committed = upto
        r.pending = True
        label = r.rid if fail else f"{r.rid}-fails"  # prefix.commit[<label>] raises: it fails alone
        self.entries.append(Commit(r.rid, blocks, self.to_generator, label))

    @rule(data=st.data(), twice=st.booleans())
    @precondition(lambda m: m.live())
    def finish(self, data, twice):
        """A request ends (a duplicate Release, as after a failure, must be harmless)."""
        if live := self.live():
            r = self.pick(data, live)
            self._end(r)
            if twice:
                self.entries.append(Release(r.rid))

    @rule(data=st.data())
    @precondition(lambda m: any(r.table for r in m.live()))
    def preempt(self, data):
        holding = [r for r in self.live() if r.table]
        if not holding:
            return
        r = self.pick(data, holding)
        r.table, r.committed, r.epoch = [], 0, None
        r.pending = True
        self.entries.append(Release(r.rid, final=False))

    @rule(now=st.booleans())
    def drop_lease(self, now):
        """Idle — or restarted (`Generator.fail_in_flight`: every sequence released): the reserve is
        dropped; the next report (now, or later) gives it back whole."""
        for r in self.live():
            self._end(r)
        self._new_lease()
        if now:
            self._report(want=0)

    @rule()
    def take_messages(self):
        self._drain()

    # -- rules: the generator's side, messages -------------------------------------------------------

    def _hints(self, data):
        """(request, its table's last block or None, n): blocks the refill gives first, earmarked."""
        return [(r.rid, r.table[-1] if r.table else None, data.draw(st.integers(1, 3)))
                for r in self.live() if data.draw(st.booleans())]

    @rule(want=st.integers(0, 6), dropped=st.integers(0, 5), crash=st.integers(0, 19), take=st.booleans(),
          data=st.data())
    def report(self, want, dropped, crash, take, data):
        """The step report; its refill taken now or later — or never: a closed channel (dropped)."""
        reply = None
        if dropped == 0:
            reply, receive = trio.open_memory_channel(1)
            receive.close()
        point = {0: "prefix.refill=raise", 1: "prefix.release=raise@1"}.get(crash)
        self._report(want, reply, point, self._hints(data))
        if take:
            self._drain()

    @rule(data=st.data())
    @precondition(lambda m: m.sent)
    def duplicate_report(self, data):
        """A report sent again (late, duplicated) changes nothing at all."""
        if not self.sent:
            return
        msg = data.draw(st.sampled_from(self.sent))
        before = self._state()
        self.send(msg)
        assert self._state() == before, "a duplicate report changed something"
        event("duplicate report")

    @rule(data=st.data())
    @precondition(lambda m: m.refills)
    def late_refill(self, data):
        """A refill taken again (a duplicate), or long after its lease or life ended: dropped."""
        if self.refills:
            self._refilled(data.draw(st.sampled_from(self.refills)))

    @rule(data=st.data())
    @precondition(lambda m: m.live())
    def bogus_draw(self, data):
        """A draw of a block the reservation does not hold (held by a request, cached or free): the
        manager refuses it, the request fails alone, and the block's owner keeps it."""
        live = [r for r in self.live() if r.epoch in (None, self.manager.epoch)]
        if not live or self.known_epoch != self.manager.epoch:
            return
        self._drain()
        self.report_now()
        self._drain()
        if self.known_epoch != self.manager.epoch or self.entries:
            return  # (the bogus draw goes alone in its report)
        reserved = set(self.manager.arena.table(self.manager.reservation)) if self.manager.ledger.lease is not None else set()
        outside = [b for b in range(NUM_BLOCKS) if b not in reserved]
        r = self.pick(data, [r for r in live if r.stage == "generator"] or live)
        if r.stage != "generator" or not outside:
            return
        block = data.draw(st.sampled_from(outside))
        before = {o: self.manager.arena.table(o) for o in self.manager.arena.owners() if o != r.rid}
        self.entries.append(Draw(r.rid, (block,)))
        self._report(want=0)
        after = {o: self.manager.arena.table(o) for o in self.manager.arena.owners() if o != r.rid}
        assert after == before, "a refused draw moved someone else's blocks"
        failed = self.generator_inbox.receive_nowait()
        assert isinstance(failed, PrefixFailed) and failed.request_id == r.rid and failed.stage == "kv reservation"
        assert getattr(failed.error, "status", None) == 503
        self._take(failed)
        event("draw refused")

    def _state(self):
        arena = self.manager.arena
        return (tuple(arena.snapshot()), {o: arena.table(o) for o in arena.owners()}, self.manager.ledger.lease,
                self.generator_inbox.statistics().current_buffer_used)

    @rule(data=st.data(), late=st.booleans(), crash=st.integers(0, 9))
    @precondition(lambda m: any(not r.table for r in m.live()))
    def resume(self, data, late, crash):
        empty = [r for r in self.live() if not r.table]
        if not empty:
            return
        r = self.pick(data, empty)
        self.report_now()  # its Release goes first (`BlockGrants._resume`)
        if r.stage != "generator":
            return
        send, receive = trio.open_memory_channel(1)
        if late:
            receive.close()
        self.send_crashing(Resume(((r.rid, r.hashes[:max(0, len(r.hashes) - 1)]),), send),
                           "prefix.resume=raise" if crash == 0 else None)
        if late:
            return
        try:
            reply = receive.receive_nowait()
        except trio.WouldBlock:
            receive.close()
            return
        assert isinstance(reply, Resumed)
        self._drain()
        if reply.epoch != self.known_epoch:
            self._heard_epoch(reply.epoch)
        for rid, blocks in reply.tables:
            if r.stage != "generator" or r.table:
                if blocks:
                    self.entries.append(Release(rid))
                continue
            r.table, r.committed = list(blocks), len(blocks)
            r.epoch = reply.epoch if blocks else None

    # -- rules: time and restarts ------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.5, WAIT_S, WAIT_S * 2]))
    def tick(self, dt):
        self.portal.call(self._jump, dt)

    @rule(dice=st.integers(0, 9), heard=st.booleans())
    def restart(self, dice=0, heard=True):
        """The supervisor's restart of a manager that died: in-flight failed, bookkeeping reset
        (drawn rarely: a restart voids every table, which hides everything else). The generator
        hears of it now, or only later (its reports meanwhile name the dead life)."""
        if dice:
            return
        async def again():
            self.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            self.manager.fail_in_flight(RuntimeError("manager died"))
            await self._start_manager()

        self.portal.call(again)
        if heard:
            self._drain()

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def one_owner_per_block(self):
        if self.scope is None:
            return
        arena = self.manager.arena
        arena.check_invariants()
        owner = self.manager.reservation
        reserved = arena.table(owner) if owner is not None else ()
        private: dict[int, str] = {}
        if self.known_epoch == self.manager.epoch and self.lease == self.manager.ledger.lease:
            for b in self.reserve:  # what the generator may draw is the reservation's alone
                assert b in reserved and arena.refcount(b) == 1 and arena.hash_of(b) is None, (
                    f"reserve block {b} is not the reservation's alone: {arena.snapshot()}")
                private[b] = "reserve"
            if not self.generator_inbox.statistics().current_buffer_used:  # no refill on its way
                drawn = {b for e in self.entries if isinstance(e, Draw) for b in e.blocks}
                assert set(reserved) == set(self.reserve) | drawn, (
                    f"the reservation holds {sorted(reserved)}; the generator knows of {sorted(self.reserve)} "
                    f"and drew {sorted(drawn)}")
        for r in self.live():
            if not r.table or r.epoch != self.manager.epoch:
                continue
            held = arena.table(r.rid)
            if not r.pending:
                assert held == tuple(r.table), (
                    f"{r.rid} believes it holds {r.table}; the manager's table says {held}")
            for b in r.table:
                assert arena.refcount(b) > 0, f"block {b} of {r.rid} is free or evictable"
                assert b in held or b in reserved, f"block {b} of {r.rid} is neither its own nor reserved"
                if arena.hash_of(b) is None:
                    assert b not in private, f"block {b} is written by both {private[b]} and {r.rid}"
                    private[b] = r.rid
        for b in range(NUM_BLOCKS):  # nobody shares a block nobody committed (no forks here)
            if arena.hash_of(b) is None:
                assert arena.refcount(b) <= 1, f"uncommitted block {b} is in {arena.refcount(b)} tables"


TestOwnership = OwnershipMachine.TestCase
TestOwnership.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


async def test_a_parked_lookup_that_raises_when_looked_up_again_fails_alone():
    """A lookup parked on another request's blocks is looked up again when that request commits;
    if that re-run raises, the waiter fails (PrefixFailed to its own channel) and the committer's
    commit stands — the error is never blamed on the request whose commit woke it."""
    from mmserve.actors.messages import lookup_pin

    manager = PrefixCacheManager("ownership", KVCacheConfig(block_size=BLOCK, inflight_wait_s=WAIT_S), NUM_BLOCKS)
    a_send, a_answers = trio.open_memory_channel(4)
    b_send, b_answers = trio.open_memory_channel(4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(manager.run)
        manager.inbox_send.send_nowait(Lookup("a", PROMPTS[2], a_send))
        manager.inbox_send.send_nowait(Lookup("b", PROMPTS[2], b_send))
        await trio.testing.wait_all_tasks_blocked()
        assert (await a_answers.receive()).blocks == () and manager.inflight.is_parked("b")
        granted = (await _grant(manager, [("a", len(PROMPTS[2]))]))["a"]
        real_lookup = manager.arena.lookup

        def failing(hashes, owner):
            if owner == lookup_pin("b"):
                raise RuntimeError("boom in b's lookup")
            return real_lookup(hashes, owner)

        manager.arena.lookup = failing
        manager.inbox_send.send_nowait(Commit("a", tuple(enumerate(PROMPTS[2])), reply=a_send))
        await trio.testing.wait_all_tasks_blocked()
        failed = b_answers.receive_nowait()
        assert isinstance(failed, PrefixFailed) and failed.request_id == "b" and "boom" in str(failed.error)
        with pytest.raises(trio.WouldBlock):
            a_answers.receive_nowait()  # a's commit was not blamed
        assert manager.arena.table("a") == granted and manager.arena.peek(PROMPTS[2]) == len(PROMPTS[2])
        manager.arena.check_invariants()
        nursery.cancel_scope.cancel()


async def _grant(manager, needs):
    return (await GeneratorSide(manager).grant(needs))[0]

"""One owner per KV block, whatever the timing of the messages (issue 28, DESIGN.md "Ownership rule").

A hypothesis state machine drives a real `PrefixCacheManager` — its own message loop, on a trio
loop with a mock clock — with random interleavings of what intake and the generator send it:
lookups (hits, misses, parked waits), intake answers received or given up on (a closed reply
channel: a late answer), grants the generator receives or stopped waiting for, commits, releases,
preemptions and resumes, the clock moving past wait deadlines, faults, and manager restarts. Beside
it, a small reference model keeps what each request *believes* it holds (what the generator's
bookkeeping would hold after the answers it received).

After every step: the arena's own invariants hold (refcounts equal table membership); every block
a live request believes it holds is in its manager table at the same place and is neither free nor
evictable; a block nobody has committed (a private, writable block) is in at most one live table.
At the end, once everything is released, nothing is referenced: no block leaked.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mmserve.actors import faults
from mmserve.actors.messages import (
    Allocate, Allocated, Commit, KVEpoch, Lookup, LookupResult, PrefixFailed, Release, Resume, Resumed)
from mmserve.actors.prefix_cache import PrefixCacheManager
from mmserve.config import KVCacheConfig

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

    def hash_at(self, i: int) -> bytes:
        """Block i's key: the prompt's, then its own answer's (answers are private content)."""
        return self.hashes[i] if i < len(self.hashes) else _h(9, int(self.rid[1:]), i)


class OwnershipMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.portal = Portal()
        self.manager = PrefixCacheManager("ownership", KVCacheConfig(block_size=BLOCK, inflight_wait_s=WAIT_S),
                                          NUM_BLOCKS)
        self.to_generator, self.generator_inbox = trio.open_memory_channel(math.inf)
        self.manager.generator = self.to_generator
        self.reqs: dict[str, Req] = {}
        self.next_id = 0
        self.known_epoch: int | None = None  # the latest manager life the generator has heard of
        self.scope: trio.CancelScope | None = None

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

    def send(self, msg):
        self.portal.call(self._send, msg)
        if self.died is not None:  # restarted as the supervisor does: fail, reset, run again
            self.restart()

    def send_crashing(self, msg, point: str | None):
        """`send`, with the manager's handling of it raising at fault point `point` (it dies)."""
        faults.configure(f"{point}=raise" if point else None)
        try:
            self.send(msg)
        finally:
            faults.configure(None)

    async def _jump(self, dt):
        self.portal.clock.jump(dt)
        await trio.testing.wait_all_tasks_blocked()

    def teardown(self):
        try:
            for r in list(self.reqs.values()):
                if r.stage == "intake":
                    self._give_up(r)
                if r.stage == "generator":
                    self._end(r)
            self.portal.call(self._jump, WAIT_S * 3)  # parked lookups expire, late answers go nowhere
            self._drain_generator_inbox()
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

    def _heard_epoch(self, epoch: int):
        """The generator's `_check_epoch`: tables of an earlier manager life are void."""
        self.known_epoch = epoch
        for r in self.live():
            if r.epoch is not None and r.epoch != epoch:
                self._end(r)  # failed with a 503; its Release reaches the new life, harmlessly

    def _drain_generator_inbox(self):
        while True:
            try:
                msg = self.generator_inbox.receive_nowait()
            except trio.WouldBlock:
                return
            assert isinstance(msg, KVEpoch)
            self._heard_epoch(msg.epoch)

    def _end(self, r: Req):
        r.stage = "done"
        r.table, r.epoch = [], None
        self.send(Release(r.rid))

    def _admit(self, r: Req, blocks, epoch):
        r.stage, r.table, r.committed = "generator", list(blocks), len(blocks)
        r.epoch = epoch if blocks else None
        self._drain_generator_inbox()
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

    # -- rules ----------------------------------------------------------------------------------

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), cut=st.integers(1, 5), fail=st.integers(0, 9))
    def lookup(self, prompt, cut, fail):
        rid = f"r{self.next_id}"
        self.next_id += 1
        send, receive = trio.open_memory_channel(1)
        r = self.reqs[rid] = Req(rid, PROMPTS[prompt][:cut], send, receive)
        r.lookup_epoch = self.manager.epoch
        faults.configure(f"prefix.lookup[{rid}]=raise" if fail == 0 else None)
        self.send(Lookup(rid, r.hashes, send, label=rid))
        faults.configure(None)

    @rule(data=st.data())
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
    def intake_gives_up(self, data):
        waiting = [r for r in self.reqs.values() if r.stage == "intake"]
        if waiting:
            self._give_up(self.pick(data, waiting))

    @rule(data=st.data(), late=st.booleans(), crash=st.integers(0, 9))
    def allocate(self, data, late, crash):
        live = self.live()
        if not live:
            return
        chosen = [self.reqs[rid] for rid in data.draw(
            st.lists(st.sampled_from([r.rid for r in live]), min_size=1, max_size=3, unique=True))]
        needs = tuple((r.rid, data.draw(st.integers(1, 3))) for r in chosen)
        send, receive = trio.open_memory_channel(1)
        if late:
            receive.close()  # the generator's allocate timeout: the grant comes too late
        self.send_crashing(Allocate(needs, send), "prefix.allocate" if crash == 0 else None)
        if late:
            return
        try:
            reply = receive.receive_nowait()
        except trio.WouldBlock:
            receive.close()
            return  # the manager died of it: nothing was granted
        assert isinstance(reply, Allocated)
        self._drain_generator_inbox()
        if reply.epoch != self.known_epoch:
            self._heard_epoch(reply.epoch)
        for rid, blocks in reply.granted:
            r = self.reqs[rid]
            if r.stage != "generator":  # failed by the epoch check: its Release frees the grant
                self.send(Release(rid))
                continue
            r.table.extend(blocks)
            r.epoch = reply.epoch

    @rule(data=st.data())
    def commit(self, data):
        live = [r for r in self.live() if r.committed < len(r.table)]
        if not live:
            return
        r = self.pick(data, live)
        upto = data.draw(st.integers(r.committed + 1, len(r.table)))
        blocks = tuple((i, r.hash_at(i)) for i in range(r.committed, upto))
        r.committed = upto
        self.send(Commit(r.rid, blocks, label=r.rid))

    @rule(data=st.data(), crash=st.integers(0, 9), twice=st.booleans())
    def finish(self, data, crash, twice):
        """A request ends (a duplicate Release, as after a failure, must be harmless)."""
        if live := self.live():
            r = self.pick(data, live)
            r.stage, r.table, r.epoch = "done", [], None
            self.send_crashing(Release(r.rid), "prefix.release" if crash == 0 else None)
            if twice:
                self.send(Release(r.rid))

    @rule(data=st.data())
    def duplicate_lookup(self, data):
        """A lookup sent again for a request the manager already knows changes nothing (within the
        life that saw the first: a restart forgets every request)."""
        if known := [r for r in self.reqs.values() if r.stage != "done" and r.lookup_epoch == self.manager.epoch]:
            r = self.pick(data, known)
            send, receive = trio.open_memory_channel(1)
            self.send(Lookup(r.rid, r.hashes, send, label=r.rid))
            with pytest.raises(trio.WouldBlock):  # never answered: its first lookup was
                receive.receive_nowait()

    @rule(data=st.data())
    def preempt(self, data):
        holding = [r for r in self.live() if r.table]
        if not holding:
            return
        r = self.pick(data, holding)
        r.table, r.committed, r.epoch = [], 0, None
        self.send(Release(r.rid, final=False))

    @rule(data=st.data(), late=st.booleans(), crash=st.integers(0, 9))
    def resume(self, data, late, crash):
        empty = [r for r in self.live() if not r.table]
        if not empty:
            return
        r = self.pick(data, empty)
        send, receive = trio.open_memory_channel(1)
        if late:
            receive.close()
        self.send_crashing(Resume(((r.rid, r.hashes[:max(0, len(r.hashes) - 1)]),), send),
                           "prefix.resume" if crash == 0 else None)
        if late:
            return
        try:
            reply = receive.receive_nowait()
        except trio.WouldBlock:
            receive.close()
            return
        assert isinstance(reply, Resumed)
        self._drain_generator_inbox()
        if reply.epoch != self.known_epoch:
            self._heard_epoch(reply.epoch)
        for rid, blocks in reply.tables:
            if r.stage != "generator" or r.table:
                self.send(Release(rid))
                continue
            r.table, r.committed = list(blocks), len(blocks)
            r.epoch = reply.epoch if blocks else None

    @rule(dt=st.sampled_from([0.5, WAIT_S, WAIT_S * 2]))
    def tick(self, dt):
        self.portal.call(self._jump, dt)

    @rule(dice=st.integers(0, 9))
    def restart(self, dice=0):
        """The supervisor's restart of a manager that died: in-flight failed, bookkeeping reset
        (drawn rarely: a restart voids every table, which hides everything else)."""
        if dice:
            return
        async def again():
            self.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            self.manager.fail_in_flight(RuntimeError("manager died"))
            await self._start_manager()

        self.portal.call(again)
        self._drain_generator_inbox()

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def one_owner_per_block(self):
        if self.scope is None:
            return
        arena = self.manager.arena
        arena.check_invariants()
        private: dict[int, str] = {}
        for r in self.live():
            if not r.table or r.epoch != self.manager.epoch:
                continue
            assert arena.table(r.rid) == tuple(r.table), (
                f"{r.rid} believes it holds {r.table}; the manager's table says {arena.table(r.rid)}")
            for b in r.table:
                assert arena.refcount(b) > 0, f"block {b} of {r.rid} is free or evictable"
                if arena.hash_of(b) is None:
                    assert b not in private, f"block {b} is written by both {private[b]} and {r.rid}"
                    private[b] = r.rid


TestOwnership = OwnershipMachine.TestCase
TestOwnership.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
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
        granted = dict((await _grant(manager, [("a", len(PROMPTS[2]))])).granted)["a"]
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
    send, receive = trio.open_memory_channel(1)
    manager.inbox_send.send_nowait(Allocate(tuple(needs), send))
    with trio.fail_after(5):
        return await receive.receive()

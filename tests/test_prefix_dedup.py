"""In-flight dedup of prefix-cache blocks: a request missing blocks another request is computing
waits for that one's commit — and computes them itself if it aborts or the wait times out."""

import math

import pytest
import trio
import trio.testing
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mmserve import Runtime
from mmserve.actors.messages import Commit, KVEpoch, Lookup, Release
from mmserve.actors.prefix_cache import PrefixCacheManager
from mmserve.cache.inflight import InFlightBlocks
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from mmserve.config import KVCacheConfig
from tests.helpers import ask
from tests.kv_protocol import GeneratorSide

HASHES = tuple(bytes([i]) * 16 for i in range(4))


# -- the pure table --------------------------------------------------------------------------------

class InFlightMachine(RuleBasedStateMachine):
    """Random register / park / done / expire against a plain model of who computes and who waits."""

    def __init__(self):
        super().__init__()
        self.table = InFlightBlocks()
        self.owner_of: dict[bytes, int] = {}
        self.parked: dict[int, tuple[int, float]] = {}  # waiter → (owner, deadline)
        self.now = 0.0

    def _busy(self, r: int) -> bool:
        return r in self.parked or r in self.owner_of.values()

    @rule(r=st.integers(0, 5), hs=st.lists(st.sampled_from(HASHES), min_size=1, max_size=4))
    def register(self, r, hs):
        if r in self.parked:
            with pytest.raises(ValueError):
                self.table.register(r, hs)
            return
        new = [h for h in dict.fromkeys(hs) if h not in self.owner_of]
        assert self.table.register(r, hs) == len(new)
        self.owner_of.update({h: r for h in new})

    @rule(w=st.integers(0, 5), h=st.sampled_from(HASHES), wait=st.floats(0.1, 5))
    def park(self, w, h, wait):
        owner = self.owner_of.get(h)
        if owner is None or owner == w or self._busy(w):
            return
        self.table.park(w, owner, self.now + wait, payload=w)
        self.parked[w] = (owner, self.now + wait)

    @rule(r=st.integers(0, 5))
    def done(self, r):
        woken = {p.waiter for p in self.table.done(r)}
        assert woken == {w for w, (o, _) in self.parked.items() if o == r}
        self.owner_of = {h: o for h, o in self.owner_of.items() if o != r}
        self.parked = {w: v for w, v in self.parked.items() if w != r and v[0] != r}

    @rule(dt=st.floats(0, 3))
    def tick(self, dt):
        self.now += dt
        late = {p.waiter for p in self.table.expired(self.now)}
        assert late == {w for w, (_, d) in self.parked.items() if d <= self.now}
        self.parked = {w: v for w, v in self.parked.items() if w not in late}

    @invariant()
    def agrees(self):
        self.table.check_invariants()
        assert {h: self.table.owner_of(h) for h in HASHES if self.table.owner_of(h) is not None} == self.owner_of
        assert len(self.table) == len(self.parked)
        assert self.table.next_deadline() == min((d for _, d in self.parked.values()), default=math.inf)


TestInFlightTable = InFlightMachine.TestCase
TestInFlightTable.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_request_cannot_wait_on_itself_or_wait_twice():
    t = InFlightBlocks()
    t.register("a", HASHES[:2])
    with pytest.raises(ValueError):
        t.park("a", "a", 1.0, None)
    t.park("b", "a", 1.0, None)
    with pytest.raises(ValueError):
        t.park("b", "a", 1.0, None)


# -- the manager actor -------------------------------------------------------------------------------

async def answer(receive):
    with trio.fail_after(5):
        return await receive.receive()


async def started(nursery, wait_s=10.0, num_blocks=64, generator=None):
    manager = PrefixCacheManager("tiny", KVCacheConfig(block_size=4, inflight_wait_s=wait_s), num_blocks,
                                 generator=generator)
    nursery.start_soon(manager.run)
    await trio.testing.wait_all_tasks_blocked()
    return manager


async def grant(m, needs):
    """The blocks of `needs` drawn from the generator's reservation: {request id: blocks}, epoch."""
    side = m.__dict__.setdefault("_test_side", GeneratorSide(m))
    return await side.grant(needs)


async def test_a_waiter_gets_the_blocks_once_the_owner_commits():
    send, receive = trio.open_memory_channel(math.inf)
    async with trio.open_nursery() as nursery:
        m = await started(nursery)
        m.inbox_send.send_nowait(Lookup("a", HASHES, send))
        assert (await answer(receive)).blocks == ()  # a computes them
        m.inbox_send.send_nowait(Lookup("b", HASHES, send))
        await trio.testing.wait_all_tasks_blocked()
        assert receive.statistics().current_buffer_used == 0 and m.stats()["waiting_lookups"] == 1
        (rid, blocks), = (await grant(m, [("a", 4)]))[0].items()
        m.inbox_send.send_nowait(Commit("a", tuple(enumerate(HASHES))))
        got = await answer(receive)
        # b's table starts with a's very blocks: a hit copies nothing
        assert (got.request_id, got.blocks) == ("b", blocks)
        assert all(m.arena.refcount(b) == 2 for b in blocks)
        m.inbox_send.send_nowait(Release("a"))
        m.inbox_send.send_nowait(Release("b"))
        await trio.testing.wait_all_tasks_blocked()
        assert not m.arena.owners() and m.stats()["dedup_waits"] == 1 and m.stats()["inflight_blocks"] == 0
        assert m.arena.num_cached() == 4  # released, still cached
        m.arena.check_invariants()
        nursery.cancel_scope.cancel()


async def test_when_the_owner_aborts_the_waiter_computes_and_others_wait_on_it():
    send, receive = trio.open_memory_channel(math.inf)
    async with trio.open_nursery() as nursery:
        m = await started(nursery)
        m.inbox_send.send_nowait(Lookup("a", HASHES, send))
        await answer(receive)
        m.inbox_send.send_nowait(Lookup("b", HASHES, send))
        m.inbox_send.send_nowait(Release("a"))
        got = await answer(receive)
        assert (got.request_id, got.blocks) == ("b", ())  # b computes the blocks now
        m.inbox_send.send_nowait(Lookup("c", HASHES[:2], send))
        await trio.testing.wait_all_tasks_blocked()
        assert m.inflight.is_parked("c")  # and c waits on b
        m.inbox_send.send_nowait(Release("c"))  # a waiter that goes away just stops waiting
        await trio.testing.wait_all_tasks_blocked()
        assert len(m.inflight) == 0
        m.inbox_send.send_nowait(Release("b"))
        await trio.testing.wait_all_tasks_blocked()
        assert not m.arena.owners() and m.inflight.registered_blocks == 0
        nursery.cancel_scope.cancel()


async def test_a_wait_ends_at_its_deadline(autojump_clock):
    send, receive = trio.open_memory_channel(math.inf)
    async with trio.open_nursery() as nursery:
        m = await started(nursery, wait_s=3.0)
        m.inbox_send.send_nowait(Lookup("a", HASHES, send))
        await answer(receive)
        t0 = trio.current_time()
        m.inbox_send.send_nowait(Lookup("b", HASHES, send))
        got = await answer(receive)
        assert got.request_id == "b" and got.blocks == () and 3.0 <= trio.current_time() - t0 < 3.5
        nursery.cancel_scope.cancel()


async def test_a_refill_gives_what_the_arena_has_and_one_nobody_takes_goes_back():
    async with trio.open_nursery() as nursery:
        m = await started(nursery, num_blocks=6)
        side = GeneratorSide(m)
        first = await side.refill(4)
        assert len(first.blocks) == 4 and first.free_blocks == 2
        assert m.arena.table(m.reservation) == first.blocks  # the reservation's alone
        send, receive = trio.open_memory_channel(1)
        receive.close()  # a refill the generator cannot take
        side.report(want=8, reply=send)
        await trio.testing.wait_all_tasks_blocked()
        assert m.arena.table(m.reservation) == first.blocks and m.arena.num_free() == 2
        late = await side.refill(8)  # no more than the arena has
        assert len(late.blocks) == 2 and late.free_blocks == 0
        m.arena.check_invariants()
        nursery.cancel_scope.cancel()


async def test_a_grant_without_free_blocks_evicts_and_logs_it():
    from structlog.testing import capture_logs

    async with trio.open_nursery() as nursery:
        m = await started(nursery, num_blocks=4)
        await grant(m, [("a", 4)])
        m.inbox_send.send_nowait(Commit("a", tuple(enumerate(HASHES))))
        m.inbox_send.send_nowait(Release("a"))
        with capture_logs() as logs:
            granted, _ = await grant(m, [("b", 2)])
        evicts = [e for e in logs if e["event"] == "prefix_cache.evict"]
        assert len(evicts) == 1 and sorted(evicts[0]["blocks"]) == sorted(granted["b"])
        # the chain is evicted from its tail: its first blocks are still a usable prefix
        assert m.arena.peek(HASHES) == 2
        m.arena.check_invariants()
        nursery.cancel_scope.cancel()


async def test_a_restart_voids_the_generators_tables():
    async with trio.open_nursery() as nursery:
        to_generator, generator_inbox = trio.open_memory_channel(math.inf)
        m = await started(nursery, generator=to_generator)
        first = (await grant(m, [("a", 1)]))[1]
        m.fail_in_flight(RuntimeError("boom"))
        nursery.start_soon(m.run)  # the supervisor's restart
        with trio.fail_after(5):
            msg = await generator_inbox.receive()
        assert isinstance(msg, KVEpoch) and msg.epoch == first + 1
        assert (await grant(m, [("b", 1)]))[1] == first + 1 and m.arena.table("a") == ()
        nursery.cancel_scope.cancel()


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0.01)


# -- in the runtime --------------------------------------------------------------------------------

async def answers(config, convos):
    out = []
    async with Runtime.open(config) as rt:
        async def one(i, msgs):
            c = await rt.chat_completion(msgs, temperature=0, max_tokens=6, min_tokens=6)
            out.append((i, c.text, c.usage.cached_tokens))
        async with trio.open_nursery() as n:
            for i, msgs in enumerate(convos):
                n.start_soon(one, i, msgs)
        await trio.testing.wait_all_tasks_blocked(cushion=0.02)
        pc = rt.registry.require("tiny").prefix_cache
        stats = pc.stats()
        pc.arena.check_invariants()
        assert not pc.arena.owners() and len(pc.inflight) == 0 and pc.inflight.registered_blocks == 0
    return sorted(out), stats


async def test_concurrent_requests_sharing_a_prefix_compute_it_once(tiny_config):
    img = render_image("red", "circle", seed=7)
    system = {"role": "system", "content": "You look at images and answer in one word. " * 4}
    convos = [[system, *ask(img, q)] for q in (Q_COLOR, Q_SHAPE, Q_COLOR + " ", Q_SHAPE + "?")]
    on, stats = await answers(tiny_config.replace(kv_cache={"block_size": 8}), convos)
    off, _ = await answers(tiny_config.replace(kv_cache={"prefix_caching": False}), convos)
    assert [t for _, t, _ in on] == [t for _, t, _ in off]
    hits = sorted(c for _, _, c in on)
    assert hits[0] == 0 and all(c > 0 for c in hits[1:]), hits  # one computed, the others reused
    assert stats["dedup_waits"] >= 1

"""Every admitted request makes progress (issue 42 item 2): the generator's grant logic
(`actors.block_grants`, `Generator._plan`, `_preempt`, `_release`) against a real `PrefixCacheManager` on its
own message loop, with random prompt lengths, bidirectional spans (Gemma 3's images: never split,
possibly larger than the step budget or the reserve's usual cap), step budgets, arena sizes and
answer lengths. The model's forward is the only part left out: a step moves each planned
sequence's KV on by its tokens (a finished prefill samples its first token).

Checked after every round: the oldest live sequence completes within a bounded number of rounds
of becoming the oldest (no hang: a stuck image chunk gets its blocks, by a refill or a
preemption — also when the manager answers late), the sequences' tables are disjoint and each is the manager's table of its owner, and
at the end everything is given back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings, strategies as st

from mmserve.actors.block_grants import BlockGrants
from mmserve.actors.step_overlap import StepOverlap
from mmserve.generation.scheduler import FIFO
from mmserve.actors.generator import Generator
from mmserve.actors.messages import Refill
from mmserve.actors.prefix_cache import PrefixCacheManager
from mmserve.actors.sequence import LIVE, SeqState
from mmserve.config import GeneratorConfig, KVCacheConfig
from mmserve.logs import get_logger


@dataclass(eq=False)
class Seq:
    """A sequence as the grant logic and the scheduler see it (`actors.sequence.Sequence`'s fields)."""

    order: int
    prompt: int
    max_tokens: int
    bidirectional: tuple[tuple[int, int], ...] = ()
    state: SeqState = SeqState.PREFILLING
    generated: int = 0
    table: list[int] = field(default_factory=list)
    kv_len: int = 0
    hashes: list = field(default_factory=list)
    committed: int = 0
    epoch: int | None = None
    registered: bool = False
    resumable: bool = False
    admitted: bool = False
    chain = None  # no prefix caching: a preempted sequence is prefilled again whole
    rows = 1

    move = Generator.__dict__["_end"].__globals__["Sequence"].move  # the real state machine

    @property
    def request_id(self) -> str:
        return f"r{self.order}"

    kv_owner = request_id

    @property
    def target_len(self) -> int:
        return self.prompt + self.generated

    @property
    def table_len(self) -> int:
        return len(self.table)

    @property
    def tokens(self) -> list[int]:
        return [0] * self.generated


class LateInbox:
    """The manager's inbox as a slow manager sees it: what the generator sends in one round reaches
    it only at the start of the next, so each refill answers a report older than the latest."""

    def __init__(self, inbox: trio.MemorySendChannel):
        self.inbox, self.queued = inbox, []

    def send_nowait(self, msg) -> None:
        self.queued.append(msg)

    def flush(self) -> None:
        for msg in self.queued:
            self.inbox.send_nowait(msg)
        self.queued = []


class Grants:
    """The generator's grant side (`BlockGrants`), driven by the generator's own planning,
    preemption, release and epoch code."""

    _plan = Generator._plan
    _make_room = Generator._make_room
    _displace = Generator._displace
    _preempt = Generator._preempt
    _release = Generator._release
    _check_epoch = Generator._check_epoch

    def __init__(self, manager: PrefixCacheManager, config: GeneratorConfig, block_size: int, late: bool = False):
        self.cache_manager = LateInbox(manager.inbox_send) if late else manager.inbox_send
        self.inbox_send, self.inbox = trio.open_memory_channel(math.inf)
        self.config, self.block_size = config, block_size
        self.log = get_logger("generator")
        self.grants = BlockGrants(self.cache_manager, self.inbox_send, config, block_size, manager.num_blocks, self.log)
        # (serial steps here: no step is in flight, no release is held)
        self.overlap = StepOverlap(False, None, None, self.grants, block_size, math.inf)
        self.seqs: list[Seq] = []
        self.ranking = FIFO
        self.metrics, self.preemptions = None, 0

    def _granted(self, plan):
        return self.grants.granted(plan, self.seqs, self.ranking, self._preempt)

    def _report(self, plan=()):
        self.grants.report(self.seqs, self.ranking, plan)

    def _refilled(self, msg: Refill) -> None:  # as `Generator._on_message` takes one
        if self.grants.epoch is None or msg.epoch > self.grants.epoch:
            self._check_epoch(msg.epoch)
        self.grants.refilled(msg)

    def _fail(self, seq, exc, stage):  # (only a dead manager life fails a sequence: none here)
        raise AssertionError(f"{seq.request_id} failed in {stage}: {exc}")

    def _prune(self):
        self.seqs[:] = [s for s in self.seqs if s.state in LIVE]

    def take(self) -> None:
        while True:
            try:
                msg = self.inbox.receive_nowait()
            except trio.WouldBlock:
                return
            assert isinstance(msg, Refill), msg
            self._refilled(msg)

    async def round(self) -> None:
        """One round of `Generator.run`: a step (its forward: every planned sequence's KV moves on),
        or, when nothing could go, a report and a short wait for the manager."""
        if isinstance(self.cache_manager, LateInbox):
            self.cache_manager.flush()
        plan = self._granted(self._plan())
        if not plan:
            self._report()
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.01):
                self._refilled(await self.inbox.receive())
            self.take()
            return
        self._report(plan)
        await trio.testing.wait_all_tasks_blocked()  # the refill comes while the forward runs
        for p in plan:
            seq = p.seq
            assert seq.kv_len + p.tokens <= seq.table_len * self.block_size, "a step past its table"
            assert not any(lo < seq.kv_len + p.tokens < hi for lo, hi in seq.bidirectional), "a span split"
            seq.kv_len += p.tokens
            if seq.kv_len == seq.target_len:  # its next token sampled
                if seq.state is SeqState.PREFILLING:
                    seq.move(SeqState.DECODING)
                seq.generated += 1
                if seq.generated >= seq.max_tokens:
                    seq.move(SeqState.FINISHED)
                    self._release(seq)
        self._prune()
        self.take()


@st.composite
def workloads(draw):
    block = draw(st.sampled_from([2, 4, 8]))
    budget = draw(st.integers(1, 40))
    seqs = []
    for order in range(draw(st.integers(1, 6))):
        prompt = draw(st.integers(1, 60))
        spans = []
        at = draw(st.integers(0, prompt))
        while at < prompt - 1 and len(spans) < 2:  # often longer than the step budget
            length = draw(st.integers(min(budget + 1, prompt - at, 40) if draw(st.booleans()) else 2, min(40, prompt - at)))
            spans.append((at, at + length))
            at += length + draw(st.integers(0, 10))
        seqs.append(Seq(order, prompt, draw(st.integers(1, 12)), tuple(spans)))
    longest = max(s.prompt + s.max_tokens for s in seqs)
    # the arena holds the longest request alone (a longer one is refused at admission), up to twice more
    blocks = -(-(longest + 1) // block) + draw(st.integers(0, 2 * -(-longest // block)))
    return block, budget, blocks, seqs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 4), st.booleans())
# an image of 32 tokens (16 blocks) with a budget of 8: the reserve's want stayed below its chunk
@example((2, 8, 64, [Seq(0, 40, 3, ((4, 36),))]), 4, False)
# the same behind a longer answer that decodes meanwhile
@example((4, 8, 64, [Seq(0, 10, 30, ()), Seq(1, 40, 3, ((4, 36),))]), 4, False)
# a slow manager (each refill answers the report before the latest), a tight arena: the oldest
# decode token waits for a preemption that "exhausted" set only by the latest report's refill put off
@example((2, 4, 12, [Seq(0, 6, 14, ()), Seq(1, 6, 14, ()), Seq(2, 6, 14, ())]), 4, True)
def test_the_oldest_admitted_request_always_completes(workload, max_running, late):
    block, budget, num_blocks, seqs = workload

    async def main():
        manager = PrefixCacheManager("m", KVCacheConfig(block_size=block, prefix_caching=False), num_blocks)
        grants = Grants(manager, GeneratorConfig(max_batched_tokens=budget, max_running_requests=max_running,
                                                 lookup_timeout_s=0.05), block, late)
        grants.seqs = list(seqs)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(manager.run)
            oldest, since, rounds = None, 0, 0
            while grants.seqs:
                head = min(grants.seqs, key=lambda s: s.order)
                since = since + 1 if head is oldest else 0
                oldest = head
                # its prompt and answer a token a round at worst, a few rounds for each refill
                bound = 4 * (head.prompt + head.max_tokens) + 40
                assert since <= bound, (f"{head.request_id} made no way in {since} rounds: kv {head.kv_len}/"
                                        f"{head.target_len}, table {head.table}, reserve {len(grants.grants.reserve)}")
                await grants.round()
                rounds += 1
                held = [b for s in grants.seqs for b in s.table]
                assert len(held) == len(set(held)), "a block in two tables"
                await trio.testing.wait_all_tasks_blocked()
                for s in grants.seqs:
                    if s.table and not late:  # every drawn block reported: the manager's table is the sequence's
                        assert list(manager.arena.table(s.kv_owner)) == s.table
            for _ in range(2):  # idle: the reservation goes back (a refill still on its way first)
                grants._report()
                if late:
                    grants.cache_manager.flush()
                await trio.testing.wait_all_tasks_blocked()
                grants.take()
            assert manager.arena.num_used() == 0 and manager.arena.num_free() == num_blocks
            manager.arena.check_invariants()
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

"""How the generator gets the KV blocks its steps need (`BlockGrants`, the generator's reservation
client: a part it holds): from a reservation the cache manager refills, with one message each way
per step and no round trip on the hot path.

The manager holds a few blocks for the generator under an owner of its own (`Reservation(epoch,
lease)`) and hands them over in `Refill`s. At plan time the generator draws the blocks its
sequences' next tokens need from that reserve, locally. Tables stay consecutive (on the CPU a
consecutive table is read in place, a scattered one gathered first): a table grows by the block
after its last one; each report hints, once per table end, the blocks after it, which the manager
earmarks for that table when they are free; a new table (nothing cached, or preempted) waits one
step for a run the manager places for it with room to grow, as `cache.free_blocks` places one.
Right before the step's forward the generator sends one `StepReport` (never awaited) with
everything since the last one, in order: the draws, the commits of blocks the previous step
filled, the releases of sequences that ended or were preempted, how many blocks it wants in
reserve (a step's worth: what the next step will draw, estimated, plus a little slack, at most an
eighth of the arena), and its hints. The manager answers with at most one refill, which arrives
while the forward runs and is taken between steps. A step that changed nothing sends nothing.

A decode token the reserve cannot cover waits a step while a refill is on its way; once the
manager has answered that it has nothing left (free or evictable), the newest sequences holding
blocks are preempted until what they give back covers it — their blocks go back through the
report (committed ones stay cached) and come back, as the manager sees fit, in the next refill.
A prefill chunk is cut to the blocks the reserve has; when only prefills wait and none can go, the
newest holder other than the oldest of them is preempted, so the oldest sequence always gets its
blocks in the end. "Oldest" and "newest" are by the scheduler's rank (`generation.scheduler.
Ranking`: priority, aged, then arrival): a stuck prefill of a better priority preempts holders of
a worse one, the lowest priority first, newest first among equals.

The reservation's life: a refill is taken only if it is of the manager life (epoch) and the lease
the generator draws from now, and never twice (its report's number). Going idle, restarting, or
hearing of a new manager life, the generator drops its reserve and starts a new lease; its next
report gives the older lease's blocks back whole, refills of it still on their way included (it
drops those). Resume and Fork stay round trips (they are not per step); the report goes first.

`BlockGrants` owns the reservation's state (the reserve, the lease, what was sent and heard, the
manager life heard of); the generator hands it its live sequences and this step's ranking per call
and decides the preemptions it asks for (`preempt`). Every release of the generator's blocks — an
ended or preempted sequence, a forked choice's copy pin, what a fork gave choices that will not
run — is an entry of the next report (`note`): no Release is sent on its own.
"""

from __future__ import annotations

import itertools
from typing import Callable

import trio

from mmserve.actors.grant_book import RESERVE_SHARE, RESERVE_SLACK, Reserve, whole_spans
from mmserve.actors.messages import Draw, Refill, Release, Resume, Resumed, StepReport
from mmserve.actors.prompt_scores import scored_blocks
from mmserve.actors.sequence import LIVE, Sequence
from mmserve.config import GeneratorConfig
from mmserve.generation.scheduler import Planned, Ranking, blocks_for, fit_chunk, newest


def newest_holder(seqs: list[Sequence], ranking: Ranking, spare: Sequence | None = None,
                  below: tuple | None = None) -> Sequence | None:
    """The sequence to preempt: the newest (worst ranked: lowest priority, newest among equals)
    holding blocks (not `spare`; ranked below `below` when given) — one still waiting for
    admission (a hit holding its pinned prefix) before any running one. None when no other
    sequence holds a block."""
    holders = [s for s in seqs if s.state in LIVE and s is not spare and s.table
               and (below is None or ranking.key(s) > below)]
    return newest([s for s in holders if not s.admitted], ranking) or newest(holders, ranking)


def resume_wants(seqs: list[Sequence], block_size: int) -> list[tuple[str, tuple[bytes, ...]]]:
    """(owner, hashes) of each preempted sequence about to be prefilled again that may get blocks
    back from the cache: each leaves at least its last token to compute (its logits)."""
    wants = []
    for seq in seqs:
        most = (seq.target_len - 1) // block_size
        limit = scored_blocks(seq, block_size)  # a prompt being scored: no row skipped
        most = most if limit is None else min(most, limit)
        if not seq.table and seq.kv_len == 0 and most > 0:  # hits only ever start an empty table
            wants.append((seq.kv_owner, tuple(seq.hashes[:most])))
    return wants


class BlockGrants:
    """The generator's side of the reservation protocol: drawing a plan's blocks from the reserve,
    the step report, refills, the manager lives heard of."""

    def __init__(self, manager: trio.MemorySendChannel, reply: trio.MemorySendChannel, config: GeneratorConfig,
                 block_size: int, num_blocks: int, log):
        self.manager, self.reply = manager, reply  # the cache manager's inbox; the generator's (refills)
        self.config, self.block_size, self.num_blocks, self.log = config, block_size, num_blocks, log
        self.epoch: int | None = None  # the latest life of the cache manager heard of
        self.reserve = Reserve()
        self.lease = 0
        self.numbers = itertools.count()  # report numbers: one generator never reuses one
        self.entries: list = []  # Draw | Commit | Release | Quarantine since the last report, in order
        self.sent_lease: int | None = None  # the lease the last report named
        self.last_sent = -1  # the last report's number
        self.last_refill = -1  # the number of the report whose refill was taken last
        self.due_since: float | None = None  # a refill was asked for and has not come
        self.manager_free: int | None = None  # what the manager could still give, at its last refill
        self.exhausted = False  # a refill said nothing is left, and no release was reported since
        self.released_in: int | None = None  # the latest report that carried a release
        self.starved = False  # the last plan had tokens no block could be drawn for
        self.stuck_need = 0  # the most blocks one of those needed
        self.placing: dict[str, int] = {}  # new tables → the report that asked for their run (-1: not yet)
        self.waiting_placement = False  # the last plan had a new table waiting for its run
        self.hinted: dict[str, int] = {}  # running tables → the last block whose successors were asked for
        self.reports = 0
        self.refills = 0

    # -- drawing -------------------------------------------------------------------------------

    def granted(self, plan: list[Planned], seqs: list[Sequence], ranking: Ranking,
                preempt: Callable[[Sequence], None]) -> list[Planned]:
        """The plan, with its blocks drawn from the reserve, most urgent first (decode tokens of
        the oldest sequences, then prefill chunks). A decode token the reserve cannot cover waits;
        a prefill chunk is cut to what the reserve covers. When the manager answered that nothing
        is left, the newest holder is preempted (`preempt`; see the module's docstring)."""
        going, stuck = [], []
        self.waiting_placement = False
        live = {s.kv_owner for s in seqs if s.state in LIVE and not s.table}
        self.placing = {o: n for o, n in self.placing.items() if o in live}
        self.hinted = {s.kv_owner: self.hinted[s.kv_owner] for s in seqs if s.kv_owner in self.hinted and s.table}
        held_back = False  # a prefill chunk is stuck: younger ones draw nothing (the reserve fills for it)
        for p in plan:
            if p.new_blocks == 0:
                going.append(p)
            elif not p.decode and held_back:
                stuck.append(p)
            elif p.decode:
                if len(self.reserve) >= p.new_blocks:
                    self.draw(p.seq, p.new_blocks)
                    going.append(p)
                else:
                    stuck.append(p)
            elif not p.seq.table and not self.reserve.marked_for(p.seq.kv_owner) and self.manager_free != 0 \
                    and (self.placing.get(p.seq.kv_owner, -1) == -1 or self.due_since is not None
                         and self.placing[p.seq.kv_owner] > self.last_refill):
                # a new table: the manager places its first run (with room to grow, as
                # `cache.free_blocks` does) when the next report asks; it starts a step later
                self.placing.setdefault(p.seq.kv_owner, -1)
                self.waiting_placement = True
            else:
                n = min(p.new_blocks, len(self.reserve))
                tokens = fit_chunk(p.seq, min(p.tokens, (p.seq.table_len + n) * self.block_size - p.seq.kv_len))
                if tokens <= 0:
                    stuck.append(p)
                    held_back = True
                    continue
                n = max(0, blocks_for(p.seq.kv_len + tokens, self.block_size) - p.seq.table_len)
                self.draw(p.seq, n)
                going.append(p if tokens == p.tokens else Planned(p.seq, tokens, n, False))
        self.starved = bool(stuck) or self.waiting_placement
        # a chunk that cannot be cut (a bidirectional span) may need more than the reserve's cap
        self.stuck_need = max((p.new_blocks for p in stuck), default=0)
        if not stuck or self.due_since is not None or not self.exhausted:
            return going  # what waits may be covered by the refill asked for (or to ask for)
        decode = any(p.decode for p in stuck)
        rank = ranking.key
        oldest_p = min(stuck, key=lambda p: rank(p.seq))
        oldest = oldest_p.seq
        # a stuck prefill preempts when nothing else runs, or else only holders ranked below it
        # (admission is by rank: better-ranked decoders go on, and end, before it)
        younger = None if decode or not going else rank(oldest)
        if younger is not None and not any(rank(s) > younger for s in seqs if s.state in LIVE and s.table):
            return going
        # victims, newest first, until what they give back covers the stuck decode tokens (or the
        # blocks the oldest prefill's chunk lacks): a victim whose blocks others share gives nothing back
        need = sum(p.new_blocks for p in stuck if p.decode) if decode else \
            max(1, oldest_p.new_blocks - len(self.reserve))
        while need > 0:
            victim = newest_holder(seqs, ranking, spare=None if decode else oldest, below=younger)
            if victim is None or (younger is not None and rank(victim) <= younger):
                break  # (with no victim left, lookups pin the blocks for now)
            others = {b for s in seqs if s is not victim and s.state in LIVE for b in s.table}
            need -= len(set(victim.table) - others)
            preempt(victim)
            self.exhausted = False  # what they give back may be enough: the manager is asked again
            going = [p for p in going if p.seq is not victim]
        return going  # the rest wait for the refill

    def draw(self, seq: Sequence, n: int) -> None:
        if n <= 0:
            return
        blocks = self.reserve.draw(seq.kv_owner, seq.table[-1] if seq.table else None, n)
        seq.table.extend(blocks)
        seq.epoch, seq.registered = self.epoch, True
        self.entries.append(Draw(seq.kv_owner, tuple(blocks)))

    def note(self, entry) -> None:
        """A Commit, Release or Quarantine for the next step report."""
        self.entries.append(entry)

    # -- the report and the refill -------------------------------------------------------------

    def _need(self, seqs: list[Sequence], ranking: Ranking, plan: list[Planned] = ()) -> int | None:
        """What the next step will draw, after the step `plan` (its draws done): a block for each
        decode token that starts one, the blocks of the prefill chunks up to `max_batched_tokens`.
        None when idle."""
        live = sorted((s for s in seqs if s.state in LIVE), key=ranking.key)
        if not live:
            return None
        # a preempted sequence gets back what is still cached of its blocks first (`_resume`):
        # asking for its whole prefill now would evict those very blocks
        live = [s for s in live if not s.resumable]
        bs, budget, want = self.block_size, self.config.max_batched_tokens, 0
        ahead = {id(p.seq): p.tokens for p in plan}
        prefills = []
        for seq in live:
            kv = seq.kv_len + ahead.get(id(seq), 0)
            if kv < seq.target_len:
                prefills.append((seq, kv))
            else:  # it decodes next step
                want += max(0, blocks_for(kv + 1, bs) - seq.table_len)
                budget -= 1
        for seq, kv in prefills:
            chunk = whole_spans(seq, kv, min(seq.target_len - kv, max(0, budget)))
            budget -= chunk
            want += max(0, blocks_for(kv + chunk, bs) - seq.table_len)
        return want

    def _hints(self, seqs: list[Sequence], plan: list[Planned]) -> tuple[tuple[str, int | None, int], ...]:
        """(owner, last block, n): the blocks after each live table that its next step will draw
        (one at least) when the reserve lacks them — given first by the refill when free, and
        earmarked for it, they keep tables consecutive."""
        ahead = {id(p.seq): p.tokens for p in plan}
        hints = []
        for seq in seqs:
            if seq.state in LIVE and not seq.table and self.placing.get(seq.kv_owner) == -1:
                chunk = min(seq.target_len - seq.kv_len, self.config.max_batched_tokens)
                hints.append((seq.kv_owner, None, max(1, blocks_for(seq.kv_len + chunk, self.block_size))))
                continue
            if (seq.state not in LIVE or not seq.table or seq.table[-1] + 1 in self.reserve
                    or self.hinted.get(seq.kv_owner) == seq.table[-1]):  # asked once per table end
                continue
            end = seq.kv_len + ahead.get(id(seq), 0)
            more = 1 if end >= seq.target_len else min(seq.target_len - end, self.config.max_batched_tokens)
            hints.append((seq.kv_owner, seq.table[-1], max(1, blocks_for(end + more, self.block_size) - seq.table_len)))
        return tuple(hints)

    def report(self, seqs: list[Sequence], ranking: Ranking, plan: list[Planned] = ()) -> None:
        """Sends the step report when there is anything to say: entries, a new lease (the older one
        goes back), or blocks to ask for — unless a refill is on its way, or the manager had none
        left and nothing here is waiting for them."""
        if not any(s.state in LIVE for s in seqs) and (len(self.reserve) or self.due_since is not None):
            self.new_lease()  # idle: the reservation goes back whole
        now = trio.current_time()
        if self.due_since is not None and now - self.due_since > self.config.lookup_timeout_s:
            self.log.warning("generator.refill_timeout", waited_s=round(now - self.due_since, 3))
            self.due_since = None  # asked again below
        need = self._need(seqs, ranking, plan)
        stuck = self.stuck_need if self.starved else 0
        if need is not None:  # a chunk that cannot be cut (an image span) is asked for whole
            need = max(need, stuck)
        cap = max(1, self.num_blocks // RESERVE_SHARE, stuck)
        # the reserve to hold: the next step's draws, plus RESERVE_SLACK for requests that arrive
        # meanwhile (none when idle); asked for only when the next step's draws are not covered
        hints = self._hints(seqs, plan) if need is not None else ()
        want = 0 if need is None else min(need + RESERVE_SLACK, cap)
        short = self.starved or (need is not None and min(need, cap) > len(self.reserve))
        ask = short and want > len(self.reserve) and self.due_since is None and (self.starved or self.manager_free != 0)
        ask = ask or bool(hints)  # blocks after a table end are asked for once, when free
        if not (self.entries or self.sent_lease != self.lease or ask):
            return
        number = next(self.numbers)
        report = StepReport(number, self.epoch, self.lease, tuple(self.entries), want, self.reply, hints,
                            slack=max(0, want - (need or 0)))
        if any(isinstance(e, Release) for e in self.entries):
            self.exhausted = False  # what it gives back may be enough: not exhausted until a refill says so
            self.released_in = number
        self.entries, self.sent_lease, self.last_sent = [], self.lease, number
        for owner, last, _ in report.hints:
            if last is None:
                self.placing[owner] = number
            else:
                self.hinted[owner] = last
        if (want > len(self.reserve) or any(last is None for _, last, _ in hints)) and self.due_since is None:
            self.due_since = now  # answered: the manager always answers a new table's placement
        self.reports += 1
        self.manager.send_nowait(report)

    def refilled(self, msg: Refill) -> None:
        """Takes a refill of the current manager life and lease, once; any other goes (the manager
        took it back when it saw the newer lease, or it died with its life). The generator told
        this part of the refill's life first (`saw_epoch`)."""
        if msg.epoch != self.epoch or msg.lease != self.lease or msg.number <= self.last_refill:
            self.log.debug("generator.refill_dropped", epoch=msg.epoch, lease=msg.lease, number=msg.number,
                           blocks=len(msg.blocks))
            return
        self.last_refill, self.manager_free, self.due_since = msg.number, msg.free_blocks, None
        # any refill of this lease tells what the manager had left: nothing, and no release sent
        # since (a newer report that asks for more need not be answered first) — the oldest's
        # preemption is not put off by younger sequences that keep reporting
        self.exhausted = msg.free_blocks == 0 and not any(isinstance(e, Release) for e in self.entries) and \
            not self._released_since(msg.number)
        self.reserve.add(msg.blocks, msg.earmarks)
        self.refills += 1

    def _released_since(self, number: int) -> bool:
        """Whether a report after report `number` gave blocks back (a refill answering `number`
        cannot know of them)."""
        return self.released_in is not None and self.released_in > number

    def new_lease(self) -> None:
        """The reserve is dropped: the next report names a new lease, which gives every block of
        the older one back (refills of it still on their way are dropped when they come)."""
        self.lease += 1
        self.reserve.clear()
        self.due_since, self.manager_free, self.exhausted = None, None, False
        # unreported draws go back with the whole lease: only ended (or failed) sequences hold any
        # now — idle, restarted, or of a manager life that died
        self.entries = [e for e in self.entries if not isinstance(e, Draw)]

    def saw_epoch(self, epoch: int) -> None:
        """A life of the cache manager was heard of: the latest is the one tables are drawn in; a
        newer one than before took the reservation with the life that died (a new lease)."""
        old = self.epoch
        self.epoch = max(epoch, old or 0)
        if old is not None and self.epoch != old:
            self.new_lease()

    # -- resumes (a round trip: not per step) --------------------------------------------------

    async def resume(self, wants: list[tuple[str, tuple[bytes, ...]]]) -> Resumed | None:
        """Asks the manager for the blocks of `wants` (`resume_wants`) still cached (committed
        before their preemption and not evicted since); None when it did not answer in time."""
        send, replies = trio.open_memory_channel(1)
        self.manager.send_nowait(Resume(tuple(wants), send))
        reply: Resumed | None = None
        with replies, trio.move_on_after(self.config.lookup_timeout_s):
            reply = await replies.receive()
        if reply is None:
            self.log.warning("generator.resume_timeout", waited_s=self.config.lookup_timeout_s)
        return reply

    def take_resumed(self, reply: Resumed, seqs: list[Sequence]) -> int:
        """The resumed blocks start their sequences' tables (their prefill goes on after them);
        those of a sequence that ended meanwhile go back. Returns how many blocks were taken."""
        taken = 0
        for owner, blocks in reply.tables:
            if not blocks:
                continue
            seq = next((s for s in seqs if s.kv_owner == owner and s.state in LIVE), None)
            if seq is None or seq.table:  # ended (or failed by the epoch check): they go back
                self.note(Release(owner))
                continue
            seq.committed = len(blocks)  # the resumed blocks are cache entries: committed
            seq.table.extend(blocks)
            seq.kv_len = seq.table_len * self.block_size
            seq.epoch, seq.registered = reply.epoch, True
            taken += len(blocks)
            self.log.info("generator.resumed", request_id=seq.request_id, blocks=len(blocks),
                          tokens=len(blocks) * self.block_size, kv_len=seq.kv_len, target_len=seq.target_len)
        return taken

"""How the generator gets the KV blocks its steps need (a part of `Generator`): from a reservation
the cache manager refills, with one message each way per step and no round trip on the hot path.

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
"""

from __future__ import annotations

import time

import trio

from mmserve.actors.grant_book import RESERVE_SHARE, RESERVE_SLACK, GrantBook, whole_spans
from mmserve.actors.messages import Draw, Refill, Release, Resume, Resumed, StepReport
from mmserve.actors.prompt_scores import scored_blocks
from mmserve.actors.sequence import LIVE, Sequence, SeqState
from mmserve.errors import ServiceUnavailable
from mmserve.generation.scheduler import FIFO, Planned, Ranking, blocks_for, displaced, fit_chunk, newest

class BlockGrants:
    """Generator methods: drawing a plan's blocks from the reservation, the step report, refills,
    preemption (for blocks, and for a better priority), resumes, manager epochs."""

    ranking: Ranking = FIFO  # who goes first (priority, aged, then arrival): set by each plan

    @property
    def grants(self) -> GrantBook:
        book = self.__dict__.get("_grant_book")
        if book is None:
            book = self._grant_book = GrantBook()
        return book

    # -- drawing -------------------------------------------------------------------------------

    def _granted(self, plan: list[Planned]) -> list[Planned]:
        """The plan, with its blocks drawn from the reserve, most urgent first (decode tokens of
        the oldest sequences, then prefill chunks). A decode token the reserve cannot cover waits;
        a prefill chunk is cut to what the reserve covers. When the manager answered that nothing
        is left, the newest holder is preempted (see the module's docstring)."""
        g = self.grants
        going, stuck = [], []
        g.waiting_placement = False
        live = {s.kv_owner for s in self.seqs if s.state in LIVE and not s.table}
        g.placing = {o: n for o, n in g.placing.items() if o in live}
        g.hinted = {s.kv_owner: g.hinted[s.kv_owner] for s in self.seqs if s.kv_owner in g.hinted and s.table}
        held_back = False  # a prefill chunk is stuck: younger ones draw nothing (the reserve fills for it)
        for p in plan:
            if p.new_blocks == 0:
                going.append(p)
            elif not p.decode and held_back:
                stuck.append(p)
            elif p.decode:
                if len(g.reserve) >= p.new_blocks:
                    self._draw(p.seq, p.new_blocks)
                    going.append(p)
                else:
                    stuck.append(p)
            elif not p.seq.table and not g.reserve.marked_for(p.seq.kv_owner) and g.manager_free != 0 \
                    and (g.placing.get(p.seq.kv_owner, -1) == -1 or g.due_since is not None
                         and g.placing[p.seq.kv_owner] > g.last_refill):
                # a new table: the manager places its first run (with room to grow, as
                # `cache.free_blocks` does) when the next report asks; it starts a step later
                g.placing.setdefault(p.seq.kv_owner, -1)
                g.waiting_placement = True
            else:
                n = min(p.new_blocks, len(g.reserve))
                tokens = fit_chunk(p.seq, min(p.tokens, (p.seq.table_len + n) * self.block_size - p.seq.kv_len))
                if tokens <= 0:
                    stuck.append(p)
                    held_back = True
                    continue
                n = max(0, blocks_for(p.seq.kv_len + tokens, self.block_size) - p.seq.table_len)
                self._draw(p.seq, n)
                going.append(p if tokens == p.tokens else Planned(p.seq, tokens, n, False))
        g.starved = bool(stuck) or g.waiting_placement
        # a chunk that cannot be cut (a bidirectional span) may need more than the reserve's cap
        g.stuck_need = max((p.new_blocks for p in stuck), default=0)
        if not stuck or g.due_since is not None or not g.exhausted:
            return going  # what waits may be covered by the refill asked for (or to ask for)
        decode = any(p.decode for p in stuck)
        rank = self.ranking.key
        oldest_p = min(stuck, key=lambda p: rank(p.seq))
        oldest = oldest_p.seq
        # a stuck prefill preempts when nothing else runs, or else only holders ranked below it
        # (admission is by rank: better-ranked decoders go on, and end, before it)
        younger = None if decode or not going else rank(oldest)
        if younger is not None and not any(rank(s) > younger for s in self.seqs if s.state in LIVE and s.table):
            return going
        # victims, newest first, until what they give back covers the stuck decode tokens (or the
        # blocks the oldest prefill's chunk lacks): a victim whose blocks others share gives nothing back
        need = sum(p.new_blocks for p in stuck if p.decode) if decode else \
            max(1, oldest_p.new_blocks - len(g.reserve))
        while need > 0:
            victim = self._newest_holder(spare=None if decode else oldest, below=younger)
            if victim is None or (younger is not None and rank(victim) <= younger):
                break  # (with no victim left, lookups pin the blocks for now)
            others = {b for s in self.seqs if s is not victim and s.state in LIVE for b in s.table}
            need -= len(set(victim.table) - others)
            self._preempt(victim)
            g.exhausted = False  # what they give back may be enough: the manager is asked again
            going = [p for p in going if p.seq is not victim]
        return going  # the rest wait for the refill

    def _draw(self, seq: Sequence, n: int) -> None:
        if n <= 0:
            return
        blocks = self.grants.reserve.draw(seq.kv_owner, seq.table[-1] if seq.table else None, n)
        seq.table.extend(blocks)
        seq.epoch, seq.registered = self.kv_epoch, True
        self.grants.entries.append(Draw(seq.kv_owner, tuple(blocks)))

    def _note(self, entry) -> None:
        """A Commit or Release for the next step report."""
        self.grants.entries.append(entry)

    # -- the report and the refill -------------------------------------------------------------

    def _need(self, plan: list[Planned] = ()) -> int | None:
        """What the next step will draw, after the step `plan` (its draws done): a block for each
        decode token that starts one, the blocks of the prefill chunks up to `max_batched_tokens`.
        None when idle."""
        live = sorted((s for s in self.seqs if s.state in LIVE), key=self.ranking.key)
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

    def _hints(self, plan: list[Planned]) -> tuple[tuple[str, int | None, int], ...]:
        """(owner, last block, n): the blocks after each live table that its next step will draw
        (one at least) when the reserve lacks them — given first by the refill when free, and
        earmarked for it, they keep tables consecutive."""
        g = self.grants
        ahead = {id(p.seq): p.tokens for p in plan}
        hints = []
        for seq in self.seqs:
            if seq.state in LIVE and not seq.table and g.placing.get(seq.kv_owner) == -1:
                chunk = min(seq.target_len - seq.kv_len, self.config.max_batched_tokens)
                hints.append((seq.kv_owner, None, max(1, blocks_for(seq.kv_len + chunk, self.block_size))))
                continue
            if (seq.state not in LIVE or not seq.table or seq.table[-1] + 1 in g.reserve
                    or g.hinted.get(seq.kv_owner) == seq.table[-1]):  # asked once per table end
                continue
            end = seq.kv_len + ahead.get(id(seq), 0)
            more = 1 if end >= seq.target_len else min(seq.target_len - end, self.config.max_batched_tokens)
            hints.append((seq.kv_owner, seq.table[-1], max(1, blocks_for(end + more, self.block_size) - seq.table_len)))
        return tuple(hints)

    def _report(self, plan: list[Planned] = ()) -> None:
        """Sends the step report when there is anything to say: entries, a new lease (the older one
        goes back), or blocks to ask for — unless a refill is on its way, or the manager had none
        left and nothing here is waiting for them."""
        g = self.grants
        if not any(s.state in LIVE for s in self.seqs) and (len(g.reserve) or g.due_since is not None):
            self._new_lease()  # idle: the reservation goes back whole
        now = trio.current_time()
        if g.due_since is not None and now - g.due_since > self.config.lookup_timeout_s:
            self.log.warning("generator.refill_timeout", waited_s=round(now - g.due_since, 3))
            g.due_since = None  # asked again below
        need = self._need(plan)
        stuck = g.stuck_need if g.starved else 0
        if need is not None:  # a chunk that cannot be cut (an image span) is asked for whole
            need = max(need, stuck)
        cap = max(1, self.kv.num_blocks // RESERVE_SHARE, stuck)
        # the reserve to hold: the next step's draws, plus RESERVE_SLACK for requests that arrive
        # meanwhile (none when idle); asked for only when the next step's draws are not covered
        hints = self._hints(plan) if need is not None else ()
        want = 0 if need is None else min(need + RESERVE_SLACK, cap)
        short = g.starved or (need is not None and min(need, cap) > len(g.reserve))
        ask = short and want > len(g.reserve) and g.due_since is None and (g.starved or g.manager_free != 0)
        ask = ask or bool(hints)  # blocks after a table end are asked for once, when free
        if not (g.entries or g.sent_lease != g.lease or ask):
            return
        number = next(g.numbers)
        report = StepReport(number, self.kv_epoch, g.lease, tuple(g.entries), want, self.inbox_send, hints,
                            slack=max(0, want - (need or 0)))
        if any(isinstance(e, Release) for e in g.entries):
            g.exhausted = False  # what it gives back may be enough: not exhausted until a refill says so
            g.released_in = number
        g.entries, g.sent_lease, g.last_sent = [], g.lease, number
        for owner, last, _ in report.hints:
            if last is None:
                g.placing[owner] = number
            else:
                g.hinted[owner] = last
        if (want > len(g.reserve) or any(last is None for _, last, _ in hints)) and g.due_since is None:
            g.due_since = now  # answered: the manager always answers a new table's placement
        g.reports += 1
        self.cache_manager.send_nowait(report)

    def _refilled(self, msg: Refill) -> None:
        """Takes a refill of the current manager life and lease, once; any other goes (the manager
        took it back when it saw the newer lease, or it died with its life)."""
        g = self.grants
        if self.kv_epoch is None or msg.epoch > self.kv_epoch:
            self._check_epoch(msg.epoch)
        if msg.epoch != self.kv_epoch or msg.lease != g.lease or msg.number <= g.last_refill:
            self.log.debug("generator.refill_dropped", epoch=msg.epoch, lease=msg.lease, number=msg.number,
                           blocks=len(msg.blocks))
            return
        g.last_refill, g.manager_free, g.due_since = msg.number, msg.free_blocks, None
        # any refill of this lease tells what the manager had left: nothing, and no release sent
        # since (a newer report that asks for more need not be answered first) — the oldest's
        # preemption is not put off by younger sequences that keep reporting
        g.exhausted = msg.free_blocks == 0 and not any(isinstance(e, Release) for e in g.entries) and \
            not self._released_since(msg.number)
        g.reserve.add(msg.blocks, msg.earmarks)
        g.refills += 1

    def _released_since(self, number: int) -> bool:
        """Whether a report after report `number` gave blocks back (a refill answering `number`
        cannot know of them)."""
        released = self.grants.released_in
        return released is not None and released > number

    def _new_lease(self) -> None:
        """The reserve is dropped: the next report names a new lease, which gives every block of
        the older one back (refills of it still on their way are dropped when they come)."""
        g = self.grants
        g.lease += 1
        g.reserve.clear()
        g.due_since, g.manager_free, g.exhausted = None, None, False
        # unreported draws go back with the whole lease: only ended (or failed) sequences hold any
        # now — idle, restarted, or of a manager life that died
        g.entries = [e for e in g.entries if not isinstance(e, Draw)]

    def _give_back(self) -> None:
        """A restart: every release so far, and the reservation, go back in one last report."""
        self._new_lease()
        self._report()

    # -- preemption, resumes, epochs -----------------------------------------------------------

    def _newest_holder(self, spare: Sequence | None = None, below: tuple | None = None) -> Sequence | None:
        """The sequence to preempt: the newest (worst ranked: lowest priority, newest among equals)
        holding blocks (not `spare`; ranked below `below` when given) — one still waiting for
        admission (a hit holding its pinned prefix) before any running one. None when no other
        sequence holds a block."""
        holders = [s for s in self.seqs if s.state in LIVE and s is not spare and s.table
                   and (below is None or self.ranking.key(s) > below)]
        return newest([s for s in holders if not s.admitted], self.ranking) or newest(holders, self.ranking)

    def _make_room(self) -> None:
        """Fixes this step's ranking, then puts admitted requests of a worse priority back in the
        queue when the best-ranked waiting request finds no room (`scheduler.displaced`)."""
        self.ranking = Ranking(time.monotonic(), self.config.priority_aging_s)
        decoding = [s for s in self.seqs if s.state is SeqState.DECODING]
        prefilling = [s for s in self.seqs if s.state is SeqState.PREFILLING]
        out = displaced(decoding, prefilling, self.config.max_batched_tokens, self.config.max_running_requests,
                        self.ranking)
        if out:
            self._displace(out)

    def _displace(self, requests) -> None:
        """Puts the admitted `requests` back in the queue for a waiting request of a better
        priority (`generation.scheduler.displaced`): each of their sequences is preempted (blocks
        given back, prefilled again later from what is still cached) and loses its admission, so
        it is admitted again by rank, like any waiting request."""
        for seq in [s for s in self.seqs if s.state in LIVE and s.request_id in requests]:
            if seq.table or seq.kv_len or seq.state is SeqState.DECODING:
                self._preempt(seq)
            seq.admitted = False
        self.log.info("generator.displaced", request_ids=list(requests))

    def _preempt(self, victim: Sequence) -> None:
        """Gives every block of `victim` back (in the next report); it is prefilled again later,
        from what is still cached of its blocks on (its images encoded again where their KV is
        gone)."""
        self._release(victim, final=False)
        victim.kv_len, victim.committed = 0, 0
        victim.resumable = victim.chain is not None and bool(victim.hashes)
        if victim.state is SeqState.DECODING:
            victim.move(SeqState.PREFILLING)
        self.preemptions += 1
        if self.metrics is not None:
            self.metrics.preempted(self.adapter.name)
        self.log.info("generator.preempted", request_id=victim.request_id, tokens=len(victim.tokens))

    async def _resume(self, seqs: list[Sequence]) -> None:
        """Preempted sequences about to be prefilled again get back, from the manager, the blocks
        of theirs still cached (committed before the preemption and not evicted since): their
        prefill goes on after them. Each leaves at least its last token to compute (its logits).
        A round trip, after the report that carries their releases."""
        wants = []
        for seq in seqs:
            most = (seq.target_len - 1) // self.block_size
            limit = scored_blocks(seq, self.block_size)  # a prompt being scored: no row skipped
            most = most if limit is None else min(most, limit)
            if not seq.table and seq.kv_len == 0 and most > 0:  # hits only ever start an empty table
                wants.append((seq.kv_owner, tuple(seq.hashes[:most])))
        if wants:
            # their releases reach the manager first — while they are still resumable, so that this
            # report neither asks for their prefill nor places tables for them: the refill would
            # evict the very blocks the resume is about to take back
            self._report()
        for seq in seqs:
            seq.resumable = False
        if not wants:
            return
        send, replies = trio.open_memory_channel(1)
        self.cache_manager.send_nowait(Resume(tuple(wants), send))
        reply: Resumed | None = None
        with replies, trio.move_on_after(self.config.lookup_timeout_s):
            reply = await replies.receive()
        while True:  # what came meanwhile — a restart of the manager above all — before any draw
            try:
                self._on_message(self.inbox.receive_nowait())
            except trio.WouldBlock:
                break
        if reply is None:  # its prefill recomputes everything: slower, never wrong
            self.log.warning("generator.resume_timeout", waited_s=self.config.lookup_timeout_s)
            return
        self._check_epoch(reply.epoch)
        for owner, blocks in reply.tables:
            if not blocks:
                continue
            seq = next((s for s in self.seqs if s.kv_owner == owner and s.state in LIVE), None)
            if seq is None or seq.table:  # ended (or failed by the epoch check): they go back
                self._note(Release(owner))
                continue
            seq.committed = len(blocks)  # the resumed blocks are cache entries: committed
            seq.table.extend(blocks)
            seq.kv_len = seq.table_len * self.block_size
            seq.epoch, seq.registered = reply.epoch, True
            self.resumed_blocks += len(blocks)
            self.log.info("generator.resumed", request_id=seq.request_id, blocks=len(blocks),
                          tokens=len(blocks) * self.block_size, kv_len=seq.kv_len, target_len=seq.target_len)

    def _check_epoch(self, epoch: int) -> None:
        """Tables from an earlier life of the cache manager point at blocks it may have given away:
        their sequences fail; those that held nothing go on. The reservation died with that life."""
        old = self.kv_epoch
        self.kv_epoch = max(epoch, old or 0)
        if old is not None and self.kv_epoch != old:
            self._new_lease()
        for seq in [s for s in self.seqs if s.epoch is not None and s.epoch != self.kv_epoch and s.state in LIVE]:
            self._fail(seq, ServiceUnavailable("the KV cache of this model was restarted while the request "
                                               "ran; retry", retry_after_s=1.0), "kv cache")
        self._prune()

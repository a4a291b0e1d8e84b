"""How the generator gets the KV blocks a step needs: one `Allocate` per step to the cache manager,
preempting the newest sequence when a decode token finds no block (a part of `Generator`)."""

from __future__ import annotations

import trio

from mmserve.actors.messages import Allocate, Allocated, Release, Resume, Resumed
from mmserve.actors.sequence import LIVE, Sequence, SeqState
from mmserve.errors import ServiceUnavailable
from mmserve.generation.scheduler import Planned, newest


class BlockGrants:
    """Generator methods: granting a plan its blocks, preemption, giving way, manager epochs."""

    async def _granted(self, plan: list[Planned]) -> list[Planned]:
        """The plan, with the blocks it needs granted. A decode token that finds no block preempts
        the newest sequence holding blocks, and the step is planned again; a prefill chunk that
        finds none waits — unless only prefills wait: then the newest holder other than the
        oldest of them is preempted, so the oldest sequence always gets its blocks in the end."""
        while plan:
            if not any(p.new_blocks for p in plan):
                return plan  # every token fits the blocks it holds: nothing to ask
            reply = await self._allocate(plan)
            if reply is None:
                return []
            self._check_epoch(reply.epoch)
            for rid, blocks in reply.granted:
                seq = next((s for s in self.seqs if s.kv_owner == rid and s.state in LIVE), None)
                if seq is None:  # failed meanwhile (e.g. by the epoch check): the grant goes back
                    self.cache_manager.send_nowait(Release(rid))
                    continue
                seq.table.extend(blocks)
                seq.epoch, seq.registered = reply.epoch, True
            refused = set(reply.refused)
            plan = [p for p in plan if p.seq.state in LIVE]
            going = [p for p in plan if p.seq.kv_owner not in refused]
            if not refused:
                return plan
            stuck = any(p.decode and p.seq.kv_owner in refused for p in plan)
            oldest_refused = min((p.seq for p in plan if p.seq.kv_owner in refused), key=lambda s: s.order)
            if (stuck or not going) and self._preempt_newest(spare=None if stuck else oldest_refused):
                plan = self._plan()
                continue
            return going  # refused prefills wait (with no victim left, lookups pin the blocks for now)
        return []

    def _preempt_newest(self, spare: Sequence | None = None) -> Sequence | None:
        """Frees every block of the newest sequence holding any (not `spare`) — one still waiting
        for admission (a hit holding its pinned prefix) before any running one; it is prefilled
        again later, from what is still cached of its blocks on (its images encoded again where
        their KV is gone). None when no other sequence holds a block."""
        holders = [s for s in self.seqs if s.state in LIVE and s is not spare and s.table]
        victim = newest([s for s in holders if not s.admitted]) or newest(holders)
        if victim is None:
            return None
        self._release(victim, final=False)
        victim.kv_len, victim.committed = 0, 0
        victim.resumable = victim.chain is not None and bool(victim.hashes)
        if victim.state is SeqState.DECODING:
            victim.move(SeqState.PREFILLING)
        self.preemptions += 1
        if self.metrics is not None:
            self.metrics.preempted(self.adapter.name)
        self.log.info("generator.preempted", request_id=victim.request_id, tokens=len(victim.tokens))
        return victim

    async def _resume(self, seqs: list[Sequence]) -> None:
        """Preempted sequences about to be prefilled again get back, from the manager, the blocks
        of theirs still cached (committed before the preemption and not evicted since): their
        prefill goes on after them. Each leaves at least its last token to compute (its logits)."""
        wants = []
        for seq in seqs:
            seq.resumable = False
            most = (seq.target_len - 1) // self.block_size
            if not seq.table and seq.kv_len == 0 and most > 0:  # hits only ever start an empty table
                wants.append((seq.kv_owner, tuple(seq.hashes[:most])))
        if not wants:
            return
        send, replies = trio.open_memory_channel(1)
        self.cache_manager.send_nowait(Resume(tuple(wants), send))
        reply: Resumed | None = None
        with replies, trio.move_on_after(self.config.lookup_timeout_s):
            reply = await replies.receive()
        if reply is None:  # its prefill recomputes everything: slower, never wrong
            self.log.warning("generator.resume_timeout", waited_s=self.config.lookup_timeout_s)
            return
        self._check_epoch(reply.epoch)
        for owner, blocks in reply.tables:
            if not blocks:
                continue
            seq = next((s for s in self.seqs if s.kv_owner == owner and s.state in LIVE), None)
            if seq is None or seq.table:  # ended (or failed by the epoch check): they go back
                self.cache_manager.send_nowait(Release(owner))
                continue
            seq.committed = len(blocks)  # the resumed blocks are cache entries: committed
            seq.table.extend(blocks)
            seq.kv_len = seq.table_len * self.block_size
            seq.epoch, seq.registered = reply.epoch, True
            self.resumed_blocks += len(blocks)
            self.log.info("generator.resumed", request_id=seq.request_id, blocks=len(blocks),
                          tokens=len(blocks) * self.block_size, kv_len=seq.kv_len, target_len=seq.target_len)

    async def _allocate(self, plan: list[Planned]) -> Allocated | None:
        needs = tuple((p.seq.kv_owner, p.new_blocks) for p in plan if p.new_blocks)
        send, replies = trio.open_memory_channel(1)
        self.cache_manager.send_nowait(Allocate(needs, send))
        # closed on the way out: a grant that comes too late finds no one, and the manager takes it back
        with replies, trio.move_on_after(self.config.lookup_timeout_s):
            return await replies.receive()
        self.log.warning("generator.allocate_timeout", waited_s=self.config.lookup_timeout_s)
        return None

    def _check_epoch(self, epoch: int) -> None:
        """Tables from an earlier life of the cache manager point at blocks it may have given away:
        their sequences fail; those that held nothing go on."""
        self.kv_epoch = max(epoch, self.kv_epoch or 0)
        for seq in [s for s in self.seqs if s.epoch is not None and s.epoch != epoch and s.state in LIVE]:
            self._fail(seq, ServiceUnavailable("the KV cache of this model was restarted while the request "
                                               "ran; retry", retry_after_s=1.0), "kv cache")
        self._prune()

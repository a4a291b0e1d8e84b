"""The cache manager's link to the shared tier (a part `PrefixCacheManager` holds, with
`[shared_cache]` and prefix caching on): the lookups it asked the tier about, the restore of what
the tier found into fresh blocks of the manager's arena, and the export of newly committed blocks.

It owns the lookups waiting on the tier (void with the manager's life) and the count of restored
blocks; the arena and the life (epoch) are the manager's, handed in by each call. KV is read and
written through the generator's model runner — blocks the manager granted, never others — and a
restore is written inside the runner's write fence for the life its blocks were granted in: a
later life refuses it (`ModelRunner.write_blocks`)."""

from __future__ import annotations

import trio

from mmserve.actors import compute
from mmserve.actors.compute import single_threaded
from mmserve.actors.kv_messages import FetchBlocks, SharedBlocks
from mmserve.actors.messages import Lookup
from mmserve.cache.block_arena import BlockArena
from mmserve.cache.keys import key_prefix
from mmserve.cache.shared_values import KIND_KV_BLOCK, block_key


class SharedKV:
    """The manager's KV blocks in the shared tier (Redis): asked, restored, exported."""

    def __init__(self, tier, runner, log, owner: str):
        self.tier = tier  # the model's SharedTier
        self.runner = runner  # the generator's ModelRunner
        self.log = log  # the manager's: its events are `prefix_cache.*`
        self.owner = owner  # the manager's key: the compute thread's owner of a restore's write
        self.restored = 0  # blocks restored from the shared tier
        self.new_life()

    def new_life(self) -> None:
        """A fresh arena: no lookup of it waits on the tier."""
        self.asked: dict[str, tuple[Lookup, int, float | None]] = {}  # request → (lookup, local hit, waited since)

    def ask(self, msg: Lookup, local: int, waited_since: float | None, epoch: int,
            reply_to: trio.MemorySendChannel) -> bool:
        """A local miss goes on in the shared tier: the hashes after the local hit are asked for, the
        answer (SharedBlocks to `reply_to`, within the tier's deadline) restores them. False when the
        tier is off (backing off after an error)."""
        if not self.tier.active():
            return False
        self.asked[msg.request_id] = (msg, local, waited_since)
        self.tier.inbox_send.send_nowait(FetchBlocks(msg.request_id, msg.hashes[local:], self.runner.dtype,
                                                     self.runner.block_shape, epoch, reply_to))
        return True

    def answered(self, answer: SharedBlocks, epoch: int) -> tuple[Lookup, int, float | None] | None:
        """The lookup `answer` is for, with its local hit and wait; None when the request went on
        without it (or ended), or the arena restarted since it was asked."""
        pending = self.asked.pop(answer.request_id, None)
        return pending if pending is not None and answer.epoch == epoch else None

    def drop(self, request_id: str) -> None:
        """The request computes nothing more: a shared-tier answer for it comes too late."""
        self.asked.pop(request_id, None)

    def waiting(self) -> list[Lookup]:
        """The lookups waiting on the tier's answer."""
        return [lookup for lookup, _, _ in self.asked.values()]

    async def restore(self, arena: BlockArena, pin: str, hashes, local: int, tensors, epoch: int) -> int:
        """Fresh blocks of `arena` for the found KV (allocated under `pin`, like any block),
        written on the compute thread inside the runner's write fence, then committed: a writer of
        an earlier life still in flight holds its blocks in quarantine (so they cannot be these),
        and the fence refuses the write if life `epoch` ends before it starts (then this raises:
        the caller drops the blocks). Returns how many were restored."""
        n = min(len(tensors), arena.num_free())
        taken = arena.allocate_evicting(pin, n)
        if evicted := [(b, h) for b, h in taken if h is not None]:
            self.log.info("prefix_cache.evict", request_id=pin, blocks=[b for b, _ in evicted],
                          hashes=[key_prefix(h) for _, h in evicted])
        written = await compute.run(self.runner.write_blocks, [block for block, _ in taken], tensors[:n], epoch,
                                    owner=self.owner)
        if not written:  # this life ended meanwhile (its tables went with it): nothing was written
            raise RuntimeError("the cache manager restarted during the restore")
        for i in range(n):
            arena.commit(pin, local + i, hashes[local + i])
        self.restored += n
        self.log.info("prefix_cache.shared_restore", request_id=pin, blocks=[b for b, _ in taken],
                      hashes=[key_prefix(h) for h in hashes[local:local + n]], found=len(tensors))
        return n

    def export(self, table: tuple[int, ...], new: list[tuple[int, bytes]]) -> None:
        """Newly committed blocks go to the shared tier, once: their KV is copied out now, while the
        committing request still references them (no one can be writing them), and written to
        Redis in the background."""
        if not self.tier.active():
            return
        with single_threaded():
            data = self.runner.read_blocks([table[i] for i, _ in new])  # [2, L, n, ...]
        for j, (_, h) in enumerate(new):
            self.tier.put_soon(KIND_KV_BLOCK, block_key(h), data[:, :, j])

    def notify_after_writes(self, reply, msg) -> None:
        """`msg` (an answer's `FinishFlushed`) sent to `reply` once the writes queued before it are
        done (or after the tier's `finish_flush_ms`): the generator then emits the finish."""
        self.tier.notify_after_writes(reply, msg)

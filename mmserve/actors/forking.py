"""How a request's n choices become sequences of their own once its prefill ended (a part of
`Generator`; the bookkeeping is `actors.choices`'): one Fork round trip to the cache manager."""

from __future__ import annotations

import trio

from mmserve.actors.choices import children, fork_of
from mmserve.actors.messages import Release, copy_pin
from mmserve.actors.token_rows import assembler as text_assembler
from mmserve.errors import MMServeError, ServiceUnavailable
from mmserve.generation.scheduler import Planned
from mmserve.engine.step_sampling import Sampled


class Forking:
    """Generator methods: forking a request's other choices."""

    async def _fork(self, p: Planned, firsts: list[Sampled]) -> Sampled | Exception:
        """The other choices of `p.seq`, whose prefill this step ended, as sequences of their own
        over its blocks, each with its first token; the parent's first token is returned."""
        parent, kv_end = p.seq, p.seq.kv_len + p.tokens
        send, replies = trio.open_memory_channel(1)
        self.cache_manager.send_nowait(fork_of(parent, kv_end, self.block_size, send))
        forked = None
        with replies, trio.move_on_after(self.config.lookup_timeout_s):
            forked = await replies.receive()
        if forked is not None and forked.epoch != parent.epoch:  # a restarted manager: none of it holds
            self._release_forked(forked)
            forked = None
        if forked is None:
            return ServiceUnavailable("the KV cache did not answer while the request's choices were set up; "
                                      "retry", retry_after_s=1.0)
        try:
            made = children(parent, forked, kv_end, self.block_size, order=lambda: next(self._orders),
                            assembler=lambda: text_assembler(self.adapter, parent.handle.request))
        except MMServeError as e:  # the request fails alone; what the manager gave its choices goes back
            self._release_forked(forked)
            return e
        parent.forks = []
        self.log.info("generator.forked", request_id=parent.request_id, choices=len(made) + 1,
                      shared_blocks=kv_end // self.block_size, copied_blocks=sum(c is not None for _, c in made))
        for (child, copy), first in zip(made, firsts[1:]):
            self.seqs.append(child)
            if copy is not None:
                self._copies.append(copy)
            self._accept(child, first)
        return firsts[0]

    def _release_forked(self, forked) -> None:
        """What the manager gave a request's choices goes back (they will not run)."""
        for owner, _, source in forked.tables:
            self.cache_manager.send_nowait(Release(owner))
            if source is not None:
                self.cache_manager.send_nowait(Release(copy_pin(owner)))

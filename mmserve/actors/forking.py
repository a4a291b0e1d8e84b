"""How a request's n choices become sequences of their own once its prefill ended (the bookkeeping
is `actors.choices`'): one Fork round trip to the cache manager. Functions: the generator adds the
choices made to its sequences, their block copies to its step executor, and their first tokens to
their answers."""

from __future__ import annotations

from typing import Callable, Iterator

import trio

from mmserve.actors.choices import BlockCopy, children, fork_of
from mmserve.actors.messages import Forked, Release, copy_pin
from mmserve.actors.sequence import Sequence
from mmserve.errors import MMServeError, ServiceUnavailable
from mmserve.generation.scheduler import Planned
from mmserve.engine.step_sampling import Sampled


async def fork_choices(p: Planned, firsts: list[Sampled], manager: trio.MemorySendChannel, block_size: int,
                       timeout_s: float, orders: Iterator[int], assembler: Callable[[], object],
                       note: Callable[[Release], None], log,
                       ) -> tuple[Sampled | Exception, list[tuple[Sequence, BlockCopy | None, Sampled]]]:
    """The other choices of `p.seq`, whose prefill this step ended, as sequences of their own
    over its blocks: (the parent's first token — or the error that fails the request —, per
    other choice (its sequence, its block copy, its first token)). `note`: a release for the
    next step report (what the manager gave choices that will not run goes back there)."""
    parent, kv_end = p.seq, p.seq.kv_len + p.tokens
    send, replies = trio.open_memory_channel(1)
    manager.send_nowait(fork_of(parent, kv_end, block_size, send))
    forked = None
    with replies, trio.move_on_after(timeout_s):
        forked = await replies.receive()
    if forked is not None and forked.epoch != parent.epoch:  # a restarted manager: none of it holds
        release_forked(forked, note)
        forked = None
    if forked is None:
        return ServiceUnavailable("the KV cache did not answer while the request's choices were set up; "
                                  "retry", retry_after_s=1.0), []
    try:
        made = children(parent, forked, kv_end, block_size, order=lambda: next(orders), assembler=assembler)
    except MMServeError as e:  # the request fails alone; what the manager gave its choices goes back
        release_forked(forked, note)
        return e, []
    parent.forks = []
    log.info("generator.forked", request_id=parent.request_id, choices=len(made) + 1,
             shared_blocks=kv_end // block_size, copied_blocks=sum(c is not None for _, c in made))
    return firsts[0], [(child, copy, first) for (child, copy), first in zip(made, firsts[1:])]


def release_forked(forked: Forked, note: Callable[[Release], None]) -> None:
    """What the manager gave a request's choices goes back (they will not run): in the next report."""
    for owner, _, source in forked.tables:
        note(Release(owner))
        if source is not None:
            note(Release(copy_pin(owner)))

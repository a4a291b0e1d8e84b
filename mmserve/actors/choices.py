"""The n choices of one request: one prefill, then one sequence per choice over shared blocks.

Choice 0 is the request's sequence from admission; it carries the other choices' random
generators and grammar states until its prefill ends. The step that computes its prompt's last
token samples every choice's first token from that one row of logits; then the other choices
become sequences of their own (`children`), whose block tables start with the parent's full
prompt blocks — shared, refcounted by the cache manager, zero bytes copied — and end with a block
of their own holding a copy of the parent's partial last block (copy-on-write: each choice
writes its answer there). The copy runs on the compute thread at the start of the next step,
before any forward writes; until then the manager keeps the source block referenced
(`messages.copy_pin`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mmserve.actors.messages import Fork, Forked, copy_pin
from mmserve.actors.sequence import Sequence, SeqState
from mmserve.errors import MMServeError


@dataclass(frozen=True)
class BlockCopy:
    """A forked choice's copy of its parent's partial block, due before its first forward."""

    child: Sequence
    source: int
    target: int
    pin: str  # the manager's owner holding `source` until the copy is done


def fork_of(parent: Sequence, kv_end: int, block_size: int, reply) -> Fork:
    """The manager's message for the choices of `parent`, whose KV covers `kv_end` prompt tokens."""
    children = tuple(f"{parent.request_id}/{c}" for c in range(1, len(parent.forks) + 1))
    return Fork(parent.kv_owner, children, kv_end // block_size, kv_end % block_size != 0, reply)


def children(parent: Sequence, forked: Forked, kv_end: int, block_size: int,
             assembler: Callable[[], object], order: Callable[[], int]) -> list[tuple[Sequence, BlockCopy | None]]:
    """One sequence per other choice, over the blocks the manager gave it, with the copy each needs."""
    out = []
    shared = kv_end // block_size
    committed = min(parent.committed, shared)
    for c, ((rng, matcher), (owner, blocks, source)) in enumerate(zip(parent.forks, forked.tables), 1):
        covers = len(blocks) * block_size >= kv_end  # shared blocks plus its own copy of the last
        kv_len = kv_end if covers else min(kv_end, len(blocks) * block_size)
        child = Sequence(parent.job, assembler(), rng, order(), parent.chain,
                         state=SeqState.DECODING if covers else SeqState.PREFILLING,
                         ids=list(parent.ids[:kv_end]), table=list(blocks), kv_len=kv_len,
                         hashes=list(parent.hashes[:committed]), committed=committed,
                         epoch=forked.epoch if blocks else None, registered=bool(blocks), choice=c,
                         matcher=matcher)
        if child.kv_owner != owner:  # the manager answered for other owners than it was asked about
            raise MMServeError(f"fork of {parent.request_id}: the cache manager gave blocks to {owner!r}, "
                               f"expected {child.kv_owner!r}")
        copy = BlockCopy(child, source, blocks[-1], copy_pin(owner)) if source is not None else None
        out.append((child, copy))
    return out

"""The token-budget scheduler: what one forward carries, and who is admitted to run.

Admission is state the scheduler keeps, not a side effect of holding KV blocks. A sequence is
*admitted* (running) the first time a step plans it and stays admitted until it ends. A
preempted sequence keeps its admission: its blocks are given back, but it is the first to be
prefilled again — before any waiting sequence is admitted. At most `max_running` **requests**
are admitted at once: the n choices of one request count as one (they share its prompt's blocks
and its one prefill; a forked choice belongs to its parent's request). Waiting sequences are
admitted strictly oldest first (by `order`): a younger one — a cache hit that arrives holding
its looked-up blocks included — is never admitted while an older one waits (head of line: if the
oldest waiting sequence cannot be admitted, nobody younger is). A waiting cache hit keeps its
looked-up blocks pinned, but does not run.

Every step carries one decode token of every admitted decoding sequence, then prefill chunks of
admitted sequences — oldest first — then those of newly admitted ones, until
`max_batched_tokens` are planned (as vLLM's scheduler does), so a long prompt never starves
decoding and the sequences waiting longest go first. It plans the tokens and the KV blocks each
sequence needs for them; the cache manager grants the blocks, and the generator preempts the
newest sequence when a decode token finds no block. Pure: no torch, no trio; the generator
applies the plan and marks every planned sequence admitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence


class Schedulable(Protocol):
    kv_len: int  # tokens whose KV is in the arena
    order: int  # arrival order: lower is older
    admitted: bool  # a step planned it (and it has not ended since)

    @property
    def request_id(self) -> Hashable: ...  # its request: the same for all n choices of one request

    @property
    def target_len(self) -> int: ...  # tokens whose KV a prefill must compute (prompt + answer so far)

    @property
    def table_len(self) -> int: ...  # blocks in its block table


@dataclass(frozen=True)
class Planned:
    seq: Schedulable
    tokens: int  # new tokens in this step
    new_blocks: int  # blocks it needs beyond its table for them
    decode: bool


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_step(decoding: Sequence[Schedulable], prefilling: Sequence[Schedulable], block_size: int,
              max_batched_tokens: int, max_running: int) -> list[Planned]:
    """The step's work: decode tokens first (oldest first; a decoding sequence is admitted), then
    prefill chunks of admitted sequences oldest first (a sequence of an admitted request is
    admitted: a forked choice, a preempted one), then the waiting sequences, admitted oldest first
    while fewer than `max_running` requests are admitted — stopping at the first that cannot be,
    so no younger one overtakes it. Every sequence in the plan is admitted from this step on."""
    plan = [_planned(s, 1, block_size, decode=True) for s in sorted(decoding, key=lambda s: s.order)]
    budget = max_batched_tokens - len(plan)
    running = {s.request_id for s in decoding} | {s.request_id for s in prefilling if s.admitted}
    admitted = [s for s in prefilling if s.admitted or s.request_id in running]
    waiting = [s for s in prefilling if not (s.admitted or s.request_id in running)]
    for seq in sorted(admitted, key=lambda s: s.order):
        if budget <= 0:
            return plan
        chunk = min(budget, seq.target_len - seq.kv_len)
        if chunk > 0:
            plan.append(_planned(seq, chunk, block_size, decode=False))
            budget -= chunk
    for seq in sorted(waiting, key=lambda s: s.order):
        if budget <= 0 or (seq.request_id not in running and len(running) >= max_running):
            break  # head of line: nobody younger is admitted before it
        chunk = min(budget, seq.target_len - seq.kv_len)
        if chunk > 0:
            running.add(seq.request_id)
            plan.append(_planned(seq, chunk, block_size, decode=False))
            budget -= chunk
    return plan


def _planned(seq: Schedulable, tokens: int, block_size: int, decode: bool) -> Planned:
    need = max(0, blocks_for(seq.kv_len + tokens, block_size) - seq.table_len)
    return Planned(seq, tokens, need, decode)


def newest(candidates: Sequence[Schedulable]) -> Schedulable | None:
    """The sequence to preempt when a block runs out: the one that arrived last."""
    return max(candidates, key=lambda s: s.order, default=None)

"""The token-budget scheduler: what one forward carries.

Every step carries one decode token of every running sequence, then prefill chunks of waiting
ones — oldest first — until `max_batched_tokens` are planned (as vLLM's scheduler does), so a
long prompt never starves decoding and the sequences waiting longest go first. It plans the
tokens and the KV blocks each sequence needs for them; the cache manager grants the blocks, and
the generator preempts the newest sequence when a decode token finds no block. Pure: no torch,
no trio; the generator applies the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


class Schedulable(Protocol):
    kv_len: int  # tokens whose KV is in the arena
    order: int  # admission order: lower is older

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
    """The step's work, decode tokens first (oldest first), then prefill chunks in admission order;
    at most `max_running` sequences hold blocks at once (a waiting sequence that holds none is
    admitted only below that)."""
    plan = [_planned(s, 1, block_size, decode=True) for s in sorted(decoding, key=lambda s: s.order)]
    budget = max_batched_tokens - len(plan)
    holding = len(decoding) + sum(1 for s in prefilling if s.table_len)
    for seq in sorted(prefilling, key=lambda s: s.order):
        if budget <= 0:
            break
        if not seq.table_len and holding >= max_running:
            continue  # not admitted yet, and the running set is full
        holding += not seq.table_len
        chunk = min(budget, seq.target_len - seq.kv_len)
        if chunk <= 0:
            continue
        plan.append(_planned(seq, chunk, block_size, decode=False))
        budget -= chunk
    return plan


def _planned(seq: Schedulable, tokens: int, block_size: int, decode: bool) -> Planned:
    need = max(0, blocks_for(seq.kv_len + tokens, block_size) - seq.table_len)
    return Planned(seq, tokens, need, decode)


def newest(candidates: Sequence[Schedulable]) -> Schedulable | None:
    """The sequence to preempt when a block runs out: the one admitted last."""
    return max(candidates, key=lambda s: s.order, default=None)

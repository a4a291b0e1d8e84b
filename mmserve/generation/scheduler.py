"""The token-budget scheduler: what one forward carries, and who is admitted to run.

Who goes first is a **rank** (`Ranking`): a request's effective priority (its `priority`, lower
first as vLLM's, improved by one level for every `aging_s` seconds since it arrived at the
runtime), then its arrival order at the generator (`order`). With every priority equal (the
default, 0) the rank is the arrival order, and everything below reads "oldest" as before;
"oldest" means "best ranked", "newest" "worst ranked". Aging bounds every wait: a request of
priority p ranks ahead of every request of priority q that arrives (p - q + 1) × aging_s seconds or
more after it (its effective priority is then strictly better, whatever order the two reached the
generator in), so only finitely many requests ever pass it.

Admission is state the scheduler keeps, not a side effect of holding KV blocks. A sequence is
*admitted* (running) the first time a step plans it and stays admitted until it ends. A
preempted sequence keeps its admission: its blocks are given back, but it is the first to be
prefilled again — before any waiting sequence is admitted — unless it was *displaced*: put back in
the queue, blocks and admission, to make room for a waiting request of a strictly better
priority (`displaced`). At most `max_running` **requests**
are admitted at once: the n choices of one request count as one (they share its prompt's blocks
and its one prefill; a forked choice belongs to its parent's request). Waiting sequences are
admitted strictly oldest first (by `order`): a younger one — a cache hit that arrives holding
its looked-up blocks included — is never admitted while an older one waits (head of line: if the
oldest waiting sequence cannot be admitted, nobody younger is). A waiting cache hit keeps its
looked-up blocks pinned, but does not run.

Every step carries one decode token of every admitted decoding sequence, then prefill chunks of
admitted sequences — oldest first — then those of newly admitted ones, until
`max_batched_tokens` are planned (as vLLM's scheduler does), so a long prompt never starves
decoding and the sequences waiting longest go first. Decode rows and prefills share that budget:
a request is admitted only while the rows of the admitted requests (one per choice: n) and its
own stay within `max_batched_tokens`, so decode rows never fill a step and an admitted sequence
that prefills (again, after a preemption) always gets a chunk — it does not wait for decoders
to end; and the first request always is (the generator refuses one whose n exceeds the budget). It plans the tokens and the KV blocks each
sequence needs for them; the cache manager grants the blocks, and the generator preempts the
newest sequence when a decode token finds no block. Pure: no torch, no trio; the generator
applies the plan and marks every planned sequence admitted.

A sequence's bidirectional spans (`bidirectional`: runs of tokens that see each other both ways,
Gemma 3's images) are never split: a prefill chunk ends before a span or after it. A chunk that
starts inside one (after a prefix hit that ended there) or at its start takes the rest of it
whole — past the step's budget only as the step's first prefill chunk (an image larger than the
budget gets a chunk of its own); otherwise it waits for the next step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

from mmserve.errors import ExceedsCapacity


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

    # optional: bidirectional: tuple[tuple[int, int], ...]  (spans [lo, hi) a chunk never splits)
    # optional: priority: int (lower first; 0 when absent), arrived: float (monotonic seconds, for aging)


@dataclass(frozen=True)
class Ranking:
    """Who goes first at one moment (`now`): lower `key` first. Fixed for one plan, so that every
    decision of a step sees one order."""

    now: float = 0.0
    aging_s: float = math.inf  # inf: no aging (strict priorities)

    def priority(self, seq: Schedulable) -> int:
        """Its effective priority: its own, one level better for every `aging_s` seconds since it
        arrived (running ones age too, so a request that ran long is no easy victim)."""
        own = getattr(seq, "priority", 0)
        if math.isinf(self.aging_s):
            return own
        waited = self.now - getattr(seq, "arrived", self.now)
        return own - int(max(0.0, waited) // self.aging_s)

    def key(self, seq: Schedulable) -> tuple[int, int]:
        """Effective priority, then `order` (arrival at the generator): with equal priorities,
        exactly today's oldest-first order, decode rows included."""
        return self.priority(seq), seq.order


FIFO = Ranking()  # every priority 0 (no priority attribute): oldest first


@dataclass(frozen=True)
class Planned:
    seq: Schedulable
    tokens: int  # new tokens in this step
    new_blocks: int  # blocks it needs beyond its table for them
    decode: bool


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_step(decoding: Sequence[Schedulable], prefilling: Sequence[Schedulable], block_size: int,
              max_batched_tokens: int, max_running: int, ranking: Ranking = FIFO) -> list[Planned]:
    """The step's work: decode tokens first (best ranked first; a decoding sequence is admitted),
    then prefill chunks of admitted sequences by rank (a sequence of an admitted request is
    admitted: a forked choice, a preempted one), then the waiting sequences, admitted by rank
    while fewer than `max_running` requests are admitted — stopping at the first that cannot be,
    so no worse-ranked one overtakes it. Every sequence in the plan is admitted from this step on."""
    rank = ranking.key
    plan = [_planned(s, 1, block_size, decode=True) for s in sorted(decoding, key=rank)]
    decodes = len(plan)
    budget = max_batched_tokens - len(plan)
    running = {s.request_id for s in decoding} | {s.request_id for s in prefilling if s.admitted}
    # decode rows share the budget: the admitted requests' rows (every choice decodes one token a
    # step) stay within it, so a prefill chunk of an admitted sequence always finds room
    rows = {s.request_id: _rows(s) for s in [*decoding, *prefilling] if s.request_id in running}
    used = sum(rows.values())
    admitted = [s for s in prefilling if s.admitted or s.request_id in running]
    waiting = [s for s in prefilling if not (s.admitted or s.request_id in running)]
    for seq in sorted(admitted, key=rank):
        if budget <= 0:
            return plan
        chunk = prefill_chunk(seq, budget, alone=len(plan) == decodes)
        if chunk > 0:
            plan.append(_planned(seq, chunk, block_size, decode=False))
            budget -= chunk
    # a request's waiting sequences go together, at its best rank (the choices of a displaced request)
    first = {}
    for seq in waiting:
        first[seq.request_id] = min(first.get(seq.request_id, rank(seq)), rank(seq))
    for seq in sorted(waiting, key=lambda s: (first[s.request_id], rank(s))):
        if budget <= 0 or (seq.request_id not in running and (
                len(running) >= max_running or (running and used + _rows(seq) > max_batched_tokens))):
            break  # head of line: nobody younger is admitted before it
        chunk = prefill_chunk(seq, budget, alone=len(plan) == decodes)
        if chunk == 0 and seq.target_len > seq.kv_len:
            break  # its next chunk is a whole image that waits for a step of its own
        if chunk > 0:
            if seq.request_id not in running:
                used += _rows(seq)
            running.add(seq.request_id)
            plan.append(_planned(seq, chunk, block_size, decode=False))
            budget -= chunk
    return plan


def prefill_chunk(seq: Schedulable, budget: int, alone: bool) -> int:
    """The length of `seq`'s next prefill chunk within `budget`, ending outside every bidirectional
    span (the module docstring); `alone`: no other prefill chunk is in the step yet."""
    start = seq.kv_len
    end = start + min(budget, seq.target_len - start)
    for lo, hi in getattr(seq, "bidirectional", ()):
        if lo < end < hi:
            if lo > start:
                end = lo  # the chunk ends before the span
            else:  # it starts inside (a hit ended there) or at the span: the rest of it, whole
                end = hi if alone else start
            break
    return max(0, end - start)


def fit_chunk(seq: Schedulable, tokens: int) -> int:
    """`tokens` (a chunk cut short, e.g. to the blocks granted) cut back further so that it ends
    outside every bidirectional span of `seq`: 0 when it would have to end inside one."""
    start = seq.kv_len
    end = start + tokens
    for lo, hi in getattr(seq, "bidirectional", ()):
        if lo < end < hi:
            end = lo if lo > start else start
            break
    return max(0, end - start)


def _rows(seq: Schedulable) -> int:
    """The decode rows its request will take a step: one per choice."""
    return getattr(seq, "rows", 1)


def _planned(seq: Schedulable, tokens: int, block_size: int, decode: bool) -> Planned:
    need = max(0, blocks_for(seq.kv_len + tokens, block_size) - seq.table_len)
    return Planned(seq, tokens, need, decode)


def never_fits(tokens: int, n: int, num_blocks: int, block_size: int, max_batched_tokens: int) -> ExceedsCapacity | None:
    """Why a request of `tokens` tokens of KV (its prompt: an image span, never split, is part of
    it) and `n` choices could never run here — refused at admission rather than left waiting —
    or None: its KV and the next token's must fit the arena, and its n decode rows a step."""
    if blocks_for(tokens + 1, block_size) > num_blocks:
        return ExceedsCapacity(f"the prompt needs {tokens} tokens of KV; this server's KV cache holds "
                               f"{num_blocks * block_size} (kv_cache.budget_bytes)", param="messages")
    if n > max_batched_tokens:
        return ExceedsCapacity(f"n = {n} choices need {n} rows in every step; this server's steps carry "
                               f"{max_batched_tokens} tokens (generator.max_batched_tokens)", param="n",
                               code="exceeds_step_budget")
    return None


def newest(candidates: Sequence[Schedulable], ranking: Ranking = FIFO) -> Schedulable | None:
    """The sequence to preempt when a block runs out: the worst ranked — the lowest priority, the
    one that arrived last among equals."""
    return max(candidates, key=ranking.key, default=None)


def displaced(decoding: Sequence[Schedulable], prefilling: Sequence[Schedulable], max_batched_tokens: int,
              max_running: int, ranking: Ranking) -> list[Hashable]:
    """The admitted requests to put back in the queue so that the best-ranked waiting request can
    be admitted now: [] when it can be already, or when it cannot be even so. Only requests of a
    strictly worse effective priority are displaced (never to admit one of the same or a lower
    priority: equal priorities keep arrival order), the worst ranked first — lowest priority,
    newest among equals — and no more than it takes for its request and its rows to fit."""
    running = {s.request_id for s in decoding} | {s.request_id for s in prefilling if s.admitted}
    waiting = [s for s in prefilling if not s.admitted and s.request_id not in running]
    if not waiting or not running:
        return []
    head = min(waiting, key=ranking.key)
    members: dict[Hashable, list[Schedulable]] = {}
    for s in [*decoding, *prefilling]:
        if s.request_id in running:
            members.setdefault(s.request_id, []).append(s)
    # a request ranks as its first sequence (its choices share its priority and arrival)
    ranks = {r: min(ranking.key(s) for s in seqs) for r, seqs in members.items()}  # (priority, order)
    rows = {r: _rows(seqs[0]) for r, seqs in members.items()}
    count, used = len(running), sum(rows.values())

    def fits() -> bool:
        return count == 0 or (count < max_running and used + _rows(head) <= max_batched_tokens)

    if fits():
        return []
    out = []
    best = ranking.priority(head)
    for r in sorted((r for r in running if ranks[r][0] > best), key=lambda r: ranks[r], reverse=True):
        out.append(r)
        count, used = count - 1, used - rows[r]
        if fits():
            return out
    return []  # displacing every lower-priority request would not make room: nobody is

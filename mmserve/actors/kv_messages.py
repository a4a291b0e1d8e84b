"""Messages of the KV arena's owner, the PrefixCacheManager: intake's look-ups, the generator's
reservation (draws, step reports, refills), the step fence (quarantine of an abandoned step's
blocks), commits and releases, resumes — and the shared tier's block fetches. Frozen dataclasses;
`actors.messages` holds the request path's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import trio

from mmserve.cache.kv_event_records import BlockRouting


@dataclass(frozen=True)
class PrefixFailed:
    """Manager → the request's `reply` channel: handling its lookup or commit raised, or a step
    report drew for it blocks the reservation does not hold. The request fails alone (its Release
    settles what the manager still holds for it)."""

    request_id: str
    stage: str
    error: Exception


@dataclass(frozen=True)
class Lookup:
    """The longest cached prefix of `hashes`, its blocks referenced for the request (they start its
    block table). On a miss the request is registered as computing the missing blocks; when
    another request already is, the lookup waits for its commit (in-flight dedup)."""

    request_id: str
    hashes: tuple[bytes, ...]
    reply: trio.MemorySendChannel  # never closed by the manager (it may be the requester's inbox)
    label: str | None = None  # the client's request id: for logs and fault hooks, never a key


@dataclass(frozen=True)
class LookupResult:
    """Manager → the lookup's `reply` channel: the blocks of the request's cached prefix, in order
    (zero bytes copied: they become the first entries of its block table)."""

    request_id: str
    blocks: tuple[int, ...] = ()
    waited_s: float = 0.0  # time parked on another request computing the same blocks
    epoch: int = 0  # the manager's life: blocks from another epoch mean nothing


@dataclass(frozen=True)
class Reservation:
    """The manager's owner of the blocks it reserved for the generator: lease `lease` in the
    manager's life `epoch`. Never a request's id (those are strings), so never confused with one."""

    epoch: int
    lease: int

    def __str__(self) -> str:
        return f"reservation:{self.epoch}/{self.lease}"


@dataclass(frozen=True)
class Draw:
    """A step report's entry: the generator gave these blocks of its reservation to the request,
    appended to its table in this order (the manager moves them from the reservation's table)."""

    request_id: str
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class StepReport:
    """Generator → manager, at most once per step, never awaited: what the step changed, in the
    order it happened — blocks drawn from the reservation (`Draw`), full blocks committed
    (`Commit`), sequences ended or preempted (`Release`) — and how many blocks the generator wants
    in reserve. The manager answers with at most one `Refill`, when the reservation holds fewer.

    `number` grows with every report and is never reused by one generator: a duplicate or replayed
    report is ignored whole. `epoch` is the manager life the generator's tables belong to (None:
    it has heard of none yet); a report of a dead life has its draws and commits ignored (their
    tables are void), its releases applied. `lease` names the reservation the draws come from; a
    newer lease gives every block of the older one back (the generator dropped it: when it went
    idle, restarted, or heard of a new manager life) — refills of the older one still on their way
    are dropped by the generator. `hints`: (request id, the last block of its table, n): the n
    blocks after it would keep that table consecutive — given first when free, earmarked for it;
    with None for the last block, a new table: a run of n placed as `cache.free_blocks` places one
    (always answered). `slack`: how many of `want` are spare, never worth an eviction."""

    number: int
    epoch: int | None
    lease: int
    entries: tuple[Any, ...]  # Draw | Commit | Release | Quarantine, in order
    want: int
    reply: trio.MemorySendChannel  # the generator's inbox: the refill, and per-request failures
    hints: tuple[tuple[str, int | None, int], ...] = ()
    slack: int = 0  # of `want`, blocks beyond the next step's draws: given from free blocks only,
    # never by evicting a cached one (a just-preempted request's blocks are the ones it would resume)


@dataclass(frozen=True)
class Refill:
    """Manager → generator, at most one per report: blocks added to the reservation (held by the
    manager under `Reservation(epoch, lease)` until drawn). `number` is the report it answers; the
    generator takes a refill only of its current epoch and lease, and never the same one twice.
    `free_blocks`: what the manager could still give (free or evictable) after it. `earmarks`: the
    blocks of `blocks` given for a hint, by request (the rest are placed as a new table would be,
    with room to grow)."""

    epoch: int
    lease: int
    number: int
    blocks: tuple[int, ...]
    free_blocks: int
    earmarks: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class StepFence:
    """The arena's owner of the blocks an abandoned step may still write (`Quarantine`): held by
    nobody else, granted to nobody, until that step's thread call has returned (`StepReturned`).
    Never a request's id (those are strings), so never confused with one."""

    step: int

    def __str__(self) -> str:
        return f"quarantine:{self.step}"


@dataclass(frozen=True)
class Quarantine:
    """A step report's entry (before the releases of that step's sequences): the step `step` was
    abandoned (its generator restarted while the compute thread still ran it) and may still write
    into `blocks` — every block of the tables it was given, copy targets included. The manager holds
    them under `StepFence(step)` whatever their owners release, in any life of its own (a reset
    carries them over), until `StepReturned(step)`."""

    step: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class StepReturned:
    """Compute thread (via the event loop) → manager: the abandoned step `step` has returned (its
    device work done): it writes nothing any more, its quarantined blocks go back. A late or
    duplicate one changes nothing."""

    step: int


@dataclass(frozen=True)
class KVEpoch:
    """Manager → generator, first thing after a restart: block tables of earlier epochs are void
    (the fresh bookkeeping may hand their blocks to anyone)."""

    epoch: int


@dataclass(frozen=True)
class Commit:
    """The request's blocks at these table indices are full and hold the KV their hashes name:
    bookkeeping (hash → block), zero bytes copied. Requests waiting for them go on."""

    request_id: str
    blocks: tuple[tuple[int, bytes], ...]  # (index in its block table, block hash)
    reply: trio.MemorySendChannel | None = None  # where a failure is reported (PrefixFailed)
    label: str | None = None
    routing: BlockRouting | None = None  # the blocks' token ids, images and group: for KV events


@dataclass(frozen=True)
class Release:
    """The request holds none of its blocks any more (it finished, aborted, failed or was
    preempted). Its committed blocks stay cached, evictable; no entry is touched. `final`: the
    request has ended (False for a preemption: it will run again). `flushed`: where to send
    `FinishFlushed` once the blocks it committed are in the shared tier (or that wait gave up) —
    the generator holds the request's finish event until then, and emits it itself."""

    request_id: str
    final: bool = True
    flushed: trio.MemorySendChannel | None = None


@dataclass(frozen=True)
class FinishFlushed:
    """Manager → generator: the blocks the request committed before its `Release` are in the shared
    tier (written, failed or dropped; or `finish_flush_ms` passed): its finish may be emitted."""

    request_id: str


@dataclass(frozen=True)
class Resume:
    """Generator → manager: preempted sequences about to be prefilled again get back what is still
    cached of their blocks. For each (owner, hashes), the cached blocks of `hashes` after the
    owner's table are appended to it (zero bytes copied); the generator cuts `hashes` where the
    sequence must still compute."""

    wants: tuple[tuple[str, tuple[bytes, ...]], ...]
    reply: trio.MemorySendChannel


@dataclass(frozen=True)
class Resumed:
    tables: tuple[tuple[str, tuple[int, ...]], ...]  # the blocks appended to each owner's table
    epoch: int


@dataclass(frozen=True)
class PrefixState:
    """What the KV cache holds for one request, from intake to generator: the prompt's full-block
    hashes, the blocks of its cached prefix (the start of its block table, `hit_tokens` long), and
    whether the manager holds anything for it that a Release must settle."""

    hashes: tuple[bytes, ...] = ()
    blocks: tuple[int, ...] = ()
    hit_tokens: int = 0
    registered: bool = False
    epoch: int | None = None

    def covers(self, start: int, length: int) -> bool:
        """Whether the hit holds every placeholder of an image at [start, start + length)."""
        return start + length <= self.hit_tokens


# -- the shared tier: PrefixCacheManager ↔ SharedTier ------------------------------------------


@dataclass(frozen=True)
class FetchBlocks:
    """Manager → tier: the KV blocks stored under `hashes` (a chain, in order), as many consecutive
    ones from the first as the tier holds, each [2, layers, block_size, kv_heads, head_dim]."""

    request_id: str
    hashes: tuple[bytes, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    epoch: int
    reply: trio.MemorySendChannel


@dataclass(frozen=True)
class SharedBlocks:
    """Tier → manager: the answer to a FetchBlocks (always sent, empty on a miss, error or late)."""

    request_id: str
    epoch: int
    blocks: tuple[torch.Tensor, ...]
    elapsed_s: float

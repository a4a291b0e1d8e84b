"""Messages between actors (frozen dataclasses) and the per-request handle they carry.

A request travels Intake → Encoder → Generator as a sequence of jobs; what the caller sees comes
back as events on the request's own output channel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from mmserve.errors import MMServeError
from mmserve.inputs.request import ChatRequest
from mmserve.models.llava import PromptInputs



@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token's log-probability in OpenAI's shape; `top` holds the most likely
    alternatives (each with an empty `top`)."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple["TokenLogprob", ...] = ()
    token_id: int = -1  # for vLLM's return_tokens_as_token_ids


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's log-probability given the tokens before it (None for the first token),
    its rank in that distribution, and the most likely alternatives `(token_id, text, logprob)`."""

    token_id: int
    token: str
    logprob: float | None
    rank: int | None = None
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    text: str
    token_id: int
    index: int = 0  # the choice it belongs to (n > 1)
    logprobs: tuple[TokenLogprob, ...] = ()  # when the request asked for them: this event's tokens
    prompt: tuple[PromptLogprob, ...] = ()  # /v1/completions: the prompt's own logprobs, once
    # the choice's progress when it was sent (vLLM's continuous_usage_stats): its prompt's
    # tokens and the tokens it has drawn so far (some of them may still hold back their text)
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: str
    usage: Usage  # this choice's: the prompt (counted once per request), its own answer
    encoder_hits: int = 0  # images served from the encoder cache (for the canonical log line)
    index: int = 0


@dataclass(frozen=True)
class ErrorEvent:
    error: MMServeError


Event = TokenEvent | FinishEvent | ErrorEvent


@dataclass(eq=False)
class RequestHandle:
    """What every actor knows about one request in flight.

    The caller owns the receiving end of `output`; actors send events into it. `aborted` is the
    one piece of state the caller writes (when it goes away); actors check it between steps.
    """

    request_id: str  # internal, minted at admission: the key of every table, pin and log line
    request: ChatRequest
    output: trio.MemorySendChannel
    client_request_id: str | None = None  # the caller's label (X-Request-Id); never a key
    created: float = field(default_factory=time.monotonic)
    aborted: bool = False
    finished: bool = False
    finished_choices: int = 0

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def choices(self) -> int:
        return self.request.sampling.n

    def abort(self) -> None:
        self.aborted = True

    def emit(self, event: Event) -> bool:
        """Sends an event to the caller; False when the caller is gone (then the request is aborted)."""
        if self.finished:
            return False
        try:
            self.output.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.aborted = True
            return False
        if isinstance(event, FinishEvent):
            self.finished_choices += 1
            self.finished = self.finished_choices >= self.choices
        elif not isinstance(event, TokenEvent):
            self.finished = True
        return True

    def fail(self, error: MMServeError) -> None:
        self.emit(ErrorEvent(error))

    @property
    def active(self) -> bool:
        return not (self.aborted or self.finished)


# -- the prefix cache: intake and generator ↔ PrefixCacheManager -----------------------------


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


@dataclass(frozen=True)
class Release:
    """The request holds none of its blocks any more (it finished, aborted, failed or was
    preempted). Its committed blocks stay cached, evictable; no entry is touched. `finish`: the
    request's last event, which the manager delivers once the blocks it committed are in the
    shared tier. `final`: the request has ended (False for a preemption: it will run again)."""

    request_id: str
    finish: tuple[RequestHandle, FinishEvent] | None = None
    final: bool = True


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


# -- the request path: Intake → Encoder → Generator ------------------------------------------


@dataclass(frozen=True)
class Route:
    """Where intake sends a request for one loaded model: its adapter and its actors' inboxes."""

    adapter: Any
    encoder: trio.MemorySendChannel
    prefix_cache: trio.MemorySendChannel | None = None


@dataclass(frozen=True)
class Submit:
    """Caller → Intake: a validated request to prepare."""

    handle: RequestHandle


@dataclass(frozen=True)
class EncodeJob:
    """Intake → Encoder: a tokenized prompt, looked up in the prefix cache; the images the hit does
    not cover need their encoder outputs."""

    handle: RequestHandle
    prompt: PromptInputs
    prefix: PrefixState = field(default_factory=PrefixState)


@dataclass(frozen=True)
class ClearCache:
    """Admin → a cache-owning actor: drop every entry nobody is using right now (pinned entries
    stay until released, so no request in flight loses data); the count dropped goes to `reply`."""

    reply: trio.MemorySendChannel


@dataclass(frozen=True)
class GenerateJob:
    """Encoder → Generator: a prompt ready to prefill: its cached prefix pinned, and one encoder
    output per image (None for an image the cached prefix covers whole)."""

    handle: RequestHandle
    prompt: PromptInputs
    image_embeds: tuple[torch.Tensor | None, ...] = ()
    prefix: PrefixState = field(default_factory=PrefixState)
    encoder_hits: int = 0  # of its images, how many came from the encoder cache


@dataclass(frozen=True)
class Fork:
    """Generator → PrefixCacheManager: the other choices of request `parent` (n > 1) share its
    prompt's KV, prefilled once. Each child gets the parent's first `shared` blocks (one more
    reference each, zero bytes copied); with `copy_last`, also a fresh block of its own for its
    copy of the parent's partial last block — which `copy_pin(child)` holds referenced until the
    generator has copied it and releases the pin."""

    parent: str
    children: tuple[str, ...]
    shared: int
    copy_last: bool
    reply: trio.MemorySendChannel


@dataclass(frozen=True)
class Forked:
    """Manager → generator: each child's blocks, and the block to copy into its last one (None:
    nothing to copy — the prompt ends on a block boundary, or no block was free and the child
    computes its last partial block itself)."""

    tables: tuple[tuple[str, tuple[int, ...], int | None], ...]
    epoch: int


def lookup_pin(request_id: str) -> str:
    """The owner that holds a lookup's (or a resume's) hits until its answer is delivered: only
    then do they start the request's table, so an answer nobody takes drops the pin alone."""
    return request_id + "/lookup"


def copy_pin(child: str) -> str:
    """The owner that keeps a forked child's copy source referenced until the copy is done."""
    return child + "/copy-source"

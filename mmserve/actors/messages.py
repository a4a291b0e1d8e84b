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

from transformers.cache_utils import Cache

from mmserve.errors import MMServeError
from mmserve.inputs.request import ChatRequest
from mmserve.models.llava import PromptInputs

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values), [1, heads, seq, dim]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenEvent:
    text: str
    token_id: int


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: str
    usage: Usage
    encoder_hits: int = 0  # images served from the encoder cache (for the canonical log line)


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

    @property
    def model(self) -> str:
        return self.request.model

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
        if not isinstance(event, TokenEvent):
            self.finished = True
        return True

    def fail(self, error: MMServeError) -> None:
        self.emit(ErrorEvent(error))

    @property
    def active(self) -> bool:
        return not (self.aborted or self.finished)


# -- the prefix cache: intake and generator ↔ PrefixCacheManager -----------------------------


@dataclass(frozen=True)
class PinnedBlocks:
    """A read-only view of a hit's slots in the pool, valid while the requester holds the pins the
    lookup took: a pinned slot is never evicted, so never rewritten (after a crash the manager
    starts a new pool; the old one is no longer written either). The requester copies from it in
    its own worker thread, into its own cache, saving a hop through this actor."""

    keys: torch.Tensor    # the pool, [layers, heads, slots, block, dim]
    values: torch.Tensor
    slots: tuple[int, ...]

    def copy_into(self, cache: Cache) -> int:
        """Writes the blocks, in order, into the first columns of an empty buffered batch-1
        cache; returns the number of tokens."""
        _, heads, _, block, dim = self.keys.shape
        n = len(self.slots) * block
        idx = torch.tensor(self.slots, device=self.keys.device)
        for i, layer in enumerate(cache.layers):
            layer.reserve(n)
            torch.index_select(self.keys[i], 1, idx, out=layer.kbuf[0, :, :n].view(heads, len(self.slots), block, dim))
            torch.index_select(self.values[i], 1, idx, out=layer.vbuf[0, :, :n].view(heads, len(self.slots), block, dim))
            layer.set_length(n)
        return n


@dataclass(frozen=True)
class PrefixFailed:
    """Manager → the request's `reply` channel: handling its lookup or commit raised. The manager
    has released the request's pins and forgotten it; the request fails alone."""

    request_id: str
    stage: str
    error: Exception


@dataclass(frozen=True)
class LookupResult:
    """Manager → the lookup's `reply` channel: the request's cached prefix, pinned for it."""

    request_id: str
    blocks: int
    source: PinnedBlocks | None = None
    waited_s: float = 0.0  # time parked on another request computing the same blocks


@dataclass(frozen=True)
class Lookup:
    """The longest cached prefix of `hashes`. On a miss the request is registered as computing the
    missing blocks; when another request already is, the lookup waits for its commit (in-flight
    dedup)."""

    request_id: str
    hashes: tuple[bytes, ...]
    reply: trio.MemorySendChannel  # never closed by the manager (it may be the requester's inbox)
    label: str | None = None  # the client's request id: for logs and fault hooks, never a key


@dataclass(frozen=True)
class Commit:
    """The sequence's full blocks, to be cached. Sent once the prompt is prefilled (so requests
    waiting on those blocks proceed at once) and again at the end with the generated tokens'."""

    request_id: str
    hashes: tuple[bytes, ...]
    kv: KV
    reply: trio.MemorySendChannel | None = None  # where a failure is reported (PrefixFailed)
    label: str | None = None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class PrefixState:
    """What the prefix cache knows of one request, from intake to generator: the prompt's full-block
    hashes, the cached prefix pinned for it (`hit_tokens`, read through `source`), and whether the
    manager holds anything for it (pins, registrations) that a final Commit or Abort must settle."""

    hashes: tuple[bytes, ...] = ()
    hit_tokens: int = 0
    source: PinnedBlocks | None = None
    registered: bool = False

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

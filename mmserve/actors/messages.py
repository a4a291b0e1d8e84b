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
from mmserve.actors.kv_messages import (  # noqa: F401 (the manager's messages, named here too)
    PrefixFailed, Lookup, LookupResult, Reservation, Draw, StepReport, Refill, StepFence, Quarantine,
    StepReturned, KVEpoch, Commit, Release, FinishFlushed, Resume, Resumed, PrefixState)
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


# -- the request path: Intake → Encoder → Generator ------------------------------------------


@dataclass(frozen=True)
class Route:
    """Where intake sends a request for one loaded model: its adapter and its actors' inboxes."""

    adapter: Any
    encoder: trio.MemorySendChannel
    prefix_cache: trio.MemorySendChannel | None = None
    arena_tokens: int | None = None  # tokens the model's KV arena holds (None: not checked at intake)


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

"""Messages between actors (frozen dataclasses) and the per-request handle they carry.

A request travels Intake → Encoder → Generator as a sequence of jobs; what the caller sees comes
back as events on the request's own output channel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import trio

from mmserve.errors import MMServeError
from mmserve.models.llava import PromptInputs
from mmserve.runtime.request import ChatRequest


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
    encoder_hits: int = 0  # written by the encoder; read for the request's canonical log line

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


@dataclass(frozen=True)
class Submit:
    """Caller → Intake: a validated request to prepare."""

    handle: RequestHandle


@dataclass(frozen=True)
class EncodeJob:
    """Intake → Encoder: a tokenized prompt whose images need their encoder outputs."""

    handle: RequestHandle
    prompt: PromptInputs


@dataclass(frozen=True)
class ClearCache:
    """Admin → a cache-owning actor: drop every entry nobody is using right now (pinned entries
    stay until released, so no request in flight loses data); the count dropped goes to `reply`."""

    reply: trio.MemorySendChannel


@dataclass(frozen=True)
class GenerateJob:
    """Encoder → Generator: a prompt with one encoder output per image, ready to prefill."""

    handle: RequestHandle
    prompt: PromptInputs
    image_embeds: tuple[torch.Tensor, ...] = ()

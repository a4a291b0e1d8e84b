"""A request's answer as its caller sees it: the stream of deltas, and the whole completion."""

from __future__ import annotations

import math
import time
import uuid
import weakref
from dataclasses import dataclass

import trio

from mmserve.actors.messages import ErrorEvent, FinishEvent, RequestHandle, TokenEvent, Usage
from mmserve.errors import DeadlineExceeded, MMServeError
from mmserve.logs import get_logger


@dataclass(frozen=True)
class Delta:
    """One piece of a streamed answer. The last delta has a finish_reason and the usage. The first
    delta comes with the first generated token, so its text may be empty (whitespace held back)."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class ChatCompletion:
    id: str
    model: str
    created: int
    text: str
    finish_reason: str
    usage: Usage


def new_request_id() -> str:
    """A fresh internal request id: 128 random bits, never reused and never taken from a client."""
    return uuid.uuid4().hex


class ChatStream:
    """The deltas of one request. Closing it (or leaving `async with`, or dropping it) aborts the
    request at the generator's next step; it never blocks."""

    def __init__(self, handle: RequestHandle, receive: trio.MemoryReceiveChannel, timeout_s: float = math.inf):
        self.handle = handle
        self.deadline = handle.created + timeout_s
        self._receive = receive
        self._done = False
        self._first_token_at: float | None = None
        self._finalizer = weakref.finalize(self, _abandon, handle, receive)

    @property
    def request_id(self) -> str:
        """The internal id this runtime gave the request (unique; the client's id is only a label)."""
        return self.handle.request_id

    @property
    def client_request_id(self) -> str | None:
        return self.handle.client_request_id

    @property
    def id(self) -> str:
        return "chatcmpl-" + self.handle.request_id

    @property
    def model(self) -> str:
        return self.handle.model

    def __aiter__(self) -> "ChatStream":
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            with trio.fail_at(trio.current_time() + max(0.0, self.deadline - time.monotonic())):
                event = await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self._done = True
            raise StopAsyncIteration from None
        except trio.TooSlowError:
            self._done = True
            self.handle.abort()
            error = DeadlineExceeded("the request did not finish within this server's deadline "
                                     f"({self.deadline - self.handle.created:g} s) and was aborted")
            self._log_end(error.status, error=error.message)
            raise error from None
        if isinstance(event, TokenEvent):
            if self._first_token_at is None:
                self._first_token_at = time.monotonic()
            return Delta(event.text)
        self._done = True
        if isinstance(event, ErrorEvent):
            self._log_end(event.error.status, error=event.error.message)
            raise event.error
        if isinstance(event, FinishEvent):
            self._log_end(200, finish_reason=event.finish_reason, usage=event.usage, encoder_hits=event.encoder_hits)
            return Delta("", event.finish_reason, event.usage)
        raise TypeError(f"unexpected event {event!r}")

    def _log_end(self, status: int, finish_reason: str | None = None, usage: Usage | None = None, **extra) -> None:
        """The one canonical line per finished request."""
        h, now = self.handle, time.monotonic()
        _log.info("request.finished", request_id=h.request_id, client_request_id=h.client_request_id,
                  model=h.model, status=status,
                  finish_reason=finish_reason, prompt_tokens=usage.prompt_tokens if usage else None,
                  cached_tokens=usage.cached_tokens if usage else None,
                  completion_tokens=usage.completion_tokens if usage else None,
                  images=h.request.num_images,
                  ttft_s=round(self._first_token_at - h.created, 6) if self._first_token_at else None,
                  total_s=round(now - h.created, 6), **extra)

    def close(self) -> None:
        if not self._done and self._finalizer.alive:
            self._done = True
            self._log_end(499, finish_reason="client_gone")
        self._finalizer()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> "ChatStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


_log = get_logger("runtime")


def _abandon(handle: RequestHandle, receive: trio.MemoryReceiveChannel) -> None:
    handle.abort()
    receive.close()


async def complete(stream: ChatStream) -> ChatCompletion:
    """Reads a started request to its end: the one completion path of HTTP and embedded callers."""
    async with stream:
        parts, final = [], None
        async for delta in stream:
            parts.append(delta.text)
            final = delta
    if final is None or final.finish_reason is None:
        raise MMServeError("the request ended without a result")
    return ChatCompletion(stream.id, stream.model, int(time.time()), "".join(parts), final.finish_reason, final.usage)

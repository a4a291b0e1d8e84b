"""A request's answer as its caller sees it: the stream of deltas, and the whole completion."""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
import weakref
from dataclasses import dataclass

import trio

from mmserve.actors.messages import (ErrorEvent, FinishEvent, PromptLogprob, RequestHandle, TokenEvent, TokenLogprob,
                                     Usage)
from mmserve.errors import DeadlineExceeded, MMServeError
from mmserve.generation.tool_calls import ToolCall, ToolCallDelta, tool_call_parser
from mmserve.logs import get_logger


@dataclass(frozen=True)
class Delta:
    """One piece of a streamed answer, of choice `index`. A choice's last delta has its
    finish_reason and the usage so far (the request's whole usage on the stream's last delta). The
    first delta comes with the first generated token, so its text may be empty (whitespace held
    back); with logprobs asked for, every token comes in a delta of its own. With tools, the text
    is read for calls (`tool_calls`: their pieces, as OpenAI streams them; the markup never shows
    in `text`), and a choice that called ends with finish_reason "tool_calls"."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()
    prompt_logprobs: tuple[PromptLogprob, ...] = ()  # /v1/completions: the prompt's own, once


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] | None = None  # None unless asked for
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # /v1/completions, when asked for


@dataclass(frozen=True)
class ChatCompletion:
    id: str
    model: str
    created: int
    choices: tuple[Choice, ...]
    usage: Usage
    system_fingerprint: str | None = None  # deterministic mode's (models.batch_invariant.fingerprint)

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


def new_request_id() -> str:
    """A fresh internal request id: 128 random bits, never reused and never taken from a client."""
    return uuid.uuid4().hex


class ChatStream:
    """The deltas of one request. Closing it (or leaving `async with`, or dropping it) aborts the
    request at the generator's next step; it never blocks."""

    def __init__(self, handle: RequestHandle, receive: trio.MemoryReceiveChannel, timeout_s: float = math.inf,
                 system_fingerprint: str | None = None):
        self.handle = handle
        self.system_fingerprint = system_fingerprint  # what the answer's bits are invariant over (None: default mode)
        self.deadline = handle.created + timeout_s
        self._receive = receive
        self._done = False
        self._first_token_at: float | None = None
        self._finished: list[FinishEvent] = []
        self._drawn: dict[int, int] = {}  # choice -> tokens drawn so far (continuous usage)
        self._prompt_tokens = 0
        tools = handle.request.tools
        self._parsers = ([tool_call_parser(tools.parser) for _ in range(handle.choices)]
                         if tools is not None and tools.parsed else None)
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
        kind = "chatcmpl-" if self.handle.request.prompt is None else "cmpl-"  # a /v1/completions prompt
        return kind + self.handle.request_id

    @property
    def model(self) -> str:
        return self.handle.model

    def __aiter__(self) -> "ChatStream":
        return self

    async def _next_event(self):
        """The next event, within the deadline. One already waiting is taken without a cancel
        scope (a token of each stream every step: the scope's cost showed on the event loop),
        with the checkpoints trio's own `receive` makes."""
        remaining = self.deadline - time.monotonic()
        if remaining > 0:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                event = self._receive.receive_nowait()
            except trio.WouldBlock:
                pass
            else:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return event
        with trio.fail_at(trio.current_time() + max(0.0, remaining)):
            return await self._receive.receive()

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self._next_event()
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
            if event.prompt_tokens:
                self._prompt_tokens = event.prompt_tokens
                self._drawn[event.index] = event.completion_tokens
            if self._first_token_at is None:
                self._first_token_at = time.monotonic()
            if self._parsers is not None:
                text, calls = self._parsers[event.index].feed(event.text)
                return Delta(text, index=event.index, logprobs=event.logprobs, tool_calls=tuple(calls))
            return Delta(event.text, index=event.index, logprobs=event.logprobs, prompt_logprobs=event.prompt)
        if isinstance(event, FinishEvent):
            text, calls = "", []
            if self._parsers is not None:
                parser = self._parsers[event.index]
                text, calls = parser.finish()
                if parser.calls and event.finish_reason == "stop":  # it called: OpenAI's reason
                    event = dataclasses.replace(event, finish_reason="tool_calls")
            self._finished.append(event)
            self._drawn[event.index] = event.usage.completion_tokens
            self._prompt_tokens = event.usage.prompt_tokens
            usage = self.usage
            if len(self._finished) >= self.handle.choices:
                self._done = True
                reasons = sorted({f.finish_reason for f in self._finished})
                self._log_end(200, finish_reason=reasons[0] if len(reasons) == 1 else ",".join(reasons),
                              usage=usage, encoder_hits=event.encoder_hits)
            return Delta(text, event.finish_reason, usage, index=event.index, tool_calls=tuple(calls))
        self._done = True
        if isinstance(event, ErrorEvent):
            self._log_end(event.error.status, error=event.error.message)
            raise event.error
        raise TypeError(f"unexpected event {event!r}")

    @property
    def done(self) -> bool:
        """True once every choice has finished (or the request failed, or was closed)."""
        return self._done

    @property
    def usage(self) -> Usage | None:
        """The usage of the choices finished so far, counted as OpenAI does: the prompt once, every
        choice's answer."""
        if not self._finished:
            return None
        first = self._finished[0].usage
        return Usage(first.prompt_tokens, sum(f.usage.completion_tokens for f in self._finished),
                     first.cached_tokens)

    @property
    def usage_so_far(self) -> Usage:
        """The usage as it stands now (vLLM's continuous_usage_stats): the prompt once, the tokens
        every choice has drawn so far (0 prompt tokens before the first token is drawn)."""
        return Usage(self._prompt_tokens, sum(self._drawn.values()))

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
    """Reads a started request to its end: the one completion path of HTTP and embedded callers.
    With vLLM's `echo`, each choice's text starts with the echoed text (the stream's deltas do not
    carry it: the HTTP stream sends it as a chunk of its own)."""
    n, want_logprobs = stream.handle.choices, stream.handle.request.sampling.logprobs
    parts: list[list[str]] = [[stream.handle.request.echo] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    calls: list[dict[int, list]] = [{} for _ in range(n)]  # call index -> [id, name, argument pieces]
    prompt: list[tuple | None] = [None] * n
    usage = None
    async with stream:
        async for delta in stream:
            parts[delta.index].append(delta.text)
            logprobs[delta.index].extend(delta.logprobs)
            if delta.prompt_logprobs:
                prompt[delta.index] = delta.prompt_logprobs
            for piece in delta.tool_calls:
                call = calls[delta.index].setdefault(piece.index, [piece.id, piece.name, []])
                call[2].append(piece.arguments)
            if delta.finish_reason is not None:
                reasons[delta.index], usage = delta.finish_reason, delta.usage
    if usage is None or None in reasons:
        raise MMServeError("the request ended without a result")
    choices = tuple(Choice(i, "".join(parts[i]), reasons[i], tuple(logprobs[i]) if want_logprobs else None,
                           tuple(ToolCall(c[0], c[1], "".join(c[2])) for _, c in sorted(calls[i].items())),
                           prompt[i])
                    for i in range(n))
    return ChatCompletion(stream.id, stream.model, int(time.time()), choices, usage, stream.system_fingerprint)

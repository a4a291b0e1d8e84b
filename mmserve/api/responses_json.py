"""The JSON shapes of OpenAI's Responses API, in one place: the `Response` object, its output items
(a `message` with `output_text`, `function_call`s), its `usage`, and the typed events of its
stream (`response.created` ... `response.completed`), each framed as a server-sent event with its
`event:` line. Every shape validates as the `openai` package's own type (tests/test_responses_api.py).

The stream is built from the chat path's deltas: text opens a `message` item (and its
`output_text` part) on its first piece; a tool call's first piece closes whatever item is open
and opens a `function_call` item, its argument fragments become `function_call_arguments.delta`
events; the end closes the open item and sends the whole response again, as OpenAI does.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from mmserve.errors import MMServeError
from mmserve.inputs.request import ChatRequest
from mmserve.runtime.stream import ChatCompletion, ChatStream, Delta, TokenLogprob, Usage


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Echo:
    """What a Response repeats of its request (its parameters as the caller set them)."""

    id: str
    model: str
    created_at: int
    body: dict
    request: ChatRequest

    def response(self, output: list[dict], status: str, usage: Usage | None = None,
                 finish_reason: str | None = None) -> dict:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output, "error": None, "incomplete_details": incomplete,
            "instructions": b.get("instructions"), "metadata": b.get("metadata") or {},
            "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
            "temperature": self.request.sampling.temperature, "top_p": b.get("top_p", 1.0),
            "tool_choice": b.get("tool_choice") or "auto", "tools": [_tool(t) for t in b.get("tools") or []],
            "max_output_tokens": b.get("max_output_tokens"), "previous_response_id": None,
            "text": {"format": fmt}, "truncation": "disabled", "background": False,
            "top_logprobs": b.get("top_logprobs"), "user": b.get("user"),
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "usage": usage_json(usage) if usage is not None else None,
        }


def _tool(t: dict) -> dict:
    return {"type": "function", "name": t["name"], "description": t.get("description"),
            "parameters": t.get("parameters") or {"type": "object", "properties": {}}, "strict": t.get("strict")}


def status_of(finish_reason: str) -> str:
    """A finished response's status: "incomplete" when it ran out of tokens."""
    return "incomplete" if finish_reason == "length" else "completed"


def usage_json(u: Usage) -> dict:
    # cache_write_tokens is OpenAI's count of tokens written for extended (paid) caching: none here;
    # mmserve's prefix cache keeps every prompt's blocks as a matter of course
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _logprobs(tokens, with_bytes: bool) -> list[dict]:
    def one(t: TokenLogprob) -> dict:
        d = {"token": t.token, "logprob": t.logprob}
        if with_bytes:
            d["bytes"] = list(t.bytes)
        return d

    return [dict(one(t), top_logprobs=[one(a) for a in t.top]) for t in tokens or ()]


def text_part(text: str, logprobs=None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": _logprobs(logprobs, True)}


def message_item(item_id: str, text: str, status: str, logprobs=None) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)] if status != "in_progress" else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response(echo: Echo, c: ChatCompletion) -> dict:
    """The whole (non-streamed) response of a finished completion: its text as one message (when
    there is text, or no call), then its calls."""
    ch = c.choices[0]
    status = status_of(ch.finish_reason)
    item_status = "incomplete" if status == "incomplete" else "completed"
    output = []
    if ch.text or not ch.tool_calls:
        output.append(message_item(new_item_id("msg"), ch.text, item_status, ch.logprobs))
    output += [call_item(new_item_id("fc"), t.id, t.name, t.arguments, item_status) for t in ch.tool_calls]
    return echo.response(output, status, c.usage, ch.finish_reason)


def sse(body: dict) -> str:
    return f"event: {body['type']}\ndata: {json.dumps(body)}\n\n"


@dataclass
class _Open:
    """The output item being streamed: a message (its text so far) or a call (its arguments)."""

    kind: str
    id: str
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class ResponseEvents:
    """The typed events of one streamed response, numbered in order (`sequence_number`)."""

    def __init__(self, echo: Echo):
        self.echo = echo
        self.seq = 0
        self.output: list[dict] = []  # the items finished so far
        self.open: _Open | None = None

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body)

    def start(self) -> list[str]:
        head = self.echo.response([], "in_progress")
        return [self.event("response.created", response=head), self.event("response.in_progress", response=head)]

    def _where(self) -> dict:
        return {"item_id": self.open.id, "output_index": len(self.output)}

    def text(self, piece: str, tokens) -> list[str]:
        out = []
        if self.open is None or self.open.kind != "message":
            out += self.close()
            self.open = _Open("message", new_item_id("msg"))
            out.append(self.event("response.output_item.added", output_index=len(self.output),
                                  item=message_item(self.open.id, "", "in_progress")))
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part=text_part("")))
        self.open.text.append(piece)
        self.open.logprobs.extend(tokens)
        out.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=piece,
                              logprobs=_logprobs(tokens, False)))
        return out

    def call(self, piece) -> list[str]:
        out = []
        if piece.id is not None:  # a new call
            out += self.close()
            self.open = _Open("function_call", new_item_id("fc"), call_id=piece.id, name=piece.name)
            out.append(self.event("response.output_item.added", output_index=len(self.output),
                                  item=call_item(self.open.id, piece.id, piece.name, "", "in_progress")))
        if piece.arguments:
            self.open.text.append(piece.arguments)
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=piece.arguments))
        return out

    def close(self, status: str = "completed") -> list[str]:
        """The events that finish the open item (none when no item is open)."""
        o, out = self.open, []
        if o is None:
            return out
        text = "".join(o.text)
        if o.kind == "message":
            out.append(self.event("response.output_text.done", **self._where(), content_index=0, text=text,
                                  logprobs=_logprobs(o.logprobs, False)))
            out.append(self.event("response.content_part.done", **self._where(), content_index=0,
                                  part=text_part(text, o.logprobs)))
            item = message_item(o.id, text, status, o.logprobs)
        else:
            out.append(self.event("response.function_call_arguments.done", **self._where(), arguments=text))
            item = call_item(o.id, o.call_id, o.name, text, status)
        out.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.open = None
        return out

    def finish(self, finish_reason: str, usage: Usage) -> list[str]:
        status = status_of(finish_reason)
        out = []
        if self.open is None and not self.output:  # an empty answer is still one (empty) message
            out += self.text("", ())
        out += self.close("incomplete" if status == "incomplete" else "completed")
        out.append(self.event(f"response.{status}",
                              response=self.echo.response(self.output, status, usage, finish_reason)))
        return out

    def error(self, err: MMServeError) -> str:
        body = err.to_body()["error"]
        return self.event("error", code=body.get("code") or body.get("type"), message=body["message"],
                          param=body.get("param"))


async def stream_events(stream: ChatStream, first: Delta, echo: Echo) -> AsyncIterator[str]:
    """The server-sent events of a streamed response (no `[DONE]`: OpenAI ends this stream with
    `response.completed`, or `response.incomplete`, or an `error` event)."""
    events = ResponseEvents(echo)
    try:
        for e in events.start():
            yield e
        delta = first
        while True:
            if delta.text or delta.logprobs:
                for e in events.text(delta.text, delta.logprobs):
                    yield e
            for piece in delta.tool_calls:
                for e in events.call(piece):
                    yield e
            if delta.finish_reason is not None:
                for e in events.finish(delta.finish_reason, stream.usage):
                    yield e
                break
            try:
                delta = await stream.__anext__()
            except StopAsyncIteration:
                break
            except MMServeError as err:
                yield events.error(err)
                break
    finally:
        stream.close()

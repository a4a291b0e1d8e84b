"""The OpenAI JSON shapes of chat completions, in one place: the whole completion, the stream's
chunks and its server-sent-event framing. Error bodies come from `MMServeError.to_body`."""

from __future__ import annotations

import json

from mmserve.runtime.stream import ChatCompletion, Usage

DONE = "data: [DONE]\n\n"


def usage(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def completion(c: ChatCompletion) -> dict:
    return {
        "id": c.id,
        "object": "chat.completion",
        "created": c.created,
        "model": c.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                     "finish_reason": c.finish_reason, "logprobs": None}],
        "usage": usage(c.usage),
    }


def chunk(id: str, model: str, created: int, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}


def usage_chunk(id: str, model: str, created: int, u: Usage) -> dict:
    """The last chunk when the caller asked for `stream_options.include_usage`."""
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
            "usage": usage(u)}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"

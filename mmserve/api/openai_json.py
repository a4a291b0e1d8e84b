"""The OpenAI JSON shapes of chat completions, in one place: the whole completion, the stream's
chunks and its server-sent-event framing. Error bodies come from `MMServeError.to_body`."""

from __future__ import annotations

import json

from mmserve.generation.tool_calls import ToolCallDelta
from mmserve.actors.messages import PromptLogprob
from mmserve.inputs.request import ChatRequest
from mmserve.runtime.stream import ChatCompletion, Choice, TokenLogprob, Usage

DONE = "data: [DONE]\n\n"


def usage(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def completion(c: ChatCompletion, ids: bool = False) -> dict:
    return {
        "id": c.id,
        "object": "chat.completion",
        "created": c.created,
        "model": c.model,
        "choices": [{"index": ch.index, "message": message(ch),
                     "finish_reason": ch.finish_reason, "logprobs": logprobs(ch.logprobs, ids)}
                    for ch in c.choices],
        "usage": usage(c.usage),
    } | ({"system_fingerprint": c.system_fingerprint} if c.system_fingerprint else {})


def message(ch: Choice) -> dict:
    """A choice's message: with tool calls, `tool_calls` (and `content` null when it is only calls)."""
    if not ch.tool_calls:
        return {"role": "assistant", "content": ch.text, "refusal": None}
    return {"role": "assistant", "content": ch.text or None, "refusal": None,
            "tool_calls": [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                           for t in ch.tool_calls]}


def tool_call_delta(d: ToolCallDelta) -> dict:
    """A stream's piece of a call: the first has its id, type and name (arguments ""), the rest
    a fragment of the arguments each, as OpenAI streams them."""
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}


def logprobs(tokens: tuple[TokenLogprob, ...] | None, ids: bool = False) -> dict | None:
    """OpenAI's `logprobs` object of a choice (or of a chunk's tokens); None when not asked for.
    With `ids` (vLLM's return_tokens_as_token_ids) each token reads "token_id:N"."""
    if tokens is None:
        return None
    if ids:
        tokens = tuple(_as_id(t) for t in tokens)
    return {"content": [_token(t, top=True) for t in tokens], "refusal": None}


def id_text(token_id: int) -> str:
    """vLLM's name of a token under `return_tokens_as_token_ids`."""
    return f"token_id:{token_id}"


def _as_id(t: TokenLogprob) -> TokenLogprob:
    text = id_text(t.token_id)
    return TokenLogprob(text, t.logprob, tuple(text.encode()), tuple(_as_id(a) for a in t.top), t.token_id)


def _token(t: TokenLogprob, top: bool = False) -> dict:
    body = {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}
    if top:
        body["top_logprobs"] = [_token(a) for a in t.top]
    return body


def chunk(id: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
          index: int = 0, tokens: tuple[TokenLogprob, ...] | None = None, ids: bool = False) -> dict:
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": logprobs(tokens, ids)}]}


def running_usage(u: Usage) -> dict:
    """vLLM's usage on a chunk under `continuous_usage_stats`: the counts so far."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}


def usage_chunk(id: str, model: str, created: int, u: Usage) -> dict:
    """The last chunk when the caller asked for `stream_options.include_usage`."""
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
            "usage": usage(u)}


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


# -- legacy completions (/v1/completions) ---------------------------------------------------


def legacy_logprobs(tokens: tuple[TokenLogprob, ...], offset: int = 0, prompt: tuple[PromptLogprob, ...] = (),
                    top_n: int = 0, ids: bool = False) -> dict:
    """The legacy `logprobs` object: `tokens`, `token_logprobs`, `top_logprobs` (token → logprob,
    the chosen token among them; null for a token without a logprob, the first prompt token's)
    and `text_offset` (each token's character offset in the choice's text, from `offset`). With
    echo the prompt's entries come first (`prompt`, `top_n` alternatives each). With `ids`
    (vLLM's return_tokens_as_token_ids) tokens read "token_id:N"; offsets stay the text's."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    entries = [(p.token, p.token_id, p.logprob, [(text, t, lp) for t, text, lp in p.top[:top_n]]) for p in prompt]
    entries += [(t.token, t.token_id, t.logprob, [(a.token, a.token_id, a.logprob) for a in t.top]) for t in tokens]
    for text_of_token, token_id, logprob, named in entries:
        token = id_text(token_id) if ids else text_of_token
        alternatives = [(id_text(t) if ids else text, lp) for text, t, lp in named]
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        top = None
        if logprob is not None:
            top = {}
            for text, lp in alternatives:  # two tokens may read alike: the likelier one's logprob
                top[text] = max(lp, top.get(text, lp))
            top[token] = logprob  # the chosen token's own, whatever else reads like it
            # most likely first, as OpenAI orders them: a client taking the first key gets the best token
            top = dict(sorted(top.items(), key=lambda kv: -kv[1]))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text_of_token)
    return out


def vllm_prompt_logprobs(prompt: tuple[PromptLogprob, ...], top_n: int, ids: bool = False) -> list:
    """vLLM's `prompt_logprobs` of a choice: null for the first token, then {token id: {logprob,
    rank, decoded_token}} of the token and its `top_n` most likely alternatives."""
    out: list = []
    for p in prompt:
        if p.logprob is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": lp, "rank": r, "decoded_token": id_text(t) if ids else text}
                 for r, (t, text, lp) in enumerate(p.top[:top_n], 1)}
        entry.setdefault(str(p.token_id), {"logprob": p.logprob, "rank": p.rank,
                                           "decoded_token": id_text(p.token_id) if ids else p.token})
        out.append(entry)
    return out


def choice_logprobs(request: ChatRequest, logprobs: tuple[TokenLogprob, ...] | None,
                    prompt: tuple[PromptLogprob, ...] | None, offset: int = 0) -> dict | None:
    """A completion choice's (or chunk's) legacy `logprobs`: None unless asked for."""
    if not request.sampling.logprobs:
        return None
    echoed = (prompt or ()) if request.prompt.echo else ()
    return legacy_logprobs(logprobs or (), offset, echoed, request.sampling.top_logprobs, request.options.tokens_as_ids)


def text_completion(id: str, model: str, created: int, request: ChatRequest, choices: list[tuple[int, Choice]],
                    u: Usage) -> dict:
    """A whole legacy completion: `choices` are (index, choice), indexed prompt-major."""
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [text_choice(request, i, ch.text, ch.finish_reason,
                                    choice_logprobs(request, ch.logprobs, ch.prompt_logprobs), ch.prompt_logprobs)
                        for i, ch in choices],
            "usage": usage(u)}


def text_choice(request: ChatRequest, index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                prompt: tuple[PromptLogprob, ...] | None = None) -> dict:
    body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if request.prompt.prompt_logprobs is not None and prompt:
        body["prompt_logprobs"] = vllm_prompt_logprobs(prompt, request.prompt.prompt_logprobs,
                                                       request.options.tokens_as_ids)
    return body


def text_chunk(id: str, model: str, created: int, choice: dict) -> dict:
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def text_usage_chunk(id: str, model: str, created: int, u: Usage) -> dict:
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": usage(u)}

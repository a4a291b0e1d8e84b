"""Parsing OpenAI's legacy completions (`POST /v1/completions`, as vLLM serves it) into the
runtime's one request type: a `ChatRequest` with no messages and a `RawPrompt`, which intake
tokenizes as it is — no chat template — and which then takes the chat path unchanged.

A batch of prompts (a list of strings, or of token-id lists) becomes one request per prompt;
the HTTP layer joins their choices, prompt-major, as OpenAI does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mmserve.config import LimitsConfig
from mmserve.errors import BadRequest, UnsupportedParameter, clip
from mmserve.inputs.extensions import (REQUEST_FIELDS, SAMPLING_FIELDS, STRUCTURED_FIELDS, TemplateOptions, flag,
                                       request_options)
from mmserve.inputs.request import (MAX_CHOICES, MAX_TOP_LOGPROBS, ChatRequest, RawPrompt, check_json_shape,
                                    parse_common, parse_sampling)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_PROMPTS = 64  # prompts in one batch
MAX_BATCH_CHOICES = 128  # prompts × n
_OWN = {"prompt", "echo", "logprobs", "max_tokens", "prompt_logprobs", "add_special_tokens", "suffix"}
_KNOWN = {
    "model", "stream", "stream_options", "n", "temperature", "top_p", "top_k", "seed", "stop", "user",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "cache_salt", "min_tokens",
    "response_format",
} | _OWN | SAMPLING_FIELDS | STRUCTURED_FIELDS | REQUEST_FIELDS
# the answer is the model's raw continuation: nothing is stripped (no generation prompt, no lead)
RAW = TemplateOptions(add_generation_prompt=False)


def _int(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be an integer between {lo} and {hi}, got {clip(v)}", param=key)
    return v


def _ids(v: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_prompts(raw: Any) -> list[tuple[str | None, tuple[int, ...] | None]]:
    """`(text, token_ids)` per prompt: a string, a list of strings, a list of token ids, or a list
    of token-id lists."""
    shape = ("'prompt' must be a string, a list of strings, a list of token ids (integers) or a list "
             "of token-id lists")
    if isinstance(raw, str):
        return [(raw, None)]
    if not isinstance(raw, list) or not raw:
        raise BadRequest(shape, param="prompt")
    if _ids(raw):
        prompts = [raw]
    elif all(isinstance(p, str) for p in raw):
        return [(p, None) for p in _bounded(raw)]
    elif all(isinstance(p, list) and p and _ids(p) for p in raw):
        prompts = _bounded(raw)
    else:
        raise BadRequest(shape, param="prompt")
    for p in prompts:
        if not all(0 <= t < 2**31 for t in p):
            raise BadRequest("'prompt': token ids must be integers >= 0", param="prompt")
    return [(None, tuple(p)) for p in prompts]


def _bounded(prompts: list) -> list:
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"'prompt' holds {len(prompts)} prompts; this server takes at most {MAX_PROMPTS} "
                         "in one request", param="prompt")
    return prompts


def parse_completion_requests(body: Any, limits: LimitsConfig, default_model: str) -> tuple[ChatRequest, ...]:
    """Validates a legacy completions body: one request per prompt (a 400 naming `param` for
    anything wrong, before any model work)."""
    check_json_shape(body, limits.max_json_depth)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        shown = ", ".join(clip(k, 64) for k in unknown[:5])
        raise BadRequest(f"unrecognized request argument(s) for /v1/completions: {shown}",
                         param=unknown[0] if len(unknown[0]) <= 64 else None)
    if body.get("suffix"):
        raise UnsupportedParameter("'suffix' is not supported by mmserve (no model here is trained to "
                                   "insert text)", param="suffix")
    if body.get("logit_bias"):
        raise UnsupportedParameter("'logit_bias' is not supported by mmserve", param="logit_bias")
    model, stream, include_usage, salt = parse_common(body, default_model)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", param="prompt")
    prompts = parse_prompts(body["prompt"])
    echo = flag(body, "echo", False)
    logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    max_tokens = _int(body, "max_tokens", 0, limits.max_tokens)
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    if max_tokens == 0 and not echo:
        raise BadRequest("'max_tokens' must be at least 1 (0 only with 'echo': the prompt is scored, nothing "
                         "generated)", param="max_tokens")
    if max_tokens == 0 and n > 1:
        raise BadRequest("'max_tokens': 0 takes one choice ('n': 1): nothing is sampled", param="n")
    if len(prompts) * n > MAX_BATCH_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts × n={n} choices is above this server's limit of "
                         f"{MAX_BATCH_CHOICES} in one request", param="prompt")
    # the prompt's own logprobs: asked for directly (vLLM), or by echo with logprobs (OpenAI)
    scored = prompt_logprobs
    if echo and logprobs is not None:
        scored = max(scored or 0, logprobs)
    rest = {k: v for k, v in body.items() if k not in _OWN}
    parsed = parse_sampling(rest, limits)
    if parsed.min_tokens > max_tokens:
        if body.get("max_tokens") is not None:  # vLLM refuses it too (never capped silently)
            raise BadRequest(f"'min_tokens' ({parsed.min_tokens}) must not be above 'max_tokens' ({max_tokens})",
                             param="min_tokens")
        max_tokens = parsed.min_tokens  # the default stretches to an explicit min_tokens
    sampling = dataclasses.replace(parsed, max_tokens=max_tokens, logprobs=logprobs is not None,
                                   top_logprobs=logprobs or 0)
    add_special = flag(body, "add_special_tokens", True)
    options = request_options(body)
    return tuple(
        ChatRequest(model=model, messages=(), sampling=sampling, stream=stream, include_usage=include_usage,
                    cache_salt=salt, template=RAW, options=options,
                    prompt=RawPrompt(text, ids, add_special, echo, scored, prompt_logprobs))
        for text, ids in prompts)

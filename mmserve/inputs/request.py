"""Parsing and validating OpenAI-shaped chat requests, shared by HTTP and embedded callers.

Everything a caller can get wrong is caught here, with the offending parameter named, before any
model work starts. Unsupported OpenAI features are refused with a 400, never silently ignored.
Whatever an error message echoes of the caller's input goes through `mmserve.errors.clip`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from mmserve.errors import CLIP_CHARS, BadRequest, UnsupportedParameter, clip
from mmserve.config import LimitsConfig
from mmserve.inputs.remote_images import check_url, is_remote_url
from mmserve.generation.sampling import SamplingParams
from mmserve.inputs.extensions import (VLLM_FIELDS, RequestOptions, TemplateOptions, echo_text, request_options,
                                       sampling_extensions, structured_grammar, template_options, wants_echo)
from mmserve.generation.tool_calls import ToolCall
from mmserve.inputs.tools import Tools, parse_tool_call_id, parse_tool_calls, parse_tools
from mmserve.inputs.video_parts import VIDEO_FIELDS, VideoPart, VideoSampling, parse_video_part, video_sampling


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image as given: a `data:` URL or a checked remote `http(s)` URL (`url`), or, from embedded
    callers, a PIL image (`image`)."""

    url: str | None = None
    image: Any = None


@dataclass(frozen=True)
class Message:
    role: str
    parts: tuple[TextPart | ImagePart | VideoPart, ...]
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message's: the call it answers

    @property
    def images(self) -> tuple[ImagePart, ...]:
        return tuple(p for p in self.parts if isinstance(p, ImagePart))


@dataclass(frozen=True)
class RawPrompt:
    """A legacy-completions prompt: text (tokenized as is, the tokenizer's special tokens added
    when `add_special_tokens`) or token ids (taken as they are)."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    add_special_tokens: bool = True
    echo: bool = False  # each choice's text starts with the prompt's
    logprobs: int | None = None  # the prompt tokens' logprobs, with this many alternatives each
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs`: answered in the choice's own field


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[Message, ...]
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    template: TemplateOptions = TemplateOptions()  # vLLM's chat-template parameters
    echo: str = ""  # vLLM's `echo`: the answer's text starts with this (the last message's content)
    tools: Tools | None = None  # tools, tool_choice, parallel_tool_calls (mmserve.inputs.tools)
    # /v1/completions: a raw prompt, tokenized without the chat template (`messages` is empty)
    prompt: RawPrompt | None = None
    options: RequestOptions = RequestOptions()  # vLLM's request_id, truncate_prompt_tokens, ...
    video: VideoSampling = VideoSampling()  # vLLM's mm_processor_kwargs: fps, num_frames, pixel budgets

    @property
    def num_images(self) -> int:
        return sum(len(m.images) for m in self.messages)


_ROLES = {"system", "developer", "user", "assistant", "tool"}
_IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
_KNOWN = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "tools",
    "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "cache_salt", "min_tokens",
    "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
} | _IGNORED | VLLM_FIELDS | VIDEO_FIELDS


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
_MAX_UNKNOWN_SHOWN = 5

# A path into the body, built only when an error needs it: None (the body itself) or a pair
# (parent path, key or index). Building strings for every node would copy a long key once per child.
_Path = tuple | None


def _path_text(path: _Path) -> str:
    """`messages[0].content[1].text` for a path; odd keys are quoted and escaped, the whole clipped."""
    segments: list[str] = []
    while path is not None:
        path, key = path
        if isinstance(key, int):
            segments.append(f"[{key}]")
        elif _PLAIN_KEY.match(key):
            segments.append(f".{key}" if path is not None else key)
        else:
            segments.append(f"[{clip(key, 64)}]")
    text = "".join(reversed(segments)) or "(the request body)"
    return text if len(text) <= CLIP_CHARS else text[: CLIP_CHARS - 1] + "…"


def _encodable(text: str) -> bool:
    """False for a str holding a lone surrogate: valid JSON (`"\\ud800"`) decodes to one, and it
    fails later wherever the text is encoded (tokenizer, cache keys, logs) as a 500."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse_text(path: _Path, what: str) -> BadRequest:
    where = _path_text(path)
    return BadRequest(f"{where}: {what} contains a lone surrogate (an unpaired \\ud800-\\udfff escape), "
                      "which is not valid Unicode text", param=None if path is None else where)


def _check_key(key: Any, path: _Path) -> None:
    if not isinstance(key, str):  # only embedded callers can send these; JSON keys are strings
        where = _path_text(path)
        raise BadRequest(f"{where}: object keys must be strings, got a {type(key).__name__}", param=where)
    if not _encodable(key):
        raise _refuse_text((path, key), "the key")


def check_json_shape(body: Any, max_depth: int) -> None:
    """Refuses nesting deeper than `max_depth` and any string value or key with a lone surrogate.

    Runs once over the whole body, iteratively (a recursive walk is what an attacker's 100,000
    nested arrays would overflow), before any other validation, so no later step can trip over
    either. Depth counts containers: the body object is 1, `{"messages": [...]}`'s list is 2.
    Values that are not JSON — embedded callers' PIL images — are skipped.
    """
    if isinstance(body, str) and not _encodable(body):
        raise _refuse_text(None, "the body")
    if not isinstance(body, (dict, list, tuple)):
        return
    stack: list[tuple[Any, int, _Path]] = [(body, 1, None)]
    while stack:
        value, depth, path = stack.pop()
        if depth > max_depth:
            where = _path_text(path)
            raise BadRequest(f"{where}: arrays and objects nest deeper than this server's limit of "
                             f"{max_depth} levels", param=None if path is None else where)
        is_dict = isinstance(value, dict)
        for key, child in (value.items() if is_dict else enumerate(value)):
            if is_dict:
                _check_key(key, path)
            if isinstance(child, str):
                if not _encodable(child):
                    raise _refuse_text((path, key), "the string")
            elif isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1, (path, key)))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """A real number. Ints are compared with their bounds exactly, never converted first: math.isfinite
    (and float()) raise OverflowError for an int past 1e308, such as a JSON `10**400`."""
    if _is_int(v):
        return True
    return isinstance(v, float) and math.isfinite(v)


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_num(v) or not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be a number between {lo} and {hi}, got {clip(v)}", param=key)
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v) or not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be an integer between {lo} and {hi}, got {clip(v)}", param=key)
    return v


MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20


def _refuse_unsupported(body: dict) -> None:
    for key in ("functions", "logit_bias", "audio", "prediction", "web_search_options"):
        if body.get(key):
            raise UnsupportedParameter(f"'{key}' is not supported by mmserve", param=key)
    for key in ("function_call", "reasoning_effort"):
        if body.get(key) not in (None, "none", "auto"):
            raise UnsupportedParameter(f"'{key}' is not supported by mmserve", param=key)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise UnsupportedParameter("only text output is supported ('modalities': ['text'])", param="modalities")


def _logprobs(body: dict) -> tuple[bool, int]:
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise BadRequest(f"'logprobs' must be a boolean, got {clip(want)}", param="logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return bool(want), top or 0


def _stop(body: dict, limits: LimitsConfig) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > limits.max_stop_sequences:
        raise BadRequest(f"'stop' allows at most {limits.max_stop_sequences} sequences", param="stop")
    return tuple(stop)


def parse_sampling(body: dict, limits: LimitsConfig) -> SamplingParams:
    max_tokens = _integer(body, "max_completion_tokens", 1, limits.max_tokens)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, limits.max_tokens)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise BadRequest("'seed' must be an integer", param="seed")
    min_tokens = _integer(body, "min_tokens", 0, limits.max_tokens) or 0
    if max_tokens is not None and min_tokens > max_tokens:  # vLLM refuses it too (never capped silently)
        raise BadRequest(f"'min_tokens' ({min_tokens}) must not be above max_tokens ({max_tokens})", param="min_tokens")
    logprobs, top_logprobs = _logprobs(body)
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    return SamplingParams(
        # without a max_tokens, the default stretches to an explicit min_tokens
        max_tokens=max_tokens if max_tokens is not None else max(limits.default_max_tokens, min_tokens),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
        top_k=_integer(body, "top_k", -1, 1_000_000) or 0,
        seed=None if seed is None else seed % 2**63,
        stop=_stop(body, limits),
        min_tokens=min_tokens,
        n=n,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_positive(body, "repetition_penalty", 1.0, 2.0 ** 7),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        grammar=structured_grammar(body),
        **sampling_extensions(body, n),
    )


def _positive(body: dict, key: str, default: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_num(v) or not 0 < v <= hi:
        raise BadRequest(f"'{key}' must be a number above 0 and at most {hi:g}, got {clip(v)}", param=key)
    return float(v)


def _image_part(part: dict, where: str, limits: LimitsConfig) -> ImagePart:
    if part.get("type") == "image":  # embedded callers may pass a PIL image directly
        if part.get("image") is None:
            raise BadRequest(f"{where}: an 'image' part needs an 'image' (a PIL image)", param=where)
        return ImagePart(image=part["image"])
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise BadRequest(f"{where}: 'image_url' must be an object with a 'url' string", param=where)
    if is_remote_url(url):  # fetched by the intake; the checks that need no I/O run here, up front
        check_url(url, limits.remote_image_policy, where)
        return ImagePart(url=url)
    if not url.startswith("data:"):
        what = "a data: URL or an http(s) URL" if limits.remote_images else "a data: URL"
        raise BadRequest(f"{where}: image URL must be {what} (data:image/png;base64,...)", param=where)
    return ImagePart(url=url)


def _parts(content: Any, where: str, role: str, limits: LimitsConfig) -> tuple:
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, list) or not content:
        raise BadRequest(f"{where}.content must be a string or a non-empty list of content parts", param=f"{where}.content")
    parts: list = []
    for j, part in enumerate(content):
        pw = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise BadRequest(f"{pw} must be an object with a 'type'", param=pw)
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{pw}: a text part needs a 'text' string", param=pw)
            parts.append(TextPart(part["text"]))
        elif kind in ("image_url", "image", "video_url", "video"):
            if role != "user":
                raise BadRequest(f"{pw}: {kind.split('_')[0]}s are only allowed in user messages", param=pw)
            parts.append((_image_part if kind.startswith("image") else parse_video_part)(part, pw, limits))
        else:
            raise BadRequest(f"{pw}: unsupported content part type {clip(kind)}; supported: 'text', 'image_url', "
                             "'video_url', 'video'", param=pw)
    return tuple(parts)


def parse_messages(raw: Any, limits: LimitsConfig, assistant_last: bool = False) -> tuple[Message, ...]:
    """The messages; the last may be the assistant's only when `assistant_last` (the template then
    continues it, or renders it without a generation prompt: vLLM's template parameters)."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    if len(raw) > limits.max_messages:
        raise BadRequest(f"at most {limits.max_messages} messages are allowed", param="messages")
    messages = []
    called: set[str] = set()  # the ids of the calls made so far
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with 'role' and 'content'", param=where)
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            extra = " (use 'tool' messages)" if role == "function" else ""
            raise BadRequest(f"{where}.role must be one of {sorted(_ROLES)}, got {clip(role)}{extra}",
                             param=f"{where}.role")
        if m.get("function_call"):
            raise UnsupportedParameter(f"{where}: 'function_call' is not supported; use 'tool_calls'",
                                       param=f"{where}.function_call")
        calls = parse_tool_calls(m["tool_calls"], where, role) if m.get("tool_calls") else ()
        content = m.get("content")
        parts = () if calls and content in (None, "", []) else _parts(content, where, role, limits)
        call_id = parse_tool_call_id(m, where, called) if role == "tool" else None
        called.update(c.id for c in calls)
        messages.append(Message("system" if role == "developer" else role, parts, calls, call_id))
    if messages[-1].role == "assistant" and not assistant_last:
        raise BadRequest("the last message must not be from the assistant: nothing to answer", param="messages")
    n_images = sum(len(m.images) for m in messages)
    if n_images > limits.max_images_per_request:
        raise BadRequest(f"at most {limits.max_images_per_request} images per request, got {n_images}", param="messages")
    return tuple(messages)


def _refuse_unknown(body: dict) -> None:
    """Refuses unknown top-level arguments, naming (clipped) the first few of them."""
    unknown = sorted(set(body) - _KNOWN)
    if not unknown:
        return
    shown = ", ".join(clip(k, 64) for k in unknown[:_MAX_UNKNOWN_SHOWN])
    more = f" and {len(unknown) - _MAX_UNKNOWN_SHOWN} more" if len(unknown) > _MAX_UNKNOWN_SHOWN else ""
    raise BadRequest(f"unrecognized request argument(s): {shown}{more}", param=_path_text((None, unknown[0])))


def parse_common(body: dict, default_model: str) -> tuple[str, bool, bool, str | None]:
    """`(model, stream, include_usage, cache_salt)`: what chat and legacy completions share."""
    model = body.get("model", default_model)
    if model is None:
        model = default_model
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise BadRequest("'stream_options' must be an object like {'include_usage': true}", param="stream_options")
    if opts and not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("'cache_salt' must be a non-empty string", param="cache_salt")
    return model, stream, bool(opts.get("include_usage", False)), salt


def parse_chat_request(body: Any, limits: LimitsConfig, default_model: str) -> ChatRequest:
    """Validates an OpenAI chat-completions body and returns the typed request."""
    check_json_shape(body, limits.max_json_depth)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _refuse_unknown(body)
    _refuse_unsupported(body)
    model, stream, include_usage, salt = parse_common(body, default_model)
    template = template_options(body)
    messages = parse_messages(body.get("messages"), limits, assistant_last=not template.opens_answer)
    return ChatRequest(
        model=model,
        messages=messages,
        sampling=parse_sampling(body, limits),
        stream=stream,
        include_usage=include_usage,
        cache_salt=salt,
        tools=parse_tools(body),
        template=template,
        echo=echo_text(messages, template) if wants_echo(body) else "",
        options=request_options(body),
        video=video_sampling(body),
    )


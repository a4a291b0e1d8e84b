"""OpenAI's Responses API (`POST /v1/responses`) as a mapping onto the chat path.

A Responses body is translated into the chat-completions body it means — `input` items into
messages, `instructions` into a system message, `max_output_tokens`, `text.format` and the flat
function `tools` into their chat spellings — and then parsed and served exactly as a chat
completion is (`Runtime.parse`, `Runtime.chat`): one validation, one sampling path. Only what is
particular to the Responses API is checked here, each refusal naming the Responses parameter.

What mmserve does not do is refused with a 400 naming it, never ignored: built-in tools (web and
file search, computer use, code interpreter, ...), `background`, `conversation`, `prompt`
templates, `truncation: "auto"`, `item_reference` items, and `previous_response_id`: **responses
are not stored** (as vLLM without its opt-in store), so a conversation is continued by sending
its whole history in `input` (earlier `message`, `function_call` and `function_call_output`
items). `store` is accepted either way and keeps nothing; `GET /v1/responses/{id}` (and
delete, cancel, input items) is a 404 that says so.

The JSON shapes of the answer and its stream are in `mmserve.api.responses_json`.
"""

from __future__ import annotations

import re
import time
from typing import Any

from quart import Response

from mmserve.api.responses_json import Echo, response, stream_events
from mmserve.errors import BadRequest, MMServeError, NotFound, UnsupportedParameter, clip
from mmserve.runtime.stream import complete

# built-in tools OpenAI runs on its side; mmserve has none of them
BUILT_IN_TOOLS = {
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26", "file_search",
    "computer_use_preview", "computer_use", "code_interpreter", "image_generation", "mcp", "local_shell", "shell",
    "apply_patch", "custom",
}
_IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
            "prompt_cache_retention"}
_KNOWN = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools", "tool_choice",
    "parallel_tool_calls", "stream", "previous_response_id", "include", "top_logprobs", "reasoning",
    "truncation", "background", "conversation", "prompt", "max_tool_calls",
    "request_id", "priority",  # vLLM's, with their chat meaning
} | _IGNORED
# what `include` may ask for: logprobs; and encrypted reasoning, which is trivially included (there
# is none: mmserve's models do not reason separately), so clients that always ask still work
_INCLUDES = {"message.output_text.logprobs", "reasoning.encrypted_content"}
_ROLES = {"user", "system", "developer", "assistant"}


def to_chat_body(body: Any) -> tuple[dict, list[str]]:
    """The chat-completions body that `body` (a Responses API request) means, and where each of
    its messages came from (`instructions`, `input`, `input[i]`); a 400 naming the Responses
    parameter for what is wrong or unsupported in it."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in _KNOWN)
    if unknown:
        shown = ", ".join(clip(k, 64) for k in unknown[:5])
        raise BadRequest(f"unrecognized request argument(s) for /v1/responses: {shown}",
                         param=unknown[0] if len(unknown[0]) <= 64 else None)
    _refuse_unsupported(body)
    messages, origins = _messages(body)
    chat: dict = {"messages": messages}
    for key in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "metadata",
                "service_tier", "prompt_cache_key", "safety_identifier", "request_id", "priority"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if _wants_logprobs(body):
        chat["logprobs"] = True
        if body.get("top_logprobs"):
            chat["top_logprobs"] = body["top_logprobs"]
    elif body.get("top_logprobs"):
        raise BadRequest("'top_logprobs' needs 'include': ['message.output_text.logprobs']", param="top_logprobs")
    fmt = text_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    tools = function_tools(body)
    if tools:
        chat["tools"] = [{"type": "function", "function": t} for t in tools]
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    return chat, origins


def _refuse_unsupported(body: dict) -> None:
    if body.get("previous_response_id") is not None:
        raise UnsupportedParameter(
            "'previous_response_id' is not supported: mmserve does not store responses; send the conversation "
            "so far in 'input' (its earlier message, function_call and function_call_output items)",
            param="previous_response_id")
    if body.get("background"):
        raise UnsupportedParameter("'background' is not supported by mmserve: responses are not stored, so one "
                                   "could not be fetched later; leave it out or stream", param="background")
    for key in ("conversation", "prompt"):
        if body.get(key) is not None:
            raise UnsupportedParameter(f"'{key}' is not supported by mmserve (it names state stored on OpenAI's "
                                       "side); send the whole 'input'", param=key)
    if body.get("truncation") not in (None, "disabled"):
        raise UnsupportedParameter("'truncation' other than 'disabled' is not supported: a prompt longer than the "
                                   "model's context is refused, never cut", param="truncation")
    if body.get("max_tool_calls") is not None:
        raise UnsupportedParameter("'max_tool_calls' is not supported by mmserve (it bounds built-in tools, "
                                   "which mmserve has none of)", param="max_tool_calls")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or reasoning.get("effort") not in (None, "none") \
                or reasoning.get("summary") is not None or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise UnsupportedParameter("'reasoning' is not supported: mmserve's models do not reason separately; "
                                       "leave it out", param="reasoning")
    stream_options = body.get("stream_options")
    if stream_options is not None and not body.get("stream"):
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")


def _wants_logprobs(body: dict) -> bool:
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise BadRequest("'include' must be a list of strings", param="include")
    other = [i for i in include if i not in _INCLUDES]
    if other:
        raise UnsupportedParameter(f"'include' {clip(other[0])} is not supported; mmserve can include only "
                                   f"{sorted(_INCLUDES)}", param="include")
    return "message.output_text.logprobs" in include


# -- input -------------------------------------------------------------------------------------

def _messages(body: dict) -> tuple[list[dict], list[str]]:
    messages: list[dict] = []
    origins: list[str] = []  # per message, the Responses parameter it came from
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
        return messages, origins + ["input"]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'input' must be a string or a non-empty list of input items", param="input")
    for i, item in enumerate(raw):
        _add_item(messages, item, f"input[{i}]")
        origins += [f"input[{i}]"] * (len(messages) - len(origins))
    return messages, origins


_MESSAGE_PATH = re.compile(r"messages\[(\d+)\]")


def _in_responses_terms(err: MMServeError, origins: list[str]) -> MMServeError:
    """`err` (from the chat parser) naming the Responses parameter a message came from, not the
    chat message it became (`messages[2].content[0]` -> `input[1].content[0]`)."""
    def name(m: re.Match) -> str:
        k = int(m.group(1))
        return origins[k] if k < len(origins) else m.group(0)

    err.message = _MESSAGE_PATH.sub(name, err.message)
    if err.param is not None:
        err.param = _MESSAGE_PATH.sub(name, err.param)
        if err.param == "messages":
            err.param = "input"
        elif err.param.startswith("input[") and err.param.endswith(".tool_call_id"):
            err.param = err.param.removesuffix(".tool_call_id") + ".call_id"  # a function_call_output's
    err.args = (err.message,)
    return err


def _add_item(messages: list[dict], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise BadRequest(f"{where} must be an object (a message or a function_call / function_call_output item)",
                         param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {sorted(_ROLES)}, got {clip(role)}", param=f"{where}.role")
        messages.append({"role": role, "content": _content(item.get("content"), where, role)})
    elif kind == "function_call":
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
        for key, value in (("call_id", call_id), ("name", name), ("arguments", args)):
            if not isinstance(value, str) or (key != "arguments" and not value):
                raise BadRequest(f"{where}.{key} must be a {'non-empty ' if key != 'arguments' else ''}string",
                                 param=f"{where}.{key}")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then its calls
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(f"{where}.call_id must be a non-empty string (the call it answers)",
                             param=f"{where}.call_id")
        if isinstance(output, list):  # a list of input_text parts: the tool's text
            output = _tool_output_text(output, where)
        if not isinstance(output, str):
            raise BadRequest(f"{where}.output must be a string", param=f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "item_reference":
        raise UnsupportedParameter(f"{where}: 'item_reference' items are not supported: mmserve stores no "
                                   "responses; send the item itself", param=where)
    elif kind == "reasoning":
        raise UnsupportedParameter(f"{where}: 'reasoning' items are not supported (mmserve's models do not "
                                   "reason separately, and never answered one)", param=where)
    else:
        raise UnsupportedParameter(f"{where}: input items of type {clip(kind)} are not supported; supported: "
                                   "message, function_call, function_call_output", param=f"{where}.type")


def _tool_output_text(parts: list, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "input_text" or not isinstance(part.get("text"), str):
            raise UnsupportedParameter(f"{where}.output[{j}]: a function_call_output's parts must be input_text "
                                       "here", param=f"{where}.output[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _content(content: Any, where: str, role: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise BadRequest(f"{where}.content must be a string or a non-empty list of content parts",
                         param=f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        pw = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{pw}: a text part needs a 'text' string", param=pw)
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and role == "assistant":
            if not isinstance(part.get("refusal"), str):
                raise BadRequest(f"{pw}: a refusal part needs a 'refusal' string", param=pw)
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if part.get("file_id") is not None:
                raise UnsupportedParameter(f"{pw}: 'file_id' images are not supported (mmserve has no file store); "
                                           "send 'image_url' (a data: or http(s) URL)", param=f"{pw}.file_id")
            if not isinstance(url, str) or not url:
                raise BadRequest(f"{pw}: an input_image needs an 'image_url' string (a data: or http(s) URL)",
                                 param=f"{pw}.image_url")
            if part.get("detail") not in (None, "auto", "low", "high", "original"):
                raise BadRequest(f"{pw}.detail must be 'auto', 'low', 'high' or 'original'", param=f"{pw}.detail")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in ("input_file", "input_audio"):
            raise UnsupportedParameter(f"{pw}: {kind} parts are not supported; supported: input_text, input_image",
                                       param=f"{pw}.type")
        else:
            raise BadRequest(f"{pw}: unsupported content part type {clip(kind)}; supported: input_text, "
                             "input_image (and output_text in an assistant message)", param=f"{pw}.type")
    return parts


# -- text.format, tools, tool_choice -----------------------------------------------------------

def text_format(body: dict) -> dict | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise BadRequest("'text' must be an object like {'format': {'type': 'json_schema', ...}}", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise UnsupportedParameter("'text.verbosity' other than 'medium' is not supported", param="text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        if not isinstance(spec.get("name"), str):
            raise BadRequest("text.format.name must be a string (json_schema formats are named)",
                             param="text.format.name")
        return {"type": "json_schema", "json_schema": spec}
    raise BadRequest(f"text.format.type must be 'text', 'json_schema' or 'json_object', got {clip(kind)}",
                     param="text.format.type")


def function_tools(body: dict) -> list[dict]:
    """The request's function tools in chat's `function` shape ({name, description, parameters,
    strict}); a built-in tool is a 400 naming it."""
    raw = body.get("tools")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be a list of {'type': 'function', 'name': ..., 'parameters': {...}}",
                         param="tools")
    out = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in BUILT_IN_TOOLS:
            raise UnsupportedParameter(f"tools[{i}]: the built-in tool {kind!r} is not supported by mmserve; only "
                                       "'function' tools (the caller runs them)", param=f"tools[{i}].type")
        if kind != "function":
            raise BadRequest(f"tools[{i}].type must be 'function', got {clip(kind)}", param=f"tools[{i}].type")
        if tool.get("defer_loading"):
            raise UnsupportedParameter(f"tools[{i}].defer_loading is not supported (mmserve has no tool search): "
                                       "every tool is shown to the model", param=f"tools[{i}].defer_loading")
        extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict", "defer_loading"})
        if extra:
            raise BadRequest(f"tools[{i}]: unrecognized field(s) {clip(', '.join(extra))} (a Responses function "
                             "tool is flat: {'type': 'function', 'name', 'description', 'parameters', 'strict'})",
                             param=f"tools[{i}]")
        out.append({k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None})
    return out


def _tool_choice(raw: Any) -> Any:
    if raw is None or isinstance(raw, str):
        return raw  # "none" / "auto" / "required": checked by the chat parser
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    if kind in BUILT_IN_TOOLS:
        raise UnsupportedParameter(f"'tool_choice' names the built-in tool {kind!r}, which mmserve does not have",
                                   param="tool_choice")
    raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                     param="tool_choice")


def _check_metadata(body: dict) -> None:
    """`metadata` is echoed in the response, so it must have OpenAI's shape: at most 16 string
    values, keys up to 64 characters and values up to 512."""
    meta = body.get("metadata")
    if meta is None:
        return
    if (not isinstance(meta, dict) or len(meta) > 16
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in meta.items())):
        raise BadRequest("'metadata' must be an object of at most 16 string values (keys up to 64 characters, "
                         "values up to 512)", param="metadata")


async def answer(rt, body: Any, g):
    """`POST /v1/responses`: the whole Response (a dict), or a streamed quart Response of its
    events. The request runs on the chat path; `g` (quart's request globals) holds the internal id
    minted for it and the client's label."""
    chat_body, origins = to_chat_body(body)
    _check_metadata(body)
    try:
        parsed = rt.parse(chat_body)
    except MMServeError as err:
        raise _in_responses_terms(err, origins) from None
    stream = rt.chat(request=parsed, client_request_id=g.client_request_id, request_id=g.request_id)
    g.request_id, g.client_request_id = stream.request_id, stream.client_request_id
    echo = Echo("resp_" + stream.request_id, stream.model, int(time.time()), body, parsed)
    try:  # the intake's refusals (an undecodable image, a prompt too long) come with the first event
        if not parsed.stream:
            return response(echo, await complete(stream))
        first = await stream.__anext__()
    except MMServeError as err:
        stream.close()
        raise _in_responses_terms(err, origins) from None
    except BaseException:
        stream.close()
        raise
    out = Response(stream_events(stream, first, echo), mimetype="text/event-stream")
    out.headers["Cache-Control"] = "no-cache"
    out.timeout = None  # a long stream must not be cut by Quart's response timeout
    return out


def not_stored(response_id: str) -> NotFound:
    """`GET /v1/responses/{id}` (and its cancel, delete, input items): nothing is ever stored."""
    return NotFound(f"response {clip(response_id)} is not stored: mmserve keeps no responses (as vLLM without its "
                    "opt-in store); a response is answered once, to the request that made it")

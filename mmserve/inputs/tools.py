"""Tool calling in a request: `tools`, `tool_choice`, `parallel_tool_calls`, and the history's
assistant `tool_calls` and `tool` messages — parsed and validated (a 400 naming the parameter),
then bound to the model (`bind_tools`: its `tool_parser`, and the call grammar of "required" or
a named function).

What each choice does:
* "none": the tools are not shown to the model; its answer is plain content.
* "auto" (the default when there are tools): the tools are rendered by the model's chat template
  and its answer is parsed by the model's `tool_parser` (a model without one refuses "auto").
* "required" / `{"type": "function", "function": {"name": ...}}`: the answer is constrained by a
  grammar (llguidance) to calls — of any of the tools, or of the named one — whose arguments
  validate against the function's parameter schema; one call, or one or more when
  `parallel_tool_calls` is true (the default).

`strict: true` on a function is enforced as `response_format`'s is: its parameter schema must
follow OpenAI's strict rules (a 400 naming the rule otherwise), and under "auto" the answer is
grammar-constrained too — plain text that opens no call, or only calls, a strict function's
arguments following its schema (`strict_auto_grammar`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from mmserve.errors import BadRequest, clip
from mmserve.generation.json_schema import check_strict
from mmserve.generation.tool_calls import Function, ToolCall, call_grammar, check_parameters, strict_auto_grammar

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tools:
    """A request's tools and what it asks of them. `choice` is "none", "auto", "required" or
    "function" (then `name` is the function's); `parser` is the model's tool_parser once bound."""

    functions: tuple[Function, ...]
    choice: str
    name: str | None = None
    parallel: bool = True
    parser: str | None = None

    @property
    def parsed(self) -> bool:
        """True when the answer is read for calls (every choice but "none")."""
        return self.choice != "none" and bool(self.functions)

    def rendered(self) -> list[dict] | None:
        """The tools as the chat template takes them; None when the model is not to see them."""
        return [f.to_json() for f in self.functions] if self.parsed else None

    def forced(self) -> tuple[Function, ...]:
        """The functions a grammar confines the answer to (none for "auto" and "none")."""
        if self.choice == "required":
            return self.functions
        if self.choice == "function":
            return tuple(f for f in self.functions if f.name == self.name)
        return ()


def _function(tool: Any, i: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise BadRequest(f"{where} must be an object like {{'type': 'function', 'function': {{...}}}}", param=where)
    if tool.get("type") != "function":
        raise BadRequest(f"{where}.type must be 'function', got {clip(tool.get('type'))}", param=f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"{where}.function must be an object with a 'name'", param=f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {clip(name)}",
                         param=f"{where}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{where}.function.description must be a string", param=f"{where}.function.description")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{where}.function.strict must be a boolean", param=f"{where}.function.strict")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise BadRequest(f"{where}.function.parameters must be a JSON schema (an object)",
                         param=f"{where}.function.parameters")
    if strict:  # OpenAI's strict-mode rules, as response_format's json_schema with strict checks them
        check_strict(params, f"{where}.function.parameters")
    function = Function(name, params, description, strict)
    check_parameters(function, f"{where}.function.parameters")
    return function


def _choice(raw: Any, names: set[str]) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if names else "none"), None
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise BadRequest(f"'tool_choice' must be one of {list(CHOICES)} or {{'type': 'function', 'function': "
                             f"{{'name': ...}}}}, got {clip(raw)}", param="tool_choice")
        if raw == "required" and not names:
            raise BadRequest("'tool_choice' 'required' needs 'tools'", param="tool_choice")
        return raw, None
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(name, str):
        raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}", param="tool_choice")
    if name not in names:
        known = ", ".join(sorted(names)) or "none"
        raise BadRequest(f"'tool_choice' names the function {clip(name)}, which is not in 'tools' (they are: "
                         f"{clip(known, 300)})", param="tool_choice")
    return "function", name


def parse_tools(body: dict) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a request body; None without tools
    (a `tool_choice` of "none" or "auto" is then allowed and means nothing)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise BadRequest("'tools' must be a list of {'type': 'function', 'function': {...}}", param="tools")
    raw = raw or []
    if len(raw) > MAX_TOOLS:
        raise BadRequest(f"at most {MAX_TOOLS} tools are allowed, got {len(raw)}", param="tools")
    functions = tuple(_function(t, i) for i, t in enumerate(raw))
    names = [f.name for f in functions]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BadRequest(f"function names must be unique within 'tools'; repeated: {clip(', '.join(dup))}",
                         param="tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    choice, name = _choice(body.get("tool_choice"), set(names))
    if not functions:
        return None
    return Tools(functions, choice, name, True if parallel is None else parallel)


def bind_tools(tools: Tools | None, model: str, parser: str | None) -> tuple[Tools | None, str | None]:
    """The request's tools bound to model `model` (whose `tool_parser` is `parser`), and the
    grammar its answer must follow (None: free text). "auto" needs a parser."""
    if tools is None or not tools.parsed:
        return tools, None
    forced = tools.forced()
    if not forced and parser is None:
        raise BadRequest(f"'tool_choice' 'auto' needs a tool-call parser, and model {clip(model)} has none: set "
                         "tool_parser in its [[models]] table (e.g. \"hermes\"), or ask for 'required' or a named "
                         "function", param="tool_choice")
    grammar = call_grammar(forced, tools.parallel) if forced else None
    if not forced and any(f.strict for f in tools.functions):  # "auto" with strict tools: calls validate
        grammar = strict_auto_grammar(tools.functions, tools.parallel)
    # a call a grammar shapes is written in hermes markup whatever the model's own parser (the one
    # format a grammar makes here), so it is read back with the hermes parser
    return dataclasses.replace(tools, parser="hermes" if grammar is not None else parser), grammar


# -- the history -----------------------------------------------------------------------------------

def parse_tool_calls(raw: Any, where: str, role: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` (OpenAI's shape; `arguments` a JSON string)."""
    where = f"{where}.tool_calls"
    if role != "assistant":
        raise BadRequest(f"{where}: only assistant messages have tool calls", param=where)
    if not isinstance(raw, list) or not raw:
        raise BadRequest(f"{where} must be a non-empty list of calls", param=where)
    calls = []
    for j, c in enumerate(raw):
        w = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            raise BadRequest(f"{w} must be like {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                             f"'arguments': '...'}}}}", param=w)
        call_id, name, args = c.get("id"), fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(f"{w}.id must be a non-empty string", param=f"{w}.id")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{w}.function.name must be a non-empty string", param=f"{w}.function.name")
        if isinstance(args, dict):  # some clients send the object itself
            try:
                args = json.dumps(args, ensure_ascii=False, allow_nan=False)
            except ValueError:  # NaN, or an integer past 4300 digits
                args = None
        if not isinstance(args, str):
            raise BadRequest(f"{w}.function.arguments must be a string (JSON)", param=f"{w}.function.arguments")
        calls.append(ToolCall(call_id, name, args))
    return tuple(calls)


def parse_tool_call_id(m: dict, where: str, called: set[str]) -> str:
    """A tool message's `tool_call_id`: one of the `called` ids of earlier assistant messages
    (OpenAI's rule: a result answers a call made before it)."""
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(f"{where}: a 'tool' message needs a 'tool_call_id' string (the id of the call it answers)",
                         param=f"{where}.tool_call_id")
    if call_id not in called:
        raise BadRequest(f"{where}: a 'tool' message must answer a call of an earlier assistant message; no "
                         f"earlier message has a tool call with id {clip(call_id)}", param=f"{where}.tool_call_id")
    return call_id


def hf_tool_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
    """Calls as chat templates take them: `arguments` an object when it is one (transformers'
    convention, which templates render with `tojson`), else the text as sent."""
    out = []
    for c in calls:
        try:
            args = json.loads(c.arguments)
        except (ValueError, RecursionError):  # not JSON (or nested past the interpreter's stack)
            args = c.arguments
        if not isinstance(args, dict):
            args = c.arguments
        out.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
    return out

"""Tool calls in a model's answer: the grammar that makes an answer a call, and the parsers that
find calls in a model's text.

* `call_grammar(functions, parallel)` is the llguidance grammar of `tool_choice` "required" or a
  named function: one call (or, with `parallel`, one or more) in hermes markup,
  `<tool_call>\\n{"name":"NAME","arguments":{...}}\\n</tool_call>`, the arguments constrained by
  the function's parameter schema — so a forced call always parses and validates.
* `HermesParser` finds such calls in text as it streams (tool_choice "auto", and the forced
  calls too): content outside the markup stays content, each call streams as OpenAI streams one
  (a first delta with its id and name, then fragments of its arguments), and nothing of the
  markup leaks into the content. `[models.x] tool_parser` names a model's parser
  (`TOOL_PARSERS`: "hermes", what Qwen2.5-VL, Qwen3-VL and Hermes models emit).

A parameter schema is read as OpenAI's strict mode reads one: an object schema with `properties`
and no `additionalProperties` is closed (a key it does not name is never generated), so a small
model cannot open a key it never closes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from mmserve.config.checks import TOOL_PARSERS
from mmserve.errors import BadRequest, clip

__all__ = ["TOOL_PARSERS", "Function", "HermesParser", "ToolCall", "ToolCallDelta", "call_grammar",
           "check_parameters", "new_call_id", "strict_auto_grammar", "tool_call_parser"]

_JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON, as grammar.py's response_format
MAX_SCHEMA_CHARS = 64 * 1024
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Function:
    """A function the caller offers (`tools[i].function`); `parameters` is its JSON schema."""

    name: str
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    description: str | None = None
    strict: bool | None = None

    def to_json(self) -> dict:
        """The tool as chat templates take it (transformers' `tools=`): OpenAI's shape."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is the JSON text of its arguments, as OpenAI sends it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index` of a choice: its first piece has `id` and `name` (and empty
    `arguments`), the next ones a fragment of the arguments each."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- the grammar of a forced call ------------------------------------------------------------

def _llg():
    import llguidance  # on first use, as in grammar.py

    return llguidance


def closed(schema: Any) -> Any:
    """`schema` with every object schema that names `properties` but says nothing of
    `additionalProperties` closed (`"additionalProperties": false`), everywhere in it."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("const", "enum", "default", "examples") else v for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local `$ref`s ("#/...") pointing under `base`, where it is embedded."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        elif k in ("const", "enum", "default", "examples"):
            out[k] = v
        else:
            out[k] = _rebased(v, base)
    return out


def _call_schema(fn: Function) -> dict:
    """The JSON schema of one call of `fn`: `{"name": NAME, "arguments": ARGS}`, in that order."""
    return {"x-guidance": _JSON_OPTIONS, "type": "object",
            "properties": {"name": {"const": fn.name},
                           "arguments": _rebased(closed(fn.parameters), "#/properties/arguments")},
            "required": ["name", "arguments"], "additionalProperties": False}


def _refusal(exc_or_messages, param: str) -> BadRequest:
    messages = exc_or_messages if isinstance(exc_or_messages, list) else [str(exc_or_messages)]
    detail = "; ".join(clip(m, 200) for m in messages) or "it cannot be compiled"
    return BadRequest(f"the function's parameters are not a usable JSON schema: {detail}", param=param)


def check_parameters(fn: Function, param: str) -> None:
    """Raises BadRequest naming `param` unless `fn`'s parameter schema compiles (~1 ms)."""
    try:
        text = json.dumps(fn.parameters, allow_nan=False)
    except ValueError as e:  # NaN, or an integer past 4300 digits
        raise BadRequest(f"the parameter schema cannot be read as JSON: {clip(str(e))}", param=param) from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise BadRequest(f"the parameter schema is {len(text)} characters; this server accepts at most "
                         f"{MAX_SCHEMA_CHARS}", param=param)
    matcher = _llg().LLMatcher
    try:
        grammar = matcher.grammar_from_json_schema(json.dumps(_call_schema(fn)))
        failed, messages = matcher.validate_grammar_with_warnings(grammar)
    except Exception as e:  # the compiler's own refusal of a shape it cannot read
        raise _refusal(e, param) from None
    if failed:
        raise _refusal(messages, param)


def call_grammar(functions: Sequence[Function], parallel: bool) -> str:
    """The llguidance grammar of an answer that is only calls of `functions` (hermes markup):
    exactly one call, or with `parallel` one or more, one per line. An optional leading space
    lets a model whose template puts one before an answer ("assistant: ...") write it."""
    alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
    calls = 'call ("\\n" call)*' if parallel else "call"
    lines = ["%llguidance {}", f'start: " "? {calls}',
             f'call: {json.dumps(OPEN + chr(10))} ({alternatives}) {json.dumps(chr(10) + CLOSE)}']
    lines += [f"fn{i}: %json {json.dumps(_call_schema(fn))}" for i, fn in enumerate(functions)]
    lark = "\n".join(lines) + "\n"
    matcher = _llg().LLMatcher
    grammar = matcher.grammar_from_lark(lark)
    failed, messages = matcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise _refusal(messages, "tools")
    return grammar


def strict_auto_grammar(functions: Sequence[Function], parallel: bool) -> str:
    """The grammar of `tool_choice` "auto" when a tool is `strict`: the answer is either plain
    text (which never opens a call) or only calls (as `call_grammar` makes them), the arguments of
    a strict function following its schema and a non-strict one's any JSON object. A strict
    function's call then always validates, as OpenAI's strict mode promises. (Text followed by
    calls in one answer is not allowed here: the grammar's lexer cannot tell where such text ends.)"""
    loose = [fn if fn.strict else Function(fn.name, {"type": "object"}) for fn in functions]
    alternatives = " | ".join(f"fn{i}" for i in range(len(loose)))
    more = ' ("\\n" OPEN args CLOSE)*' if parallel else ""
    # the first call's opening (and the space a template may put before it) is one lexeme: the
    # lexer runs it beside TEXT and keeps whichever survives the next byte
    lines = ["%llguidance {}", f"start: TEXT | FIRST args CLOSE{more}",
             f"TEXT: /(?s:.*)/ & ~/(?s:.*{OPEN}.*)/", f"FIRST: / ?{OPEN}\\n/",
             f"OPEN: {json.dumps(OPEN + chr(10))}", f"CLOSE: {json.dumps(chr(10) + CLOSE)}",
             f"args: {alternatives}"]
    lines += [f"fn{i}: %json {json.dumps(_call_schema(fn))}" for i, fn in enumerate(loose)]
    matcher = _llg().LLMatcher
    grammar = matcher.grammar_from_lark("\n".join(lines) + "\n")
    failed, messages = matcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise _refusal(messages, "tools")
    return grammar


# -- parsing calls out of text -----------------------------------------------------------------

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (text that may yet become it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _ValueEnd:
    """Finds where a JSON object or array ends, in text that arrives in pieces."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def feed(self, text: str) -> int:
        """How much of `text` belongs to the value (all of it while the value goes on)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class _Call:
    """The call being read: the text inside its markup, and what of it has streamed."""

    def __init__(self, index: int, before: str = "") -> None:
        self.index, self.body, self.id, self.name = index, "", new_call_id(), None
        self.before = before  # whitespace of the content before the markup: dropped if it is a call
        self.args_at = -1  # where the arguments value starts in `body`, once the header is read
        self.sent = 0  # characters of the arguments streamed
        self.value: _ValueEnd | None = None
        self.arguments: list[str] = []

    def stream(self) -> list[ToolCallDelta]:
        """The deltas that `body` allows now: the header once it is known, then argument text
        up to the end of the arguments value (never the object's closing brace)."""
        out = []
        if self.name is None:
            m = _HEADER.match(self.body)
            if m is None:
                return out
            try:
                self.name = json.loads(m.group(1))
            except ValueError:
                return out
            self.args_at = m.end()
            out.append(ToolCallDelta(self.index, "", self.id, self.name))
            if self.body[self.args_at] in "{[":
                self.value = _ValueEnd()
        if self.value is not None and not self.value.done:
            new = self.body[self.args_at + self.sent:]
            piece = new[: self.value.feed(new)]
            if piece:
                self.sent += len(piece)
                out.append(self._argument(piece))
        return out

    def _argument(self, piece: str) -> ToolCallDelta:
        self.arguments.append(piece)
        return ToolCallDelta(self.index, piece)

    def close(self, complete: bool) -> tuple[str, list[ToolCallDelta]]:
        """The markup ended (`complete`) or the answer did: (content, deltas). A body that is a
        call finishes it; one that is not and has streamed nothing goes back to content."""
        out = self.stream()
        try:
            parsed = json.loads(self.body)
        except (ValueError, RecursionError):
            parsed = None
        ok = (isinstance(parsed, dict) and isinstance(parsed.get("name"), str) and "arguments" in parsed)
        if self.name is None:
            if not ok:
                return OPEN + self.body + (CLOSE if complete else ""), out
            self.name = parsed["name"]
            out.append(ToolCallDelta(self.index, "", self.id, self.name))
        if ok and (self.value is None or not self.value.done) and not self.sent:
            args = parsed["arguments"]
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            if text:
                out.append(self._argument(text))
        return "", out

    def result(self) -> ToolCall:
        return ToolCall(self.id, self.name or "", "".join(self.arguments))


class HermesParser:
    """Calls in hermes markup (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) found in
    one choice's text as it streams.

    `feed(text)` and `finish()` return (content, deltas): the content outside the markup that is
    safe to show now, and the call deltas. Text that may begin a tag is held back until it is
    known; whitespace around calls is dropped (an answer that is only calls has no content);
    `calls` lists the finished calls. Streamed and whole, the same text gives the same calls."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet judged (a possible partial tag)
        self._held = ""  # trailing whitespace of the content, dropped if a call follows
        self._call: _Call | None = None
        self.calls: list[ToolCall] = []
        self._count = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._buf:
            if self._call is None:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    content.append(self._say(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._say(self._buf[:at]))
                self._buf = self._buf[at + len(OPEN):]
                self._call = _Call(self._count, self._held)
                self._held, self._count = "", self._count + 1
                continue
            at = self._buf.find(CLOSE)
            if at < 0:
                keep = _partial_suffix(self._buf, CLOSE)
                self._call.body += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                deltas += self._call.stream()
                break
            self._call.body += self._buf[:at]
            self._buf = self._buf[at + len(CLOSE):]
            content.append(self._end_call(True, deltas))
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The answer ended: flushes what was held back (an unclosed call ends as it stands)."""
        deltas: list[ToolCallDelta] = []
        if self._call is not None:
            self._call.body += self._buf
            content = self._end_call(False, deltas)
        else:
            content = self._say(self._buf)
        self._buf = ""
        tail, self._held = ("" if self.calls else self._held), ""
        return content + tail, deltas

    def _end_call(self, complete: bool, deltas: list[ToolCallDelta]) -> str:
        call, self._call = self._call, None
        text, out = call.close(complete)
        deltas += out
        if call.name is not None:
            self.calls.append(call.result())
            return ""
        self._count -= 1  # not a call: its index is the next call's
        return self._say(call.before + text)

    def _say(self, text: str) -> str:
        """Content, less its trailing whitespace (held until more content or a call decides)."""
        text = self._held + text
        cut = len(text.rstrip())
        self._held = text[cut:]
        return text[:cut]


def tool_call_parser(name: str) -> HermesParser:
    """A fresh parser for one choice of a model whose `tool_parser` is `name`."""
    if name == "hermes":
        return HermesParser()
    raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(TOOL_PARSERS)}")

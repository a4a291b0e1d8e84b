"""Grammar-constrained decoding for `response_format`, with llguidance.

Why llguidance (1.9): a 3 MB wheel with no dependencies, a JSON-schema compiler of ~1 ms and a
token mask of ~0.02 ms a step on the demo tokenizer, computed in Rust with the GIL released (so
it overlaps the forward). xgrammar works too but pulls triton (286 MB) and apache-tvm-ffi into
every install, CPU ones included. llguidance's `torch` helper JIT-compiles on first use (22 s on
a 2-core CPU), so masks are filled with its numpy path and unpacked here with torch.

* `grammar_for(response_format)` turns the request's `response_format` into an llguidance
  grammar, or raises `BadRequest` naming what is wrong with the schema (at parse time: no model
  work starts for a bad schema). JSON is compact (no free whitespace): a model unused to JSON
  must not fill its answer with spaces.
* `Grammars` (one per model) holds the tokenizer view llguidance needs and the compiled grammars,
  cached by grammar text (LRU); a request gets a fresh matcher copied from the compiled one.
* `MaskJob` fills the next-token bitmask of every constrained row of a step in one call, in a
  worker thread started before the forward and joined after it; `allowed` unpacks it on the
  logits' device.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch

from mmserve.errors import BadRequest, clip
from mmserve.generation.json_schema import check_strict, close_objects

_JSON_OPTIONS = {"whitespace_flexible": False}
_MAX_SCHEMA_CHARS = 64 * 1024


def _llg():
    import llguidance  # imported on first use: requests without a response_format never need it

    return llguidance


def grammar_for(response_format: Any) -> str | None:
    """The llguidance grammar for an OpenAI `response_format`; None for plain text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise BadRequest("'response_format' must be an object with a 'type' ('text', 'json_object' or "
                         "'json_schema')", param="response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _compile_schema({"type": "object"}, "response_format")
    if kind != "json_schema":
        raise BadRequest(f"response_format type {clip(kind)} is not supported; use 'text', 'json_object' "
                         "or 'json_schema'", param="response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise BadRequest("response_format 'json_schema' must be an object like {'name': ..., 'schema': {...}}",
                         param="response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise BadRequest("response_format.json_schema.schema must be a JSON schema (an object)",
                         param="response_format.json_schema.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"response_format.json_schema.strict must be a boolean, got {clip(strict)}",
                         param="response_format.json_schema.strict")
    return json_schema_grammar(schema, "response_format.json_schema.schema", strict=bool(strict))


def json_schema_grammar(schema: dict | bool, param: str, strict: bool = False) -> str:
    """The grammar of a JSON schema as users write it: objects closed unless they say otherwise
    (`json_schema.close_objects`); with `strict`, OpenAI's rules checked first."""
    if strict:
        check_strict(schema, param)
    return _compile_schema(close_objects(schema), param)


def regex_grammar(pattern: Any, param: str) -> str:
    """The grammar of a regular expression (vLLM's `guided_regex`; Rust regex syntax)."""
    if not isinstance(pattern, str) or not pattern:
        raise BadRequest(f"'{param}' must be a non-empty regular expression string", param=param)
    return _checked(lambda m: m.grammar_from_regex(pattern), len(pattern), "regular expression", param)


def lark_grammar(text: Any, param: str) -> str:
    """A Lark grammar as llguidance reads it (vLLM's `guided_grammar`); a bad one is a 400 naming
    `param` and what the compiler says of it."""
    if not isinstance(text, str) or not text.strip():
        raise BadRequest(f"'{param}' must be a non-empty Lark grammar (a string)", param=param)
    return _checked(lambda m: m.grammar_from_lark(text), len(text), "Lark grammar", param)


def choice_grammar(choices: Any, param: str) -> str:
    """The grammar whose only sentences are `choices` (vLLM's `guided_choice`)."""
    if (not isinstance(choices, list) or not choices or len(choices) > 1024
            or not all(isinstance(c, str) and c for c in choices)):
        raise BadRequest(f"'{param}' must be a list of 1 to 1024 non-empty strings", param=param)
    lark = "start: " + " | ".join(json.dumps(c) for c in choices)
    return _checked(lambda m: m.grammar_from_lark(lark), len(lark), "choice list", param)


def _compile_schema(schema: dict | bool, param: str) -> str:
    text = json.dumps(schema)
    if len(text) > _MAX_SCHEMA_CHARS:
        raise BadRequest(f"the JSON schema is {len(text)} characters; this server accepts at most "
                         f"{_MAX_SCHEMA_CHARS}", param=param)
    return _checked(lambda m: m.grammar_from_json_schema(text, overrides=_JSON_OPTIONS), len(text), "JSON schema",
                    param)


def _checked(make, size: int, what: str, param: str) -> str:
    if size > _MAX_SCHEMA_CHARS:
        raise BadRequest(f"the {what} is {size} characters; this server accepts at most {_MAX_SCHEMA_CHARS}",
                         param=param)
    matcher = _llg().LLMatcher
    try:
        grammar = make(matcher)
        failed, messages = matcher.validate_grammar_with_warnings(grammar)
    except Exception as e:  # the compiler's own refusal of a shape it cannot read
        failed, messages = True, [str(e)]
    if failed:
        detail = "; ".join(clip(m, 200) for m in messages) or "it cannot be compiled"
        raise BadRequest(f"the {what} is invalid or unsupported: {detail}", param=param)
    return grammar


class Grammars:
    """The compiled grammars of one model, cached by grammar text (at most `capacity`)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int], capacity: int = 256):
        llg = _llg()
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids))
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._llg = llg
        self.compiles = 0

    def matcher(self, grammar: str):
        """A fresh matcher for `grammar` at its start (compiled once, then copied)."""
        with self._lock:
            template = self._compiled.get(grammar)
            if template is None:
                template = self._llg.LLMatcher(self.tokenizer, grammar)
                if template.is_error():
                    raise BadRequest(f"the grammar cannot be used with this model: {clip(template.get_error(), 300)}",
                                     param="response_format")
                self.compiles += 1
                self._compiled[grammar] = template
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
            return template.deep_copy()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a piece of a UTF-8 character for some byte-level tokens)."""
        return self.tokenizer.decode_bytes([token_id])


class MaskJob:
    """The allowed next tokens of every constrained row of one step, computed off the step's thread."""

    _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmserve-grammar")

    def __init__(self, grammars: Grammars, matchers: Sequence[Any]):
        self.vocab_size = grammars.vocab_size
        self.rows = len(matchers)
        self._future: Future | None = None
        if matchers:
            self._future = self._pool.submit(_fill, grammars, list(matchers))

    def allowed(self, device: torch.device) -> torch.Tensor:
        """[rows, vocab] bool: True where the row's grammar allows the token."""
        if self._future is None:
            return torch.zeros(0, self.vocab_size, dtype=torch.bool, device=device)
        words = torch.from_numpy(self._future.result()).to(device, non_blocking=True)
        bits = torch.arange(32, dtype=torch.int32, device=device)
        unpacked = (words.unsqueeze(-1) >> bits) & 1  # little-endian bits of int32 words
        return unpacked.reshape(self.rows, -1)[:, : self.vocab_size].bool()


def _fill(grammars: Grammars, matchers: list):
    import llguidance.numpy as lnp

    bitmask = lnp.allocate_token_bitmask(len(matchers), grammars.vocab_size)
    executor = _executor()
    lnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
    return bitmask


_EXECUTOR = None


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = _llg().LLExecutor()
    return _EXECUTOR

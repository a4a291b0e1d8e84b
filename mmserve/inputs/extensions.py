"""vLLM's request extensions to OpenAI's chat completions, accepted with vLLM's meaning.

Benchmark and evaluation clients (guidellm, lm-eval, ...) send them to any OpenAI-compatible
server. Each is either honoured as vLLM defines it, or — where it makes no sense here — refused
with a 400 naming it; never silently ignored:

* sampling: `ignore_eos`, `min_p`, `stop_token_ids`, `skip_special_tokens`,
  `include_stop_str_in_output`, `spaces_between_special_tokens` (a no-op with transformers 5's
  tokenizers, as it is for fast tokenizers in vLLM), `best_of` (only equal to `n`: mmserve does
  not rank candidates), `use_beam_search` (false only), `length_penalty` (beam search only: any
  value is accepted and, as in vLLM without beam search, unused), `prompt_logprobs` (null only
  here: `/v1/completions` computes them, `mmserve.inputs.completions`), `add_special_tokens` (false only, vLLM's
  default for chat);
  `top_k`, `min_tokens` and `repetition_penalty` are parsed with OpenAI's own fields;
* the chat template: `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`;
* `echo`: the answer starts with the last message's content when that message has the answer's
  role (assistant, or the last message's own role without a generation prompt);
* structured output: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (a Lark
  grammar, llguidance's dialect), `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
  `json_object`), on the grammar path of `response_format`; `guided_decoding_backend` names the
  backend: "auto", "guidance" (vLLM's name of llguidance) or "llguidance", anything else a 400;
* per request (`RequestOptions`): `request_id` (the client's label of the request: logged and
  echoed in x-request-id, never the internal id; the header wins when both are sent),
  `truncate_prompt_tokens` (the prompt's last k tokens are kept; -1 as many as the model takes;
  a prompt with images is refused rather than cut), `return_tokens_as_token_ids` (logprob tokens
  read "token_id:N"), `priority` (an integer in [PRIORITY_MIN, PRIORITY_MAX], lower first, as
  vLLM's — honoured without any server flag: `generation.scheduler`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from mmserve.errors import BadRequest, UnsupportedParameter, clip
from mmserve.generation.grammar import choice_grammar, grammar_for, json_schema_grammar, lark_grammar, regex_grammar

SAMPLING_FIELDS = {
    "ignore_eos", "min_p", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
    "spaces_between_special_tokens", "best_of", "use_beam_search", "length_penalty", "prompt_logprobs",
    "add_special_tokens",
}
TEMPLATE_FIELDS = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs", "echo"}
STRUCTURED_ORDER = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
STRUCTURED_FIELDS = set(STRUCTURED_ORDER) | {"guided_decoding_backend"}
REQUEST_FIELDS = {"request_id", "truncate_prompt_tokens", "return_tokens_as_token_ids", "priority"}
VLLM_FIELDS = SAMPLING_FIELDS | TEMPLATE_FIELDS | STRUCTURED_FIELDS | REQUEST_FIELDS
# vLLM's names of structured-output backends that mean the one mmserve has (llguidance, which
# vLLM calls "guidance"); "auto" lets the server choose
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")
# a request's `priority` (lower first): a 32-bit integer, as clients of vLLM send it
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")  # as the x-request-id header's

MAX_STOP_TOKEN_IDS = 64
MAX_SCHEMA_TEXT = 64 * 1024
MAX_TEMPLATE_KWARGS = 64
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
# apply_chat_template's own parameters (and what the request sets itself): never from the caller's kwargs
RESERVED_TEMPLATE_KWARGS = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs", "images", "videos",
    "audio", "text", "kwargs",
}


@dataclass(frozen=True)
class TemplateOptions:
    """How the chat template renders the request (vLLM's template parameters)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = field(default_factory=dict)  # chat_template_kwargs (only those the template reads are used)

    @property
    def opens_answer(self) -> bool:
        """The prompt ends with the generation prompt: the answer starts a new assistant message."""
        return self.add_generation_prompt and not self.continue_final_message

    def render_args(self) -> dict:
        """The keyword arguments of the model's `apply_chat_template` ({} for the defaults)."""
        if self.opens_answer and not self.kwargs:
            return {}
        return {**self.kwargs, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


def flag(body: dict, key: str, default: bool) -> bool:
    """`body[key]` as a boolean (`default` when absent); a 400 naming the key otherwise."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be a boolean, got {clip(v)}", param=key)
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """A finite number (an int is compared as it is: float() of a 10**400 would overflow)."""
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def sampling_extensions(body: dict, n: int) -> dict:
    """SamplingParams keywords of vLLM's sampling extensions (refusing the ones mmserve cannot honour)."""
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != n):
        raise UnsupportedParameter(f"'best_of' must equal 'n' ({n}) or be left out: mmserve returns every "
                                   f"choice it samples and ranks none, got {clip(best_of)}", param="best_of")
    if flag(body, "use_beam_search", False):
        raise UnsupportedParameter("'use_beam_search' is not supported by mmserve (sampling only); "
                                   "leave it out or set it to false", param="use_beam_search")
    length_penalty = body.get("length_penalty")
    if length_penalty is not None and not _is_number(length_penalty):
        raise BadRequest(f"'length_penalty' must be a number, got {clip(length_penalty)}", param="length_penalty")
    if body.get("prompt_logprobs") is not None:
        raise UnsupportedParameter("'prompt_logprobs' is not supported on chat completions; /v1/completions "
                                   "computes them (prompt_logprobs, or echo with logprobs)", param="prompt_logprobs")
    if flag(body, "add_special_tokens", False):
        raise UnsupportedParameter("'add_special_tokens': true is not supported: the chat template adds the "
                                   "special tokens", param="add_special_tokens")
    flag(body, "spaces_between_special_tokens", True)  # no effect with transformers 5 tokenizers
    min_p = body.get("min_p")
    if min_p is not None and not (_is_number(min_p) and 0 <= min_p <= 1):
        raise BadRequest(f"'min_p' must be a number between 0 and 1, got {clip(min_p)}", param="min_p")
    return dict(
        min_p=float(min_p or 0.0),
        ignore_eos=flag(body, "ignore_eos", False),
        stop_token_ids=_token_ids(body.get("stop_token_ids")),
        skip_special_tokens=flag(body, "skip_special_tokens", True),
        include_stop_str_in_output=flag(body, "include_stop_str_in_output", False),
    )


@dataclass(frozen=True)
class RequestOptions:
    """vLLM's per-request fields that are not sampling: the client's label for the request, how
    its prompt is cut, and how its logprobs name tokens."""

    client_request_id: str | None = None  # vLLM's `request_id`: a label (logged, echoed), never a key
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: as many as fit
    tokens_as_ids: bool = False  # `return_tokens_as_token_ids`: logprob tokens read "token_id:N"
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: every chunk carries usage
    priority: int = 0  # lower first (vLLM's): orders admission and preemption (`generation.scheduler`)


def request_options(body: dict) -> RequestOptions:
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not _CLIENT_ID.match(rid)):
        raise BadRequest("'request_id' must be 1 to 128 letters, digits or '.', '_', ':', '-' (it becomes the "
                         f"request's client id, as the x-request-id header), got {clip(rid)}", param="request_id")
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (not _is_int(truncate) or not (truncate == -1 or 1 <= truncate < 2**31)):
        raise BadRequest(f"'truncate_prompt_tokens' must be an integer >= 1 (keep the prompt's last k tokens) or "
                         f"-1 (as many as the model takes), got {clip(truncate)}", param="truncate_prompt_tokens")
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise UnsupportedParameter(f"'guided_decoding_backend' {clip(backend)} is not available: mmserve's "
                                   f"structured output runs on llguidance ({', '.join(map(repr, GRAMMAR_BACKENDS))} "
                                   "name it)", param="guided_decoding_backend")
    opts = body.get("stream_options")
    continuous = flag(opts, "continuous_usage_stats", False) if isinstance(opts, dict) else False
    if continuous and not opts.get("include_usage"):
        raise BadRequest("'stream_options.continuous_usage_stats' needs 'include_usage': true (as vLLM)",
                         param="stream_options.continuous_usage_stats")
    priority = body.get("priority")
    if priority is not None and not (_is_int(priority) and PRIORITY_MIN <= priority <= PRIORITY_MAX):
        raise BadRequest(f"'priority' must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX} (lower runs first), "
                         f"got {clip(priority)}", param="priority")
    return RequestOptions(rid, truncate, flag(body, "return_tokens_as_token_ids", False), continuous,
                          priority or 0)


def _token_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if (not isinstance(v, list) or len(v) > MAX_STOP_TOKEN_IDS
            or not all(_is_int(t) and 0 <= t < 2**31 for t in v)):
        raise BadRequest(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids "
                         "(integers >= 0)", param="stop_token_ids")
    return tuple(dict.fromkeys(v))


def template_options(body: dict) -> TemplateOptions:
    add = flag(body, "add_generation_prompt", True)
    cont = flag(body, "continue_final_message", False)
    if add and cont and "add_generation_prompt" in body:
        raise BadRequest("cannot set both 'continue_final_message' and 'add_generation_prompt' to true",
                         param="continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise BadRequest(f"'chat_template_kwargs' must be an object of at most {MAX_TEMPLATE_KWARGS} keyword "
                         "arguments", param="chat_template_kwargs")
    for key in kwargs:
        where = f"chat_template_kwargs.{key}" if _IDENTIFIER.match(key) else "chat_template_kwargs"
        if not _IDENTIFIER.match(key):
            raise BadRequest(f"chat_template_kwargs: {clip(key, 64)} is not a template variable name", param=where)
        if key in RESERVED_TEMPLATE_KWARGS:
            raise BadRequest(f"chat_template_kwargs: {key!r} cannot be set here (it is a parameter of the request "
                             "or of the template renderer itself)", param=where)
    return TemplateOptions(add_generation_prompt=add and not cont, continue_final_message=cont, kwargs=dict(kwargs))


def wants_echo(body: dict) -> bool:
    return flag(body, "echo", False)


def echo_text(messages: tuple, template: TemplateOptions) -> str:
    """vLLM's `echo`: the last message's text when it has the answer's role (the assistant's, or,
    without a generation prompt, the last message's own), else nothing."""
    role = "assistant" if template.add_generation_prompt else messages[-1].role
    last = messages[-1]
    return "".join(p.text for p in last.parts if hasattr(p, "text")) if last.role == role else ""


def structured_grammar(body: dict) -> str | None:
    """The grammar of the request's structured output: `response_format`, or one of vLLM's
    `guided_json` / `guided_regex` / `guided_choice` / `structured_outputs` (at most one of them)."""
    given = [k for k in STRUCTURED_ORDER if body.get(k) is not None]
    grammar = grammar_for(body.get("response_format"))
    if grammar is not None:
        given.insert(0, "response_format")
    if len(given) > 1:
        raise BadRequest(f"only one kind of structured output per request: got {', '.join(given)}", param=given[1])
    if not given or grammar is not None:
        return grammar
    key = given[0]
    if key == "structured_outputs":
        return _structured_outputs(body[key])
    if key == "guided_json":
        return json_schema_grammar(_schema(body[key], key), key)
    if key == "guided_regex":
        return regex_grammar(body[key], key)
    if key == "guided_grammar":
        return lark_grammar(body[key], key)
    return choice_grammar(body[key], key)


_SO_FLAGS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


def _structured_outputs(spec: Any) -> str | None:
    if not isinstance(spec, dict):
        raise BadRequest("'structured_outputs' must be an object like {'json': {...schema...}}",
                         param="structured_outputs")
    for key, value in spec.items():
        if key in _SO_FLAGS:
            if value is not None and not isinstance(value, bool):
                raise BadRequest(f"structured_outputs.{key} must be a boolean", param=f"structured_outputs.{key}")
        elif key not in ("json", "regex", "choice", "grammar", "json_object") and value is not None:
            where = f"structured_outputs.{key}" if _IDENTIFIER.match(key) else "structured_outputs"
            raise UnsupportedParameter(f"structured_outputs.{clip(key, 64)} is not supported by mmserve "
                                       "(supported: json, regex, choice, grammar, json_object)", param=where)
    kinds = [k for k in ("json", "regex", "choice", "grammar") if spec.get(k) is not None]
    if spec.get("json_object"):
        kinds.append("json_object")
    if len(kinds) != 1:
        raise BadRequest("'structured_outputs' needs exactly one of json, regex, choice, grammar or json_object; got "
                         f"{', '.join(kinds) or 'none'}", param="structured_outputs")
    kind = kinds[0]
    if kind == "json":
        return json_schema_grammar(_schema(spec["json"], "structured_outputs.json"), "structured_outputs.json")
    if kind == "regex":
        return regex_grammar(spec["regex"], "structured_outputs.regex")
    if kind == "choice":
        return choice_grammar(spec["choice"], "structured_outputs.choice")
    if kind == "grammar":
        return lark_grammar(spec["grammar"], "structured_outputs.grammar")
    return grammar_for({"type": "json_object"})


def _schema(v: Any, param: str) -> dict | bool:
    """A JSON schema given as an object or, as vLLM also takes it, as JSON text."""
    if isinstance(v, str):
        if len(v) > MAX_SCHEMA_TEXT:
            raise BadRequest(f"'{param}' is {len(v)} characters; this server accepts at most {MAX_SCHEMA_TEXT}",
                             param=param)
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):
            raise BadRequest(f"'{param}' is a string that is not JSON (a JSON schema is expected)",
                             param=param) from None
    if not isinstance(v, (dict, bool)):
        raise BadRequest(f"'{param}' must be a JSON schema (an object)", param=param)
    return v

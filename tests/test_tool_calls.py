"""Tool calling without a server: the request's tools and tool messages (every mistake a 400 naming
its parameter), the call grammar (whatever a model picks within it parses and validates), the
hermes parser (streamed in any pieces it finds the same calls, and its markup never reaches the
content), the demo template's rendering of tools and calls, and the stream a caller reads — the
`auto` path on hermes markup, which the demo models never write by themselves."""

from __future__ import annotations

import dataclasses
import json
import random

import jsonschema
import pytest
import trio
from hypothesis import given, settings, strategies as st
from transformers import AutoTokenizer

from mmserve.actors.intake import hf_messages, hf_tools
from mmserve.actors.messages import FinishEvent, RequestHandle, TokenEvent, Usage
from mmserve.api import openai_json
from mmserve.config import Config, LimitsConfig, ModelConfig
from mmserve.errors import BadRequest
from mmserve.generation.grammar import Grammars
from mmserve.generation.tool_calls import HermesParser, call_grammar, closed
from mmserve.inputs.request import parse_chat_request
from mmserve.inputs.tools import bind_tools
from mmserve.models.adapter import Adapter
from mmserve.models.demo import checkpoint_dir
from mmserve.runtime.stream import ChatStream, complete

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
# a pydantic-style schema: a nested model under $defs, no additionalProperties anywhere
SHAPE = {"type": "function", "function": {"name": "report", "parameters": {
    "$defs": {"Point": {"properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                       "y": {"type": "integer", "minimum": 0, "maximum": 99}},
                        "required": ["x", "y"], "title": "Point", "type": "object"}},
    "properties": {"color": {"enum": ["red", "green"], "type": "string"}, "at": {"$ref": "#/$defs/Point"},
                   "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["color", "at", "tags"], "title": "Report", "type": "object"}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def parse(**body):
    body.setdefault("messages", USER)
    return parse_chat_request(body, LimitsConfig(), "demo")


def bound(parser="hermes", **body):
    r = parse(**body)
    return bind_tools(r.tools, r.model, parser)


# -- parsing and validation ----------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["f"]}, "tools[0]"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[1].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [*USER, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages[0].tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": "x"}, *USER]}, "messages[1].tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}, *USER]},
     "messages[1].tool_calls[0].id"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}, *USER]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}]},
                   *USER]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c", "content": [{"type": "image_url", "image_url": {
        "url": "data:,"}}]}]}, "messages[1].content[0]"),
    ({"messages": [*USER, {"role": "assistant", "function_call": {"name": "f"}}, *USER]}, "messages[1].function_call"),
])
def test_bad_tool_requests_name_their_parameter(body, param):
    with pytest.raises(BadRequest) as info:
        parse(**body)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_tools_parse_with_their_defaults():
    r = parse(tools=[WEATHER, SHAPE])
    assert (r.tools.choice, r.tools.parallel, [f.name for f in r.tools.functions]) == ("auto", True, ["get_weather", "report"])
    assert r.tools.rendered()[0] == WEATHER and r.sampling.grammar is None
    assert parse(tools=[], tool_choice="auto").tools is None  # nothing to call: a plain request
    assert parse(tool_choice="none").tools is None
    named = parse(tools=[WEATHER, SHAPE], tool_choice={"type": "function", "function": {"name": "report"}},
                  parallel_tool_calls=False).tools
    assert (named.choice, named.name, named.parallel, [f.name for f in named.forced()]) == ("function", "report", False, ["report"])
    none = parse(tools=[WEATHER], tool_choice="none").tools
    assert none.rendered() is None and not none.parsed  # the model is not shown tools it may not call


def test_binding_to_the_model():
    with pytest.raises(BadRequest) as info:
        bound(parser=None, tools=[WEATHER])  # auto needs a parser
    assert info.value.param == "tool_choice" and "tool_parser" in info.value.message
    tools, grammar = bound(parser="hermes", tools=[WEATHER])
    assert (tools.parser, grammar) == ("hermes", None)
    tools, grammar = bound(parser=None, tools=[WEATHER], tool_choice="required")  # a grammar needs no parser
    assert tools.parser == "hermes" and grammar
    assert bound(parser=None, tools=[WEATHER], tool_choice="none") == (parse(tools=[WEATHER], tool_choice="none").tools, None)


def test_history_with_calls_and_tool_messages():
    r = parse(tools=[WEATHER], messages=[
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
    ])
    hf = hf_messages(r)
    assert hf[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}
    assert hf[2:] == [{"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                      {"role": "tool", "content": "rain", "tool_call_id": "call_2"}]


class _Template:
    """The parts of an adapter that `hf_tools` and `renders_tools` use, over a chat template."""

    renders_tools = Adapter.renders_tools
    name = "stub"

    def __init__(self, template: str):
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir("demo"))
        self.tokenizer.chat_template = template

    def _render(self, messages, generation_prompt, tools=None):
        return Adapter._render(self, messages, generation_prompt, tools)


def test_a_template_that_ignores_tools_is_refused():
    blind = _Template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert not blind.renders_tools
    with pytest.raises(BadRequest) as info:
        hf_tools(blind, parse(tools=[WEATHER]))
    assert info.value.param == "tools" and "does not render" in info.value.message
    assert hf_tools(blind, parse(tools=[WEATHER], tool_choice="none")) is None  # not shown: nothing to refuse


def test_demo_template_renders_tools_calls_and_tool_messages():
    tok = AutoTokenizer.from_pretrained(checkpoint_dir("demo"))
    assert tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False) == \
        "<s>user: What is the weather in Paris?\nassistant:"  # without tools: as trained
    history = [{"role": "system", "content": "Be brief."}, *USER,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = tok.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<s>system: Be brief.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(WEATHER) + "\n</tools>\n" in text
    assert text.endswith('\nuser: What is the weather in Paris?\nassistant: <tool_call>\n{"name":"get_weather",'
                         '"arguments":{"city":"Paris"}}\n</tool_call></s>\ntool: <tool_response>\nsunny\n'
                         '</tool_response>\nassistant:')
    assert _Template(tok.chat_template).renders_tools


# -- the grammar of a forced call -----------------------------------------------------------------

@pytest.fixture(scope="module")
def grammars():
    tok = AutoTokenizer.from_pretrained(checkpoint_dir("demo"))
    return tok, Grammars(tok, len(tok), [tok.eos_token_id])


def _accepts(grammars, grammar: str, text: str) -> bool:
    tok, g = grammars
    m = g.matcher(grammar)
    ids = tok.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_grammar_accepts_calls_and_nothing_else(grammars):
    fns = parse(tools=[WEATHER, SHAPE]).tools.functions
    one, many = call_grammar(fns, parallel=False), call_grammar(fns, parallel=True)
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    other = '<tool_call>\n{"name":"report","arguments":{"color":"red","at":{"x":1,"y":2},"tags":[true]}}\n</tool_call>'
    for text in (call, " " + call, other):
        assert _accepts(grammars, one, text) and _accepts(grammars, many, text)
    assert _accepts(grammars, many, call + "\n" + other) and not _accepts(grammars, one, call + "\n" + other)
    for wrong in ["Paris", call.replace("get_weather", "get_time"), call.replace('"Paris"', '"Paris","x":1'),
                  call.replace('{"city":"Paris"}', "{}"), call.replace('"Paris"', '"a very long city"'),
                  other.replace('"y":2', '"y":200'), call.replace("\n</tool_call>", "")]:
        assert not _accepts(grammars, many, wrong), wrong


STRICT = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}


@pytest.mark.parametrize("parameters, rule", [
    ({"type": "object", "properties": {"city": {"type": "string"}}, "required": []}, "required"),
    ({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "additionalProperties"),
])
def test_a_strict_function_follows_openais_strict_rules_as_response_format_does(parameters, rule):
    with pytest.raises(BadRequest) as info:
        parse(tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": parameters}}])
    assert info.value.param.startswith("tools[0].function.parameters") and rule in info.value.message
    # the same schema without strict is taken (its objects closed, as always)
    parse(tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}])


def test_auto_with_a_strict_function_is_text_or_calls_that_validate(grammars):
    tools, grammar = bound(tools=[STRICT, WEATHER | {"function": {**WEATHER["function"], "name": "loose"}}])
    assert grammar is not None and tools.parser == "hermes" and tools.choice == "auto"
    assert bound(tools=[WEATHER])[1] is None  # no strict tool: "auto" stays free
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":2}}\n</tool_call>'
    loose = '<tool_call>\n{"name":"loose","arguments":{"anything":[1]}}\n</tool_call>'
    for text in ("It is sunny.", "", call, " " + call, call + "\n" + loose):
        assert _accepts(grammars, grammar, text), text
    for wrong in (call.replace(',"days":2', ""), call.replace("2}", '"two"}'), call.replace("Paris", 'Paris","x":"1'),
                  "Sure: " + call, loose.replace("loose", "other")):
        assert not _accepts(grammars, grammar, wrong), wrong


def test_closing_objects_leaves_explicit_ones_alone():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object", "additionalProperties": True, "properties": {}},
                                               "c": {"type": "object"}, "d": {"const": {"properties": {}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["additionalProperties"] is True and "additionalProperties" not in out["properties"]["c"]
    assert out["properties"]["d"] == {"const": {"properties": {}}}  # a value, not a schema


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), parallel=st.booleans(), named=st.booleans())
def test_whatever_the_model_picks_within_the_grammar_parses_and_validates(grammars, seed, parallel, named):
    """A random walk over the tokens the grammar allows (any model's choices), to its end: the
    answer is calls only, of the allowed functions, whose arguments validate."""
    import llguidance.numpy as lnp

    tok, g = grammars
    body = {"tools": [WEATHER, SHAPE], "tool_choice": "required", "parallel_tool_calls": parallel}
    if named:
        body["tool_choice"] = {"type": "function", "function": {"name": "report"}}
    tools, grammar = bound(**body)
    m, rng, ids = g.matcher(grammar), random.Random(seed), []
    while not m.is_stopped() and len(ids) < 3000:
        mask = lnp.allocate_token_bitmask(1, g.vocab_size)
        lnp.fill_next_token_bitmask(m, mask, 0)
        allowed = [t for t in range(g.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
        if tok.eos_token_id in allowed and rng.random() < 0.5:
            break
        token = rng.choice([t for t in allowed if t != tok.eos_token_id] or allowed)
        if token == tok.eos_token_id:
            break
        assert m.consume_token(token)
        ids.append(token)
    assert m.is_accepting(), "the walk did not finish within 3000 tokens"
    parser = HermesParser()
    content, _ = parser.feed(tok.decode(ids))
    tail, _ = parser.finish()
    assert content + tail == "" and parser.calls and (parallel or len(parser.calls) == 1)
    schemas = {f.name: f.parameters for f in tools.functions}
    for call in parser.calls:
        assert call.name in ([f.name for f in tools.forced()])
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


# -- the hermes parser -----------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "t": [1, {"a": "}"}]}}\n</tool_call>'
PARSES = [
    ("plain text, no markup", "plain text, no markup", []),
    ("a < b and <tool is not a tag", "a < b and <tool is not a tag", []),
    (CALL, "", [("get_weather", '{"city": "Paris", "t": [1, {"a": "}"}]}')]),
    ("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n", "Let me check.",
     [("get_weather", '{"city": "Paris", "t": [1, {"a": "}"}]}'), ("get_weather", '{"city": "Rome", "t": [1, {"a": "}"}]}')]),
    ('<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>', "", [("f", '{"q": 1}')]),  # other key order
    ('<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>', "", [("f", '{"q": 1}')]),  # a JSON string
    ("a <tool_call>not a call</tool_call> b", "a <tool_call>not a call</tool_call> b", []),  # not a call: content
    ('x <tool_call>{"name": "f", "arguments": {"q": "cut off', "x", [("f", '{"q": "cut off')]),  # max_tokens mid-call
    ('<tool_call>{"name": "f", "arguments": {}}', "", [("f", "{}")]),  # no closing tag
    ("x <tool_call>{\"na", "x <tool_call>{\"na", []),  # ended before it was a call
]


def _run(text: str, cuts: list[int]):
    parser, content, calls = HermesParser(), [], {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for out in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content.append(out[0])
        for d in out[1]:
            if d.id is not None:
                assert d.index not in calls and d.arguments == ""  # the first piece: id and name
                calls[d.index] = [d.id, d.name, ""]
            else:
                calls[d.index][2] += d.arguments
    assert [(c.id, c.name, c.arguments) for c in parser.calls] == [tuple(calls[i]) for i in sorted(calls)]
    return "".join(content), [(n, a) for _, n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("text, content, calls", PARSES)
def test_hermes_parser(text, content, calls):
    assert _run(text, []) == (content, calls)


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(PARSES), data=st.data())
def test_any_streaming_of_a_text_finds_the_same_calls(case, data):
    text, content, calls = case
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=30))))
    assert _run(text, cuts) == (content, calls)


WORDS = st.sampled_from(["hi", " ", "\n", "<", "tool", "_call", ">", "{", "}", '"', "a", "<tool_call>", "</tool_call>"])


@settings(max_examples=300, deadline=None)
@given(prose=st.lists(st.lists(WORDS, max_size=6).map("".join), min_size=1, max_size=4),
       args=st.lists(st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=6), max_size=3), max_size=3),
       data=st.data())
def test_calls_between_prose_never_leak_markup(prose, args, data):
    """Well-formed calls between arbitrary prose come out as calls with their arguments exactly,
    and none of their markup is in the content."""
    calls = [f'<tool_call>\n{json.dumps({"name": f"fn{i}", "arguments": a})}\n</tool_call>' for i, a in enumerate(args)]
    prose = [p.replace("<tool_call>", "").replace("</tool_call>", "") for p in prose]
    prose = [p.replace("<tool_call", "") for p in prose]  # a tag split by a call's own markup
    text = prose[0] + "".join(c + (prose[i + 1] if i + 1 < len(prose) else "") for i, c in enumerate(calls))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=20))))
    content, found = _run(text, cuts)
    assert [n for n, _ in found][:len(args)] == [f"fn{i}" for i in range(len(args))]
    assert [json.loads(a) for _, a in found[:len(args)]] == args
    for call in calls:
        assert call not in content and '"arguments"' not in content


# -- the stream a caller reads (the `auto` path) -------------------------------------------------

async def _answer(texts_by_choice: list[list[str]], **body):
    body = {"messages": USER, "tools": [WEATHER], **body}
    request = parse_chat_request(body, LimitsConfig(), "demo")
    tools, _ = bind_tools(request.tools, "demo", "hermes")
    request = dataclasses.replace(request, tools=tools)
    send, receive = trio.open_memory_channel(1000)
    handle = RequestHandle("r1", request, send)
    for i, texts in enumerate(texts_by_choice):
        for t in texts:
            handle.emit(TokenEvent(t, 5, i))
        handle.emit(FinishEvent("stop", Usage(10, len(texts)), index=i))
    return ChatStream(handle, receive)


async def test_auto_answers_become_calls_in_the_completion_and_the_stream():
    said = ["I'll look.", "\n<tool", '_call>\n{"name": "get_weather", "argu', 'ments": {"city": "Pa', 'ris"}}\n</tool',
            "_call>\n"]
    done = await complete(await _answer([said, ["It is sunny."]], n=2))
    body = openai_json.completion(done)
    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "I'll look."
    [call] = first["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert (second["index"], second["finish_reason"]) == (1, "stop")
    assert second["message"]["content"] == "It is sunny." and "tool_calls" not in second["message"]
    only_calls = openai_json.completion(await complete(await _answer([said[1:]])))
    assert only_calls["choices"][0]["message"]["content"] is None

    deltas = [d async for d in await _answer([said])]
    pieces = [openai_json.tool_call_delta(p) for d in deltas for p in d.tool_calls]
    assert pieces[0] == {"index": 0, "id": pieces[0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}
    assert len(pieces) > 2 and all(set(p) == {"index", "function"} for p in pieces[1:])  # arguments streamed in pieces
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Paris"}'
    assert "".join(d.text for d in deltas) == "I'll look." and deltas[-1].finish_reason == "tool_calls"


async def test_tool_choice_none_reads_nothing_into_the_text():
    said = ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>']
    done = await complete(await _answer([said], tool_choice="none"))
    assert done.choices[0].text == said[0] and not done.choices[0].tool_calls and done.finish_reason == "stop"


def test_tool_parser_config():
    assert ModelConfig("m", "/x", tool_parser="hermes").tool_parser == "hermes"
    with pytest.raises(ValueError, match="tool_parser"):
        ModelConfig("m", "/x", tool_parser="mistral")
    assert Config().models[0].tool_parser == "hermes"  # the built-in demo's template writes hermes markup


SCHEMA = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(["object", "string", "integer", "#", "#/x"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "properties", "items", "$ref", "enum", "required", "additionalProperties", "anyOf",
                         "$defs", "maxLength", "minimum", "const"]) | st.text(max_size=3), inner, max_size=4),
    max_leaves=15)
TOOL = st.fixed_dictionaries({"type": st.just("function") | st.text(max_size=3), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"]) | st.text(max_size=4)},
    optional={"parameters": SCHEMA, "description": SCHEMA, "strict": SCHEMA})})


@settings(max_examples=300, deadline=None)
@given(tools=st.lists(TOOL, max_size=3), choice=st.sampled_from(["auto", "required", "none", {"type": "function",
       "function": {"name": "f"}}]) | SCHEMA, parallel=st.none() | st.booleans() | SCHEMA)
def test_any_tools_are_accepted_whole_or_refused_with_a_400(grammars, tools, choice, parallel):
    """Whatever tools a caller sends, parsing and binding either succeed — and then a forced
    call's grammar makes a matcher for the model — or raise a 400 naming the parameter."""
    try:
        r, grammar = bound(tools=tools, tool_choice=choice, parallel_tool_calls=parallel)
    except BadRequest as e:
        assert e.status == 400 and e.param and e.message
        return
    if grammar is not None:
        grammars[1].matcher(grammar)


def test_a_request_parsed_elsewhere_is_bound_when_it_starts():
    from types import SimpleNamespace

    from mmserve.runtime.runtime import Runtime

    rt = SimpleNamespace(config=Config(), _bind_tools=None)
    request = parse(tools=[WEATHER], tool_choice="required")
    assert request.tools.parser is None and request.sampling.grammar is None  # as parse_chat_request leaves it
    bound_request = Runtime._bind_tools(rt, request)
    assert bound_request.tools.parser == "hermes" and bound_request.sampling.grammar
    assert Runtime._bind_tools(rt, bound_request) is bound_request  # once

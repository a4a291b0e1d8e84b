"""Tool calling end to end over a real socket, with the official `openai` client, langchain-openai
(when the `clients` extra is installed) and the request bodies instructor and LangChain send
(recorded in tests/fixtures), against the trained demo model.

`required` and a named function are grammar-constrained: whatever the demo model (which was never
trained on tools) picks, its answer is calls whose arguments validate against the schema. The demo
model never writes hermes markup by itself, so `auto` here checks that plain answers stay plain
content; the parser on markup is tested in tests/test_tool_calls.py (strings, and the stream a
caller reads).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from mmserve.actors.intake import hf_messages, hf_tools
from mmserve.models.demo import COLORS, Q_COLOR, SHAPES, render_image
from tests.helpers import ServerThread, colour_question, data_url

FIXTURES = Path(__file__).parent / "fixtures"
REPORT = {"type": "function", "function": {
    "name": "report_shape", "description": "Report the colour and the kind of the shape in the image",
    "parameters": {"type": "object", "properties": {"color": {"type": "string", "enum": list(COLORS)},
                                                    "shape": {"type": "string", "enum": list(SHAPES)}},
                   "required": ["color", "shape"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (REPORT, WEATHER)}
PROMPTS = [colour_question(c, s, seed=i) for i, (c, s) in enumerate(zip(COLORS, SHAPES * 2))]


@pytest.fixture(scope="module")
def server(demo_config):
    """`demo` with the hermes tool parser; `demo-wide` without one (its `auto` is refused)."""
    demo, wide = demo_config.models
    with ServerThread(demo_config.replace(models=(dataclasses.replace(demo, tool_parser="hermes"), wide))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_calls(choice, names, single: bool = False):
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and (len(calls) == 1 or not single)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.parametrize("messages", PROMPTS)
def test_required_and_named_calls_validate_against_the_schema(client, messages):
    for choice, parallel, names in [("required", True, {"report_shape", "get_weather"}),
                                    ({"type": "function", "function": {"name": "get_weather"}}, False, {"get_weather"}),
                                    ({"type": "function", "function": {"name": "report_shape"}}, True, {"report_shape"})]:
        r = client.chat.completions.create(model="demo", messages=messages, tools=[REPORT, WEATHER], tool_choice=choice,
                                           parallel_tool_calls=parallel, temperature=0, max_tokens=200)
        _check_calls(r.choices[0], names, single=not parallel)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.usage.completion_tokens > 10


def test_streamed_deltas_reassemble_to_the_same_calls(client):
    kw = dict(model="demo", messages=PROMPTS[1], tools=[REPORT, WEATHER], tool_choice="required", temperature=0,
              max_tokens=200)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    calls: dict[int, dict] = {}
    for c in chunks:
        for piece in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if piece.index not in calls:  # the first chunk of a call: its id, type, name and no arguments yet
                assert piece.id.startswith("call_") and piece.type == "function" and piece.function.arguments == ""
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments
    assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices) > 2 * len(calls)  # in pieces
    expected = [(t.function.name, t.function.arguments) for t in _check_calls(whole.choices[0], SCHEMAS)]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_every_choice_calls(client):
    r = client.chat.completions.create(model="demo", messages=PROMPTS[2], tools=[REPORT, WEATHER], n=3, seed=7,
                                       temperature=1, tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        _check_calls(choice, SCHEMAS, single=True)
    assert r.usage.completion_tokens > 3 * 10  # every choice's answer counted


HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'}}]},
    {"role": "tool", "tool_call_id": "call_a1", "content": "sunny, 24 C"},
    {"role": "user", "content": "And tomorrow?"},
]


def test_a_history_with_calls_and_tool_results_renders_through_the_template(client, server):
    body = {"model": "demo", "messages": HISTORY, "tools": [WEATHER], "temperature": 0, "max_tokens": 8}
    r = client.chat.completions.create(**body)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None
    rt = server.runtime
    adapter = rt.registry.require("demo").adapter
    request = rt.parse(body)
    prompt = adapter.render_prompt(hf_messages(request), hf_tools(adapter, request))
    assert prompt.startswith("<s>system: # Tools\n") and json.dumps(WEATHER) in prompt
    assert prompt.endswith('user: What is the weather in Paris?\nassistant: <tool_call>\n{"name":"get_weather",'
                           '"arguments":{"city":"Paris","days":1}}\n</tool_call></s>\ntool: <tool_response>\n'
                           'sunny, 24 C\n</tool_response>\nuser: And tomorrow?\nassistant:')
    assert r.usage.prompt_tokens == len(adapter.tokenizer(prompt)["input_ids"])  # what was served


def test_tool_choice_none_and_auto_give_plain_content(client):
    plain = client.chat.completions.create(model="demo", messages=colour_question("green"), temperature=0)
    none = client.chat.completions.create(model="demo", messages=colour_question("green"), temperature=0,
                                          tools=[REPORT], tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content == "green"
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # "none": the tools are not shown
    for stream in (False, True):  # auto: the demo model answers in words, read by the hermes parser
        r = client.chat.completions.create(model="demo", messages=colour_question("blue"), temperature=0,
                                           tools=[REPORT], stream=stream)
        if stream:
            chunks = list(r)
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == "blue"
            assert not any(c.choices[0].delta.tool_calls for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"
        else:
            assert r.choices[0].message.content == "blue" and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("change, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools[0].function.name"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"model": "demo-wide"}, "tool_choice"),  # auto on a model without a tool_parser
    ({"messages": [*HISTORY[:2], {"role": "tool", "content": "sunny"}]}, "messages[2].tool_call_id"),
])
def test_bad_tool_requests_are_400_naming_the_parameter(client, change, param):
    body = {"model": "demo", "messages": colour_question("red"), "tools": [REPORT], **change}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            r = client.chat.completions.create(**body, stream=stream)
            list(r) if stream else None
        assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


def _replay(server, name: str, color: str, shape: str) -> dict:
    body = json.loads((FIXTURES / name).read_text())["body"]
    url = data_url(render_image(color, shape))
    text = json.dumps(body).replace("data:image/png;base64,IMAGE", url)
    r = httpx.post(server.url + "/v1/chat/completions", content=text, timeout=120,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("fixture", ["instructor_tools_request.json", "langchain_bind_tools_request.json"])
def test_recorded_client_requests(server, fixture):
    """instructor's TOOLS mode (it cannot be installed beside this venv's openai: it pins
    openai<4 and jiter<0.15) and LangChain's bind_tools, as they send them: the answer is
    what each parses — the first call's arguments validate against the pydantic model's schema."""
    schema = json.loads((FIXTURES / fixture).read_text())["body"]["tools"][0]["function"]["parameters"]
    for i, (color, shape) in enumerate(zip(COLORS * 2, SHAPES * 4)):
        choice = _replay(server, fixture, color, shape)["choices"][0]
        assert choice["finish_reason"] == "tool_calls"  # instructor raises IncompleteOutputException on "length"
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "ShapeReport"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_langchain_bind_tools(server):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel
    from typing import Literal

    class ShapeReport(BaseModel):
        """The colour and kind of the shape in the image."""
        color: Literal[COLORS]  # type: ignore[valid-type]
        shape: Literal[SHAPES]  # type: ignore[valid-type]

    llm = lc.ChatOpenAI(model="demo", base_url=server.url + "/v1", api_key="unused", temperature=0, max_retries=0)
    messages = [("user", [{"type": "image_url", "image_url": {"url": data_url(render_image("purple", "square"))}},
                          {"type": "text", "text": Q_COLOR}])]
    for tool_choice in ("ShapeReport", "any"):  # named, and LangChain's "any" (sent as "required")
        bound = llm.bind_tools([ShapeReport], tool_choice=tool_choice)
        msg = bound.invoke(messages)
        [call] = msg.tool_calls
        assert call["name"] == "ShapeReport" and call["id"].startswith("call_")
        ShapeReport.model_validate(call["args"])
        streamed = None
        for chunk in bound.stream(messages):
            streamed = chunk if streamed is None else streamed + chunk
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    structured = llm.with_structured_output(ShapeReport, method="function_calling").invoke(messages)
    assert isinstance(structured, ShapeReport)


def test_a_streamed_answer_of_only_calls_has_null_content_as_the_whole_one(client, server):
    """OpenAI's stream of an answer that is only calls opens with `content: null` (beside the
    first call), so a client joining the deltas gets None, as in the non-streamed message."""
    kw = dict(model="demo", messages=PROMPTS[0], tools=[REPORT], tool_choice="required", temperature=0,
              max_tokens=200)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert client.chat.completions.create(**kw).choices[0].message.content is None
    # plain text still opens with content ""
    plain = list(client.chat.completions.create(model="demo", messages=PROMPTS[0], tools=[REPORT], tool_choice="none",
                                                temperature=0, max_tokens=5, stream=True))
    assert plain[0].choices[0].delta.content == "" and "".join(c.choices[0].delta.content or "" for c in plain)


@pytest.mark.parametrize("messages", [
    [{"role": "tool", "content": "x", "tool_call_id": "1"}],
    [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x", "tool_call_id": "call_a1"}],
    [*HISTORY[:2], {"role": "tool", "tool_call_id": "call_other", "content": "sunny"}],
])
def test_a_tool_message_answering_no_earlier_call_is_a_400(client, messages):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=messages, max_tokens=4)
    assert info.value.body["param"] == f"messages[{len(messages) - 1}].tool_call_id"
    assert "earlier" in info.value.body["message"]


def test_auto_with_a_strict_tool_answers_through_its_grammar(client):
    """The demo model never writes calls by itself: under the strict "auto" grammar its answer
    stays the plain text it would give (text that opens no call is the grammar's other branch)."""
    strict = {"type": "function", "function": dict(REPORT["function"], strict=True, parameters=dict(
        REPORT["function"]["parameters"], additionalProperties=False))}
    free = client.chat.completions.create(model="demo", messages=PROMPTS[3], temperature=0, max_tokens=8)
    r = client.chat.completions.create(model="demo", messages=PROMPTS[3], tools=[strict], temperature=0, max_tokens=8)
    assert r.choices[0].message.content == free.choices[0].message.content and not r.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as info:  # a schema strict mode refuses, as response_format's
        client.chat.completions.create(model="demo", messages=PROMPTS[3], tools=[
            {"type": "function", "function": dict(REPORT["function"], strict=True)}])
    assert info.value.body["param"].startswith("tools[0].function.parameters")

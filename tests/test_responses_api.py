"""OpenAI's Responses API (`POST /v1/responses`) end to end over a real socket, with the official
`openai` client (`responses.create`, `responses.stream`) against the trained demo model, images
included. Every answer and every stream event is validated as the `openai` package's own type,
strictly: no field it does not define, none it requires missing, none of the wrong type."""

from __future__ import annotations

import dataclasses
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from mmserve.models.demo import COLORS, SHAPES, Q_COLOR, render_image
from tests.helpers import ServerThread, data_url

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}
REPORT = {"type": "function", "name": "report_shape", "strict": True,
          "parameters": {"type": "object", "properties": {"color": {"type": "string", "enum": list(COLORS)},
                                                          "shape": {"type": "string", "enum": list(SHAPES)}},
                         "required": ["color", "shape"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, REPORT)}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(demo_config):
    demo, wide = demo_config.models
    with ServerThread(demo_config.replace(models=(dataclasses.replace(demo, tool_parser="hermes"), wide))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def image_input(color: str, shape: str = "circle", seed: int = 0, question: str = Q_COLOR) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(render_image(color, shape, seed=seed))},
        {"type": "input_text", "text": question}]}]


def no_extra(obj, path: str = "") -> None:
    """Every model in `obj` holds only fields its type defines (openai's models allow extras)."""
    if isinstance(obj, BaseModel):
        assert not obj.model_extra, f"{path}: fields the openai type does not define: {obj.model_extra}"
        for name in type(obj).model_fields:
            no_extra(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            no_extra(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, x in obj.items():
            no_extra(x, f"{path}.{k}")


def strict_response(body: dict) -> Response:
    r = Response.model_validate(body, strict=True)
    no_extra(r, "response")
    return r


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json=body, timeout=120)


def sse_events(server, body: dict) -> list:
    """The stream's events, each validated strictly; its `event:` lines must match the types."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                event = EVENTS.validate_python(data, strict=True)
                no_extra(event, name)
                events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


@pytest.mark.parametrize("color", ["red", "blue"])
def test_an_image_question_answered_as_a_response(client, server, color):
    body = {"model": "demo", "input": image_input(color, "square", seed=3), "temperature": 0}
    raw = post(server, body)
    assert raw.status_code == 200, raw.text
    r = strict_response(raw.json())
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed" and r.model == "demo"
    assert color in r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    u = r.usage
    assert u.input_tokens > 16 and u.output_tokens >= 1 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    assert raw.headers["x-request-id"] == r.id.removeprefix("resp_")
    # and through the official client
    again = client.responses.create(model="demo", input=image_input(color, "square", seed=3), temperature=0)
    assert again.output_text == r.output_text


def test_streamed_events_rebuild_the_same_response(client, server):
    body = {"model": "demo", "input": image_input("purple", "triangle", seed=5), "temperature": 0,
            "instructions": "Answer briefly."}
    whole = strict_response(post(server, body).json())
    events = sse_events(server, body)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.usage is None
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[-1].response.instructions == "Answer briefly."
    with client.responses.stream(model="demo", input=body["input"], instructions="Answer briefly.",
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text


def test_a_required_call_is_a_function_call_item_whose_arguments_validate(client, server):
    body = {"model": "demo", "input": image_input("green", "square", seed=2), "tools": [WEATHER, REPORT],
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 200}
    r = strict_response(post(server, body).json())
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed" and not r.output_text
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "report_shape"]
    # streamed: an item added, its arguments in pieces, then done with the same call
    events = sse_events(server, body)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call" and added[0].item.arguments == ""
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 2 and "".join(pieces) == call.arguments
    done = next(e for e in events if e.type == "response.output_item.done").item
    assert (done.name, done.arguments, done.status) == (call.name, call.arguments, "completed")
    # the official client's stream helper accumulates the same call
    with client.responses.stream(**{k: v for k, v in body.items() if k != "model"}, model="demo") as stream:
        final = stream.get_final_response()
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == [(call.name, call.arguments)]


def test_a_named_function_and_a_history_of_calls_and_outputs(client, server):
    r = client.responses.create(model="demo", input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                max_output_tokens=200)
    no_extra(r)
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather"
    # the next turn sends the whole history: the call and its output as items
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}]
    after = client.responses.create(model="demo", input=history, tools=[WEATHER], temperature=0,
                                    max_output_tokens=8)
    no_extra(after)
    assert after.output[0].type == "message" and after.usage.input_tokens > r.usage.input_tokens
    # an output that answers no call is refused, as OpenAI does, naming the item
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="demo", input=history[:1] + history[2:], tools=[WEATHER])
    assert info.value.body["param"] == "input[1].call_id"


def test_text_format_json_schema_and_max_output_tokens(client, server):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": list(COLORS)}},
              "required": ["color"], "additionalProperties": False}
    body = {"model": "demo", "input": image_input("yellow", "circle", seed=9), "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}}}
    r = strict_response(post(server, body).json())
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "colour"
    cut = strict_response(post(server, {"model": "demo", "input": image_input("yellow"), "max_output_tokens": 1,
                                        "temperature": 0, "include": ["message.output_text.logprobs"],
                                        "top_logprobs": 2}).json())
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 1 and cut.max_output_tokens == 1 and cut.output[0].status == "incomplete"
    logprobs = cut.output[0].content[0].logprobs
    assert len(logprobs) == 1 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in logprobs)
    events = sse_events(server, {"model": "demo", "input": image_input("yellow"), "max_output_tokens": 1})
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 1


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"tools": [{"type": "computer_use_preview"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"n": 2}, "n"),
    ({"priority": 2.5}, "priority"),
    ({"tools": [dict(WEATHER, defer_loading=True)]}, "tools[0].defer_loading"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]"),  # chat's nested shape
    ({"metadata": {"k": 1}}, "metadata"),
    # the chat parser's and the intake's refusals name the Responses item, not the chat message
    ({"instructions": "x", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,aGVsbG8="}]}]}, "input[1].content (image 0)"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "ftp://x/a.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "assistant", "content": "hi"}]}, "input"),
])
def test_what_mmserve_cannot_do_is_a_400_naming_it(server, body, param):
    r = post(server, {"model": "demo", "input": "hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    kind = body.get("tools", [{}])[0].get("type") or (body.get("tool_choice") or {}).get("type")
    if kind and kind != "function":  # a built-in tool is named
        assert kind in error["message"]


def test_vllm_request_id_and_an_include_of_no_reasoning(server):
    r = post(server, {"model": "demo", "input": "red", "max_output_tokens": 2, "request_id": "resp-job-1",
                      "include": ["reasoning.encrypted_content"]})
    assert r.status_code == 200 and r.headers["x-request-id"] == "resp-job-1"
    assert all(o.type == "message" for o in strict_response(r.json()).output)


def test_errors_through_the_official_client(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="demo", input="hi", previous_response_id="resp_1")
    assert "does not store responses" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_123")
    assert info.value.body["code"] == "not_found" and "not stored" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_123")


def test_a_langchain_shaped_request_with_bound_tools(server):
    """The body langchain-openai's `ChatOpenAI(use_responses_api=True).bind_tools([...])` sends
    (langchain-openai is not installed here, so this is its documented shape, not a live client):
    messages as `type: message` items, flat function tools with `strict` unset, and `stream`."""
    body = {"model": "demo", "stream": False, "temperature": 0.0,
            "input": [{"type": "message", "role": "developer", "content": "You report shapes."},
                      {"type": "message", "role": "user", "content": [
                          {"type": "input_text", "text": Q_COLOR},
                          {"type": "input_image", "image_url": data_url(render_image("red", "square")),
                           "detail": "auto"}]}],
            "tools": [{"type": "function", "name": "report_shape", "description": "Report the shape",
                       "parameters": REPORT["parameters"]}],
            "tool_choice": "required"}
    r = strict_response(post(server, body).json())
    call = next(o for o in r.output if o.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), REPORT["parameters"])


def test_langchain_use_responses_api_with_bind_tools(server):
    """Live, with langchain-openai (the `clients` extra; skipped without it)."""
    lc = pytest.importorskip("langchain_openai")
    from typing import Literal

    class ShapeReport(BaseModel):
        """The colour and kind of the shape in the image."""
        color: Literal[COLORS]  # type: ignore[valid-type]
        shape: Literal[SHAPES]  # type: ignore[valid-type]

    llm = lc.ChatOpenAI(model="demo", base_url=server.url + "/v1", api_key="unused", temperature=0, max_retries=0,
                        use_responses_api=True)
    messages = [("user", [{"type": "image_url", "image_url": {"url": data_url(render_image("purple", "square"))}},
                          {"type": "text", "text": Q_COLOR}])]
    assert "purple" in llm.invoke(messages).text
    bound = llm.bind_tools([ShapeReport], tool_choice="any")
    [call] = bound.invoke(messages).tool_calls
    assert call["name"] == "ShapeReport"
    ShapeReport.model_validate(call["args"])
    streamed = None
    for chunk in bound.stream(messages):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]

"""JSON schemas as users write them: objects without `additionalProperties` are closed at every
level (as xgrammar and vLLM do), and `strict: true` follows OpenAI's structured-output rules (a
schema OpenAI would refuse is a 400 naming the rule and where it is broken). End to end: a plain
pydantic model's schema, sent as instructor's JSON_SCHEMA mode sends it, parses 16 of 16 times."""

import copy
import json
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from mmserve.config import LimitsConfig
from mmserve.errors import BadRequest
from mmserve.generation.grammar import Grammars, MaskJob, json_schema_grammar
from mmserve.generation.json_schema import check_strict, close_objects
from mmserve.inputs.request import parse_chat_request
from mmserve.models.demo import COLORS, Q_COLOR, Q_SHAPE, render_image
from tests.conftest import _demo_dir
from tests.helpers import data_url, run_concurrently

FIXTURE = Path(__file__).parent / "fixtures" / "instructor_json_schema.json"
P = "response_format.json_schema.schema"


class Shape(BaseModel):
    color: Literal["red", "green", "blue", "yellow", "purple", "orange"]
    shape: Literal["circle", "square", "triangle"]


class Inner(BaseModel):
    x: int


class Nested(BaseModel):
    inner: Inner
    items: list[Inner]
    maybe: Inner | None = None


def fmt(schema, strict=None):
    spec = {"name": "answer", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def parse(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_chat_request(body, LimitsConfig(), "demo")


# -- closing ------------------------------------------------------------------------------------


def test_every_object_level_is_closed_and_the_input_is_not_changed():
    schema = Nested.model_json_schema()
    before = copy.deepcopy(schema)
    closed = close_objects(schema)
    assert schema == before
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Inner"]["additionalProperties"] is False
    arrays = {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string"}}}}
    assert close_objects(arrays)["items"]["additionalProperties"] is False
    branches = {"anyOf": [{"properties": {"a": {}}}, {"type": "object", "properties": {"b": {"properties": {}}}}]}
    closed = close_objects(branches)
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert closed["anyOf"][1]["properties"]["b"]["additionalProperties"] is False


def test_what_the_schema_says_stays():
    open_ = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}
    assert close_objects(open_) == open_
    typed = {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}}
    assert close_objects(typed) == typed
    free = {"type": "object"}  # a free-form object (json_object, a dict[str, Any]) stays open
    assert close_objects(free) == free
    # values are not schemas: an enum of objects or a default is never touched
    values = {"enum": [{"properties": {"a": 1}}], "default": {"properties": {}}}
    assert close_objects(values) == values
    # allOf's members are not closed one by one (each would forbid the others' keys)
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert close_objects(both) == both


@pytest.fixture(scope="module")
def grammars():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_demo_dir("demo"))
    return Grammars(tok, vocab_size=len(tok), eos_token_ids=[tok.eos_token_id])


def allowed_after(grammars, grammar: str, text: str) -> list[str]:
    m = grammars.matcher(grammar)
    for t in grammars.tokenizer.tokenize_str(text):
        assert m.consume_token(t), text
    mask = MaskJob(grammars, [m]).allowed("cpu")[0]
    return [grammars.tokenizer.decode_str([i]) for i in range(grammars.vocab_size) if mask[i]]


def test_a_pydantic_schema_allows_no_extra_key(grammars):
    """The bug: pydantic's schema has no additionalProperties; after both keys the grammar
    allowed ',' and a new key the model never closed. Now only '}' may follow."""
    g = json_schema_grammar(Shape.model_json_schema(), P)
    assert allowed_after(grammars, g, '{"color":"red","shape":"triangle"') == ["}"]
    nested = json_schema_grammar(Nested.model_json_schema(), P)
    for text in ('{"inner":{"x":1', '{"inner":{"x":1},"items":[{"x":2'):  # $defs, and array items
        after = allowed_after(grammars, nested, text)
        assert "}" in after and "," not in after and not any(t.startswith(",") for t in after), after
    opened = json_schema_grammar({**Shape.model_json_schema(), "additionalProperties": True}, P)
    assert "," in allowed_after(grammars, opened, '{"color":"red","shape":"triangle"')


# -- strict --------------------------------------------------------------------------------------


STRICT_OK = {"type": "object", "additionalProperties": False, "required": ["color", "tags", "n", "child"],
             "properties": {"color": {"type": "string", "enum": ["red", "blue"], "description": "c"},
                            "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"},
                                     "minItems": 1, "maxItems": 3},
                            "n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
                            "child": {"$ref": "#/$defs/Child"}},
             "$defs": {"Child": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                 "additionalProperties": False}}}


def test_a_strict_schema_openai_accepts_is_accepted():
    check_strict(STRICT_OK, P)
    r = parse(response_format=fmt(STRICT_OK, strict=True))
    assert r.sampling.grammar is not None


def _with(path, key, value):
    schema = copy.deepcopy(STRICT_OK)
    node = schema
    for k in path:
        node = node[k]
    if value is None:
        node.pop(key)
    else:
        node[key] = value
    return schema


@pytest.mark.parametrize("schema, param, words", [
    (_with((), "additionalProperties", None), P, "'additionalProperties' is required to be supplied and to be false"),
    (_with((), "additionalProperties", True), P, "'additionalProperties'"),
    (_with(("$defs", "Child"), "additionalProperties", None), P + ".$defs.Child", "'additionalProperties'"),
    (_with((), "required", ["color", "tags", "n"]), P, "missing 'child'"),
    (_with(("properties", "color"), "minLength", 1), P + ".properties.color", "'minLength' is not permitted"),
    (_with(("properties", "tags"), "uniqueItems", True), P + ".properties.tags", "'uniqueItems' is not permitted"),
    (_with((), "allOf", [{"type": "object"}]), P, "'allOf' is not permitted"),
    (_with(("properties", "child"), "$ref", "https://example.com/s.json"), P + ".properties.child.$ref", "'$ref'"),
    (_with(("properties", "n"), "type", "decimal"), P + ".properties.n.type", "type 'decimal'"),
    ({"type": "array", "items": {"type": "string"}}, P, "'type: \"object\"'"),
    ({"anyOf": [STRICT_OK]}, P, "not anyOf"),
])
def test_a_strict_schema_openai_refuses_is_a_400_naming_the_rule(schema, param, words):
    with pytest.raises(BadRequest) as info:
        parse(response_format=fmt(schema, strict=True))
    assert info.value.status == 400 and info.value.param == param, info.value.param
    assert words in info.value.message and "strict" in info.value.message


def test_strict_limits_and_nesting():
    deep = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
    node = deep
    for i in range(11):
        child = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
        node["properties"]["c"], node["required"] = child, ["c"]
        node = child
    with pytest.raises(BadRequest, match="nest deeper than 10"):
        check_strict(deep, P)
    many = {"type": "object", "additionalProperties": False, "required": ["e"],
            "properties": {"e": {"type": "integer", "enum": list(range(1001))}}}
    with pytest.raises(BadRequest, match="1001 enum values"):
        check_strict(many, P)


def test_without_strict_the_same_schemas_are_accepted_and_closed():
    r = parse(response_format=fmt(Shape.model_json_schema()))
    assert '"additionalProperties":false' in r.sampling.grammar.replace(" ", "")
    parse(response_format=fmt(_with(("properties", "color"), "minLength", 1), strict=False))
    with pytest.raises(BadRequest, match="boolean"):
        parse(response_format=fmt(STRICT_OK, strict="yes"))


# -- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_instructors_json_schema_request_parses_16_of_16(client):
    """The body instructor's JSON_SCHEMA mode sends (recorded in tests/fixtures; instructor's
    own install would downgrade this venv's openai), its plain pydantic model's schema as is,
    at instructor's default temperature: every answer validates with pydantic."""
    recorded = json.loads(FIXTURE.read_text())["body"]
    assert recorded["response_format"]["json_schema"]["schema"] == Shape.model_json_schema()
    assert "additionalProperties" not in json.dumps(recorded["response_format"])
    got: dict[int, object] = {}

    def one(i: int) -> None:
        body = json.loads(json.dumps(recorded).replace(
            "$IMAGE_URL", data_url(render_image(COLORS[i % 6], ("circle", "square", "triangle")[i % 3], seed=i))))
        if i % 2:
            body["messages"][1]["content"][1]["text"] = Q_SHAPE
        extra = {k: v for k, v in body.items() if k not in ("model", "messages")}
        r = client.chat.completions.create(model=body["model"], messages=body["messages"], max_tokens=64, seed=i,
                                           extra_body=extra)
        try:
            got[i] = (Shape.model_validate_json(r.choices[0].message.content), r.choices[0].finish_reason)
        except Exception as e:  # noqa: BLE001 - reported below with the content
            got[i] = (e, r.choices[0].message.content)

    assert not run_concurrently(one, [(i,) for i in range(16)], timeout=240)
    bad = {i: v for i, v in got.items() if not isinstance(v[0], Shape) or v[1] != "stop"}
    assert len(got) == 16 and not bad, bad


def test_a_strict_response_format_is_enforced_end_to_end(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": list(COLORS)}},
              "required": ["color"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(render_image("blue", "square", seed=4))}},
            {"type": "text", "text": Q_COLOR}]}],
        temperature=0, max_tokens=32, response_format=fmt(schema, strict=True))
    answer = json.loads(r.choices[0].message.content)
    assert list(answer) == ["color"] and answer["color"] in COLORS
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                       response_format=fmt({**schema, "additionalProperties": True}, strict=True))
    assert info.value.body["param"] == P and "additionalProperties" in info.value.body["message"]

"""Message parsing and validation: every user mistake is a typed error naming the parameter."""

import pytest
from PIL import Image

from mmserve.errors import BadRequest, UnsupportedParameter
from mmserve.config import LimitsConfig
from mmserve.inputs.request import ImagePart, TextPart, parse_chat_request

LIMITS = LimitsConfig()
USER = [{"role": "user", "content": "hi"}]


def parse(**body):
    body.setdefault("messages", USER)
    return parse_chat_request(body, LIMITS, "demo")


def test_minimal_request_gets_defaults():
    r = parse()
    assert r.model == "demo" and not r.stream
    assert r.messages[0].parts == (TextPart("hi"),)
    assert r.sampling.max_tokens == LIMITS.default_max_tokens and r.sampling.temperature == 1.0


def test_content_parts_and_roles():
    url = "data:image/png;base64,AAAA"
    r = parse(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "q"}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": [{"type": "text", "text": "again"}]},
    ])
    assert [m.role for m in r.messages] == ["system", "user", "assistant", "user"]
    assert r.messages[1].parts[0] == ImagePart(url=url)
    assert r.num_images == 1


def test_embedded_pil_image_part():
    img = Image.new("RGB", (4, 4))
    r = parse(messages=[{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "q"}]}])
    assert r.messages[0].parts[0].image is img


def test_sampling_parameters():
    r = parse(max_completion_tokens=7, max_tokens=99, temperature=0, top_p=0.5, top_k=3, seed=42, stop="x")
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (7, 0.0, 0.5, 3, 42, ("x",))
    assert s.greedy


def test_stream_options():
    assert parse(stream=True, stream_options={"include_usage": True}).include_usage
    with pytest.raises(BadRequest):
        parse(stream_options={"include_usage": True})


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}, *USER]}, "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, *USER]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "messages"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"seed": "x"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"model": 3}, "model"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"cache_salt": 3}, "cache_salt"),
])
def test_bad_requests_name_their_parameter(body, param):
    with pytest.raises(BadRequest) as info:
        parse(**body)
    assert info.value.status == 400
    assert info.value.param == param


@pytest.mark.parametrize("body", [
    {"functions": [{"name": "f"}]}, {"function_call": {"name": "f"}}, {"modalities": ["audio"]},
    {"logit_bias": {"1": 2}}, {"audio": {"voice": "x"}},
])
def test_unsupported_features_are_refused_not_ignored(body):
    with pytest.raises(UnsupportedParameter) as info:
        parse(**body)
    assert info.value.status == 400 and info.value.code == "unsupported_parameter"


def test_image_count_limit():
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    msgs = [{"role": "user", "content": [part] * (LIMITS.max_images_per_request + 1)}]
    with pytest.raises(BadRequest):
        parse(messages=msgs)


def test_body_must_be_object():
    with pytest.raises(BadRequest):
        parse_chat_request([1, 2], LIMITS, "demo")

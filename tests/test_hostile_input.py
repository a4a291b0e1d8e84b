"""A corpus of malformed requests over HTTP — each a clean OpenAI-style 4xx, the server unaffected —
and a fuzz test of request parsing."""

import base64
import io

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from mmserve.errors import CLIP_CHARS, MMServeError
from mmserve.config import LimitsConfig
from mmserve.inputs.request import TextPart, parse_chat_request
from tests.helpers import ServerThread, colour_question, data_url

OK_IMG = data_url(Image.new("RGB", (16, 16), "red"))
PNG = io.BytesIO()
Image.new("RGB", (16, 16), "red").save(PNG, "PNG")


def img(url):
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "?"}]}]}


def msgs(*m):
    return {"messages": list(m)}


U = {"role": "user", "content": "hi"}
B64 = lambda data, mime="image/png": f"data:{mime};base64," + base64.b64encode(data).decode()  # noqa: E731
U_RAW = b'{"messages": [{"role": "user", "content": "hi"}]'


def nest(value, depth: int, as_list: bool = True):
    for _ in range(depth):
        value = [value] if as_list else {"a": value}
    return value

CORPUS = [
    # (name, raw body or json, status, error type)
    ("empty body", b"", 400), ("not json", b"hello", 400), ("truncated json", b'{"messages": [', 400),
    ("json null", b"null", 400), ("json number", b"42", 400), ("json string", b'"x"', 400),
    ("json list", b"[]", 400), ("invalid utf8", b'{"messages": "\xff"}', 400), ("bom junk", b"\xef\xbb\xbf\xff{}", 400),
    ("no messages", {}, 400), ("messages null", {"messages": None}, 400), ("messages object", {"messages": {}}, 400),
    ("messages empty", {"messages": []}, 400), ("message not object", msgs("hi"), 400),
    ("message no role", msgs({"content": "x"}), 400), ("role number", msgs({"role": 1, "content": "x"}), 400),
    ("role unknown", msgs({"role": "wizard", "content": "x"}), 400), ("role tool", msgs({"role": "tool", "content": "x"}), 400),
    ("content number", msgs({"role": "user", "content": 5}), 400), ("content null", msgs({"role": "user", "content": None}), 400),
    ("content empty list", msgs({"role": "user", "content": []}), 400),
    ("part not object", msgs({"role": "user", "content": ["x"]}), 400),
    ("part no type", msgs({"role": "user", "content": [{"text": "x"}]}), 400),
    ("part unknown type", msgs({"role": "user", "content": [{"type": "video_url"}]}), 400),
    ("part audio", msgs({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}), 400),
    ("text part no text", msgs({"role": "user", "content": [{"type": "text"}]}), 400),
    ("text part number", msgs({"role": "user", "content": [{"type": "text", "text": 3}]}), 400),
    ("image_url missing", msgs({"role": "user", "content": [{"type": "image_url"}]}), 400),
    ("image_url number", msgs({"role": "user", "content": [{"type": "image_url", "image_url": 7}]}), 400),
    ("image url empty", img(""), 400), ("image url http", img("http://example.com/a.png"), 400),
    ("image url file", img("file:///etc/passwd"), 400), ("image url ftp", img("ftp://x/y"), 400),
    ("data url no base64", img("data:image/png,abc"), 400), ("data url bad base64", img("data:image/png;base64,***"), 400),
    ("data url not image", img(B64(b"just text")), 400), ("data url truncated png", img(B64(PNG.getvalue()[:30])), 400),
    ("data url zero bytes", img("data:image/png;base64,"), 400),
    ("gif refused", img(data_url(Image.new("RGB", (4, 4)), "GIF")), 400),
    ("bmp refused", img(data_url(Image.new("RGB", (4, 4)), "BMP")), 400),
    ("image in assistant", msgs({"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": OK_IMG}}]}, U), 400),
    ("too many images", msgs({"role": "user", "content": [{"type": "image_url", "image_url": {"url": OK_IMG}}] * 9}), 400),
    ("last is assistant", msgs(U, {"role": "assistant", "content": "x"}), 400),
    ("tool calls", msgs({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, U), 400),
    ("unknown model", {**msgs(U), "model": "gpt-7"}, 404), ("model number", {**msgs(U), "model": 12}, 400),
    ("model empty", {**msgs(U), "model": ""}, 400),
    ("temperature negative", {**msgs(U), "temperature": -0.1}, 400), ("temperature huge", {**msgs(U), "temperature": 1e9}, 400),
    ("temperature string", {**msgs(U), "temperature": "0"}, 400), ("temperature bool", {**msgs(U), "temperature": True}, 400),
    ("top_p zero-ish negative", {**msgs(U), "top_p": -1}, 400), ("top_p two", {**msgs(U), "top_p": 2}, 400),
    ("top_k negative", {**msgs(U), "top_k": -5}, 400), ("max_tokens zero", {**msgs(U), "max_tokens": 0}, 400),
    ("max_tokens negative", {**msgs(U), "max_tokens": -3}, 400), ("max_tokens absurd", {**msgs(U), "max_tokens": 10**12}, 400),
    ("max_tokens float", {**msgs(U), "max_tokens": 2.5}, 400), ("max_completion string", {**msgs(U), "max_completion_tokens": "9"}, 400),
    ("min_tokens negative", {**msgs(U), "min_tokens": -1}, 400), ("seed float", {**msgs(U), "seed": 1.5}, 400),
    ("seed huge", {**msgs(U), "seed": 2**80}, 400), ("stop number", {**msgs(U), "stop": 3}, 400),
    ("stop empty string", {**msgs(U), "stop": ""}, 400), ("stop too many", {**msgs(U), "stop": list("abcde")}, 400),
    ("stream string", {**msgs(U), "stream": "true"}, 400), ("stream_options without stream", {**msgs(U), "stream_options": {"include_usage": True}}, 400),
    ("stream_options bad", {**msgs(U), "stream": True, "stream_options": {"include_usage": "yes"}}, 400),
    ("n seventeen", {**msgs(U), "n": 17}, 400), ("n zero", {**msgs(U), "n": 0}, 400), ("logprobs string", {**msgs(U), "logprobs": "yes"}, 400),
    ("top_logprobs without logprobs", {**msgs(U), "top_logprobs": 2}, 400), ("top_logprobs 21", {**msgs(U), "logprobs": True, "top_logprobs": 21}, 400),
    ("repetition penalty zero", {**msgs(U), "repetition_penalty": 0}, 400),
    ("response_format bad schema", {**msgs(U), "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, 400),
    ("response_format unknown type", {**msgs(U), "response_format": {"type": "yaml"}}, 400),
    ("tools", {**msgs(U), "tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]}, 400),
    ("presence penalty absurd", {**msgs(U), "presence_penalty": 2.5}, 400), ("frequency penalty absurd", {**msgs(U), "frequency_penalty": 99}, 400),
    ("logit bias", {**msgs(U), "logit_bias": {"5": 10}}, 400), ("unknown field", {**msgs(U), "temprature": 0.5}, 400),
    ("cache_salt number", {**msgs(U), "cache_salt": 5}, 400), ("cache_salt empty", {**msgs(U), "cache_salt": ""}, 400),
    ("too many messages", {"messages": [U] * 300}, 400),
    ("prompt too long", msgs({"role": "user", "content": "word " * 20000}), 400),
    ("lone surrogate text", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400),
    ("lone surrogate key", U_RAW + b', "\\udfff": 1}', 400),
    ("lone surrogate salt", U_RAW + b', "cache_salt": "\\udc00"}', 400),
    ("deep arrays", U_RAW + b', "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("deep objects", U_RAW + b', "metadata": ' + b'{"a":' * 5_000 + b"0" + b"}" * 5_001, 400),
    ("depth 65", {**msgs(U), "metadata": nest(0, 64)}, 400),
    ("integer literal too long", U_RAW + b', "max_tokens": ' + b"7" * 5_000 + b"}", 400),
    ("temperature 10**400", {**msgs(U), "temperature": 10**400}, 400),
    ("top_k 10**400", {**msgs(U), "top_k": -(10**400)}, 400),
]


@pytest.fixture(scope="module")
def client(tiny_config):
    config = tiny_config.replace(limits={"max_prompt_tokens": 2048})
    with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 60


@pytest.mark.parametrize("name, body, status", CORPUS, ids=[c[0] for c in CORPUS])
def test_malformed_request(client, name, body, status):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    resp = client.post("/v1/chat/completions", **kw)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] in ("invalid_request_error", "not_found_error") and err["message"]
    ok = client.post("/v1/chat/completions", json={"messages": colour_question("red"), "max_tokens": 2})
    assert ok.status_code == 200


SURROGATE = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
TEXT = st.text(max_size=8) | st.builds(lambda a, s, b: a + s + b, st.text(max_size=3), SURROGATE, st.text(max_size=3))
# past float's range, seed's range and repr()'s 4300 digits (built lazily: hypothesis reprs a sampled_from's list)
HUGE = st.sampled_from([(10, 400), (-10, 401), (2, 64), (10, 5000), (-2, 63)]).map(lambda be: be[0] ** be[1])
LEAF = st.none() | st.booleans() | st.integers() | HUGE | st.floats() | TEXT
SHALLOW = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                       max_leaves=12)
DEEP = st.builds(nest, SHALLOW, st.integers(55, 3_000), st.booleans())  # around max_json_depth, and far past it
JSON = SHALLOW | DEEP
KEYS = st.sampled_from(["model", "messages", "temperature", "top_p", "max_tokens", "stop", "stream", "seed",
                        "stream_options", "n", "top_k", "cache_salt", "tools", "tool_choice", "parallel_tool_calls",
                        "user", "metadata"]) | TEXT
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | JSON},
                                optional={"content": JSON | st.lists(st.fixed_dictionaries(
                                    {"type": st.sampled_from(["text", "image_url", "x"]) | JSON},
                                    optional={"text": JSON, "image_url": JSON}), max_size=3),
                                          "tool_calls": JSON, "tool_call_id": JSON})


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(KEYS, JSON, max_size=5) | st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3)},
    optional={k: JSON for k in ["temperature", "stop", "max_tokens", "seed", "model", "user", "cache_salt",
                                "metadata"]}))
def test_parsing_never_fails_with_anything_but_a_typed_error(body):
    try:
        request = parse_chat_request(body, LimitsConfig(), "demo")
    except MMServeError as e:
        assert 400 <= e.status < 500 and e.message and len(e.message) < 1000
        assert e.param is None or len(e.param) <= CLIP_CHARS
        (e.message + (e.param or "")).encode("utf-8")  # an error body can always be sent
        return
    texts = [request.model, request.cache_salt or "", *request.sampling.stop,
             *(p.text for m in request.messages for p in m.parts if isinstance(p, TextPart))]
    for text in texts:  # whatever parses can be tokenized, hashed and logged
        text.encode("utf-8")

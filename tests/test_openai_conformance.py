"""OpenAI conformance, written from the `openai` package's own types: the server's responses are
parsed with `ChatCompletion` / `ChatCompletionChunk` / `Model` in pydantic's strict mode, and every
field those types define must be present (null where OpenAI sends null) unless it is one of the
optional ones listed below, which OpenAI itself leaves out of such answers. Then what the types
cannot say: logprob `token`s join to the content (streamed too) and `bytes` are their UTF-8; an
undecodable image is a 400 `invalid_image`; `client.models.retrieve()` works (an unknown id is an
OpenAI-shaped 404); `message.refusal` is null. The real `openai` client against a real server."""

import json
import typing

import httpx
import openai
import pytest
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel
from transformers import AutoProcessor

from mmserve.models.demo import Q_COLOR, render_image
from tests.conftest import _demo_dir
from tests.helpers import colour_question, data_url

# fields OpenAI's types define that may be absent, by "Type.field" (OpenAI omits them too, or
# they belong to features these answers do not use: audio, moderation, annotations, tool calls)
OPTIONAL = {
    "ChatCompletion.metadata", "ChatCompletion.moderation", "ChatCompletion.service_tier",
    "ChatCompletion.system_fingerprint",
    "ChatCompletionMessage.annotations", "ChatCompletionMessage.audio", "ChatCompletionMessage.function_call",
    "ChatCompletionMessage.tool_calls",
    "ChatCompletionChunk.moderation", "ChatCompletionChunk.obfuscation", "ChatCompletionChunk.service_tier",
    "ChatCompletionChunk.system_fingerprint", "ChatCompletionChunk.usage",
    "ChoiceDelta.audio", "ChoiceDelta.function_call", "ChoiceDelta.tool_calls",
    "CompletionUsage.completion_tokens_details",
    "PromptTokensDetails.audio_tokens", "PromptTokensDetails.cache_write_tokens", "PromptTokensDetails.image_tokens",
    "PromptTokensDetails.text_tokens",
    "Model.shutdown_date",
}
# a stream's chunks carry only what changed: the first delta of a choice has role, content and
# refusal; the others content (or nothing, with the finish)
OPTIONAL_IN_LATER_CHUNKS = {"ChoiceDelta.role", "ChoiceDelta.refusal", "ChoiceDelta.content"}


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through Optional, List, Union, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def missing_fields(cls: type[BaseModel], data, where: str = "", optional=frozenset()) -> list[str]:
    """Every field of `cls` (recursively) that `data` lacks and that is not optional."""
    out = []
    if not isinstance(data, dict):
        return out
    for name, field in cls.model_fields.items():
        key = field.alias or name
        path = f"{where}.{key}" if where else key
        if key not in data:
            if f"{cls.__name__}.{name}" not in OPTIONAL | optional:
                out.append(f"{path} ({cls.__name__}.{name})")
            continue
        nested = _models(field.annotation)
        values = data[key] if isinstance(data[key], list) else [data[key]]
        for i, value in enumerate(values):
            if isinstance(value, dict) and nested:
                # a union of models: the one whose fields the value has
                best = max(nested, key=lambda m: len(set(value) & {f.alias or n for n, f in m.model_fields.items()}))
                out += missing_fields(best, value, f"{path}[{i}]" if isinstance(data[key], list) else path, optional)
    return out


def conforms(cls: type[BaseModel], data: dict, optional=frozenset()):
    """`data` parsed strictly as `cls`, with every field present (see the module doc)."""
    parsed = cls.model_validate(data, strict=True)
    assert not missing_fields(cls, data, optional=optional), missing_fields(cls, data, optional=optional)
    return parsed


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def sse(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_completion_is_every_field_of_openais_type(demo_server):
    body = {"model": "demo", "messages": colour_question("red"), "temperature": 0, "max_tokens": 6,
            "logprobs": True, "top_logprobs": 2}
    data = post(demo_server, body).json()
    parsed = conforms(ChatCompletion, data)
    message = data["choices"][0]["message"]
    assert message["refusal"] is None and "refusal" in message and parsed.choices[0].message.content == "red"
    assert data["choices"][0]["logprobs"]["refusal"] is None
    plain = post(demo_server, {**body, "logprobs": False, "top_logprobs": None, "n": 2}).json()
    conforms(ChatCompletion, plain)
    assert [c["logprobs"] for c in plain["choices"]] == [None, None]  # present, null, as OpenAI sends it


def test_every_chunk_is_every_field_of_openais_type(demo_server):
    chunks = sse(demo_server, {"model": "demo", "messages": colour_question("blue"), "temperature": 0,
                               "max_tokens": 6, "logprobs": True, "stream_options": {"include_usage": True}})
    first, *rest = chunks
    conforms(ChatCompletionChunk, first)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    for chunk in rest:
        conforms(ChatCompletionChunk, chunk, optional=OPTIONAL_IN_LATER_CHUNKS)
    assert rest[-1]["choices"] == [] and rest[-1]["usage"]["completion_tokens"] >= 1
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1


def test_models_list_and_retrieve(client, demo_server):
    listed = client.models.list()
    assert {m.id for m in listed.data} >= {"demo", "demo-wide"}
    for m in httpx.get(demo_server.url + "/v1/models").json()["data"]:
        conforms(Model, m)
    demo = client.models.retrieve("demo")
    assert (demo.id, demo.object, demo.owned_by) == ("demo", "model", "mmserve")
    conforms(Model, httpx.get(demo_server.url + "/v1/models/demo-wide").json())
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    error = info.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "model_not_found"
    assert "gpt-9" in error["message"] and "demo" in error["message"]


def _join(tokens) -> tuple[str, bytes]:
    return "".join(t.token for t in tokens), b"".join(bytes(t.bytes) for t in tokens)


@pytest.mark.parametrize("extra", [
    {},
    {"stop": ["ee"], "extra_body": {"ignore_eos": True}},  # a stop string cuts a token's text
    {"n": 2, "temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True}},
    {"extra_body": {"ignore_eos": True, "skip_special_tokens": False}},
])
def test_logprob_tokens_join_to_the_content(client, extra):
    args = dict(model="demo", messages=colour_question("green", "triangle"), temperature=0, max_tokens=10,
                logprobs=True, top_logprobs=3)
    args.update(extra)
    r = client.chat.completions.create(**args)
    for choice in r.choices:
        content = choice.message.content
        text, raw = _join(choice.logprobs.content)
        assert text == content and raw == content.encode()
        for t in choice.logprobs.content:
            assert bytes(t.bytes) == t.token.encode()
        if args["temperature"] == 0 and "stop" not in extra:  # greedy: the top alternative is the token
            assert all(t.top_logprobs[0].token == t.token for t in choice.logprobs.content)
    streamed = client.chat.completions.create(**args, stream=True)
    content, tokens = {}, {}
    for chunk in streamed:
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            tokens.setdefault(c.index, []).extend(c.logprobs.content if c.logprobs else [])
    assert sorted(content) == list(range(len(r.choices)))
    for i, text in content.items():
        assert _join(tokens[i]) == (text, text.encode())
    if args["temperature"] == 0:
        assert content[0] == r.choices[0].message.content


def test_the_first_tokens_alternatives_lose_the_lead_as_it_does(client):
    r = client.chat.completions.create(model="demo", messages=colour_question("red"), temperature=0, max_tokens=4,
                                       logprobs=True, top_logprobs=5)
    first = r.choices[0].logprobs.content[0]
    assert first.token == "red" and not any(a.token.startswith(" ") and a.token.strip() in ("green", "blue")
                                            for a in first.top_logprobs)


@pytest.mark.parametrize("url", [
    "data:image/png;base64,@@@notbase64",
    "data:image/png;base64," + "aGVsbG8gd29ybGQ=",  # "hello world": not an image
])
def test_an_undecodable_image_is_a_400_invalid_image(client, url):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": Q_COLOR}]}])
    assert info.value.status_code == 400
    assert info.value.body["code"] == "invalid_image" and info.value.body["type"] == "invalid_request_error"
    assert info.value.body["param"].startswith("messages[0].content")
    ok = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(render_image("red", "circle"))}},
        {"type": "text", "text": Q_COLOR}]}], temperature=0)
    assert ok.choices[0].message.content == "red" and ok.choices[0].message.refusal is None


def test_legacy_logprobs_most_likely_first_and_eos_listed_once_and_counted(demo_server):
    """/v1/completions with logprobs: each `top_logprobs` dict is ordered most likely first (a
    client reading its first key gets the best token), an answer ended by EOS lists that token
    once (its own text, "" as vLLM shows it, and never again under another spelling), and
    `completion_tokens` counts it: one entry per token drawn."""
    processor = AutoProcessor.from_pretrained(_demo_dir("demo"))
    prompt = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
                                           add_generation_prompt=True, tokenize=False)
    for temperature in (0, 1.0):
        r = httpx.post(demo_server.url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": prompt, "max_tokens": 12, "logprobs": 5, "temperature": temperature,
            "seed": 3})
        choice = r.json()["choices"][0]
        lp, usage = choice["logprobs"], r.json()["usage"]
        assert choice["finish_reason"] == "stop", choice
        assert len(lp["tokens"]) == usage["completion_tokens"]  # the EOS is drawn, listed and counted
        assert lp["tokens"][-1] == "" and "".join(lp["tokens"]) == choice["text"]
        eos_top = lp["top_logprobs"][-1]
        assert eos_top[""] == lp["token_logprobs"][-1]
        eos_text = processor.tokenizer.decode([processor.tokenizer.eos_token_id])
        assert eos_text not in eos_top  # the EOS is not listed a second time under its special text
        for top in lp["top_logprobs"]:
            values = list(top.values())
            assert values == sorted(values, reverse=True) and 5 <= len(top) <= 6

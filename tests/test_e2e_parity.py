"""OpenAI parity over a real socket with the official `openai` client against the trained demo
model: logprobs, n, penalties, response_format (JSON schema) and seed."""

import json
import math
import re
import threading

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import ask, colour_question, run_concurrently


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def prefill_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(r'^mmserve:prefill_tokens_total\{model_name="demo"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_logprobs_are_openais_shape_and_greedy_top1_is_the_chosen_token(client):
    r = client.chat.completions.create(model="demo", messages=colour_question("red", seed=11), temperature=0,
                                       max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and "".join(t.token for t in content).strip() == r.choices[0].message.content
    for t in content:
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert bytes(t.bytes).decode() == t.token
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1.0 + 1e-6


def test_streamed_logprobs_equal_the_whole_answers(client):
    body = dict(model="demo", messages=colour_question("blue", "square", seed=3), temperature=0, max_tokens=6,
                logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**body).choices[0].logprobs.content
    streamed = [t for chunk in client.chat.completions.create(**body, stream=True)
                for c in chunk.choices if c.logprobs and c.logprobs.content for t in c.logprobs.content]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in whole]


def test_n_choices_share_one_prefill(client, demo_server):
    messages = ask(render_image("green", "triangle", background="white", seed=91), Q_SHAPE)
    before = prefill_tokens(demo_server.url)
    r = client.chat.completions.create(model="demo", messages=messages, n=4, temperature=1.5, seed=3, max_tokens=8)
    prefilled = prefill_tokens(demo_server.url) - before
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert prefilled == r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens  # once, not 4 times
    assert r.usage.completion_tokens > 0
    again = client.chat.completions.create(model="demo", messages=messages, n=4, temperature=1.5, seed=3, max_tokens=8)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_n_greedy_choices_equal_the_single_answer_and_stream_by_index(client):
    messages = colour_question("yellow", "circle", seed=21)
    single = client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=8)
    texts, reasons = {}, {}
    for chunk in client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=8,
                                                n=3, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        if chunk.usage:
            usage = chunk.usage
    assert texts == {i: single.choices[0].message.content for i in range(3)}
    assert set(reasons) == {0, 1, 2}
    assert usage.completion_tokens == 3 * single.usage.completion_tokens
    assert usage.prompt_tokens == single.usage.prompt_tokens


def _first_tokens(client, **extra):
    # the answer (" red") is in the history, so the repetition penalty reaches it from the first token
    messages = [*colour_question("red", seed=4), {"role": "assistant", "content": "red"},
                {"role": "user", "content": Q_COLOR}]
    r = client.chat.completions.create(model="demo", messages=messages, temperature=0,
                                       max_tokens=6, logprobs=True, top_logprobs=5,
                                       extra_body={"min_tokens": 6, **extra.pop("extra_body", {})}, **extra)
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in r.choices[0].logprobs.content]


def _same(a, b, tol=1e-3) -> bool:
    """Two steps' (token, logprob, top) agree: the same tokens, logprobs within `tol` (a cached
    prefix moves them by ~1e-7, which rounding to a fixed decimal can turn into a difference)."""
    return a[0] == b[0] and abs(a[1] - b[1]) < tol and [t for t, _ in a[2]] == [t for t, _ in b[2]] \
        and all(abs(x - y) < tol for (_, x), (_, y) in zip(a[2], b[2]))


def test_penalties_change_the_distribution_from_where_they_apply(client):
    plain = _first_tokens(client)
    repeated = _first_tokens(client, extra_body={"repetition_penalty": 3.0})
    assert not _same(repeated[0], plain[0])  # the prompt's tokens count from the first token on
    for kind in ("presence_penalty", "frequency_penalty"):
        penalized = _first_tokens(client, **{kind: 2.0})
        assert _same(penalized[0], plain[0])  # nothing generated yet: nothing to penalize
        assert not all(_same(p, q) for p, q in zip(penalized, plain))


def _schemas():
    leaf = st.one_of(
        st.just({"type": "boolean"}),
        st.tuples(st.integers(-50, 0), st.integers(0, 50)).map(
            lambda b: {"type": "integer", "minimum": b[0], "maximum": b[1]}),
        st.lists(st.sampled_from(["red", "blue", "green", "circle", "a b", "ü"]), min_size=1, max_size=4,
                 unique=True).map(lambda e: {"enum": e}),
        st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    )
    names = st.lists(st.sampled_from(["color", "shape", "n", "ok", "label"]), min_size=1, max_size=3, unique=True)
    return names.flatmap(lambda keys: st.tuples(*[leaf] * len(keys)).map(lambda vals: {
        "type": "object", "properties": dict(zip(keys, vals)), "required": keys, "additionalProperties": False}))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=_schemas(), temperature=st.sampled_from([0.0, 1.0]))
def test_json_schema_output_always_parses_and_validates_beside_unconstrained_requests(client, schema, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    free = {}

    def unconstrained():  # in the same steps: a constrained row and a free one share a batch
        free["r"] = client.chat.completions.create(model="demo", messages=colour_question("red", seed=5),
                                                   temperature=0, max_tokens=24)

    t = threading.Thread(target=unconstrained)
    t.start()
    r = client.chat.completions.create(model="demo", messages=ask(render_image("blue", "square", seed=2), Q_COLOR),
                                       temperature=temperature, max_tokens=120, response_format=fmt)
    t.join()
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)
    assert free["r"].choices[0].message.content.strip() == "red"


def test_json_cut_by_max_tokens_finishes_with_length(client):
    schema = {"type": "object", "properties": {"description": {"type": "string", "minLength": 20}},
              "required": ["description"]}
    r = client.chat.completions.create(model="demo", messages=colour_question("red"), max_tokens=4, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "d", "schema": schema}})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith('{"')


def test_a_bad_schema_is_a_400_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=colour_question("red"), response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "nope"}}}}})
    assert "nope" in info.value.body["message"]
    assert info.value.body["param"] == "response_format.json_schema.schema"
    ok = client.chat.completions.create(model="demo", messages=colour_question("red"), temperature=0)
    assert ok.choices[0].message.content.strip() == "red"


def test_a_seed_gives_the_same_sample_alone_or_batched(client):
    body = dict(model="demo", messages=colour_question("green", "square", seed=8), temperature=1.8, seed=1234,
                max_tokens=10, presence_penalty=0.5)
    alone = client.chat.completions.create(**body).choices[0].message.content
    got = {}

    def one(i):
        got[i] = client.chat.completions.create(**(body if i == 0 else {**body, "seed": i})).choices[0].message.content

    assert not run_concurrently(one, [(i,) for i in range(4)], timeout=60)
    assert got[0] == alone

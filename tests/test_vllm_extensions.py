"""vLLM's request extensions, accepted with vLLM's meaning (or refused with a 400 naming them):
parsing field by field, then end to end against the demo model where the behaviour shows."""

import json
import math

import httpx
import openai
import pytest
import torch

from mmserve.config import LimitsConfig
from mmserve.errors import BadRequest, UnsupportedParameter
from mmserve.generation.sampler import sample_batch
from mmserve.generation.sampling import SamplingParams, make_generator, sample
from mmserve.inputs.request import parse_chat_request
from mmserve.models.demo import Q_COLOR, render_image
from tests.conftest import _demo_dir
from tests.helpers import colour_question, data_url

USER = [{"role": "user", "content": "hi"}]
GREEN = 345  # " green" in the demo tokenizer


def parse(**body):
    body.setdefault("messages", USER)
    return parse_chat_request(body, LimitsConfig(), "demo")


# -- parsing ----------------------------------------------------------------------------------------


def test_sampling_extensions_are_parsed():
    s = parse(ignore_eos=True, min_p=0.25, stop_token_ids=[5, 7, 5], skip_special_tokens=False,
              include_stop_str_in_output=True, spaces_between_special_tokens=False, top_k=-1,
              repetition_penalty=1.1, min_tokens=2, best_of=1, use_beam_search=False, length_penalty=1.0,
              prompt_logprobs=None, add_special_tokens=False, priority=0).sampling
    assert (s.ignore_eos, s.min_p, s.stop_token_ids, s.skip_special_tokens, s.include_stop_str_in_output) == \
        (True, 0.25, (5, 7), False, True)
    assert (s.top_k, s.repetition_penalty, s.min_tokens) == (-1, 1.1, 2)
    d = parse().sampling
    assert (d.ignore_eos, d.min_p, d.stop_token_ids, d.skip_special_tokens, d.include_stop_str_in_output) == \
        (False, 0.0, (), True, False)


@pytest.mark.parametrize("body, param, kind", [
    ({"best_of": 3}, "best_of", UnsupportedParameter),
    ({"best_of": 2, "n": 3}, "best_of", UnsupportedParameter),
    ({"use_beam_search": True}, "use_beam_search", UnsupportedParameter),
    ({"prompt_logprobs": 0}, "prompt_logprobs", UnsupportedParameter),
    ({"add_special_tokens": True}, "add_special_tokens", UnsupportedParameter),
    ({"priority": 2**31}, "priority", BadRequest),
    ({"priority": -(2**31) - 1}, "priority", BadRequest),
    ({"priority": "1"}, "priority", BadRequest),
    ({"priority": True}, "priority", BadRequest),
    ({"ignore_eos": "yes"}, "ignore_eos", BadRequest),
    ({"min_p": 1.5}, "min_p", BadRequest),
    ({"min_p": float("nan")}, "min_p", BadRequest),
    ({"stop_token_ids": [-1]}, "stop_token_ids", BadRequest),
    ({"stop_token_ids": "5"}, "stop_token_ids", BadRequest),
    ({"skip_special_tokens": 1}, "skip_special_tokens", BadRequest),
    ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens", BadRequest),
    ({"length_penalty": "x"}, "length_penalty", BadRequest),
    ({"echo": 1}, "echo", BadRequest),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message", BadRequest),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", BadRequest),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", BadRequest),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt",
     BadRequest),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs", BadRequest),
    ({"guided_json": "{not json"}, "guided_json", BadRequest),
    ({"guided_regex": "[a-z"}, "guided_regex", BadRequest),
    ({"guided_choice": []}, "guided_choice", BadRequest),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", BadRequest),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", BadRequest),
    # a GBNF grammar is not a Lark one: refused, naming the field and what the compiler says
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar", BadRequest),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar", BadRequest),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", BadRequest),
    ({"structured_outputs": {}}, "structured_outputs", BadRequest),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", BadRequest),
    ({"guided_grammar": 'start: "a"', "guided_regex": "a"}, "guided_grammar", BadRequest),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", UnsupportedParameter),
    ({"request_id": ""}, "request_id", BadRequest),
    ({"request_id": "a b"}, "request_id", BadRequest),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", BadRequest),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", BadRequest),
    ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids", BadRequest),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", BadRequest),
    ({"min_tokens": 5, "max_completion_tokens": 4}, "min_tokens", BadRequest),
    ({"priority": 1.5}, "priority", BadRequest),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats",
     BadRequest),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(body, param, kind):
    with pytest.raises(kind) as info:
        parse(**body)
    assert info.value.status == 400 and info.value.param == param, (info.value.param, info.value.message)


def test_structured_output_extensions_make_grammars():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for body in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                 {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}):
        g = parse(**body).sampling.grammar
        assert g is not None and '"additionalProperties":false' in g.replace(" ", "")  # closed, as response_format
    assert "regex" in parse(guided_regex="(red|blue)").sampling.grammar
    assert '"red" | "blue"' in parse(guided_choice=["red", "blue"]).sampling.grammar
    assert parse(structured_outputs={"regex": "a+"}).sampling.grammar is not None
    assert parse(structured_outputs={"json_object": True}).sampling.grammar is not None


def test_vllm_request_fields_are_parsed():
    r = parse(guided_grammar='start: "red" | "blue"', guided_decoding_backend="guidance", request_id="job-7",
              truncate_prompt_tokens=12, return_tokens_as_token_ids=True, min_tokens=300, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert '"red" | "blue"' in r.sampling.grammar
    assert r.options.client_request_id == "job-7" and r.options.truncate_prompt_tokens == 12
    assert r.options.tokens_as_ids and r.options.continuous_usage
    assert r.sampling.min_tokens == 300 and r.sampling.max_tokens >= 300  # the default stretches to min_tokens
    assert parse(structured_outputs={"grammar": 'start: "a"+'}).sampling.grammar is not None
    for backend in ("auto", "guidance", "llguidance"):
        parse(guided_decoding_backend=backend)
    assert parse(priority=-1).options.priority == -1 and parse().options.priority == 0
    assert parse(priority=2**31 - 1).options.priority == 2**31 - 1


def test_template_options_and_the_last_message():
    assert parse().template.opens_answer and parse().template.render_args() == {}
    prefill = [*USER, {"role": "assistant", "content": "The answer is"}]
    with pytest.raises(BadRequest, match="must not be from the assistant"):
        parse(messages=prefill)
    r = parse(messages=prefill, continue_final_message=True, chat_template_kwargs={"enable_thinking": False})
    assert not r.template.opens_answer and r.messages[-1].role == "assistant"
    assert r.template.render_args() == {"enable_thinking": False, "add_generation_prompt": False,
                                        "continue_final_message": True}
    assert not parse(add_generation_prompt=False).template.opens_answer
    assert parse(messages=prefill, continue_final_message=True, echo=True).echo == "The answer is"
    assert parse(echo=True).echo == ""  # the last message is the user's: nothing of the answer's role
    assert parse(echo=True, add_generation_prompt=False).echo == "hi"  # vLLM: the last message's own role


# -- sampling -------------------------------------------------------------------------------------


def test_min_p_keeps_only_tokens_near_the_top_batched_as_alone():
    logits = torch.tensor([[4.0, 3.9, 1.0, 0.5, -2.0], [2.0, 2.0, 2.0, -9.0, 0.0]])
    p = [SamplingParams(temperature=1.0, min_p=0.5, seed=3), SamplingParams(temperature=0.7, min_p=0.2, seed=4)]
    gens_a = [make_generator(x) for x in p]
    gens_b = [make_generator(x) for x in p]
    drawn = [sample_batch(logits, p, gens_a) for _ in range(100)]
    alone = [[sample(logits[b], p[b], gens_b[b]) for b in range(2)] for _ in range(100)]
    assert drawn == alone  # the batched path draws exactly what the 1-D path draws
    assert {d[0] for d in drawn} == {0, 1} and {d[1] for d in drawn} == {0, 1, 2}
    # p(2) / p(0) = e^-3 < 0.5 in row 0; row 1 keeps the three tied at the top only
    unseeded = sample_batch(logits, p, [None, None])
    assert unseeded[0] in (0, 1) and unseeded[1] in (0, 1, 2)


# -- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages=None, **extra):
    args = {k: extra.pop(k) for k in ("temperature", "max_tokens", "n", "stream", "logprobs", "seed", "stop")
            if k in extra}
    args.setdefault("temperature", 0)
    return client.chat.completions.create(model="demo", messages=messages or colour_question("red"),
                                          extra_body=extra, **args)


def test_guidellms_body_gets_exactly_max_tokens(demo_server):
    """guidellm's standard benchmark body (its OpenAI backend's chat payload): streamed, usage
    included, `ignore_eos` with `max_tokens`; it used to fail 2000 of 2000 with a bare 400."""
    body = {"model": "demo", "messages": colour_question("blue"), "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 20, "max_completion_tokens": 20,
            "stop": None, "ignore_eos": True}
    with httpx.stream("POST", demo_server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 20
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["length"]


def test_ignore_eos_gives_exactly_max_tokens(client):
    normal = chat(client, max_tokens=12)
    assert normal.choices[0].finish_reason == "stop" and normal.usage.completion_tokens < 12
    r = chat(client, max_tokens=12, ignore_eos=True)
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith(normal.choices[0].message.content)


def test_stop_token_ids_stop_and_the_token_stays_in_the_answer(client):
    r = chat(client, max_tokens=12, ignore_eos=True, stop_token_ids=[GREEN])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "red green"
    assert r.usage.completion_tokens == 2


def test_min_tokens_holds_back_stop_token_ids_too(client):
    r = chat(client, max_tokens=12, ignore_eos=True, stop_token_ids=[GREEN], min_tokens=3)
    assert r.usage.completion_tokens >= 3 and r.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output(client):
    cut = chat(client, max_tokens=12, ignore_eos=True, stop=["gr"])
    kept = chat(client, max_tokens=12, ignore_eos=True, stop=["gr"], include_stop_str_in_output=True)
    assert (cut.choices[0].message.content, kept.choices[0].message.content) == ("red ", "red gr")
    assert kept.choices[0].finish_reason == "stop"


def test_min_p_one_is_greedy_at_any_temperature(client):
    greedy = chat(client, max_tokens=8).choices[0].message.content
    for seed in range(4):
        hot = chat(client, max_tokens=8, temperature=2.0, seed=seed, min_p=1.0)
        assert hot.choices[0].message.content == greedy


def test_skip_special_tokens_false_keeps_their_text():
    from mmserve.actors.token_rows import assembler
    from mmserve.models.loading import load_adapter

    adapter = load_adapter("demo", _demo_dir("demo"))
    keep, skip = (assembler(adapter, parse(skip_special_tokens=flag)) for flag in (False, True))
    ids = [342, 1, GREEN]  # " red", "</s>", " green"
    assert "".join(keep.add(i) for i in ids) + keep.finish() == "red</s> green"
    assert "".join(skip.add(i) for i in ids) + skip.finish() == "red green"


def test_best_of_equal_to_n_and_beam_search_off_are_accepted(client):
    r = chat(client, n=2, best_of=2, use_beam_search=False, length_penalty=1.0, temperature=1.0, seed=1,
             max_tokens=4, spaces_between_special_tokens=True, skip_special_tokens=True)
    assert len(r.choices) == 2
    for body, param in (({"best_of": 3}, "best_of"), ({"use_beam_search": True}, "use_beam_search"),
                        ({"prompt_logprobs": 1}, "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, **body)
        assert info.value.body["param"] == param and param in info.value.body["message"]


def test_continue_final_message_and_echo(client):
    prefill = [*colour_question("red"), {"role": "assistant", "content": "The color is"}]
    r = chat(client, prefill, max_tokens=6, continue_final_message=True, add_generation_prompt=False)
    assert r.choices[0].message.content == " red"  # the lead is not cut: it continues a message
    echoed = chat(client, prefill, max_tokens=6, continue_final_message=True, echo=True)
    assert echoed.choices[0].message.content == "The color is red"
    stream = chat(client, prefill, max_tokens=6, continue_final_message=True, echo=True, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "The color is red"


def test_add_generation_prompt_false_renders_no_generation_prompt(client):
    from transformers import AutoTokenizer

    generation_prompt = AutoTokenizer.from_pretrained(_demo_dir("demo")).encode("assistant:", add_special_tokens=False)
    with_prompt = chat(client, max_tokens=1)
    without = chat(client, max_tokens=1, add_generation_prompt=False)
    assert with_prompt.usage.prompt_tokens - without.usage.prompt_tokens == len(generation_prompt)


def test_chat_template_kwargs_reach_the_template_and_unread_ones_are_dropped():
    from mmserve.models.loading import load_adapter

    adapter = load_adapter("demo", _demo_dir("demo"))
    user = [{"role": "user", "content": [{"type": "text", "text": "q"}]}]
    adapter.processor.chat_template = "{{ greeting }}|{{ messages[0]['content'][0]['text'] }}|" \
                                      "{% if add_generation_prompt %}A:{% endif %}"
    adapter._template_variables = None
    options = parse(chat_template_kwargs={"greeting": "hello", "enable_thinking": False}).template.render_args()
    assert adapter.render_prompt(user, None, options) == "hello|q|A:"  # enable_thinking: not read, dropped


def test_structured_outputs_end_to_end(client):
    image = {"type": "image_url", "image_url": {"url": data_url(render_image("green", "circle"))}}
    q = [{"role": "user", "content": [image, {"type": "text", "text": Q_COLOR}]}]
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["color"]}
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        r = chat(client, q, max_tokens=24, **extra)
        answer = json.loads(r.choices[0].message.content)
        assert list(answer) == ["color"] and answer["color"] in ("red", "green", "blue"), (extra, answer)
    r = chat(client, q, max_tokens=8, guided_choice=["green", "purple"])
    assert r.choices[0].message.content in ("green", "purple") and r.choices[0].finish_reason == "stop"
    r = chat(client, q, max_tokens=8, guided_regex="(gre|pur)[a-z]{2,3}")
    assert r.choices[0].message.content[:3] in ("gre", "pur")
    r = chat(client, q, max_tokens=8, structured_outputs={"choice": ["blue", "green"]})
    assert r.choices[0].message.content in ("blue", "green")
    assert math.isfinite(r.usage.completion_tokens)


def test_guided_grammar_and_structured_outputs_grammar_confine_the_answer(client):
    lark = 'start: "yes" | "no" | "maybe"'
    for extra in ({"guided_grammar": lark, "guided_decoding_backend": "guidance"},
                  {"structured_outputs": {"grammar": lark}}):
        for color in ("red", "blue"):
            r = chat(client, colour_question(color), temperature=1.0, seed=3, **extra)
            assert r.choices[0].message.content.strip() in ("yes", "no", "maybe"), extra
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, guided_grammar="start: (")
    assert info.value.body["param"] == "guided_grammar" and "Lark grammar" in info.value.body["message"]


def test_request_id_labels_the_request_and_the_header_wins(demo_server):
    url, body = demo_server.url + "/v1/chat/completions", {"model": "demo", "messages": USER, "max_tokens": 2}
    r = httpx.post(url, json=dict(body, request_id="batch-1.item-2"), timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "batch-1.item-2"
    assert r.json()["id"] != "chatcmpl-batch-1.item-2"  # a label, never the internal id
    r = httpx.post(url, json=dict(body, request_id="from-body"), headers={"x-request-id": "from-header"}, timeout=60)
    assert r.headers["x-request-id"] == "from-header"
    r = httpx.post(demo_server.url + "/v1/completions", timeout=60,
                   json={"model": "demo", "prompt": "red", "max_tokens": 2, "request_id": "legacy-3"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "legacy-3"


def test_return_tokens_as_token_ids(client, demo_server):
    plain = chat(client, logprobs=True, top_logprobs=2, max_tokens=4)
    named = chat(client, logprobs=True, top_logprobs=2, max_tokens=4, return_tokens_as_token_ids=True)
    assert named.choices[0].message.content == plain.choices[0].message.content  # the text is the text
    for a, b in zip(plain.choices[0].logprobs.content, named.choices[0].logprobs.content):
        assert b.token.startswith("token_id:") and b.logprob == pytest.approx(a.logprob, abs=1e-5)
        assert b.bytes == list(b.token.encode()) and all(t.token.startswith("token_id:") for t in b.top_logprobs)
    assert GREEN == int(chat(client, colour_question("green"), logprobs=True, max_tokens=1,
                             return_tokens_as_token_ids=True).choices[0].logprobs.content[0].token.split(":")[1])
    r = httpx.post(demo_server.url + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": "red green", "max_tokens": 3, "logprobs": 2, "echo": True, "temperature": 0,
        "return_tokens_as_token_ids": True}).json()["choices"][0]
    lp = r["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(all(k.startswith("token_id:") for k in top) for top in lp["top_logprobs"] if top)
    assert lp["text_offset"][-1] < len(r["text"])  # offsets are still the text's


def test_truncate_prompt_tokens_keeps_the_last_tokens(demo_server, client):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(_demo_dir("demo"))("red green blue " * 8)["input_ids"]
    post = lambda **b: httpx.post(demo_server.url + "/v1/completions", timeout=60,  # noqa: E731
                                  json={"model": "demo", "max_tokens": 1, "temperature": 0, **b})
    cut, tail = post(prompt=ids, truncate_prompt_tokens=5).json(), post(prompt=ids[-5:]).json()
    assert cut["usage"]["prompt_tokens"] == 5 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
    assert post(prompt=ids, truncate_prompt_tokens=-1).json()["usage"]["prompt_tokens"] == len(ids)  # it fits
    short = chat(client, [{"role": "user", "content": "red green blue " * 8}], max_tokens=1, truncate_prompt_tokens=9)
    assert short.usage.prompt_tokens == 9
    with pytest.raises(openai.BadRequestError) as info:  # images are never cut through
        chat(client, colour_question("red"), truncate_prompt_tokens=4)
    assert info.value.body["param"] == "truncate_prompt_tokens"
    assert chat(client, colour_question("red"), truncate_prompt_tokens=10_000).choices[0].message.content == "red"


def test_continuous_usage_stats_on_every_chunk(demo_server):
    for path, extra in (("/v1/chat/completions", {"messages": colour_question("blue")}),
                        ("/v1/completions", {"prompt": "red green"})):
        body = {"model": "demo", "stream": True, "max_tokens": 6, "ignore_eos": True, **extra,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with httpx.stream("POST", demo_server.url + path, json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert all(c.get("usage") for c in chunks) and counted == sorted(counted)
        assert counted[-1] == chunks[-1]["usage"]["completion_tokens"] == 6
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
                   for c in chunks)


def test_min_tokens_above_max_tokens_is_a_400_and_stretches_the_default(client):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=2, min_tokens=5)
    assert info.value.body["param"] == "min_tokens"
    r = client.completions.create(model="demo", prompt="red", temperature=0, extra_body={"min_tokens": 20})
    assert r.usage.completion_tokens >= 20  # the default of 16 gives way to the explicit min_tokens

"""`POST /v1/completions` (OpenAI's legacy API, as vLLM serves it) over a real server with the
official `openai` client: the raw prompt takes the chat path untemplated, so a prompt that is the
chat template's rendering of a conversation gets the chat path's answer; echo, logprobs, batches,
streams, the prompt's own logprobs against HF's forward, and OpenAI-shaped 400s naming `param`."""

import json
import time

import httpx
import openai
import pytest
import torch
import trio
from openai.types import Completion
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmserve import Runtime
from tests.conftest import _demo_dir

QUESTION = [{"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
            {"role": "user", "content": [{"type": "text", "text": "What colour is the square?"}]}]


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def rendered():
    """The chat template's rendering of QUESTION, ending with the generation prompt."""
    processor = AutoProcessor.from_pretrained(_demo_dir("demo"))
    return processor.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoProcessor.from_pretrained(_demo_dir("demo")).tokenizer


def salt(name):
    return {"cache_salt": f"{name}-{time.time_ns()}"}


def post(server, body, path="/v1/completions"):
    return httpx.post(server.url + path, json=body, timeout=120)


def test_raw_prompt_equals_the_chat_path(client, rendered):
    chat = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=8,
                                          logprobs=True, top_logprobs=3)
    done = client.completions.create(model="demo", prompt=rendered, temperature=0, max_tokens=8, logprobs=3)
    assert done.id.startswith("cmpl-") and done.object == "text_completion"
    choice = done.choices[0]
    # the chat path strips the template's lead (" ") from its answer; the raw path keeps it
    assert choice.text.strip() == chat.choices[0].message.content.strip() and choice.text.strip()
    assert choice.finish_reason == chat.choices[0].finish_reason
    assert done.usage.prompt_tokens == chat.usage.prompt_tokens
    assert done.usage.completion_tokens == chat.usage.completion_tokens
    # the same tokens with the same logprobs (the distribution they were drawn from)
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    want = [t.logprob for t in chat.choices[0].logprobs.content]
    assert lp.token_logprobs[:len(want)] == pytest.approx(want, abs=1e-4)
    # an answer ended by EOS lists it last, without text, as vLLM does (chat, as OpenAI, does not)
    assert len(lp.tokens) == len(want) + (choice.finish_reason == "stop")
    if choice.finish_reason == "stop":
        assert lp.tokens[-1] == "" and lp.token_logprobs[-1] < 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == chosen and len(top) <= 4  # 3 alternatives and the chosen token
        assert max(top.values()) == pytest.approx(chosen)  # greedy: the chosen is the most likely


def test_token_ids_and_a_list_of_one_equal_the_text(client, rendered, tokenizer):
    ids = tokenizer(rendered)["input_ids"]
    by_text = client.completions.create(model="demo", prompt=rendered, temperature=0, max_tokens=6)
    for prompt in (ids, [ids], [rendered]):
        got = client.completions.create(model="demo", prompt=prompt, temperature=0, max_tokens=6)
        assert got.choices[0].text == by_text.choices[0].text
        assert got.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
        assert len(got.choices) == 1


def test_default_max_tokens_is_16_and_stop(client):
    got = client.completions.create(model="demo", prompt="red green blue", temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 16 and got.choices[0].finish_reason == "length"
    cut = got.choices[0].text.split()[1]
    stopped = client.completions.create(model="demo", prompt="red green blue", temperature=0, stop=[" " + cut],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert got.choices[0].text.startswith(stopped.choices[0].text) and cut not in stopped.choices[0].text.split()[1:]


def test_echo_prepends_the_prompt(client, rendered, tokenizer):
    plain = client.completions.create(model="demo", prompt=rendered, temperature=0, max_tokens=4)
    echoed = client.completions.create(model="demo", prompt=rendered, temperature=0, max_tokens=4, echo=True)
    assert echoed.choices[0].text == rendered + plain.choices[0].text
    ids = tokenizer(rendered)["input_ids"]
    by_ids = client.completions.create(model="demo", prompt=ids, temperature=0, max_tokens=4, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text


def test_batch_and_n_are_indexed_prompt_major(client):
    prompts = ["red green", "blue square"]
    single = [client.completions.create(model="demo", prompt=p, temperature=0, max_tokens=5).choices[0].text
              for p in prompts]
    got = client.completions.create(model="demo", prompt=prompts, temperature=0, max_tokens=5, n=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [single[0], single[0], single[1], single[1]]
    echoed = client.completions.create(model="demo", prompt=prompts, temperature=0, max_tokens=5, n=2, echo=True,
                                       logprobs=1)
    assert [c.text for c in echoed.choices] == [p + t for p, t in zip(
        [prompts[0], prompts[0], prompts[1], prompts[1]], [c.text for c in got.choices])]
    assert echoed.choices[0].logprobs.token_logprobs == echoed.choices[1].logprobs.token_logprobs
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    seeded = client.completions.create(model="demo", prompt="red", temperature=1.0, max_tokens=6, n=3, seed=7)
    again = client.completions.create(model="demo", prompt="red", temperature=1.0, max_tokens=6, n=3, seed=7)
    assert [c.text for c in seeded.choices] == [c.text for c in again.choices]


@pytest.mark.parametrize("extra", [{"logprobs": 2}, {"echo": True}, {"echo": True, "logprobs": 2}])
def test_stream_equals_non_stream(client, rendered, extra):
    full = client.completions.create(model="demo", prompt=[rendered, "blue"], temperature=0, max_tokens=8, **extra)
    chunks = list(client.completions.create(model="demo", prompt=[rendered, "blue"], temperature=0, max_tokens=8,
                                            stream=True, stream_options={"include_usage": True}, **extra))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine) == full.choices[index].text
        assert [c.finish_reason for c in mine if c.finish_reason] == [full.choices[index].finish_reason]
        if "logprobs" in extra:
            tokens = [t for c in mine if c.logprobs for t in c.logprobs.tokens]
            offsets = [o for c in mine if c.logprobs for o in c.logprobs.text_offset]
            assert tokens == full.choices[index].logprobs.tokens
            assert offsets == full.choices[index].logprobs.text_offset
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_responses_conform_to_openais_types(demo_server, rendered):
    body = {"model": "demo", "prompt": rendered, "max_tokens": 4, "temperature": 0, "logprobs": 1, "user": "u1"}
    r = post(demo_server, body)
    assert r.status_code == 200, r.text
    done = Completion.model_validate(r.json())
    assert done.choices[0].logprobs.tokens and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    with httpx.stream("POST", demo_server.url + "/v1/completions", json=dict(body, stream=True), timeout=120) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        chunk = json.loads(ln[len("data: "):])
        # a chunk before a choice's last has finish_reason null, as OpenAI and vLLM stream it; the
        # type (which the client does not validate chunks against) allows only the final values
        assert all(c["finish_reason"] in (None, "stop", "length") for c in chunk["choices"])
        for c in chunk["choices"]:
            c["finish_reason"] = c["finish_reason"] or "stop"
        Completion.model_validate(chunk)


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [10 ** 6]}, "prompt"),  # past the vocabulary: refused at intake
    ({"prompt": "<image> what"}, "prompt"),  # the image placeholder: text-only
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "n": 2}, "n"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "messages": []}, "messages"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
])
def test_bad_inputs_are_400_naming_param(demo_server, body, param):
    r = post(demo_server, {"model": "demo", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_bad_input_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="x", logprobs=99)
    assert e.value.body["param"] == "logprobs"


# -- the prompt's own logprobs (lm-eval's log-likelihood: echo, logprobs, max_tokens 0) -----------

LONG = ("red green blue square circle triangle " * 9).strip()  # ~55 tokens: several blocks


@pytest.fixture(scope="module")
def hf_logprobs(tokenizer):
    """log-softmax of HF's own forward (fp32) over a prompt's tokens: row j scores token j+1."""
    model = AutoModelForImageTextToText.from_pretrained(_demo_dir("demo"), dtype=torch.float32).eval()

    def score(ids):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
    return score


def check_against_hf(ids, token_logprobs, lp, top=None):
    assert token_logprobs[0] is None and len(token_logprobs) == len(ids)
    want = [lp[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
    assert token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    if top is not None:  # the most likely alternative of each position, and its logprob
        for j in range(1, len(ids)):
            best = max(top[j].values())
            assert best == pytest.approx(lp[j - 1].max().item(), abs=1e-4)


def test_echo_logprobs_max_tokens_0_are_hf_forward(client, tokenizer, hf_logprobs):
    """What lm-eval sends for a log-likelihood: every prompt token scored, nothing generated — and
    the prompt was cached just before, so a request that used the prefix cache would have no logits."""
    ids = tokenizer(LONG)["input_ids"]
    assert len(ids) > 40
    client.completions.create(model="demo", prompt=LONG, max_tokens=2)  # caches its blocks
    got = client.completions.create(model="demo", prompt=LONG, max_tokens=0, echo=True, logprobs=1)
    choice = got.choices[0]
    assert choice.text == LONG and choice.finish_reason == "length"
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(ids)
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    lp = choice.logprobs
    assert "".join(lp.tokens) == LONG
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.top_logprobs[0] is None
    check_against_hf(ids, lp.token_logprobs, hf_logprobs(ids), lp.top_logprobs)
    for token, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == chosen and 1 <= len(top) <= 2


def test_echo_logprobs_with_an_answer(client, tokenizer, hf_logprobs):
    """lm-eval's other shape (max_tokens 1): the prompt's entries, then the answer's."""
    ids = tokenizer("red green blue")["input_ids"]
    got = client.completions.create(model="demo", prompt=ids, max_tokens=3, echo=True, logprobs=2, temperature=0)
    lp, choice = got.choices[0].logprobs, got.choices[0]
    assert len(lp.tokens) == len(ids) + got.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(tokenizer.decode(ids))
    check_against_hf(ids, lp.token_logprobs[:len(ids)], hf_logprobs(ids))
    plain = client.completions.create(model="demo", prompt=ids, max_tokens=3, logprobs=2, temperature=0)
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)


def test_vllm_prompt_logprobs(demo_server, tokenizer, hf_logprobs):
    ids = tokenizer(LONG)["input_ids"]
    r = post(demo_server, {"model": "demo", "prompt": LONG, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    scores = r.json()["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(ids)
    lp = hf_logprobs(ids)
    chosen = [None] + [entry[str(ids[j])]["logprob"] for j, entry in enumerate(scores[1:], 1)]
    check_against_hf(ids, chosen, lp)
    for j, entry in enumerate(scores[1:], 1):
        assert 3 <= len(entry) <= 4
        mine = entry[str(ids[j])]
        assert mine["rank"] == int((lp[j - 1] > lp[j - 1, ids[j]]).sum()) + 1
        assert mine["decoded_token"] == tokenizer.decode([ids[j]])
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(ids[j]) or e["rank"] <= 3)
        assert ranks[:3] == [1, 2, 3]


async def test_prompt_logprobs_over_several_prefill_chunks(demo_config, tokenizer, hf_logprobs):
    """A prompt longer than a step's token budget is scored over several prefill chunks, beside
    other requests' steps; the scores are the same as one forward's."""
    config = demo_config.replace(generator={"max_batched_tokens": 12})
    ids = tokenizer(LONG)["input_ids"]
    async with Runtime.open(config) as rt:
        async with trio.open_nursery() as nursery:
            others = []

            async def other(p):
                others.append(await rt.text_completion(p, max_tokens=8, temperature=0))
            for p in ("blue square", "red circle triangle"):
                nursery.start_soon(other, p)
            done = await rt.text_completion(ids, max_tokens=0, echo=True, logprobs=0)
    scores = done.choices[0].prompt_logprobs
    check_against_hf(ids, [s.logprob for s in scores], hf_logprobs(ids))
    assert len(others) == 2


def test_lm_evals_loglikelihood_body(demo_server, tokenizer, hf_logprobs):
    """lm-eval's `local-completions` log-likelihood request, as its `_create_payload` builds it (a
    batch of context+continuation token lists), read as its `parse_logprobs` reads it."""
    pairs = [("red green blue", " square"), ("What colour is the circle?", " red circle")]
    batch = [tokenizer(ctx)["input_ids"] + tokenizer(cont)["input_ids"] for ctx, cont in pairs]
    ctxlens = [len(tokenizer(ctx)["input_ids"]) for ctx, _ in pairs]
    body = {"model": "demo", "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = post(demo_server, body)
    assert r.status_code == 200, r.text
    out = r.json()
    for choice, ctxlen, ids in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens, batch):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]  # lm-eval's own slicing
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        lp = hf_logprobs(ids)
        want = [lp[j - 1, ids[j]].item() for j in range(ctxlen, len(ids))]
        assert sum(token_logprobs) == pytest.approx(sum(want), abs=1e-4)
        greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs))
        assert greedy == all(lp[j - 1].argmax().item() == ids[j] for j in range(ctxlen, len(ids)))


async def test_qwen_raw_prompt_m_rope(demo_config):
    """Qwen2-VL (M-RoPE): a raw prompt gets the text positions the model itself gives it — its
    greedy answer is the chat path's, its prompt scores are HF's forward."""
    from mmserve.config import ModelConfig

    config = demo_config.replace(models=(ModelConfig("demo-qwen", _demo_dir("demo-qwen"), default=True),))
    question = [{"role": "user", "content": "What colour is the square?"}]
    async with Runtime.open(config) as rt:
        adapter = rt.registry.loaded["demo-qwen"].adapter
        text = adapter.render_prompt([{"role": "user", "content": [{"type": "text", "text": question[0]["content"]}]}])
        chat = await rt.chat_completion(question, temperature=0, max_tokens=6)
        raw = await rt.text_completion(text, temperature=0, max_tokens=6, echo=True, logprobs=0)
        ids = list(adapter.tokenizer(text)["input_ids"])
    assert raw.text.startswith(text) and raw.text[len(text):].strip() == chat.text.strip()
    model = AutoModelForImageTextToText.from_pretrained(_demo_dir("demo-qwen"), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    check_against_hf(ids, [p.logprob for p in raw.choices[0].prompt_logprobs], lp)


async def test_a_preempted_scoring_request_keeps_its_scores_and_sends_its_echo_once(demo_config, tokenizer,
                                                                                     hf_logprobs):
    """A small arena: a scoring request is the newest while a long answer decodes, so it is
    preempted and prefilled again; its prompt scores are still HF's and its echo comes once."""
    from tests.test_preemption import LONG as LONG_CHAT, small_arena

    ids = tokenizer("red green blue square circle triangle " * 3)["input_ids"]
    async with Runtime.open(small_arena(demo_config)) as rt:
        alone = await rt.text_completion(ids, temperature=0, max_tokens=30, echo=True, logprobs=1, ignore_eos=True)
        generator = rt.registry.require("demo").generator
        before = generator.preemptions
        out = {}

        async def scored():
            out["scored"] = await rt.text_completion(ids, temperature=0, max_tokens=30, echo=True, logprobs=1,
                                                     ignore_eos=True)

        async with trio.open_nursery() as nursery:
            long_answer = rt.chat(LONG_CHAT, temperature=0, max_tokens=60, min_tokens=60)
            async for _ in long_answer:  # decoding: the scoring request comes after it
                nursery.start_soon(scored)
                break
            async for _ in long_answer:
                pass
        assert generator.preemptions > before
    got = out["scored"].choices[0]
    assert got.text == alone.choices[0].text and got.text.startswith(tokenizer.decode(ids))
    assert got.text.count(tokenizer.decode(ids)) == 1
    check_against_hf(ids, [p.logprob for p in got.prompt_logprobs], hf_logprobs(ids))
    assert [t.logprob for t in got.logprobs] == pytest.approx([t.logprob for t in alone.choices[0].logprobs],
                                                              abs=1e-4)

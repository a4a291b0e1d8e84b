"""vLLM's tokenizer routes (`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`) over a
real socket against the demo model: the model's own tokenizer and chat template, a chat's images
counted as the model sees them, vLLM's shapes — and the calls lm-eval 0.4's `RemoteTokenizer`
makes when it is given only `base_url` and `model`, replayed as its source makes them —
`/tokenizer_info` must hold `eos_token`, `/tokenize` takes `{"prompt", "add_special_tokens":
false}` and answers `tokens`, `/detokenize` answers `prompt` (lm-eval itself runs live against a
server in tests/test_lm_eval_live.py, from its own environment; this replay needs none)."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import _demo_dir
from tests.helpers import colour_question

TEXT = "What colour is the square? red green blue"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(_demo_dir("demo"))


@pytest.fixture(scope="module")
def http(demo_server):
    with httpx.Client(base_url=demo_server.url, timeout=60) as c:
        yield c


def test_tokenize_a_prompt_as_the_models_tokenizer_does(http, tokenizer):
    r = http.post("/tokenize", json={"model": "demo", "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tokenizer(TEXT)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["token_strs"] is None and body["max_model_len"] > body["count"]
    bare = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False,
                                        "return_token_strs": True}).json()  # the default model
    assert bare["tokens"] == tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    back = http.post("/detokenize", json={"model": "demo", "tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(bare["tokens"])}


def test_a_chat_is_tokenized_as_its_request_is_images_included(http, demo_server):
    messages = colour_question("red", "square", seed=4)
    r = http.post("/tokenize", json={"model": "demo", "messages": messages})
    assert r.status_code == 200, r.text
    chat = http.post("/v1/chat/completions", json={"model": "demo", "messages": messages, "max_tokens": 1}).json()
    assert r.json()["count"] == chat["usage"]["prompt_tokens"]  # the image's tokens as the model sees them
    no_prompt = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < r.json()["count"]


def test_tokenizer_info_has_what_lm_eval_reads(http, tokenizer):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and "chat_template" in info and info["chat_template"]
    assert info["tokenizer_class"] and info["model"] == "demo"
    assert http.get("/tokenizer_info", params={"model": "demo-wide"}).json()["model"] == "demo-wide"


def test_lm_eval_remote_tokenizer_protocol(http, tokenizer):
    """What lm-eval's check_remote_tokenizer_support and RemoteTokenizer do with
    base_url=<server>/v1/completions: strip the API path, then call the routes at the root."""
    info = http.get("/tokenizer_info").json()
    assert isinstance(info, dict) and "eos_token" in info
    probe = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
    assert isinstance(probe["tokens"], list)
    eos_id = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"][0]
    assert eos_id == tokenizer.eos_token_id
    ids = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == TEXT


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "max_tokens": 3}, 400, "max_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "temperature": 1}, 400, "temperature"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "http://example.com/a.png"}}]}]}, 400, None),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
])
def test_bad_bodies_are_4xx_naming_the_field(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param

"""A prompt whose text alone is too long is refused before it is tokenized (inputs/text_bound.py):
the bound never refuses a prompt that fits (hypothesis, over the demo tokenizers and any text), and
a body of megabytes of text is refused at once with the error its token count would have given,
while the server goes on answering."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings, strategies as st
from transformers import AutoTokenizer

from mmserve import Runtime
from mmserve.errors import BadRequest
from mmserve.inputs.text_bound import max_token_bytes
from mmserve.models.demo import checkpoint_dir

TOKENIZERS = {name: AutoTokenizer.from_pretrained(checkpoint_dir(name)) for name in ("demo", "demo-qwen")}
TEXT = st.text(st.characters(codec="utf-8"), max_size=300) | st.text(" \n\tab<|>_-=é中🙂", max_size=300)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_a_text_is_never_fewer_tokens_than_its_bytes_over_the_longest_token(name, text):
    tokenizer = TOKENIZERS[name]
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert tokens * max_token_bytes(tokenizer) >= len(text.strip().encode("utf-8"))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_longest_token_is_counted_with_the_special_ones(name):
    tokenizer = TOKENIZERS[name]
    longest = max(len(t.encode()) for t in tokenizer.all_special_tokens)
    assert max_token_bytes(tokenizer) >= longest


async def test_megabytes_of_text_are_refused_before_tokenizing_and_the_server_goes_on(demo_config):
    async with Runtime.open(demo_config) as rt:
        huge = [{"role": "user", "content": "tell me about the colour red " * 300_000}]  # 8.7 MB
        t0 = time.monotonic()
        with pytest.raises(BadRequest, match="at least .* tokens .*limit of 8192") as err:
            await rt.chat_completion(huge, max_tokens=2)
        assert time.monotonic() - t0 < 2.0  # the tokenizer took ~10 s per MB of it before
        assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
        out = await rt.chat_completion([{"role": "user", "content": "hi"}], max_tokens=2)
        assert out.usage.completion_tokens >= 1
        with pytest.raises(BadRequest, match=r"the prompt is \d+ tokens, above"):  # just past: counted exactly
            await rt.chat_completion([{"role": "user", "content": "red " * 9000}], max_tokens=2)

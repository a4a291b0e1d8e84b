"""Each token's text as the answer shows it (`TextAssembler.settled`, what logprob `token`s are):
joined, they are the answer — with the template's lead cut, stop strings (kept or cut), characters
split over byte-level tokens and skipped special tokens — and a token's text is settled only once
it is shown."""

import pytest
from hypothesis import given, settings, strategies as st

from mmserve.generation.stops import TextAssembler


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    from mmserve.models.demo import checkpoint_dir

    return AutoTokenizer.from_pretrained(checkpoint_dir("demo"))


def run(a: TextAssembler, ids) -> tuple[str, list[str], list]:
    shown, texts, payloads = [], [], []
    for i in ids:
        shown.append(a.add(i, payload=i))
        got = a.settled()
        for text, payload in got:  # settled text is never ahead of what was shown
            texts.append(text)
            payloads.append(payload)
        assert "".join(texts) == "".join(shown)[:len("".join(texts))]
        if a.stopped:
            break
    shown.append(a.finish())
    for text, payload in a.settled():
        texts.append(text)
        payloads.append(payload)
    return "".join(shown), texts, payloads


def test_the_lead_and_a_stop_string_are_cut_from_the_tokens_texts():
    words = {1: " r", 2: "ed", 3: " gr", 4: "een", 5: " blue"}
    decode = lambda ids: "".join(words[i] for i in ids)
    answer, texts, payloads = run(TextAssembler(decode, stop=("ee",), lead=" "), [1, 2, 3, 4, 5])
    assert answer == "red gr" and texts == ["r", "ed", " gr", ""] and payloads == [1, 2, 3, 4]
    answer, texts, _ = run(TextAssembler(decode, stop=("ee",), lead=" ", include_stop=True), [1, 2, 3, 4, 5])
    assert answer == "red gree" and texts == ["r", "ed", " gr", "ee"]


def test_a_lead_token_of_its_own_has_no_text():
    words = {1: " ", 2: "red"}
    answer, texts, _ = run(TextAssembler(lambda ids: "".join(words[i] for i in ids), lead=" "), [1, 2])
    assert answer == "red" and texts == ["", "red"]


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 359), max_size=40), stop=st.sampled_from([(), ("e",), ("ed", " gr"), ("\n",)]),
       lead=st.sampled_from(["", " "]), include=st.booleans(), special=st.booleans())
def test_the_tokens_texts_join_to_the_answer(demo_tokenizer, ids, stop, lead, include, special):
    decode = lambda xs: demo_tokenizer.decode(list(xs), skip_special_tokens=not special)
    answer, texts, payloads = run(TextAssembler(decode, stop, lead, include_stop=include), ids)
    assert "".join(texts) == answer
    assert payloads == ids[:len(payloads)] and len(payloads) == len(ids[:len(payloads)])

"""Stop strings, incremental text, and sampling determinism."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmserve.generation.sampling import SamplingParams, make_generator, sample
from mmserve.generation.stops import TextAssembler

VOCAB = {1: "hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "\n"}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def run(ids, stop=()):
    a = TextAssembler(decode, stop)
    out = []
    for i in ids:
        out.append(a.add(i))
        if a.stopped:
            break
    out.append(a.finish())
    return "".join(out), a


def test_without_stop_everything_streams():
    text, a = run([1, 2, 3, 4])
    assert text == "hello world" and not a.stopped


def test_stop_string_cuts_and_never_leaks():
    text, a = run([1, 2, 3, 4, 5], stop=("o w",))
    assert text == "hell" and a.stopped and a.text == "hell"


def test_stop_string_spanning_tokens_is_held_back():
    a = TextAssembler(decode, ("lo wor",))
    assert a.add(1) == "he"  # the "l" might start the stop string
    assert a.add(2) == "l"  # "hello": only the trailing "lo" is held back
    assert a.add(3) == ""
    assert a.stopped and a.text == "hel"


def test_held_back_text_is_flushed_when_not_a_stop():
    text, _ = run([1, 2, 6], stop=("lox",))
    assert text == "hello\n"


def test_greedy_is_argmax_and_bans_tokens():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0])
    p = SamplingParams(temperature=0.0)
    assert sample(logits, p, None) == 1
    assert sample(logits, p, None, banned=torch.tensor([1])) == 3


def test_seeded_sampling_is_deterministic():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7)
    g1, g2 = make_generator(p), make_generator(p)
    assert [sample(logits, p, g1) for _ in range(20)] == [sample(logits, p, g2) for _ in range(20)]


def test_top_k_and_top_p_restrict_choices():
    logits = torch.tensor([10.0, 9.0, 0.0, -1.0, -2.0])
    pk = SamplingParams(temperature=1.0, top_k=2, seed=1)
    g = make_generator(pk)
    assert {sample(logits, pk, g) for _ in range(200)} <= {0, 1}
    pp = SamplingParams(temperature=1.0, top_p=0.5, seed=1)
    g = make_generator(pp)
    assert {sample(logits, pp, g) for _ in range(200)} == {0}


def test_template_lead_is_removed_once():
    words = {1: " r", 2: "ed", 3: " and", 4: " blue"}
    a = TextAssembler(lambda ids: "".join(words[i] for i in ids), lead=" ")
    assert a.add(1) + a.add(2) + a.add(3) + a.add(4) + a.finish() == "red and blue"


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    from mmserve.models.demo import checkpoint_dir

    return AutoTokenizer.from_pretrained(checkpoint_dir("demo"))


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 359), max_size=60))
def test_incremental_text_equals_decoding_everything(demo_tokenizer, ids):
    """Streaming deltas of the real (byte-level) tokenizer add up to the full decode, multi-byte
    characters split across tokens included."""
    decode = lambda xs: demo_tokenizer.decode(list(xs), skip_special_tokens=True)
    a = TextAssembler(decode)
    streamed = "".join(a.add(i) for i in ids) + a.finish()
    full = decode(ids)
    if not full.endswith("\ufffd"):
        assert streamed == full
    else:  # a trailing incomplete character is never shown
        assert full.startswith(streamed)

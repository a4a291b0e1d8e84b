"""response_format → llguidance grammars: bad schemas are 400s naming the problem, grammars compile
once per model, and the batch mask equals what llguidance itself allows."""

import json

import llguidance
import llguidance.numpy
import pytest
from transformers import AutoTokenizer

from mmserve.config import LimitsConfig
from mmserve.errors import BadRequest
from mmserve.generation.grammar import Grammars, MaskJob, grammar_for
from mmserve.inputs.request import parse_chat_request
from tests.conftest import _demo_dir

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "count"], "additionalProperties": False}


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module")
def grammars():
    tok = AutoTokenizer.from_pretrained(_demo_dir("demo"))
    return Grammars(tok, vocab_size=len(tok) + 7, eos_token_ids=[tok.eos_token_id])


@pytest.mark.parametrize("response_format, param, words", [
    ({"type": "yaml"}, "response_format.type", "'yaml'"),
    ({"type": "json_schema"}, "response_format.json_schema", "name"),
    (fmt({"type": "strin"}), "response_format.json_schema.schema", "strin"),
    (fmt({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "response_format.json_schema.schema", ""),
    (fmt([1, 2]), "response_format.json_schema.schema", "JSON schema"),
    ("json", "response_format", "object"),
])
def test_a_bad_response_format_is_a_400_naming_it(response_format, param, words):
    with pytest.raises(BadRequest) as info:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "response_format": response_format},
                           LimitsConfig(), "demo")
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message


def test_text_is_no_grammar_and_json_object_is_one():
    assert grammar_for(None) is None and grammar_for({"type": "text"}) is None
    assert "json_schema" in grammar_for({"type": "json_object"})


def test_grammars_compile_once_and_each_request_gets_a_fresh_state(grammars):
    g = grammar_for(fmt(SCHEMA))
    first, second = grammars.matcher(g), grammars.matcher(g)
    assert grammars.compiles == 1
    for t in AutoTokenizer.from_pretrained(_demo_dir("demo")).encode('{"color":"red"', add_special_tokens=False):
        assert first.consume_token(t)
    assert not second.is_error() and second is not first
    # the second one is still at the start: only "{" may come
    mask = MaskJob(grammars, [second]).allowed("cpu")[0]
    assert [i for i in range(grammars.vocab_size) if mask[i]] == grammars.tokenizer.tokenize_str("{")


def test_the_batch_mask_equals_llguidances_own(grammars):
    g = grammar_for(fmt(SCHEMA))
    matchers = [grammars.matcher(g), grammars.matcher(grammar_for({"type": "json_object"})), grammars.matcher(g)]
    for t in grammars.tokenizer.tokenize_str('{"color":"'):
        matchers[0].consume_token(t)
    mask = MaskJob(grammars, matchers).allowed("cpu")
    assert mask.shape == (3, grammars.vocab_size)
    for row, m in enumerate(matchers):
        bits = llguidance.numpy.allocate_token_bitmask(1, grammars.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(m, bits, 0)
        want = [i for i in range(grammars.vocab_size) if (int(bits[0, i // 32]) >> (i % 32)) & 1]
        assert [i for i in range(grammars.vocab_size) if mask[row, i]] == want
    assert not mask[:, -7:].any()  # ids past the tokenizer's vocabulary are never allowed


def test_a_completed_grammar_allows_only_eos(grammars):
    m = grammars.matcher(grammar_for(fmt({"type": "object", "properties": {"a": {"type": "boolean"}},
                                           "required": ["a"], "additionalProperties": False})))
    for t in grammars.tokenizer.tokenize_str(json.dumps({"a": True}, separators=(",", ":"))):
        assert m.consume_token(t)
    assert m.is_accepting()
    allowed = MaskJob(grammars, [m]).allowed("cpu")[0]
    assert allowed.nonzero().flatten().tolist() == list(grammars.tokenizer.eos_tokens) or m.is_stopped()

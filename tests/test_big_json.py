"""`mmserve.api.big_json.loads` (long strings decoded apart, in pieces) against its reference,
`json.loads`: the same value for every JSON text, the same error for every text that is not JSON.
Small `big` and `piece` make every string long and every piece short, so escapes, surrogate pairs
and backslash runs land on every possible cut."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.api import big_json
from mmserve.api.request_body import parse_json
from mmserve.errors import BadRequest

# text rich in what a cut could split: escapes, quotes, backslashes, controls, astral characters
TEXT = st.text(alphabet=st.sampled_from(['a', '"', '\\', '\n', '\t', '\x00', '\x1f', 'é', '😀', '\u2028', '/',
                                         '\ud800', 'u', '0']) | st.characters(), max_size=60)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(JSON, st.booleans(), st.integers(1, 8), st.integers(1, 9))
def test_the_value_is_json_loads_value(value, ascii_only, big, piece):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert big_json.loads(text, big=big, piece=piece) == json.loads(text)


@settings(max_examples=300, deadline=None)
@given(JSON, st.integers(0, 10_000), st.sampled_from(['"', '\\', '\x01', '}', ']', ',', 'x', '\\u12', '']),
       st.integers(1, 8), st.integers(1, 9))
def test_a_damaged_text_fails_as_json_loads_fails(value, at, damage, big, piece):
    text = json.dumps(value, ensure_ascii=False)
    at %= len(text) + 1
    broken = text[:at] + damage + text[at + 1:]
    try:
        want = json.loads(broken)
    except ValueError as e:
        with pytest.raises(type(e)) as got:
            big_json.loads(broken, big=big, piece=piece)
        assert str(got.value) == str(e)
    else:
        assert big_json.loads(broken, big=big, piece=piece) == want


def test_a_client_string_that_looks_like_a_placeholder_stays_itself():
    text = json.dumps({"a": "x" * 100, "b": "mmserve-big-0", "c": ["y" * 100, "mmserve-big-1"]})
    assert big_json.loads(text, big=10) == json.loads(text)


def test_a_long_key_stays_in_place():
    text = json.dumps({"k" * 100: "v" * 100})
    assert big_json.loads(text, big=10) == json.loads(text)


def test_parse_json_of_a_large_body_matches_json_loads_and_maps_errors_to_400():
    body = {"messages": [{"role": "user", "content": "é😀\\\"\n" * 40_000}], "url": "data:," + "A" * 200_000}
    raw = json.dumps(body, ensure_ascii=False).encode()
    assert len(raw) > 64 * 1024 and parse_json(raw) == body
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_json(raw[:-1])
    with pytest.raises(BadRequest, match="not valid UTF-8"):
        parse_json(raw[:100_000] + b"\xff" + raw[100_000:])
    # a multi-byte character split across the decoder's 1 MiB pieces
    raw = json.dumps({"t": "é" * 1_200_000}, ensure_ascii=False).encode()
    assert parse_json(raw) == {"t": "é" * 1_200_000}

"""The shared tier's byte layouts (cache/shared_values.py): keys and value headers are pinned, and a
stored value decodes to exactly its tensor or to None (a miss) — never to anything else."""

import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmserve.cache.shared_values import (
    KIND_ENCODER, KIND_KV_BLOCK, MAGIC, NAMESPACE, SHARED_KEY_LAYOUT_VERSION, SHARED_VALUE_LAYOUT_VERSION,
    block_key, decode, encode, encoder_key)
from mmserve.cache.keys import encoder_cache_key

KEY = bytes(range(16))


def test_key_bytes_are_pinned():
    assert SHARED_KEY_LAYOUT_VERSION == 2 and NAMESPACE == b"mmserve:s2:"
    assert encoder_key(KEY) == b"mmserve:s2:enc:" + KEY
    assert block_key(KEY) == b"mmserve:s2:kv:" + KEY
    # an encoder entry is keyed by the local encoder cache's own key: mm_hash and cache_salt inside
    salted = encoder_key(encoder_cache_key(KEY, "tenant-a"))
    assert salted.hex() == "6d6d73657276653a73323a656e633a" "e4c804dca88be75639ff296c32f4f69f"
    assert encoder_key(encoder_cache_key(KEY, "tenant-b")) != salted != encoder_key(encoder_cache_key(KEY, None))
    with pytest.raises(ValueError):
        block_key(KEY[:15])
    with pytest.raises(ValueError):
        encoder_key(KEY + b"x")


def test_value_header_bytes_are_pinned():
    assert SHARED_VALUE_LAYOUT_VERSION == 1
    value = encode(KIND_KV_BLOCK, block_key(KEY), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert value.hex() == (
        "4d4d5356" "0100" "02" "01" "02"     # magic, version 1, kind KV block, float32, 2 dims
        "02000000" "03000000"                # shape 2 x 3
        "1800000000000000"                   # 24 payload bytes
        "366e0655763418ee"                   # xxh3_64 over header, key (s2 namespace) and payload
        "00000000" "0000803f" "00000040" "00004040" "00008040" "0000a040")
    assert value[:4] == MAGIC


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                                      b.view(-1).view(torch.uint8) if b.numel() else b)


@settings(max_examples=150, deadline=None)
@given(t=tensors(), kind=st.sampled_from([KIND_ENCODER, KIND_KV_BLOCK]))
def test_round_trip(t, kind):
    key = block_key(KEY) if kind == KIND_KV_BLOCK else encoder_key(KEY)
    back = decode(kind, key, encode(kind, key, t), t.dtype, tuple(t.shape))
    assert back is not None and _same(back, t)
    assert decode(kind, key, encode(kind, key, t)) is not None  # no expectation: any dtype/shape


@settings(max_examples=300, deadline=None)
@given(t=tensors(), data=st.data())
def test_any_mutation_or_truncation_is_a_miss_or_the_same_tensor(t, data):
    key = block_key(KEY)
    value = bytearray(encode(KIND_KV_BLOCK, key, t))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(value) - 1))
        value[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        value = value[:data.draw(st.integers(0, len(value) - 1))]
    elif how == "extend":
        value += data.draw(st.binary(min_size=1, max_size=8))
    else:
        i = data.draw(st.integers(0, len(value)))
        value[i:i] = data.draw(st.binary(min_size=1, max_size=4))
    back = decode(KIND_KV_BLOCK, key, bytes(value))
    assert back is None or _same(back, t)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise(junk):
    assert decode(KIND_KV_BLOCK, block_key(KEY), junk) is None
    assert decode(KIND_ENCODER, encoder_key(KEY), junk, torch.float32, (None, 8)) is None


def test_foreign_values_are_misses():
    t = torch.randn(2, 3)
    key, other = block_key(KEY), block_key(bytes(16))
    value = encode(KIND_KV_BLOCK, key, t)
    assert decode(KIND_KV_BLOCK, other, value) is None  # copied under another key
    assert decode(KIND_ENCODER, key, value) is None  # another kind
    assert decode(KIND_KV_BLOCK, key, value, torch.float16) is None  # another dtype than expected
    assert decode(KIND_KV_BLOCK, key, value, shape=(3, 2)) is None  # another shape
    assert decode(KIND_KV_BLOCK, key, value, shape=(2, 3, 1)) is None
    assert decode(KIND_KV_BLOCK, key, value, shape=(None, 3)) is not None
    newer = bytearray(value)
    newer[4:6] = struct.pack("<H", SHARED_VALUE_LAYOUT_VERSION + 1)  # a later layout: not read
    assert decode(KIND_KV_BLOCK, key, bytes(newer)) is None
    assert decode(KIND_KV_BLOCK, key, None) is None

"""The shared tier's byte layouts (cache/shared_values.py): keys and value headers are pinned, and a
stored value decodes to exactly its tensor or to None (a miss) — never to anything else: not a
value tagged under another secret or none, not one of another size, not a NaN."""

import hashlib
import hmac
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mmserve.cache import shared_values as sv
from mmserve.cache.shared_values import (
    KIND_ENCODER, KIND_KV_BLOCK, MAC_CONTEXT, MAGIC, MIN_SECRET_BYTES, NAMESPACE, SHARED_KEY_LAYOUT_VERSION,
    SHARED_VALUE_LAYOUT_VERSION, MacKey, Rejected, block_key, encoder_key, value_size, verify)
from mmserve.config.checks import MIN_SHARED_SECRET_BYTES
from mmserve.cache.keys import encoder_cache_key

KEY = bytes(range(16))
SECRET = b"0123456789abcdef-test-secret"
MAC = MacKey(SECRET)


def encode(kind, key, t, mac=MAC):
    return sv.encode(kind, key, t, mac)


def decode(kind, key, value, dtype=None, shape=None, mac=MAC):
    return sv.decode(kind, key, value, mac, dtype, shape)


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
    assert SHARED_VALUE_LAYOUT_VERSION == 2
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    value = encode(KIND_KV_BLOCK, block_key(KEY), t)
    header = bytes.fromhex("4d4d5356" "0200" "02" "01" "02" "02000000" "03000000" "1800000000000000")
    payload = bytes.fromhex("00000000" "0000803f" "00000040" "00004040" "00008040" "0000a040")
    tag = bytes.fromhex("2edbea8359dd67e233726ab559c3fc921427fb7d92eeac3ee9715279976e646e")
    assert value == header + tag + payload  # magic, version 2, KV block, float32, 2 dims, 2 x 3, 24 bytes
    # the tag is HMAC-SHA256 under HMAC-SHA256(secret, MAC_CONTEXT), over len(key), key, header, payload
    mac_key = hmac.new(SECRET, MAC_CONTEXT, hashlib.sha256).digest()
    key = block_key(KEY)
    assert tag == hmac.new(mac_key, struct.pack("<I", len(key)) + key + header + payload, hashlib.sha256).digest()
    assert value[:4] == MAGIC
    assert len(value) == value_size(torch.float32, (2, 3))


def test_secrets_and_their_bounds():
    assert MIN_SECRET_BYTES == MIN_SHARED_SECRET_BYTES == 16
    with pytest.raises(ValueError):
        MacKey(b"x" * 15)
    assert "test-secret" not in repr(MAC) and MAC.authenticated
    public = MacKey.unauthenticated()
    assert not public.authenticated
    t, key = torch.randn(2, 3), block_key(KEY)
    value = encode(KIND_KV_BLOCK, key, t)
    other = MacKey(b"another secret of the same length")
    assert verify(KIND_KV_BLOCK, key, value, other) == Rejected("mac")  # another secret's replicas: foreign
    assert verify(KIND_KV_BLOCK, key, value, public) == Rejected("mac")
    assert decode(KIND_KV_BLOCK, key, encode(KIND_KV_BLOCK, key, t, public), mac=public) is not None


def test_a_value_resigned_with_the_old_public_checksum_is_refused():
    """Version 1's forgery: the header and payload of another tensor, with xxh3-64 under the
    public seed as its checksum (anyone could compute it). Whatever its version field says, it
    never verifies."""
    import xxhash

    key, forged_tensor = block_key(KEY), torch.full((2, 3), 7.0)
    payload = forged_tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    for version in (1, 2):
        head = struct.pack("<4sHBBB2IQ", MAGIC, version, KIND_KV_BLOCK, 1, 2, 2, 3, len(payload))
        h = xxhash.xxh3_64(seed=0x4D4D_5345_5256_0006)
        for part in (head, key, payload):
            h.update(part)
        checksum = struct.pack("<Q", h.intdigest())
        forged = head + checksum + payload if version == 1 else head + checksum * 4 + payload
        got = verify(KIND_KV_BLOCK, key, forged, MAC, torch.float32, (2, 3))
        assert got == Rejected("version" if version == 1 else "mac")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused_even_with_a_valid_tag(dtype, bad):
    key = block_key(KEY)
    for n, at in ((1, 0), (1000, 0), (1000, 517), (1000, 999), (4099, 4098)):  # the sum's vector body and tail
        t = torch.randn(n).to(dtype)
        t[at] = bad
        assert verify(KIND_KV_BLOCK, key, encode(KIND_KV_BLOCK, key, t), MAC) == Rejected("non_finite")
    big = torch.full((1000,), torch.finfo(dtype).max if dtype == torch.float16 else 1e4).to(dtype)
    assert isinstance(verify(KIND_KV_BLOCK, key, encode(KIND_KV_BLOCK, key, big), MAC), torch.Tensor)


def test_each_refusal_has_its_reason():
    t, key = torch.randn(2, 3), block_key(KEY)
    value = encode(KIND_KV_BLOCK, key, t)
    assert verify(KIND_KV_BLOCK, key, None, MAC) is None  # absent: no reason
    assert verify(KIND_KV_BLOCK, key, b"junk", MAC) == Rejected("format")
    assert verify(KIND_ENCODER, key, value, MAC) == Rejected("format")
    assert verify(KIND_KV_BLOCK, key, value, MAC, torch.float16) == Rejected("format")
    assert verify(KIND_KV_BLOCK, key, value, MAC, shape=(3, 2)) == Rejected("format")
    assert verify(KIND_KV_BLOCK, key, value[:-1], MAC) == Rejected("size")
    assert verify(KIND_KV_BLOCK, key, value + b"\0", MAC) == Rejected("size")
    assert verify(KIND_KV_BLOCK, block_key(bytes(16)), value, MAC) == Rejected("mac")
    flipped = bytearray(value)
    flipped[-1] ^= 1
    assert verify(KIND_KV_BLOCK, key, bytes(flipped), MAC) == Rejected("mac")


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
    assert verify(KIND_KV_BLOCK, key, bytes(newer), MAC) == Rejected("version")
    assert decode(KIND_KV_BLOCK, key, None) is None

"""Keys and values of the shared cache tier (Redis): byte layouts only, pure and synchronous.

Keys. The tier stores what the two local caches store, under the keys they already use: an
encoder output under its encoder key (`keys.encoder_cache_key`: the item's `mm_hash` and the
request's `cache_salt`), a full KV block under its block hash. Both keys hold the model signature
(the model's name, config and weight files, dtype and device type) and the request's `cache_salt`
(the encoder key directly, a block hash through its chain root), so a tenant with another salt, or a
replica with another checkpoint under the same name, computes other keys and never reads these
entries. The Redis key is a versioned namespace then the raw 16 key bytes:

    b"mmserve:s2:enc:" + encoder key        b"mmserve:s2:kv:" + block_hash

`SHARED_KEY_LAYOUT_VERSION` ("s2") changes whenever this layout or the meaning of a value
changes: an old replica and a new one then simply do not see each other's entries.

Values. A header, a tag, then the tensor's bytes (little-endian, C order):

    magic  b"MMSV"                 4 bytes
    u16    value layout version    (SHARED_VALUE_LAYOUT_VERSION, 2)
    u8     kind                    1 = encoder output, 2 = KV block
    u8     dtype code              see DTYPE_CODES
    u8     ndim                    0..8
    u32    shape[i]                ndim times
    u64    payload bytes
    32     tag                     HMAC-SHA256 under the replicas' shared secret (`MacKey`) over
                                   u32 len(redis key), the Redis key, every header byte before the
                                   tag, and the payload

The tag authenticates the value and binds it to its key: without the secret nobody can write a
value that verifies (version 1's xxh3 checksum had a public seed, so anyone who could write to
Redis could re-sign any tensor under any key), and a value copied under another key (another
model's, another tenant's, another block's) is foreign. `verify` answers the tensor, None for an
absent value, or a `Rejected` with its reason: "format" (magic, kind, dtype, shape or layout not
what the reader expects), "version" (another layout version: an older or newer replica's), "size"
(a length that is not the exact size of this key's value), "mac" (the tag does not verify) or
"non_finite" (a NaN or an infinity in the payload: even a value that verifies is refused, so a
replica that holds the secret and goes wrong cannot make another replica's requests fail). A
rejected value is a miss, never a wrong answer. Every value of a given kind, dtype and shape has
one exact size (`value_size`), so a reader bounds what it reads before it reads it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
from dataclasses import dataclass
from typing import Sequence

import torch

from mmserve.cache.keys import CONTENT_KEY_BYTES

SHARED_KEY_LAYOUT_VERSION = 2  # 2: an encoder entry is keyed by its salted encoder key, not its mm_hash
SHARED_VALUE_LAYOUT_VERSION = 2  # 2: an HMAC-SHA256 tag under a shared secret (1: a public-seed xxh3 checksum)
# ("MMSERV" + 6 seeded layout 1's value checksums and "MMSERV" + 7 its salted encoder keys: retired, never reuse)
MAC_CONTEXT = b"mmserve shared-cache value tag v2"  # the tag's key is HMAC(secret, this): one use of the secret

MAGIC = b"MMSV"
KIND_ENCODER = 1
KIND_KV_BLOCK = 2
KINDS = (KIND_ENCODER, KIND_KV_BLOCK)
MAX_NDIM = 8
TAG_BYTES = 32
MIN_SECRET_BYTES = 16

NAMESPACE = b"mmserve:s%d:" % SHARED_KEY_LAYOUT_VERSION
_KIND_TAG = {KIND_ENCODER: b"enc:", KIND_KV_BLOCK: b"kv:"}

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

_FIXED = struct.Struct("<4sHBBB")  # magic, version, kind, dtype code, ndim
_NBYTES = struct.Struct("<Q")  # payload bytes (the tag follows)

REJECT_REASONS = ("format", "version", "size", "mac", "non_finite")


def shared_key(kind: int, key: bytes) -> bytes:
    """The Redis key of a local cache key (`mm_hash` for KIND_ENCODER, a block hash for KIND_KV_BLOCK)."""
    if kind not in _KIND_TAG:
        raise ValueError(f"unknown shared-value kind {kind!r}")
    if type(key) is not bytes or len(key) != CONTENT_KEY_BYTES:
        raise ValueError(f"a shared key wraps a {CONTENT_KEY_BYTES}-byte cache key, got {key!r}")
    return NAMESPACE + _KIND_TAG[kind] + key


def encoder_key(encoder_cache_key: bytes) -> bytes:
    """An encoder output's Redis key: the namespace, then the local encoder cache's own key
    (`keys.encoder_cache_key(mm_hash, cache_salt)`), so a tenant reads and writes its own entry only."""
    return shared_key(KIND_ENCODER, encoder_cache_key)


def block_key(block_hash: bytes) -> bytes:
    return shared_key(KIND_KV_BLOCK, block_hash)


class MacKey:
    """The key the values' tags are made with: derived from the secret every replica shares
    (`[shared_cache] secret`). `unauthenticated()` is the key of `trust = "network"` without a
    secret: a constant anyone can compute, so its tags only catch corruption, never forgery."""

    __slots__ = ("_key", "authenticated")

    def __init__(self, secret: bytes):
        if type(secret) is not bytes or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the shared cache's secret must be at least {MIN_SECRET_BYTES} bytes")
        self._key = hmac.digest(secret, MAC_CONTEXT, "sha256")
        self.authenticated = True

    @classmethod
    def unauthenticated(cls) -> MacKey:
        key = cls(b"mmserve: no secret, the network is trusted")
        key.authenticated = False
        return key

    def tag(self, redis_key: bytes, header, payload) -> bytes:
        # hmac with a named digest runs OpenSSL's HMAC, which lets go of the GIL over large buffers
        h = hmac.new(self._key, struct.pack("<I", len(redis_key)) + redis_key, "sha256")
        h.update(header)
        h.update(payload)
        return h.digest()

    def __repr__(self) -> str:  # never the key itself
        return f"MacKey(authenticated={self.authenticated})"


@dataclass(frozen=True)
class Rejected:
    """A stored value refused by `verify` (a miss), and why: one of REJECT_REASONS."""

    reason: str


def header_size(ndim: int) -> int:
    return _FIXED.size + 4 * ndim + _NBYTES.size + TAG_BYTES


def value_size(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """The exact size in bytes of the stored value of a tensor of `dtype` and `shape`."""
    numel = 1
    for d in shape:
        numel *= int(d)
    return header_size(len(shape)) + numel * dtype.itemsize


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite: one sum in float32 (a NaN or an infinity anywhere makes
    the sum non-finite; summing is ~10x faster on the CPU than isfinite over half-precision
    elements). An honest tensor whose magnitudes sum past float32's 3.4e38 is refused too: a
    miss, never a wrong answer (no model's activations come near)."""
    if not t.numel():
        return True
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    return bool(torch.isfinite(t.sum(dtype=acc)))


def encode(kind: int, redis_key: bytes, tensor: torch.Tensor, mac: MacKey) -> bytes:
    """The stored value of `tensor` (any device; copied to host bytes) under `redis_key`."""
    if kind not in KINDS:
        raise ValueError(f"unknown shared-value kind {kind!r}")
    if sys.byteorder != "little":  # the layout is little-endian; a big-endian host would need swaps
        raise RuntimeError("the shared cache tier's value layout needs a little-endian host")
    code = DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"dtype {tensor.dtype} has no shared-value code")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"at most {MAX_NDIM} dimensions, got {tensor.dim()}")
    t = tensor.detach().to("cpu").contiguous()
    payload = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    head = _FIXED.pack(MAGIC, SHARED_VALUE_LAYOUT_VERSION, kind, code, t.dim())
    head += struct.pack(f"<{t.dim()}I", *t.shape)
    head += _NBYTES.pack(len(payload))
    return head + mac.tag(redis_key, head, payload) + payload


def verify(kind: int, redis_key: bytes, value: bytes | bytearray | memoryview | None, mac: MacKey,
           dtype: torch.dtype | None = None, shape: Sequence[int | None] | None = None,
           ) -> torch.Tensor | Rejected | None:
    """The tensor stored in `value` under `redis_key`; None when there is no value; `Rejected`
    when it is corrupt, truncated, foreign (another key, kind, layout or secret), not of the
    expected `dtype` / `shape` (None entries of `shape` match any size), or not finite. Never
    raises on any bytes."""
    if value is None:
        return None
    data = memoryview(value).cast("B") if not isinstance(value, bytes) else memoryview(value)
    if len(data) < _FIXED.size:
        return Rejected("format")
    magic, version, got_kind, code, ndim = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        return Rejected("format")
    if version != SHARED_VALUE_LAYOUT_VERSION:
        return Rejected("version")
    if got_kind != kind or ndim > MAX_NDIM:
        return Rejected("format")
    got_dtype = _DTYPES.get(code)
    if got_dtype is None or (dtype is not None and got_dtype != dtype):
        return Rejected("format")
    tag_at = _FIXED.size + 4 * ndim + _NBYTES.size
    start = tag_at + TAG_BYTES
    if len(data) < start:
        return Rejected("size")
    dims = struct.unpack_from(f"<{ndim}I", data, _FIXED.size)
    if shape is not None and (len(shape) != ndim or any(w is not None and w != d for w, d in zip(shape, dims))):
        return Rejected("format")
    (nbytes,) = _NBYTES.unpack_from(data, tag_at - _NBYTES.size)
    numel = 1
    for d in dims:
        numel *= d
    if nbytes != numel * got_dtype.itemsize or len(data) - start != nbytes:
        return Rejected("size")
    payload = data[start:]
    if not hmac.compare_digest(mac.tag(redis_key, data[:tag_at], payload), data[tag_at:start]):
        return Rejected("mac")
    if not numel:
        return torch.empty(dims, dtype=got_dtype)
    t = torch.frombuffer(bytearray(payload), dtype=got_dtype).reshape(dims)
    return t if all_finite(t) else Rejected("non_finite")


def decode(kind: int, redis_key: bytes, value: bytes | bytearray | memoryview | None, mac: MacKey,
           dtype: torch.dtype | None = None, shape: Sequence[int | None] | None = None) -> torch.Tensor | None:
    """`verify`'s tensor, or None for a value that is absent or rejected."""
    got = verify(kind, redis_key, value, mac, dtype, shape)
    return got if isinstance(got, torch.Tensor) else None

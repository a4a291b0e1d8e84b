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

Values. A header, then the tensor's bytes (little-endian, C order):

    magic  b"MMSV"                 4 bytes
    u16    value layout version    (SHARED_VALUE_LAYOUT_VERSION)
    u8     kind                    1 = encoder output, 2 = KV block
    u8     dtype code              see DTYPE_CODES
    u8     ndim                    0..8
    u32    shape[i]                ndim times
    u64    payload bytes
    u64    checksum                xxh3_64 (fixed seed) over every header byte before it,
                                   the Redis key, and the payload

The checksum covers the key, so a value copied under another key (or written by a replica of
another model) is foreign: `decode` answers None. So does any value whose magic, version, kind,
dtype or shape is not what the reader expects, whose length is wrong, or whose checksum does not
match: a bad entry is a miss, never a wrong answer.
"""

from __future__ import annotations

import struct
import sys
from typing import Sequence

import torch
import xxhash

from mmserve.cache.keys import CONTENT_KEY_BYTES

SHARED_KEY_LAYOUT_VERSION = 2  # 2: an encoder entry is keyed by its salted encoder key, not its mm_hash
SHARED_VALUE_LAYOUT_VERSION = 1
SEED_SHARED_VALUE = 0x4D4D_5345_5256_0006  # "MMSERV" + 6: a new kind of digest, never change it
# ("MMSERV" + 7 salted layout 1's encoder keys here; retired, never reuse it)

MAGIC = b"MMSV"
KIND_ENCODER = 1
KIND_KV_BLOCK = 2
KINDS = (KIND_ENCODER, KIND_KV_BLOCK)
MAX_NDIM = 8

NAMESPACE = b"mmserve:s%d:" % SHARED_KEY_LAYOUT_VERSION
_KIND_TAG = {KIND_ENCODER: b"enc:", KIND_KV_BLOCK: b"kv:"}

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

_FIXED = struct.Struct("<4sHBBB")  # magic, version, kind, dtype code, ndim
_TAIL = struct.Struct("<QQ")  # payload bytes, checksum


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


def _checksum(header: bytes, redis_key: bytes, payload) -> int:
    h = xxhash.xxh3_64(seed=SEED_SHARED_VALUE)
    h.update(header)
    h.update(redis_key)
    h.update(payload)
    return h.intdigest()


def encode(kind: int, redis_key: bytes, tensor: torch.Tensor) -> bytes:
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
    head += struct.pack("<Q", len(payload))
    return head + struct.pack("<Q", _checksum(head, redis_key, payload)) + payload


def decode(kind: int, redis_key: bytes, value: bytes | bytearray | memoryview | None,
           dtype: torch.dtype | None = None, shape: Sequence[int | None] | None = None) -> torch.Tensor | None:
    """The tensor stored in `value` under `redis_key`, or None when the value is absent, corrupt,
    truncated, foreign (another key, kind or layout) or not of the expected `dtype` / `shape`
    (None entries of `shape` match any size). Never raises on any bytes."""
    if value is None:
        return None
    data = memoryview(value).cast("B") if not isinstance(value, bytes) else memoryview(value)
    if len(data) < _FIXED.size:
        return None
    magic, version, got_kind, code, ndim = _FIXED.unpack_from(data, 0)
    if magic != MAGIC or version != SHARED_VALUE_LAYOUT_VERSION or got_kind != kind or ndim > MAX_NDIM:
        return None
    got_dtype = _DTYPES.get(code)
    if got_dtype is None or (dtype is not None and got_dtype != dtype):
        return None
    dims_end = _FIXED.size + 4 * ndim
    if len(data) < dims_end + _TAIL.size:
        return None
    dims = struct.unpack_from(f"<{ndim}I", data, _FIXED.size)
    if shape is not None and (len(shape) != ndim or any(w is not None and w != d for w, d in zip(shape, dims))):
        return None
    nbytes, checksum = _TAIL.unpack_from(data, dims_end)
    numel = 1
    for d in dims:
        numel *= d
    start = dims_end + _TAIL.size
    itemsize = torch.empty((), dtype=got_dtype).element_size()
    if nbytes != numel * itemsize or len(data) - start != nbytes:
        return None
    payload = data[start:]
    if _checksum(data[:dims_end + 8], redis_key, payload) != checksum:
        return None
    if not numel:
        return torch.empty(dims, dtype=got_dtype)
    return torch.frombuffer(bytearray(payload), dtype=got_dtype).reshape(dims)

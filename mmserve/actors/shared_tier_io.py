"""What the shared tier writes to Redis, reads back, and how it tidies up after. Writes overwrite
(SET EX) and never carry a non-finite tensor. Every value is read at most
one byte past the exact size its key's value has (a longer one is refused unread), verified
(`cache.shared_values.verify`: tag, format, size, finite), and a refused value deleted by a
compare-and-delete unless it was rewritten since it was read. Called from the tier's worker
threads (`actors.shared_tier`); no trio here.

Nothing anyone else writes to Redis is believed:
- a look-up reads at most the exact size a value of its key has (`GETRANGE key 0 size`): a longer
  value is refused without being read (a 200 MB value planted under a key costs one value's bytes);
- a value that does not verify (tag, format, size, or a NaN/inf in it) is a miss, counted by reason
  (`rejected`), and deleted — unless it was rewritten since it was read (a compare-and-delete in
  one Lua script, so an honest value written in between stays);
- writes overwrite (`SET EX`, not `SET NX`): a planted value never locks an honest one out;
- only values that verified have their TTL renewed (after the read, in the background).

The client: redis-py's synchronous client over one `ConnectionPool`, called from trio worker
threads (`trio.to_thread.run_sync`). redis-py is the maintained client with TLS (`rediss://`),
passwords in the URL and pipelining; its asyncio client needs an asyncio event loop (under trio
only through a bridge such as trio-asyncio), and the trio-native clients are unmaintained. A
worker thread per round trip costs ~50 us, small beside a network round trip, and the pool is
thread-safe. A thread that outlives its look-up's deadline is abandoned (its answer is dropped);
look-ups in threads are bounded by a limiter and the client's socket timeout.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from mmserve.cache.shared_values import (
    MAGIC, SHARED_VALUE_LAYOUT_VERSION, MacKey, Rejected, all_finite, encode, value_size, verify)

REFUSED_PREFIX_BYTES = 128  # what a compare-and-delete compares: the header and tag of any value, and more

# Deletes a value that was refused, unless it was rewritten since it was read: KEYS[1] the key;
# ARGV[1] the first bytes that were read of it, ARGV[2] how many bytes were read, ARGV[3] "1" when
# the read stopped short (the value is at least that long), "0" when it read the whole value.
# A key of another type than a string (never one of ours) is deleted.
DELETE_REFUSED_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return 0 end
if t ~= 'string' then return redis.call('DEL', KEYS[1]) end
local n = redis.call('STRLEN', KEYS[1])
local read = tonumber(ARGV[2])
if (ARGV[3] == '1' and n < read) or (ARGV[3] == '0' and n ~= read) then return 0 end
if redis.call('GETRANGE', KEYS[1], 0, string.len(ARGV[1]) - 1) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


@dataclass(frozen=True)
class Refused:
    """A stored value a look-up refused: enough of it to delete it unless it was rewritten since."""

    key: bytes
    reason: str
    prefix: bytes  # its first REFUSED_PREFIX_BYTES bytes (fewer when it is shorter)
    read: int  # bytes read of it
    partial: bool  # the read stopped at the size limit: the value is longer


def read_values(client, kind: int, keys: list[bytes], dtype: torch.dtype, shapes, mac: MacKey) -> tuple[list, list, list]:
    """(tensors or None per key, the keys whose values verified, the values refused) — in a
    worker thread. Each value is read up to one byte past its exact size: a longer one is
    refused without reading the rest."""
    sizes = [value_size(dtype, s) for s in shapes]
    pipe = client.pipeline(transaction=False)
    for k, size in zip(keys, sizes):
        pipe.getrange(k, 0, size)  # inclusive: at most size + 1 bytes
    values = pipe.execute(raise_on_error=False)
    out, found, refused = [], [], []
    for k, v, size, shape in zip(keys, values, sizes, shapes):
        if isinstance(v, Exception):
            if not str(v).startswith("WRONGTYPE"):
                raise v  # Redis refuses reads: the tier's error, not this value's
            got = Rejected("format")  # a hash, list... under our key: never one of ours
            v = b""
        elif not v:
            out.append(None)  # absent (an empty string is no value of ours either)
            continue
        elif len(v) != size:  # another layout's value is left to its replicas; any other is refused
            got = Rejected("version" if other_layout(v) else "size")
        else:
            got = verify(kind, k, v, mac, dtype, shape)
        if isinstance(got, Rejected):
            out.append(None)
            refused.append(Refused(k, got.reason, bytes(v[:REFUSED_PREFIX_BYTES]), len(v), len(v) > size))
        else:
            out.append(got)
            found.append(k)
    return out, found, refused


def renew_and_delete(client, delete_refused, found: list[bytes], refused: list[Refused], ttl_s: float) -> int:
    """(Worker thread.) One pipelined round trip; how many refused values were deleted."""
    pipe = client.pipeline(transaction=False)
    for k in found:
        pipe.expire(k, ttl_s)
    for r in refused:
        delete_refused(keys=[r.key], args=[r.prefix, r.read, 1 if r.partial else 0], client=pipe)
    replies = pipe.execute()
    return sum(1 for x in replies[len(found):] if x == 1)


def write_values(client, batch: list, mac: MacKey, ttl_s: float) -> tuple[int, int, int]:
    """Writes a batch of (kind, key, tensor) in one pipelined round trip. SET EX, not SET NX:
    whatever is under the key (a value another replica wrote, or one planted there) is replaced by
    this honest one. A tensor that is not finite is never written: this replica's own fault, not
    spread. (values written, their bytes, values refused)."""
    pipe = client.pipeline(transaction=False)
    nbytes = written = refused = 0
    for kind, key, tensor in batch:
        tensor = tensor.detach().to("cpu")  # once, for the check and the bytes
        if not all_finite(tensor):
            refused += 1
            continue
        value = encode(kind, key, tensor, mac)
        nbytes += len(value)
        written += 1
        pipe.set(key, value, ex=ttl_s)
    if written:
        pipe.execute()
    return written, nbytes, refused


def other_layout(value: bytes) -> bool:
    """Whether `value` says it is a value of another layout version than this one's."""
    return (len(value) >= 6 and value[:4] == MAGIC
            and struct.unpack_from("<H", value, 4)[0] != SHARED_VALUE_LAYOUT_VERSION)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def public_error(e: BaseException) -> str:
    """What kind of failure `e` is, in words that say nothing of where Redis is (redis-py's
    messages name the host and port)."""
    import redis.exceptions as rex

    if isinstance(e, rex.AuthenticationError):
        return "Redis refused the credentials"
    if isinstance(e, (rex.TimeoutError, TimeoutError)):
        return "Redis did not answer in time"
    if isinstance(e, (rex.ConnectionError, ConnectionError, OSError)):
        return "Redis is unreachable"
    if isinstance(e, rex.OutOfMemoryError) or (isinstance(e, rex.ResponseError) and str(e).startswith("OOM")):
        return "Redis is full (it refuses writes)"
    if isinstance(e, rex.ResponseError):
        return "Redis refused a command"
    return f"Redis error ({type(e).__name__})"

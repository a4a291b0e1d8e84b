"""The encoder-output cache: mm_hash → encoder output tensor, LRU under an exact byte budget.

Pure and synchronous: no logging, no trio. Every call returns what happened (hit or miss, stored
or not and why, what was evicted) so the owning Encoder actor can log `encoder_cache.*` events.

- The budget counts `tensor.nbytes` (element_size * numel) of what is stored, exactly. A tensor
  that is a view into a larger storage is stored as a compact copy, so the memory the cache keeps
  alive is the memory it counts.
- Eviction is strictly least-recently-used: a `get` hit and a repeated `put` refresh recency; a
  `pin` does not.
- Entries pinned by in-flight requests are never evicted (nor cleared). Pins are refcounted per
  owner; `release_owner` drops every pin of a request that finished, aborted or crashed.
- Stored tensors are shared with callers, not copied: treat them as read-only.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Hashable

import torch

from mmserve.cache.keys import key_prefix

STORED = "stored"
ALREADY_PRESENT = "already_present"  # the key was cached already: recency refreshed, nothing stored
TOO_LARGE = "too_large"  # bigger than the whole budget (or max_entries == 0): serve it uncached
NO_ROOM = "no_room"  # even evicting every unpinned entry would not make room: nothing evicted


@dataclass(frozen=True)
class PutResult:
    """Outcome of a put: whether the tensor was stored, why, and what was evicted to make room."""

    stored: bool
    evicted: list[tuple[bytes, int]] = field(default_factory=list)  # (key, nbytes), LRU first
    reason: str = STORED

    @property
    def cached(self) -> bool:
        """The key is in the cache after the put (stored now or already present)."""
        return self.reason in (STORED, ALREADY_PRESENT)


@dataclass(frozen=True)
class EncoderCacheStats:
    hits: int
    misses: int
    inserts: int
    evictions: int
    bytes_saved: int  # sum of nbytes served from hits
    bytes_in_use: int
    entries: int
    pinned_entries: int
    budget_bytes: int
    max_entries: int | None


@dataclass(frozen=True)
class EntryInfo:
    """One row of `snapshot()`; rank 0 is the least recently used (next eviction candidate)."""

    key_prefix: str
    nbytes: int
    pins: int
    rank: int


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Exact payload size: element_size * numel."""
    return tensor.element_size() * tensor.numel()


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself if it owns exactly its storage, else a compact copy; never tracks grad."""
    if tensor.layout != torch.strided:
        raise TypeError(f"only dense tensors can be cached, got layout {tensor.layout}")
    if tensor.requires_grad:
        tensor = tensor.detach()
    owns_storage = (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor_nbytes(tensor)
    )
    return tensor if owns_storage else tensor.clone(memory_format=torch.contiguous_format)


class EncoderCache:
    """LRU map key → encoder output under an exact byte budget, with per-owner pins."""

    def __init__(self, budget_bytes: int, max_entries: int | None = None):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must be >= 0 or None, got {max_entries}")
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # LRU first
        self._pins: dict[bytes, Counter] = {}  # key → owner → count (only keys with pins)
        self._owner_keys: dict[Hashable, set[bytes]] = {}  # owner → keys it pins
        self._bytes = 0
        self._hits = self._misses = self._inserts = self._evictions = self._bytes_saved = 0

    # -- look-ups ----------------------------------------------------------------------------

    def get(self, key: bytes) -> torch.Tensor | None:
        """The cached tensor (refreshing its recency) or None; counts a hit or a miss."""
        tensor = self._entries.get(key)
        if tensor is None:
            self._misses += 1
            return None
        self._entries.move_to_end(key)
        self._hits += 1
        self._bytes_saved += tensor_nbytes(tensor)
        return tensor

    def contains(self, key: bytes) -> bool:
        """Whether key is cached; touches neither recency nor counters."""
        return key in self._entries

    __contains__ = contains

    def __len__(self) -> int:
        return len(self._entries)

    # -- insertion and eviction ----------------------------------------------------------------

    def put(self, key: bytes, tensor: torch.Tensor, *, pin_owner: Hashable | None = None) -> PutResult:
        """Store tensor under key, evicting least-recently-used unpinned entries as needed.

        With `pin_owner`, the entry is also pinned for that owner if it is in the cache afterwards
        (stored now or already present). Nothing is evicted unless the tensor will then fit.
        """
        if not isinstance(key, bytes) or not key:
            raise TypeError("key must be non-empty bytes")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"value must be a torch.Tensor, got {type(tensor).__name__}")
        if key in self._entries:
            self._entries.move_to_end(key)
            result = PutResult(False, [], ALREADY_PRESENT)
        else:
            result = self._insert(key, tensor)
        if pin_owner is not None and result.cached:
            self.pin(key, pin_owner)
        return result

    def _insert(self, key: bytes, tensor: torch.Tensor) -> PutResult:
        nbytes = tensor_nbytes(tensor)
        if nbytes > self.budget_bytes or self.max_entries == 0:
            return PutResult(False, [], TOO_LARGE)
        victims = self._victims_for(nbytes)
        if victims is None:
            return PutResult(False, [], NO_ROOM)
        evicted = [(k, self._remove(k)) for k in victims]
        self._evictions += len(evicted)
        self._entries[key] = _compact(tensor)
        self._bytes += nbytes
        self._inserts += 1
        return PutResult(True, evicted, STORED)

    def _victims_for(self, nbytes: int) -> list[bytes] | None:
        """Unpinned keys, LRU first, whose eviction makes room for nbytes; None if impossible."""
        need_bytes = self._bytes + nbytes - self.budget_bytes
        need_slots = 0 if self.max_entries is None else len(self._entries) + 1 - self.max_entries
        victims: list[bytes] = []
        for key, tensor in self._entries.items():
            if need_bytes <= 0 and need_slots <= 0:
                break
            if key in self._pins:
                continue
            victims.append(key)
            need_bytes -= tensor_nbytes(tensor)
            need_slots -= 1
        return victims if need_bytes <= 0 and need_slots <= 0 else None

    def _remove(self, key: bytes) -> int:
        nbytes = tensor_nbytes(self._entries.pop(key))
        self._bytes -= nbytes
        return nbytes

    def clear(self) -> list[tuple[bytes, int]]:
        """Drop every unpinned entry (pinned ones stay until released); returns (key, nbytes) dropped.

        Counters are kept; dropped entries do not count as evictions.
        """
        return [(k, self._remove(k)) for k in list(self._entries) if k not in self._pins]

    # -- pins ----------------------------------------------------------------------------------

    def pin(self, key: bytes, owner: Hashable) -> None:
        """Protect key from eviction for owner (refcounted); KeyError if key is not cached."""
        if key not in self._entries:
            raise KeyError(f"cannot pin {key_prefix(key)}: not in the encoder cache")
        self._pins.setdefault(key, Counter())[owner] += 1
        self._owner_keys.setdefault(owner, set()).add(key)

    def unpin(self, key: bytes, owner: Hashable) -> None:
        """Drop one pin of owner on key; KeyError if owner holds no pin on it."""
        owners = self._pins.get(key)
        if not owners or owners[owner] <= 0:
            raise KeyError(f"{owner!r} holds no pin on {key_prefix(key)}")
        owners[owner] -= 1
        if owners[owner] == 0:
            self._drop_pin(key, owner)

    def release_owner(self, owner: Hashable) -> list[bytes]:
        """Drop every pin owner holds (request done, aborted or crashed); returns the keys."""
        keys = sorted(self._owner_keys.get(owner, ()))
        for key in keys:
            self._drop_pin(key, owner)
        return keys

    def pins(self, key: bytes) -> int:
        """Total pin count on key (all owners)."""
        return sum(self._pins.get(key, Counter()).values())

    def _drop_pin(self, key: bytes, owner: Hashable) -> None:
        owners = self._pins[key]
        del owners[owner]
        if not owners:
            del self._pins[key]
        keys = self._owner_keys[owner]
        keys.discard(key)
        if not keys:
            del self._owner_keys[owner]

    # -- introspection -------------------------------------------------------------------------

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(
            hits=self._hits,
            misses=self._misses,
            inserts=self._inserts,
            evictions=self._evictions,
            bytes_saved=self._bytes_saved,
            bytes_in_use=self._bytes,
            entries=len(self._entries),
            pinned_entries=len(self._pins),
            budget_bytes=self.budget_bytes,
            max_entries=self.max_entries,
        )

    def snapshot(self) -> list[EntryInfo]:
        """Every entry, least recently used first, for debugging."""
        return [
            EntryInfo(key_prefix(key), tensor_nbytes(t), self.pins(key), rank)
            for rank, (key, t) in enumerate(self._entries.items())
        ]

    def keys(self) -> list[bytes]:
        """Cached keys, least recently used first."""
        return list(self._entries)

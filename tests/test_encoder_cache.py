"""EncoderCache: exact byte budget, strict LRU, pins (DESIGN.md F5); a stateful model check."""

from __future__ import annotations

from collections import Counter, OrderedDict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmserve.cache.encoder_cache import (
    ALREADY_PRESENT,
    NO_ROOM,
    STORED,
    TOO_LARGE,
    EncoderCache,
    EncoderCacheStats,
    tensor_nbytes,
)


def k(i: int) -> bytes:
    return bytes([i]) * 16


def t(nbytes: int, fill: float = 0.0) -> torch.Tensor:
    """A float32 tensor of exactly nbytes (a multiple of 4)."""
    return torch.full((nbytes // 4,), fill, dtype=torch.float32)


# -- unit tests --------------------------------------------------------------------------------


def test_budget_counts_nbytes_exactly():
    cache = EncoderCache(budget_bytes=1000)
    value = torch.zeros(3, 5, dtype=torch.float16)
    assert cache.put(k(1), value).stored
    assert cache.stats().bytes_in_use == 30 == value.nbytes == tensor_nbytes(value)


def test_get_hit_miss_and_bytes_saved():
    cache = EncoderCache(budget_bytes=100)
    assert cache.get(k(1)) is None
    value = t(40, 1.5)
    cache.put(k(1), value)
    assert cache.get(k(1)) is value
    assert cache.get(k(1)) is value
    s = cache.stats()
    assert (s.hits, s.misses, s.inserts, s.bytes_saved) == (2, 1, 1, 80)


def test_eviction_is_least_recently_used_and_get_refreshes():
    cache = EncoderCache(budget_bytes=12)
    for i in (1, 2, 3):
        cache.put(k(i), t(4))
    cache.get(k(1))  # 2 is now the least recently used
    result = cache.put(k(4), t(4))
    assert result.stored and result.evicted == [(k(2), 4)]
    assert cache.keys() == [k(3), k(1), k(4)]
    assert not cache.contains(k(2))


def test_contains_touches_neither_recency_nor_counters():
    cache = EncoderCache(budget_bytes=8)
    cache.put(k(1), t(4))
    cache.put(k(2), t(4))
    before = cache.stats()
    assert k(1) in cache and cache.contains(k(1))
    assert cache.stats() == before
    assert cache.put(k(3), t(4)).evicted == [(k(1), 4)]


def test_evicts_as_many_as_needed_lru_first():
    cache = EncoderCache(budget_bytes=16)
    for i in (1, 2, 3, 4):
        cache.put(k(i), t(4))
    result = cache.put(k(5), t(12))
    assert result.evicted == [(k(1), 4), (k(2), 4), (k(3), 4)]
    assert cache.stats().bytes_in_use == 16
    assert cache.stats().evictions == 3


def test_too_large_for_the_budget_is_not_stored_and_evicts_nothing():
    cache = EncoderCache(budget_bytes=16)
    cache.put(k(1), t(8))
    result = cache.put(k(2), t(20))
    assert (result.stored, result.reason, result.evicted, result.cached) == (False, TOO_LARGE, [], False)
    assert cache.keys() == [k(1)]
    assert cache.stats().inserts == 1


def test_no_room_when_pinned_entries_fill_the_budget_and_nothing_is_evicted():
    cache = EncoderCache(budget_bytes=16)
    cache.put(k(1), t(8), pin_owner="req-1")
    cache.put(k(2), t(4))
    result = cache.put(k(3), t(12))
    assert (result.stored, result.reason, result.evicted) == (False, NO_ROOM, [])
    assert cache.keys() == [k(1), k(2)]  # k(2) survives: evicting it would not have helped
    assert cache.put(k(3), t(8)).evicted == [(k(2), 4)]


def test_pinned_entries_are_skipped_by_eviction():
    cache = EncoderCache(budget_bytes=12)
    for i in (1, 2, 3):
        cache.put(k(i), t(4))
    cache.pin(k(1), "req")
    assert cache.put(k(4), t(4)).evicted == [(k(2), 4)]
    cache.unpin(k(1), "req")
    assert cache.put(k(5), t(4)).evicted == [(k(1), 4)]


def test_pins_are_refcounted_per_owner():
    cache = EncoderCache(budget_bytes=8)
    cache.put(k(1), t(4))
    cache.pin(k(1), "a")
    cache.pin(k(1), "a")
    cache.pin(k(1), "b")
    assert cache.pins(k(1)) == 3
    cache.unpin(k(1), "a")
    cache.release_owner("b")
    assert cache.pins(k(1)) == 1 and cache.stats().pinned_entries == 1
    cache.unpin(k(1), "a")
    assert cache.pins(k(1)) == 0 and cache.stats().pinned_entries == 0
    with pytest.raises(KeyError):
        cache.unpin(k(1), "a")


def test_pin_errors():
    cache = EncoderCache(budget_bytes=8)
    with pytest.raises(KeyError):
        cache.pin(k(1), "a")  # not cached
    cache.put(k(1), t(4))
    with pytest.raises(KeyError):
        cache.unpin(k(1), "never-pinned")


def test_release_owner_drops_all_its_pins_and_only_its_own():
    cache = EncoderCache(budget_bytes=16)
    for i in (1, 2, 3):
        cache.put(k(i), t(4), pin_owner="crashed")
    cache.pin(k(2), "alive")
    assert cache.release_owner("crashed") == [k(1), k(2), k(3)]
    assert [cache.pins(k(i)) for i in (1, 2, 3)] == [0, 1, 0]
    assert cache.release_owner("crashed") == []
    assert cache.release_owner("unknown") == []


def test_put_of_a_present_key_refreshes_and_pins_but_stores_nothing():
    cache = EncoderCache(budget_bytes=8)
    first = t(4, 1.0)
    cache.put(k(1), first)
    cache.put(k(2), t(4))
    result = cache.put(k(1), t(4, 2.0), pin_owner="r")
    assert (result.stored, result.reason, result.cached) == (False, ALREADY_PRESENT, True)
    assert cache.get(k(1)) is first and cache.pins(k(1)) == 1
    assert cache.keys() == [k(2), k(1)]
    assert cache.stats().inserts == 2


def test_put_with_pin_owner_pins_only_when_cached():
    cache = EncoderCache(budget_bytes=8)
    assert cache.put(k(1), t(4), pin_owner="r").reason == STORED
    assert cache.pins(k(1)) == 1
    assert cache.put(k(2), t(12), pin_owner="r").reason == TOO_LARGE
    assert cache.release_owner("r") == [k(1)]


def test_max_entries_caps_the_count():
    cache = EncoderCache(budget_bytes=1000, max_entries=2)
    cache.put(k(1), t(4))
    cache.put(k(2), t(4))
    assert cache.put(k(3), t(4)).evicted == [(k(1), 4)]
    cache.pin(k(2), "r")
    cache.pin(k(3), "r")
    assert cache.put(k(4), t(4)).reason == NO_ROOM
    assert EncoderCache(budget_bytes=1000, max_entries=0).put(k(1), t(4)).reason == TOO_LARGE


def test_views_are_stored_compactly_so_the_budget_is_the_real_memory():
    batch = torch.arange(24, dtype=torch.float32).reshape(3, 2, 4)  # e.g. a batched encoder output
    cache = EncoderCache(budget_bytes=1000)
    cache.put(k(1), batch[1])
    stored = cache.get(k(1))
    assert torch.equal(stored, batch[1])
    assert stored.untyped_storage().nbytes() == stored.nbytes == 32
    assert stored.untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()
    whole = torch.zeros(2, 4)
    cache.put(k(2), whole)
    assert cache.get(k(2)) is not None and cache.get(k(2)).data_ptr() == whole.data_ptr()  # no copy needed


def test_clear_keeps_pinned_entries_and_counters():
    cache = EncoderCache(budget_bytes=16)
    cache.put(k(1), t(4), pin_owner="r")
    cache.put(k(2), t(8))
    cache.get(k(2))
    assert cache.clear() == [(k(2), 8)]
    s = cache.stats()
    assert (s.entries, s.bytes_in_use, s.pinned_entries, s.hits, s.inserts, s.evictions) == (1, 4, 1, 1, 2, 0)


def test_snapshot_lists_entries_lru_first():
    cache = EncoderCache(budget_bytes=100)
    cache.put(k(1), t(4))
    cache.put(k(2), t(8), pin_owner="r")
    cache.get(k(1))
    rows = cache.snapshot()
    assert [(r.key_prefix, r.nbytes, r.pins, r.rank) for r in rows] == [
        (k(2)[:6].hex(), 8, 1, 0),
        (k(1)[:6].hex(), 4, 0, 1),
    ]


def test_stats_is_a_frozen_value():
    stats = EncoderCache(budget_bytes=64, max_entries=3).stats()
    assert stats == EncoderCacheStats(0, 0, 0, 0, 0, 0, 0, 0, 64, 3)
    with pytest.raises(AttributeError):
        stats.hits = 1


def test_argument_validation():
    with pytest.raises(ValueError):
        EncoderCache(budget_bytes=-1)
    with pytest.raises(ValueError):
        EncoderCache(budget_bytes=1, max_entries=-1)
    cache = EncoderCache(budget_bytes=64)
    with pytest.raises(TypeError):
        cache.put("not-bytes", t(4))
    with pytest.raises(TypeError):
        cache.put(b"", t(4))
    with pytest.raises(TypeError):
        cache.put(k(1), [1.0, 2.0])
    with pytest.raises(TypeError):
        cache.put(k(1), torch.eye(2).to_sparse())


# -- stateful check against a reference LRU ---------------------------------------------------

KEYS = [k(i) for i in range(6)]
OWNERS = ["r1", "r2", "r3"]
DTYPES = [torch.uint8, torch.float16, torch.float32]


class ReferenceLRU:
    """The policy stated plainly: an OrderedDict (LRU first) and a pin multiset."""

    def __init__(self, budget: int, max_entries: int | None):
        self.budget, self.max_entries = budget, max_entries
        self.entries: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # key → (nbytes, fill)
        self.pins: Counter = Counter()  # (key, owner) → count
        self.hits = self.misses = self.inserts = self.evictions = self.saved = 0

    def pinned(self, key: bytes) -> bool:
        return any(n > 0 for (kk, _), n in self.pins.items() if kk == key)

    def fits(self, keys: list[bytes], nbytes: int) -> bool:
        used = sum(self.entries[x][0] for x in keys)
        count_ok = self.max_entries is None or len(keys) + 1 <= self.max_entries
        return used + nbytes <= self.budget and count_ok

    def put(self, key: bytes, nbytes: int, fill: float) -> tuple[str, list]:
        if key in self.entries:
            self.entries.move_to_end(key)
            return ALREADY_PRESENT, []
        if nbytes > self.budget or self.max_entries == 0:
            return TOO_LARGE, []
        keep = list(self.entries)
        evict = []
        for candidate in list(self.entries):
            if self.fits(keep, nbytes):
                break
            if not self.pinned(candidate):
                keep.remove(candidate)
                evict.append(candidate)
        if not self.fits(keep, nbytes):
            return NO_ROOM, []
        evicted = [(x, self.entries.pop(x)[0]) for x in evict]
        self.evictions += len(evicted)
        self.entries[key] = (nbytes, fill)
        self.inserts += 1
        return STORED, evicted


class EncoderCacheMachine(RuleBasedStateMachine):
    @rule(
        budget=st.integers(0, 48),
        max_entries=st.one_of(st.none(), st.integers(0, 4)),
    )
    @precondition(lambda self: not hasattr(self, "cache"))
    def init(self, budget, max_entries):
        self.cache = EncoderCache(budget, max_entries)
        self.ref = ReferenceLRU(budget, max_entries)
        self.fill = 0.0

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(
        key=st.sampled_from(KEYS),
        numel=st.integers(0, 12),
        dtype=st.sampled_from(DTYPES),
        owner=st.sampled_from([None, *OWNERS]),
    )
    def put(self, key, numel, dtype, owner):
        self.fill += 1
        value = torch.full((numel,), self.fill % 200, dtype=dtype)
        result = self.cache.put(key, value, pin_owner=owner)
        reason, evicted = self.ref.put(key, value.nbytes, self.fill % 200)
        assert result.reason == reason and result.stored == (reason == STORED)
        assert result.evicted == evicted
        assert not any(self.ref.pinned(x) for x, _ in evicted)
        if owner is not None and reason in (STORED, ALREADY_PRESENT):
            self.ref.pins[(key, owner)] += 1

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(key=st.sampled_from(KEYS))
    def get(self, key):
        got = self.cache.get(key)
        if key not in self.ref.entries:
            assert got is None
            self.ref.misses += 1
            return
        nbytes, fill = self.ref.entries[key]
        assert got is not None and got.nbytes == nbytes
        assert bool((got == fill).all())
        self.ref.entries.move_to_end(key)
        self.ref.hits += 1
        self.ref.saved += nbytes

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS))
    def pin(self, key, owner):
        if key not in self.ref.entries:
            with pytest.raises(KeyError):
                self.cache.pin(key, owner)
            return
        self.cache.pin(key, owner)
        self.ref.pins[(key, owner)] += 1

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS))
    def unpin(self, key, owner):
        if self.ref.pins[(key, owner)] == 0:
            with pytest.raises(KeyError):
                self.cache.unpin(key, owner)
            return
        self.cache.unpin(key, owner)
        self.ref.pins[(key, owner)] -= 1

    @precondition(lambda self: hasattr(self, "cache"))
    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner):
        held = sorted(kk for (kk, o), n in self.ref.pins.items() if o == owner and n > 0)
        assert self.cache.release_owner(owner) == held
        for kk in held:
            self.ref.pins[(kk, owner)] = 0

    @invariant()
    def matches_reference(self):
        if not hasattr(self, "cache"):
            return
        ref, stats = self.ref, self.cache.stats()
        assert self.cache.keys() == list(ref.entries)  # same contents, same recency order
        assert stats.bytes_in_use == sum(n for n, _ in ref.entries.values()) <= ref.budget
        assert ref.max_entries is None or stats.entries <= ref.max_entries
        assert all(kk in ref.entries for (kk, _), n in ref.pins.items() if n > 0)  # pinned never evicted
        ref_pins = [sum(n for (kk, _), n in ref.pins.items() if kk == x) for x in KEYS]
        assert [self.cache.pins(x) for x in KEYS] == ref_pins
        expected = (ref.hits, ref.misses, ref.inserts, ref.evictions, ref.saved, len(ref.entries))
        got = (stats.hits, stats.misses, stats.inserts, stats.evictions, stats.bytes_saved, stats.entries)
        assert got == expected
        assert stats.pinned_entries == sum(1 for x in KEYS if ref.pinned(x))


EncoderCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestEncoderCacheAgainstReference = EncoderCacheMachine.TestCase

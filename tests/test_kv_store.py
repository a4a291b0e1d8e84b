"""KVBlockStore: unit tests, a state machine against an independent reference model, mutants.

The state machine also keeps a shadow KV pool (slot → the hash whose KV was written there, as
the PrefixCacheManager actor does on commit) and checks after every step that every entry's slot
holds that entry's content: the property failure F3 broke.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import fields

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mmserve.cache.block_hash import MMPlaceholder, block_hashes, root_hash
from mmserve.cache.kv_store import KVBlockStore, KVSlotInfo, KVStoreStats


def H(name: str) -> bytes:
    """A 16-byte test hash."""
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def chain(symbols: str, root: str = "r") -> list[bytes]:
    """Chained hashes of a token-like string: block i's hash covers every symbol before it."""
    out, prev = [], H(root)
    for c in symbols:
        prev = hashlib.blake2b(prev + c.encode(), digest_size=16).digest()
        out.append(prev)
    return out


A, B, C, D, E, F = (H(x) for x in "ABCDEF")


# -- unit tests -----------------------------------------------------------------------------------


def test_empty_store():
    s = KVBlockStore(3)
    assert s.num_slots == 3 and len(s) == 0 and s.free_slots() == 3
    assert s.lookup([A, B], "r1") == []
    assert s.owners() == set()  # a miss pins nothing
    st_ = s.stats()
    assert (st_.queries_blocks, st_.hit_blocks, st_.entries, st_.pinned_slots) == (2, 0, 0, 0)
    assert s.snapshot() == []
    s.check_invariants()


def test_commit_assigns_lowest_free_slots_and_pins():
    s = KVBlockStore(4)
    assert s.commit([A, B, C], "r1") == [(0, 0, None), (1, 1, None), (2, 2, None)]
    assert [s.slot_of(h) for h in (A, B, C, D)] == [0, 1, 2, None]
    assert [s.hash_of(i) for i in range(4)] == [A, B, C, None]
    assert [s.pins(i) for i in range(4)] == [1, 1, 1, 0]
    assert s.owners() == {"r1"} and len(s) == 3 and s.free_slots() == 1
    assert s.stats().commits_blocks == 3
    s.check_invariants()
    s.release("r1")
    assert [s.pins(i) for i in range(4)] == [0, 0, 0, 0] and s.owners() == set()
    assert len(s) == 3  # release keeps entries
    s.check_invariants()


def test_lookup_returns_longest_prefix_stops_at_first_miss_and_pins():
    s = KVBlockStore(4)
    s.commit([A, C], "w")  # C cached, B not: lookup [A, B, C] must stop at B
    s.release("w")
    assert s.lookup([A, B, C], "r1") == [0]
    assert s.pins(0) == 1 and s.pins(1) == 0
    assert s.lookup([B, A], "r2") == []
    st_ = s.stats()
    assert (st_.queries_blocks, st_.hit_blocks) == (5, 1)
    s.check_invariants()


def test_pins_count_owners_not_calls():
    s = KVBlockStore(2)
    s.commit([A], "r1")
    s.lookup([A], "r1")
    s.commit([A], "r1")
    assert s.pins(0) == 1
    s.lookup([A], "r2")
    assert s.pins(0) == 2 and s.owners() == {"r1", "r2"}
    s.release("r1")
    assert s.pins(0) == 1 and s.owners() == {"r2"}
    s.release("r1")  # releasing twice (or an unknown owner) is harmless
    s.release("nobody")
    assert s.pins(0) == 1
    s.release("r2")
    assert s.pins(0) == 0
    s.check_invariants()


def test_peek_changes_nothing():
    s = KVBlockStore(3)
    s.commit([A, B], "w")
    s.release("w")
    before = (s.snapshot(), s.stats())
    assert s.peek([A, B, C]) == 2 and s.peek([B]) == 1 and s.peek([C, A]) == 0 and s.peek([]) == 0
    assert (s.snapshot(), s.stats()) == before
    assert s.evict(1) == [(1, B)]  # recency untouched: B (chain tail) is still the LRU entry


def test_commit_of_cached_prefix_only_pins():
    s = KVBlockStore(3)
    s.commit([A, B], "r1")
    s.release("r1")
    before = s.stats()
    assert s.commit([A, B], "r2") == []
    assert [s.pins(0), s.pins(1)] == [1, 1] and s.free_slots() == 1
    after = s.stats()
    assert (after.commits_blocks, after.evictions) == (before.commits_blocks, before.evictions)
    assert s.commit([A, B, C], "r2") == [(2, 2, None)]  # only the new block is returned
    assert [s.pins(i) for i in range(3)] == [1, 1, 1]
    s.check_invariants()


def test_commit_stops_when_every_slot_is_pinned():
    s = KVBlockStore(3)
    s.commit([A, B], "r1")  # pinned by r1
    assert s.commit([C, D, E], "r2") == [(0, 2, None)]  # one free slot, then stop
    assert s.slot_of(D) is None and s.slot_of(E) is None  # later blocks are not registered
    assert s.stats().uncommitted_blocks == 2
    assert s.commit([F], "r3") == []
    assert s.stats().uncommitted_blocks == 3 and s.stats().evictions == 0
    assert [s.hash_of(i) for i in range(3)] == [A, B, C]
    s.check_invariants()


def test_commit_never_evicts_its_own_chain():
    s = KVBlockStore(2)
    assert s.commit([A, B, C, D], "r1") == [(0, 0, None), (1, 1, None)]  # stops, keeps A and B
    assert s.lookup([A, B], "r2") == [0, 1]
    s.release("r1")
    s.release("r2")
    # A cached and unpinned, the LRU candidate; committing [A, X, Y] must not evict A for X.
    s.evict(1)  # drop B: slot 1 free
    assert s.commit([A, C, D], "r3") == [(1, 1, None)]
    assert s.slot_of(A) == 0 and s.stats().evictions == 1
    s.check_invariants()


def test_slot_reused_by_commit_erases_the_old_entry():
    s = KVBlockStore(1)
    s.commit([A], "r1")
    s.release("r1")
    assert s.commit([B], "r2") == [(0, 0, A)]
    assert s.slot_of(A) is None and s.slot_of(B) == 0 and s.hash_of(0) == B
    assert s.lookup([A], "r3") == [] and s.peek([A]) == 0
    st_ = s.stats()
    assert (st_.evictions, st_.stale_entries_dropped, st_.explicit_evictions) == (1, 1, 0)
    s.check_invariants()


def test_abort_consumes_nothing():
    """F3: aborts between commits must not change which slot the next commit gets."""

    def run(aborts: bool) -> tuple:
        s = KVBlockStore(3)
        s.commit([A], "r1")
        s.release("r1")
        if aborts:
            for i in range(5):
                s.abort(f"gone{i}")  # prepared, never looked up
            s.lookup([B], "gone-miss")  # a miss pins nothing
            s.abort("gone-miss")
        placed = s.commit([B, C, D], "r2")
        s.release("r2")
        return placed, s.snapshot(), [s.slot_of(h) for h in (A, B, C, D)]

    assert run(True) == run(False)
    placed, _, slots = run(True)
    assert placed == [(0, 1, None), (1, 2, None), (2, 0, A)]


def test_abort_after_hit_is_release():
    def run(finish) -> list:
        s = KVBlockStore(3)
        s.commit([A, B], "w")
        s.release("w")
        s.commit([C], "w2")
        s.release("w2")
        assert s.lookup([A, B], "r") == [0, 1]
        finish(s, "r")
        return [s.commit([D], "x"), s.commit([E], "y"), s.snapshot(), s.stats()]

    assert run(KVBlockStore.abort) == run(KVBlockStore.release)


def test_lru_order_and_release_by_last_use():
    s = KVBlockStore(3)
    s.commit([A], "r1")  # r1 keeps A pinned: last use t1
    s.commit([B], "r2")
    s.release("r2")  # B last used t2
    s.commit([C], "r3")
    s.release("r3")  # C last used t3
    s.release("r1")  # A re-enters the LRU order at its last use, before B
    assert [r.lru_rank for r in s.snapshot()] == [0, 1, 2]
    s.lookup([B], "r4")
    s.release("r4")  # B is now the most recent
    assert s.evict(3) == [(0, A), (2, C), (1, B)]
    assert s.free_slots() == 3 and len(s) == 0
    s.check_invariants()


def test_chain_is_evicted_from_its_tail():
    s = KVBlockStore(4)
    s.commit([A, B, C], "r1")
    s.release("r1")
    assert s.evict(1) == [(2, C)]
    assert s.peek([A, B, C]) == 2  # what is left is still a usable prefix
    s.lookup([A, B], "r2")
    s.release("r2")
    assert s.commit([D], "r3") == [(0, 2, None)]  # lowest free slot
    s.release("r3")
    assert s.evict(3) == [(1, B), (0, A), (2, D)]


def test_evict_and_clear_never_touch_pinned_slots():
    s = KVBlockStore(4)
    s.commit([A, B], "keep")
    s.commit([C, D], "tmp")
    s.release("tmp")
    assert s.evict(0) == []
    with pytest.raises(ValueError):
        s.evict(-1)
    assert s.evict(5) == [(3, D), (2, C)]
    assert s.evict() == [] and len(s) == 2
    s.commit([E, F], "tmp2")
    s.release("tmp2")
    assert s.clear() == 2
    assert [s.hash_of(i) for i in range(4)] == [A, B, None, None] and s.free_slots() == 2
    assert s.clear() == 0
    st_ = s.stats()
    assert (st_.explicit_evictions, st_.evictions, st_.cleared_entries, st_.stale_entries_dropped) == (2, 2, 2, 0)
    s.release("keep")
    assert s.clear() == 2 and len(s) == 0 and s.free_slots() == 4
    assert s.commit([F], "x") == [(0, 0, None)]  # freed slots are handed out lowest first again
    s.check_invariants()


def test_discard_refuses_pinned_slots_and_frees_the_rest():
    s = KVBlockStore(4)
    placed = s.commit(chain("xy"), "r0")
    slots = [slot for _, slot, _ in placed]
    with pytest.raises(ValueError, match="pinned"):
        s.discard(slots)
    assert len(s) == 2
    s.release("r0")
    assert s.discard(slots) == chain("xy") and len(s) == 0 and s.free_slots() == 4
    assert s.lookup(chain("xy"), "r1") == []
    s.check_invariants()


def test_zero_slots():
    s = KVBlockStore(0)
    assert s.lookup([A], "r") == [] and s.commit([A, B], "r") == [] and s.peek([A]) == 0
    assert s.evict(3) == [] and s.clear() == 0 and s.owners() == set()
    assert s.stats().uncommitted_blocks == 2
    s.check_invariants()


def test_argument_validation():
    with pytest.raises(ValueError):
        KVBlockStore(-1)
    with pytest.raises(ValueError):
        KVBlockStore(True)
    s = KVBlockStore(2)
    with pytest.raises(TypeError):
        s.commit(A, "r")  # a single hash, not a chain
    with pytest.raises(TypeError):
        s.lookup(["ab"], "r")
    with pytest.raises(TypeError):
        s.commit([A, bytearray(B)], "r")
    assert len(s) == 0 and s.owners() == set()  # a rejected call changed nothing
    with pytest.raises(ValueError):
        s.pins(2)
    with pytest.raises(ValueError):
        s.hash_of(-1)


def test_stats_and_snapshot_shape():
    s = KVBlockStore(3)
    s.commit([A, B], "r1")
    s.release("r1")
    s.lookup([A], "r2")
    names = [f.name for f in fields(KVStoreStats)]
    assert names[:9] == ["num_slots", "entries", "free_slots", "pinned_slots", "queries_blocks",
                         "hit_blocks", "commits_blocks", "evictions", "stale_entries_dropped"]
    assert s.stats() == KVStoreStats(3, 2, 1, 1, 1, 1, 2, 0, 0, 0, 0, 0)
    with pytest.raises(Exception):
        s.stats().entries = 0  # frozen
    assert s.snapshot() == [KVSlotInfo(0, A.hex()[:12], 1, None), KVSlotInfo(1, B.hex()[:12], 0, 0)]
    assert s.snapshot()[1] == (1, B.hex()[:12], 0, 0)


@pytest.mark.parametrize("corrupt", [
    "two_entries_one_slot", "slot_both_free_and_used", "pin_on_free_slot", "refcount_mismatch",
    "pinned_slot_in_lru", "unpinned_slot_missing_from_lru", "lost_slot", "lru_out_of_order",
])
def test_check_invariants_detects_corruption(corrupt):
    s = KVBlockStore(4)
    s.commit([A, B], "r1")
    s.commit([C], "r2")
    s.release("r2")
    s.check_invariants()
    if corrupt == "two_entries_one_slot":
        s._slot_of[D] = 0
    elif corrupt == "slot_both_free_and_used":
        s._free.append(0)
    elif corrupt == "pin_on_free_slot":
        s._held["r1"].add(3)
        s._refs[3] += 1
    elif corrupt == "refcount_mismatch":
        s._refs[0] += 1
    elif corrupt == "pinned_slot_in_lru":
        s._lru[0] = None
    elif corrupt == "unpinned_slot_missing_from_lru":
        s._lru.pop(2)
    elif corrupt == "lost_slot":
        s._free.remove(3)
    elif corrupt == "lru_out_of_order":
        s.release("r1")
        s._lru.move_to_end(next(iter(s._lru)))
    with pytest.raises(ValueError):
        s.check_invariants()


def test_with_real_block_hashes():
    """Two prompts sharing a text prefix, then different images: the shared blocks hit, the image
    blocks do not (F2), and the second commit writes only the new blocks."""
    root = root_hash(123, None)
    tokens = list(range(8)) + [99] * 8
    img1 = [MMPlaceholder(H("img1"), 8, 8)]
    img2 = [MMPlaceholder(H("img2"), 8, 8)]
    h1 = block_hashes(root, tokens, img1, 4)
    h2 = block_hashes(root, tokens, img2, 4)
    s = KVBlockStore(8)
    assert [i for i, _, _ in s.commit(h1, "r1")] == [0, 1, 2, 3]
    s.release("r1")
    assert s.lookup(h2, "r2") == [0, 1]
    assert s.commit(h2, "r2") == [(2, 4, None), (3, 5, None)]
    s.release("r2")
    assert s.peek(h1) == 4 and s.peek(h2) == 4
    s.check_invariants()


# -- state machine against an independent reference model -----------------------------------------


class RefStore:
    """The specification, spelled out naively: plain dicts, recency as explicit timestamps.

    A use at time t of a chain's block i is stamped (t, -i): in one call, earlier blocks of the
    chain count as more recent, so a chain is evicted tail first.
    """

    def __init__(self, num_slots: int):
        self.n = num_slots
        self.entry: dict[bytes, int] = {}
        self.pins: dict[object, set[int]] = {}
        self.used: dict[int, tuple[int, int]] = {}
        self.time = 0
        self.queries = self.hits = self.commits = self.stale = self.explicit = 0
        self.uncommitted = self.cleared = 0

    def slots(self) -> dict[int, bytes]:
        return {s: h for h, s in self.entry.items()}

    def refcount(self, slot: int) -> int:
        return sum(slot in held for held in self.pins.values())

    def lru(self) -> list[int]:
        """Unpinned occupied slots, least recently used first."""
        return sorted((s for s in self.slots() if self.refcount(s) == 0), key=lambda s: self.used[s])

    def _remove(self, slot: int) -> bytes:
        h = self.slots()[slot]
        del self.entry[h]
        del self.used[slot]
        return h

    def _pin(self, owner, slot: int, i: int) -> None:
        self.pins.setdefault(owner, set()).add(slot)
        self.used[slot] = (self.time, -i)

    def lookup(self, hashes, owner) -> list[int]:
        self.time += 1
        out = []
        for h in hashes:
            if h not in self.entry:
                break
            out.append(self.entry[h])
        for i, slot in enumerate(out):
            self._pin(owner, slot, i)
        self.queries += len(hashes)
        self.hits += len(out)
        return out

    def peek(self, hashes) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.entry:
            n += 1
        return n

    def commit(self, hashes, owner) -> list[tuple[int, int, bytes | None]]:
        self.time += 1
        placed = []
        for i, h in enumerate(hashes):
            if h in self.entry:
                self._pin(owner, self.entry[h], i)
                continue
            free = [s for s in range(self.n) if s not in self.slots()]
            if free:
                slot, old = min(free), None
            else:
                lru = self.lru()
                if not lru:
                    self.uncommitted += len(hashes) - i
                    break
                slot = lru[0]
                old = self._remove(slot)
                self.stale += 1
            self.entry[h] = slot
            self._pin(owner, slot, i)
            placed.append((i, slot, old))
        self.commits += len(placed)
        return placed

    def release(self, owner) -> None:
        self.pins.pop(owner, None)

    def evict(self, n: int) -> list[tuple[int, bytes]]:
        out = []
        for _ in range(n):
            lru = self.lru()
            if not lru:
                break
            out.append((lru[0], self._remove(lru[0])))
        self.explicit += len(out)
        return out

    def discard(self, slots) -> list[bytes]:
        return [self._remove(s) for s in dict.fromkeys(slots) if s in self.slots()]

    def clear(self) -> int:
        lru = self.lru()
        for slot in lru:
            self._remove(slot)
        self.cleared += len(lru)
        return len(lru)


OWNERS = ["r0", "r1", "r2", ("req", 3)]
ROOTS = ["root-a", "root-b"]
# Chains from a 2-letter alphabet under 2 roots: prefixes overlap often, and with at most 6 slots
# and chains of up to 6 blocks, commits keep reusing slots.
# The third item, when >= 0, picks a recently used chain instead (see `_chain`).
CHAINS = st.tuples(st.sampled_from(ROOTS), st.text(alphabet="xy", max_size=6), st.integers(-3, 3))


class KVStoreMachine(RuleBasedStateMachine):
    store_cls = KVBlockStore
    internal_checks = True  # also call check_invariants(); mutants are judged without it

    @initialize(num_slots=st.integers(1, 6), allow_gaps=st.booleans())
    def init(self, num_slots, allow_gaps):
        self.allow_gaps = allow_gaps  # may commit chains with a block left out (orphans)
        self.store = self.store_cls(num_slots)
        self.ref = RefStore(num_slots)
        self.pool: dict[int, bytes] = {}  # slot → hash whose KV the "actor" wrote there
        self.universe: dict[bytes, bytes | None] = {}  # every hash seen → its parent in its chain
        self.seen: list[tuple[str, str]] = []  # (root, symbols) of every chain used so far

    def _chain(self, spec) -> list[bytes]:
        """The hashes of `spec`; note a failing example prints the drawn spec, before reuse."""
        root, symbols, reuse = spec
        if reuse >= 0 and self.seen:  # a recent chain again, maybe a little longer
            root, base = self.seen[-1 - reuse % len(self.seen)]
            symbols = base + symbols[:len(symbols) % 3]
        self.seen.append((root, symbols))
        hashes = chain(symbols, root)
        for i, h in enumerate(hashes):
            self.universe[h] = hashes[i - 1] if i else None
        return hashes

    def _content_ok(self, hashes, slots) -> None:
        for h, slot in zip(hashes, slots):
            assert self.pool.get(slot) == h, f"slot {slot} holds {self.pool.get(slot)!r}, not the hit {h!r}"

    @rule(owner=st.sampled_from(OWNERS), spec=CHAINS)
    def lookup(self, owner, spec):
        hashes = self._chain(spec)
        got = self.store.lookup(hashes, owner)
        assert got == self.ref.lookup(hashes, owner)
        self._content_ok(hashes, got)

    @rule(spec=CHAINS)
    def peek(self, spec):
        hashes = self._chain(spec)
        assert self.store.peek(hashes) == self.ref.peek(hashes)

    @rule(owner=st.sampled_from(OWNERS), spec=CHAINS)
    def commit(self, owner, spec):
        hashes = self._chain(spec)
        placed = self.store.commit(hashes, owner)
        assert placed == self.ref.commit(hashes, owner)
        for i, slot, _ in placed:
            self.pool[slot] = hashes[i]  # the actor writes block i's KV into the slot

    @precondition(lambda self: self.allow_gaps)
    @rule(owner=st.sampled_from(OWNERS), spec=CHAINS, gap=st.integers(0, 2), reader=st.sampled_from(OWNERS))
    def commit_with_gap(self, owner, spec, gap, reader):
        """Commit a sequence that is not a valid chain (one block left out), which can leave blocks
        cached whose parent is not; then look the whole chain up: it must stop at the hole."""
        hashes = self._chain(spec)
        gapped = hashes[:gap % len(hashes)] + hashes[gap % len(hashes) + 1:] if hashes else []
        placed = self.store.commit(gapped, owner)
        assert placed == self.ref.commit(gapped, owner)
        for i, slot, _ in placed:
            self.pool[slot] = gapped[i]
        got = self.store.lookup(hashes, reader)
        assert got == self.ref.lookup(hashes, reader)
        self._content_ok(hashes, got)

    @rule(owner=st.sampled_from(OWNERS), spec=CHAINS)
    def request(self, owner, spec):
        """A whole request: look up, write the rest, release."""
        self.lookup(owner, spec)
        self.commit(owner, spec)
        self.release(owner)

    @rule(owner=st.sampled_from(OWNERS), spec=CHAINS)
    def failed_commit(self, owner, spec):
        """A commit whose KV write failed: the owner's pins are released and the blocks it placed
        discarded, so no entry names a slot that never received its KV."""
        hashes = self._chain(spec)
        placed = self.store.commit(hashes, owner)
        assert placed == self.ref.commit(hashes, owner)
        self.release(owner)
        slots = [slot for _, slot, _ in placed]
        assert self.store.discard(slots) == self.ref.discard(slots)
        for slot in slots:
            self.pool.pop(slot, None)

    @rule(owner=st.sampled_from(OWNERS), spec=CHAINS)
    def cancelled_request(self, owner, spec):
        """A request that looked up (holding pins), then was cancelled before it committed."""
        self.lookup(owner, spec)
        self.abort(owner)

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner):
        self.store.release(owner)
        self.ref.release(owner)

    @rule(owner=st.sampled_from(OWNERS))
    def abort(self, owner):
        self.store.abort(owner)
        self.ref.release(owner)  # an abort is a release, nothing more

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        assert self.store.evict(n) == self.ref.evict(n)

    @rule()
    def clear(self):
        assert self.store.clear() == self.ref.clear()

    @invariant()
    def agrees_with_reference_and_pool(self):
        store, ref = self.store, self.ref
        # Each slot is described by at most one entry; each entry's slot holds its content.
        described: dict[int, bytes] = {}
        for h in self.universe:
            slot = store.slot_of(h)
            assert slot == ref.entry.get(h)
            if slot is not None:
                assert slot not in described, f"slot {slot} described by two entries"
                described[slot] = h
                assert store.hash_of(slot) == h
                assert self.pool.get(slot) == h, f"entry {h!r} → slot {slot} holding {self.pool.get(slot)!r}"
        assert len(store) == len(ref.entry) == len(described)
        # With valid chains the cache stays prefix-closed: a cached block's parent is cached.
        if not self.allow_gaps:
            for h in described.values():
                parent = self.universe[h]
                assert parent is None or store.slot_of(parent) is not None, "orphaned block cached"
        n = ref.n
        assert [store.hash_of(i) for i in range(n)] == [ref.slots().get(i) for i in range(n)]
        assert [store.pins(i) for i in range(n)] == [ref.refcount(i) for i in range(n)]
        assert store.owners() == {o for o, held in ref.pins.items() if held}
        assert store.free_slots() == n - len(ref.entry)
        ranks = {slot: r for r, slot in enumerate(ref.lru())}
        assert [(row.slot, row.pins, row.lru_rank) for row in store.snapshot()] == [
            (slot, ref.refcount(slot), ranks.get(slot)) for slot in sorted(ref.slots())]
        s = store.stats()
        assert (s.num_slots, s.entries, s.free_slots, s.pinned_slots) == (
            n, len(ref.entry), n - len(ref.entry), sum(ref.refcount(i) > 0 for i in range(n)))
        assert (s.queries_blocks, s.hit_blocks, s.commits_blocks, s.evictions, s.stale_entries_dropped,
                s.explicit_evictions, s.uncommitted_blocks, s.cleared_entries) == (
            ref.queries, ref.hits, ref.commits, ref.stale + ref.explicit, ref.stale, ref.explicit,
            ref.uncommitted, ref.cleared)
        if self.internal_checks:
            store.check_invariants()

    def teardown(self):
        if not hasattr(self, "store"):
            return
        for owner in OWNERS:
            self.store.release(owner)
            self.ref.release(owner)
        assert self.store.owners() == set()
        assert all(self.store.pins(i) == 0 for i in range(self.store.num_slots))
        assert self.store.stats().pinned_slots == 0
        self.agrees_with_reference_and_pool()
        # Nothing pinned: every entry is evictable, and evicting all frees every slot.
        assert len(self.store.evict(self.store.num_slots)) == len(self.ref.entry)
        assert self.store.free_slots() == self.store.num_slots
        if self.internal_checks:
            self.store.check_invariants()


KVStoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestKVStoreAgainstReference = KVStoreMachine.TestCase


# -- mutants: the state machine must catch each, from observable behaviour alone -------------------


class AbortFreesSlots(KVBlockStore):
    """An abort gives back the slots its owner had pinned (erasing live entries)."""

    def abort(self, owner):
        held = set(self._held.get(owner, ()))
        self.release(owner)
        for slot in sorted(held):
            if slot in self._lru:
                del self._lru[slot]
                self._drop_entry(slot)
                self._free.append(slot)


class RoundRobinSlots(KVBlockStore):
    """F3 as shipped: a counter hands out slots, advances on abort, and leaves stale entries."""

    _next = 0

    def _take_slot(self):
        slot = self._next % self.num_slots
        self._next += 1
        if slot in self._free:
            self._free.remove(slot)
        self._lru.pop(slot, None)
        return slot, self._hash_of.get(slot)

    def abort(self, owner):
        self._next += 1
        self.release(owner)


class StaleEntryKept(KVBlockStore):
    """A reused slot's old entry is not erased: two hashes describe one slot."""

    def _take_slot(self):
        if self._free:
            return super()._take_slot()
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        return slot, None


class CommitEvictsPinned(KVBlockStore):
    """The victim is the least recently used occupied slot, pinned or not."""

    def _take_slot(self):
        if self._free:
            return super()._take_slot()
        used_before = [s for s in self._hash_of if s in self._last_use]  # not placed by this commit
        if not used_before:
            return None
        slot = min(used_before, key=self._last_use.__getitem__)
        self._lru.pop(slot, None)
        return slot, self._drop_entry(slot)


class LruPicksMostRecent(KVBlockStore):
    """Commit evicts the most recently used unpinned slot."""

    def _take_slot(self):
        if self._free or not self._lru:
            return super()._take_slot()
        slot, _ = self._lru.popitem(last=True)
        return slot, self._drop_entry(slot)


class CommitPinsAtEnd(KVBlockStore):
    """Commit pins the chain only after placing it all, so it can evict its own earlier blocks."""

    def commit(self, hashes, owner):
        placed, slots = [], []
        for i, h in enumerate(hashes):
            slot = self._slot_of.get(h)
            if slot is None:
                taken = self._take_slot()
                if taken is None:
                    self._uncommitted_blocks += len(hashes) - i
                    break
                slot, evicted = taken
                self._slot_of[h], self._hash_of[slot] = slot, h
                self._last_use[slot] = 0
                self._lru[slot] = None
                placed.append((i, slot, evicted))
            slots.append(slot)
        for slot in slots:
            if self._hash_of.get(slot) is not None:
                self._pin(slot, owner)
        self._touch([s for s in slots if s in self._hash_of])
        self._commits_blocks += len(placed)
        return placed


class LookupSkipsMisses(KVBlockStore):
    """Lookup returns every cached block of the chain, not just the leading run."""

    def lookup(self, hashes, owner):
        slots = [self._slot_of[h] for h in hashes if h in self._slot_of]
        for slot in slots:
            self._pin(slot, owner)
        self._touch(slots)
        self._queries_blocks += len(hashes)
        self._hit_blocks += len(slots)
        return slots


class ReleaseCountsAsUse(KVBlockStore):
    """Released slots go to the most-recent end, ignoring when they were last used."""

    def _requeue(self, slots):
        for slot in sorted(slots):
            self._clock += 1
            self._last_use[slot] = self._clock
            self._lru[slot] = None


class HeadFirstEviction(KVBlockStore):
    """Within one call, later blocks count as more recent: chains are evicted from block 0."""

    def _touch(self, chain_slots):
        for slot in chain_slots:
            self._clock += 1
            self._last_use[slot] = self._clock


class AbortLeaksPins(KVBlockStore):
    """Abort does nothing: pins of aborted requests live forever."""

    def abort(self, owner):
        pass


MUTANTS = [AbortFreesSlots, RoundRobinSlots, StaleEntryKept, CommitEvictsPinned, LruPicksMostRecent,
           CommitPinsAtEnd, LookupSkipsMisses, ReleaseCountsAsUse, HeadFirstEviction, AbortLeaksPins]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_state_machine_catches_mutant(mutant):
    machine = type(f"Machine{mutant.__name__}", (KVStoreMachine,),
                   {"store_cls": mutant, "internal_checks": False})
    with pytest.raises(Exception):
        run_state_machine_as_test(machine, settings=settings(
            max_examples=100, stateful_step_count=40, deadline=None, derandomize=True, database=None,
            phases=[Phase.generate], report_multiple_bugs=False, print_blob=False))

"""BlockArena: unit tests, a state machine against an independent reference model, mutants.

The state machine also keeps a shadow KV pool (block → what the "generator" last wrote there: the
hash of the content it committed, or scratch while a block is being filled) and checks after every
step that every cached entry's block holds that entry's content: the property failure F3 broke.
"""

from __future__ import annotations

import hashlib
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

from mmserve.cache.free_blocks import FreeBlocks
from mmserve.cache.block_arena import (
    EVICTABLE,
    REFERENCED,
    ArenaBlockInfo,
    ArenaFull,
    ArenaStats,
    BlockArena,
)
from mmserve.cache.block_hash import MMPlaceholder, block_hashes, root_hash


def H(name: str) -> bytes:
    """A 16-byte test hash."""
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


A, B, C, D, E, F = (H(x) for x in "ABCDEF")


def cached(arena: BlockArena, hashes=(A, B, C, D, E, F)) -> dict:
    """Every entry among `hashes`: hash → block."""
    return {h: arena.block_of(h) for h in hashes if arena.block_of(h) is not None}


def finished(arena: BlockArena, owner, hashes: list[bytes]) -> list[int]:
    """A whole request with no hit: allocate one block per hash, commit each, free."""
    blocks = arena.allocate(owner, len(hashes))
    for i, h in enumerate(hashes):
        arena.commit(owner, i, h)
    arena.free(owner)
    return blocks


# -- unit tests -----------------------------------------------------------------------------------


def test_empty_arena():
    a = BlockArena(3)
    assert a.num_blocks == 3 and a.num_free() == 3 and a.num_used() == 0 and a.num_cached() == 0
    assert a.lookup([A, B], "r1") == []
    assert a.owners() == set() and a.table("r1") == ()  # a miss starts no table
    s = a.stats()
    assert (s.queries_blocks, s.hit_blocks, s.free_blocks, s.referenced_blocks) == (2, 0, 3, 0)
    assert a.snapshot() == [] and a.free_blocks() == [0, 1, 2] and a.evictable_blocks() == []
    a.check_invariants()


def test_allocate_keeps_tables_consecutive_and_appends_to_them():
    a = BlockArena(5)
    assert a.allocate("r1", 2) == [0, 1]  # an empty arena: from its start
    assert a.allocate("r2", 1) == [3]  # the middle of the free run [2, 5): r1 keeps room to grow
    assert a.allocate("r1", 1) == [2]  # right after r1's last block
    assert a.table("r1") == (0, 1, 2) and a.table("r2") == (3,)
    assert [a.refcount(i) for i in range(5)] == [1, 1, 1, 1, 0]
    assert [a.hash_of(i) for i in range(5)] == [None] * 5  # allocated blocks hold no hash
    assert a.num_used() == 4 and a.num_free() == 1 and a.owners() == {"r1", "r2"}
    a.free("r2")
    assert a.free_blocks() == [3, 4]
    assert a.allocate("r3", 2) == [3, 4]  # centred in the run they fit in: here all of it
    assert a.allocate("r4", 0) == [] and a.table("r4") == () and "r4" not in a.owners()
    assert a.stats().allocated_blocks == 6
    a.check_invariants()


def test_tables_admitted_together_stay_consecutive_as_they_grow():
    """Sixteen 17-block prompts admitted in one step, then each decoding 10 blocks more, in turns:
    every table is still one run of consecutive ids (attention reads its KV without a gather)."""
    a = BlockArena(512)
    for i in range(16):
        a.allocate(i, 17)
    for _ in range(10):
        for i in range(16):
            a.allocate(i, 1)
    for i in range(16):
        t = a.table(i)
        assert list(t) == list(range(t[0], t[0] + 27)), (i, t)
    a.check_invariants()


def test_allocate_is_all_or_nothing():
    a = BlockArena(4)
    finished(a, "w", [A])  # block 0 evictable
    a.allocate("r1", 2)  # blocks 1, 2
    before = (a.snapshot(), a.stats(), a.free_blocks(), a.evictable_blocks(), a.table("r2"))
    assert a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(ArenaFull) as err:
        a.allocate("r2", 3)
    assert isinstance(err.value, ValueError) and (err.value.wanted, err.value.available) == (3, 2)
    assert (a.snapshot(), a.stats(), a.free_blocks(), a.evictable_blocks(), a.table("r2")) == before
    assert a.block_of(A) == 0  # the entry a partial allocation would have evicted is still there
    with pytest.raises(ArenaFull):
        a.allocate("r1", 3)  # an owner with a table keeps exactly that table
    assert a.table("r1") == (1, 2)
    assert a.allocate("r2", 2) == [3, 0]  # free first, then the evictable block
    assert a.block_of(A) is None and not a.can_allocate(1) and a.can_allocate(0)
    a.check_invariants()


def test_allocate_evicts_lru_and_erases_the_entry_of_a_reused_block():
    """F3: a reused block never keeps a stale entry; its old hash no longer resolves."""
    a = BlockArena(2)
    finished(a, "w1", [A])  # block 0
    finished(a, "w2", [B])  # block 1, released after A
    assert a.evictable_blocks() == [0, 1] and a.num_free() == 2 and a.num_cached() == 2
    assert a.allocate_evicting("r1", 1) == [(0, A)]
    assert a.block_of(A) is None and a.hash_of(0) is None and a.block_of(B) == 1
    assert a.lookup([A], "r2") == [] and a.peek([A]) == 0
    assert a.commit("r1", 0, C) is True  # the reused block now holds C, and only C names it
    assert cached(a) == {B: 1, C: 0}
    assert a.stats().evictions == 1
    a.check_invariants()


def test_lookup_returns_longest_prefix_references_blocks_and_starts_the_table():
    a = BlockArena(4)
    a.allocate("w", 3)
    a.commit("w", 0, A)
    a.commit("w", 2, C)  # B not cached: a lookup of [A, B, C] stops at B
    a.free("w")
    assert a.lookup([A, B, C], "r1") == [0]
    assert a.table("r1") == (0,) and a.refcount(0) == 1 and a.refcount(2) == 0
    assert a.evictable_blocks() == [2]  # the hit left the LRU order
    assert a.lookup([B, A], "r2") == [] and a.table("r2") == ()
    s = a.stats()
    assert (s.queries_blocks, s.hit_blocks) == (5, 1)
    a.check_invariants()


def test_lookup_only_starts_an_empty_table_and_transfer_hands_it_over():
    """Hits never land after blocks an owner holds (they would shift the indices it commits by,
    issue 28); a lookup's pin hands its hits to the request whole, once the answer is delivered."""
    a = BlockArena(6)
    a.allocate("r1", 3)
    for i, h in enumerate([A, B, C]):
        a.commit("r1", i, h)
    a.truncate("r1", 1)
    with pytest.raises(ValueError, match="empty table"):
        a.lookup([A, B, C, D], "r1")
    assert a.table("r1") == (0,) and a.evictable_blocks() == [2, 1]  # changed nothing
    assert a.lookup([A, B, C, D], "r2/lookup") == [0, 1, 2]
    assert a.transfer("r2/lookup", "r2") == [0, 1, 2]
    assert a.table("r2") == (0, 1, 2) and a.table("r2/lookup") == () and a.refcount(0) == 2
    with pytest.raises(ValueError, match="empty table"):
        a.transfer("r2", "r1")
    assert a.transfer("nobody", "r3") == [] and a.table("r3") == ()
    s = a.stats()
    assert (s.queries_blocks, s.hit_blocks) == (4, 3)
    a.check_invariants()


def test_a_hit_is_block_ids_shared_by_owners():
    a = BlockArena(4)
    a.allocate("r1", 2)
    a.commit("r1", 0, A)
    a.commit("r1", 1, B)  # r1 still running: its committed blocks are shared at once
    assert a.lookup([A, B, C], "r2") == [0, 1]
    assert [a.refcount(0), a.refcount(1)] == [2, 2] and a.num_used() == 2
    assert a.allocate("r2", 1) == [2]
    assert a.table("r2") == (0, 1, 2)
    a.free("r1")
    assert [a.refcount(0), a.refcount(1)] == [1, 1] and a.evictable_blocks() == []
    a.free("r2")
    assert a.evictable_blocks() == [1, 0] and a.free_blocks() == [2, 3]  # r2's block 2 had no hash
    a.check_invariants()


def test_commit_registers_once_and_refuses_duplicates():
    a = BlockArena(4)
    a.allocate("r1", 1)
    a.allocate("r2", 1)
    assert a.commit("r1", 0, A) is True
    before = (a.snapshot(), cached(a))
    assert a.commit("r2", 0, A) is False  # A is cached in block 0: r2's block 1 stays private
    assert (a.snapshot(), cached(a)) == before and a.hash_of(1) is None
    assert a.commit("r1", 0, A) is False  # the same content again: nothing to do
    with pytest.raises(ValueError, match="cannot be committed as"):
        a.commit("r1", 0, B)  # one block, one content
    s = a.stats()
    assert (s.commits, s.duplicate_commits, s.cached_blocks) == (1, 1, 1)
    a.free("r2")
    assert a.free_blocks() == [1, 2, 3] and a.block_of(A) == 0  # the private copy is just freed
    a.free("r1")
    assert a.evictable_blocks() == [0]
    a.check_invariants()


def test_commit_of_a_hit_block():
    a = BlockArena(3)
    finished(a, "w", [A])
    assert a.lookup([A], "r") == [0]
    assert a.commit("r", 0, A) is False  # a generator committing every full block: harmless
    with pytest.raises(ValueError):
        a.commit("r", 0, B)
    assert a.stats().duplicate_commits == 0 and cached(a) == {A: 0}


def test_commit_argument_validation():
    a = BlockArena(3)
    with pytest.raises(ValueError, match="no blocks"):
        a.commit("nobody", 0, A)
    a.allocate("r", 2)
    for bad in (2, -1, True, 1.0, "0"):
        with pytest.raises(ValueError):
            a.commit("r", bad, A)
    with pytest.raises(TypeError):
        a.commit("r", 0, "A")
    with pytest.raises(TypeError):
        a.commit("r", 0, bytearray(A))
    assert a.num_cached() == 0 and a.stats().commits == 0


def test_free_makes_hashed_blocks_evictable_tail_first_and_the_rest_free():
    a = BlockArena(5)
    a.allocate("r", 4)
    for i, h in enumerate([A, B, C]):
        a.commit("r", i, h)
    a.free("r")
    assert a.evictable_blocks() == [2, 1, 0]  # the chain's tail is evicted first
    assert a.free_blocks() == [3, 4] and a.owners() == set() and a.table("r") == ()
    assert a.allocate_evicting("x", 3) == [(3, None), (4, None), (2, C)]
    assert a.peek([A, B, C]) == 2  # what stays cached is a usable prefix
    a.free("r")  # freeing twice (or an unknown owner) is harmless
    a.free("nobody")
    a.check_invariants()


def test_lru_is_by_release_and_a_hit_takes_a_block_out_of_it():
    a = BlockArena(3)
    a.allocate("r1", 1)
    a.commit("r1", 0, A)  # r1 keeps block 0
    finished(a, "r2", [B])  # block 1 released first
    finished(a, "r3", [C])  # block 2 released next
    a.free("r1")  # block 0 released last
    assert a.evictable_blocks() == [1, 2, 0]
    assert [r.lru_rank for r in a.snapshot()] == [2, 0, 1]
    assert a.lookup([B], "r4") == [1] and a.evictable_blocks() == [2, 0]
    a.free("r4")
    assert a.evictable_blocks() == [2, 0, 1]  # most recently released last
    assert a.allocate_evicting("x", 3) == [(2, C), (0, A), (1, B)]
    assert a.num_cached() == 0 and a.stats().evictions == 3
    a.check_invariants()


def test_abort_touches_no_entry_and_consumes_nothing():
    """F3: aborts (with or without a hit) change neither entries nor which block comes next."""

    def run(aborts: bool) -> tuple:
        a = BlockArena(4)
        finished(a, "w", [A, B])  # blocks 0, 1 evictable
        if aborts:
            entries = cached(a)
            for i in range(5):
                a.free(f"gone{i}")  # admitted, never got blocks
            a.lookup([C], "gone-miss")
            a.free("gone-miss")
            a.lookup([A, B], "gone-hit")
            a.allocate("gone-hit", 2)  # aborted mid-prefill: its private blocks were half written
            a.free("gone-hit")
            assert cached(a) == entries
        rows = a.allocate_evicting("r", 3)
        return rows, a.snapshot(), cached(a), a.free_blocks(), a.evictable_blocks()

    without, with_aborts = run(False), run(True)
    assert with_aborts == without
    assert without[0] == [(2, None), (3, None), (1, B)]


def test_preempted_owner_recomputes_from_the_cache():
    a = BlockArena(4)
    a.allocate("old", 3)
    a.commit("old", 0, A)
    a.commit("old", 1, B)  # block 2 is being filled
    a.allocate("new", 1)
    assert not a.can_allocate(1)
    a.free("new")  # the newest sequence is preempted; its blocks go back
    a.allocate("old", 1)
    a.free("old")  # later: also preempted, with two committed blocks
    assert a.lookup([A, B, C], "old") == [0, 1]  # the recompute starts from its own prefix
    assert a.allocate("old", 2) == [2, 3]
    a.check_invariants()


def test_clear_drops_evictable_entries_only():
    a = BlockArena(4)
    a.allocate("keep", 2)
    a.commit("keep", 0, A)
    a.commit("keep", 1, B)
    finished(a, "tmp", [C, D])
    assert a.clear() == 2
    assert [a.hash_of(i) for i in range(4)] == [A, B, None, None] and a.free_blocks() == [2, 3]
    assert a.clear() == 0 and a.stats().cleared_entries == 2
    a.free("keep")
    assert a.clear() == 2 and a.num_cached() == 0 and a.num_free() == 4
    assert a.allocate("x", 1) == [0]
    a.check_invariants()


def test_same_block_twice_in_one_table():
    a = BlockArena(2)
    finished(a, "w", [A])
    assert a.lookup([A, A], "r") == [0, 0]  # not a real chain, but the arena does not care
    assert a.refcount(0) == 2 and a.num_used() == 1
    a.free("r")
    assert a.refcount(0) == 0 and a.evictable_blocks() == [0]
    a.check_invariants()


def test_zero_blocks():
    a = BlockArena(0)
    assert a.lookup([A], "r") == [] and a.allocate("r", 0) == [] and a.can_allocate(0)
    assert not a.can_allocate(1)
    with pytest.raises(ArenaFull):
        a.allocate("r", 1)
    assert a.clear() == 0 and a.owners() == set() and a.snapshot() == []
    a.check_invariants()


def test_argument_validation():
    for bad in (-1, True, 2.0, "3", None):
        with pytest.raises(ValueError):
            BlockArena(bad)
    a = BlockArena(2)
    with pytest.raises(TypeError):
        a.lookup(A, "r")  # a single hash, not a sequence
    with pytest.raises(TypeError):
        a.lookup(["ab"], "r")
    with pytest.raises(TypeError):
        a.lookup([A, bytearray(B)], "r")
    with pytest.raises(TypeError):
        a.peek("ab")
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError):
            a.allocate("r", bad)
        with pytest.raises(ValueError):
            a.can_allocate(bad)
    with pytest.raises(TypeError):
        a.allocate(["unhashable"], 1)
    assert a.owners() == set() and a.num_free() == 2  # a rejected call changed nothing
    for bad in (2, -1, True):
        with pytest.raises(ValueError):
            a.refcount(bad)
        with pytest.raises(ValueError):
            a.hash_of(bad)
    a.check_invariants()


def test_stats_and_snapshot_shape():
    a = BlockArena(4)
    finished(a, "w", [A, B])
    a.lookup([A], "r")
    a.allocate("r", 1)
    a.commit("r", 1, A)  # duplicate
    names = [f.name for f in fields(ArenaStats)]
    assert names[:11] == ["num_blocks", "free_blocks", "evictable_blocks", "referenced_blocks",
                          "cached_blocks", "owners", "queries_blocks", "hit_blocks", "allocated_blocks",
                          "evictions", "commits"]
    assert a.stats() == ArenaStats(4, 1, 1, 2, 2, 1, 1, 1, 3, 0, 2, 1, 0)
    with pytest.raises(Exception):
        a.stats().commits = 0  # frozen
    assert a.snapshot() == [ArenaBlockInfo(0, REFERENCED, 1, A.hex()[:12], None),
                            ArenaBlockInfo(1, EVICTABLE, 0, B.hex()[:12], 0),
                            ArenaBlockInfo(2, REFERENCED, 1, None, None)]
    assert a.snapshot()[1] == (1, "evictable", 0, B.hex()[:12], 0)
    assert "BlockArena(num_blocks=4" in repr(a)


@pytest.mark.parametrize("corrupt", [
    "negative_refcount", "refcount_mismatch", "free_and_referenced", "lost_block", "free_with_hash",
    "two_entries_one_block", "referenced_in_lru", "evictable_without_hash",
    "lru_out_of_order", "empty_table_kept", "table_out_of_range", "free_count_off", "free_map_not_flags",
])
def test_check_invariants_detects_corruption(corrupt):
    a = BlockArena(5)
    a.allocate("r1", 2)
    a.commit("r1", 0, A)
    finished(a, "w", [B, C])  # blocks 2, 3 evictable (3 first)
    a.check_invariants()
    if corrupt == "negative_refcount":
        a._refs[4] = -1
    elif corrupt == "refcount_mismatch":
        a._refs[0] += 1
    elif corrupt == "free_and_referenced":
        a._free.give(0)
    elif corrupt == "lost_block":
        a._free.take(4)
    elif corrupt == "free_with_hash":
        a._hash_of[4] = D
        a._block_of[D] = 4
    elif corrupt == "two_entries_one_block":
        a._block_of[D] = 0
    elif corrupt == "referenced_in_lru":
        a._lru[0] = 99
    elif corrupt == "evictable_without_hash":
        del a._block_of[a._hash_of.pop(2)]
    elif corrupt == "lru_out_of_order":
        a._lru.move_to_end(next(iter(a._lru)))
    elif corrupt == "empty_table_kept":
        a._tables["ghost"] = []
    elif corrupt == "table_out_of_range":
        a._tables["r1"].append(7)
    elif corrupt == "free_count_off":
        a._free._count += 1
    elif corrupt == "free_map_not_flags":
        a._free._map[4] = 2
    with pytest.raises(ValueError):
        a.check_invariants()


def test_with_real_block_hashes():
    """Two prompts sharing a text prefix, then different images: the shared blocks hit, the image
    blocks do not (F2), and the second request allocates and commits only the new blocks."""
    root = root_hash(123, None)
    tokens = list(range(8)) + [99] * 8
    h1 = block_hashes(root, tokens, [MMPlaceholder(H("img1"), 8, 8)], 4)
    h2 = block_hashes(root, tokens, [MMPlaceholder(H("img2"), 8, 8)], 4)
    a = BlockArena(8)
    assert finished(a, "r1", h1) == [0, 1, 2, 3]
    hit = a.lookup(h2, "r2")
    assert hit == [0, 1]
    assert a.allocate("r2", len(h2) - len(hit)) == [5, 6]  # centred in the free run [4, 8)
    assert [a.commit("r2", i, h2[i]) for i in range(4)] == [False, False, True, True]
    a.free("r2")
    assert a.peek(h1) == 4 and a.peek(h2) == 4 and a.num_cached() == 6
    a.check_invariants()


# -- state machine against an independent reference model -----------------------------------------


class RefArena:
    """The specification, spelled out naively: tables and entries in plain dicts; everything else
    (refcounts, free and evictable blocks, LRU order) recomputed from them at every question."""

    def __init__(self, num_blocks: int):
        self.n = num_blocks
        self.tables: dict[object, list[int]] = {}
        self.entry: dict[bytes, int] = {}
        self.released: dict[int, int] = {}  # block → when its last reference went
        self.time = 0
        self.queries = self.hits = self.allocated = self.evictions = 0
        self.commits = self.duplicates = self.cleared = 0

    def hashes(self) -> dict[int, bytes]:
        return {b: h for h, b in self.entry.items()}

    def refcount(self, block: int) -> int:
        return sum(table.count(block) for table in self.tables.values())

    def free(self) -> list[int]:
        return [b for b in range(self.n) if self.refcount(b) == 0 and b not in self.hashes()]

    def evictable(self) -> list[int]:
        """Hashed unreferenced blocks, least recently released first."""
        return sorted((b for b in self.hashes() if self.refcount(b) == 0), key=lambda b: self.released[b])

    def table(self, owner) -> tuple[int, ...]:
        return tuple(self.tables.get(owner, ()))

    def lookup(self, hashes, owner) -> list[int]:
        """Hits start an empty table only (issue 28); an owner holding blocks is refused."""
        if self.tables.get(owner):
            raise ValueError("a lookup starts an empty table")
        out = []
        for h in hashes:
            if h not in self.entry:
                break
            out.append(self.entry[h])
        if out:
            self.tables[owner] = list(out)
        self.queries += len(hashes)
        self.hits += len(out)
        return out

    def peek(self, hashes) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.entry:
            n += 1
        return n

    def allocate(self, owner, n: int) -> list[tuple[int, bytes | None]] | None:
        """None when it cannot give all n (and then nothing changes)."""
        if n > len(self.free()) + len(self.evictable()):
            return None
        out = []
        for _ in range(n):
            free = self.free()
            if free:
                block, old = self.placed(free, self.tables.get(owner, []), n - len(out)), None
            else:
                block = self.evictable()[0]
                old = self.hashes()[block]
                del self.entry[old]
                self.evictions += 1
            self.tables.setdefault(owner, []).append(block)
            out.append((block, old))
        self.allocated += n
        return out

    @staticmethod
    def placed(free: list[int], table: list[int], wanted: int) -> int:
        """The free block a table grows by: the one after its last block, else in the first
        largest run of consecutive free blocks, `wanted` blocks centred in it (at block 0: its start)."""
        if table and table[-1] + 1 in free:
            return table[-1] + 1
        runs: list[list[int]] = []
        for b in free:
            if runs and runs[-1][-1] == b - 1:
                runs[-1].append(b)
            else:
                runs.append([b])
        run = max(runs, key=len)  # the first of the longest
        return run[0] if run[0] == 0 else run[max(0, len(run) - wanted) // 2]

    def commit(self, owner, index: int, h: bytes) -> bool | str:
        """True / False as the arena; "error" when the block already holds another hash."""
        block = self.tables[owner][index]
        old = self.hashes().get(block)
        if old is not None:
            return False if old == h else "error"
        if h in self.entry:
            self.duplicates += 1
            return False
        self.entry[h] = block
        self.commits += 1
        return True

    def release(self, owner, keep: int = 0) -> None:
        full = self.tables.pop(owner, [])
        if keep and full[:keep]:
            self.tables[owner] = full[:keep]
        table = full[keep:]
        for i in reversed(range(len(table))):  # each reference dropped from the tail
            block = table[i]
            if self.refcount(block) + table[:i].count(block) == 0 and block in self.hashes():
                self.time += 1
                self.released[block] = self.time

    def share(self, src, dst, start: int, count: int) -> list[int] | None:
        """None: refused (src lacks those blocks, or shares with itself)."""
        table = self.tables.get(src, [])
        if src == dst or start + count > len(table):
            return None
        blocks = table[start:start + count]
        if blocks:
            self.tables.setdefault(dst, []).extend(blocks)
        return blocks

    def clear(self) -> int:
        gone = self.evictable()
        for block in gone:
            del self.entry[self.hashes()[block]]
        self.cleared += len(gone)
        return len(gone)


OWNERS = ["r0", "r1", "r2", ("req", 3)]
# Two "prompts" of up to 6 blocks: hash i of chain c is what block i of that prompt holds. Few
# hashes, few blocks: hits, duplicate commits (two owners filling one prompt) and evictions are common.
CHAINS = [[H(f"{c}{i}") for i in range(6)] for c in "ab"]
KEYS = CHAINS[0] + CHAINS[1]
# (chain or None for any hashes, length, any hashes)
HASHES = st.tuples(st.sampled_from([0, 1, None]), st.integers(0, 6), st.lists(st.sampled_from(KEYS), max_size=5))


class ArenaMachine(RuleBasedStateMachine):
    arena_cls = BlockArena
    internal_checks = True  # also call check_invariants(); mutants are judged without it

    @initialize(num_blocks=st.integers(1, 8))
    def init(self, num_blocks):
        self.arena = self.arena_cls(num_blocks)
        self.ref = RefArena(num_blocks)
        self.pool: dict[int, object] = {}  # block → the hash of what was written there, or scratch
        self.started: list[object] = []  # owners holding blocks, oldest table first
        self.prompt: dict[object, int] = {}  # owner → the chain it looked up last (its prompt)

    @staticmethod
    def _hashes(spec) -> list[bytes]:
        """A prompt's chain prefix (what aligned commits build) or any hashes."""
        c, k, keys = spec
        return keys if c is None else CHAINS[c][:k]

    def _note_start(self, owner) -> None:
        if self.arena.table(owner) and owner not in self.started:
            self.started.append(owner)

    @rule(owner=st.sampled_from(OWNERS), spec=HASHES)
    def lookup(self, owner, spec):
        """A new (or preempted, hence empty) sequence's prefix hit; refused for an owner holding
        blocks, changing nothing."""
        hashes = self._hashes(spec)
        if self.ref.table(owner):
            before = self.arena.table(owner)
            with pytest.raises(ValueError):
                self.arena.lookup(hashes, owner)
            assert self.arena.table(owner) == before
            return
        if spec[0] is not None:
            self.prompt[owner] = spec[0]
        got = self.arena.lookup(hashes, owner)
        assert got == self.ref.lookup(hashes, owner)
        for h, block in zip(hashes, got):
            assert self.pool.get(block) == h, f"block {block} holds {self.pool.get(block)!r}, not the hit {h!r}"
        self._note_start(owner)

    @rule(spec=HASHES)
    def peek(self, spec):
        hashes = self._hashes(spec)
        assert self.arena.peek(hashes) == self.ref.peek(hashes)

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 4))
    def allocate(self, owner, n):
        expected = self.ref.allocate(owner, n)
        assert self.arena.can_allocate(n) == (expected is not None)
        if expected is None:
            before = (self.arena.snapshot(), self.arena.stats(), self.arena.free_blocks(),
                      self.arena.evictable_blocks(), self.arena.table(owner))
            with pytest.raises(ArenaFull):
                self.arena.allocate(owner, n)
            assert (self.arena.snapshot(), self.arena.stats(), self.arena.free_blocks(),
                    self.arena.evictable_blocks(), self.arena.table(owner)) == before
            return
        got = self.arena.allocate_evicting(owner, n)
        assert got == expected
        for block, _ in got:
            self.pool[block] = ("scratch", owner)  # the generator starts writing new KV at once
        self._note_start(owner)

    @rule(owner=st.sampled_from(OWNERS), index=st.integers(0, 7), aligned=st.booleans(),
          key=st.sampled_from(KEYS))
    def commit(self, owner, index, aligned, key):
        table = self.ref.table(owner)
        if not table:
            with pytest.raises(ValueError):
                self.arena.commit(owner, 0, key)
            return
        index %= len(table)
        prompt = CHAINS[self.prompt.get(owner, 0)]
        h = prompt[index] if aligned and index < len(prompt) else key
        block = table[index]
        if self.arena.hash_of(block) is None:
            self.pool[block] = h  # the owner filled its private block with the content h names
        expected = self.ref.commit(owner, index, h)
        if expected == "error":
            before = (self.arena.snapshot(), self.arena.stats())
            with pytest.raises(ValueError):
                self.arena.commit(owner, index, h)
            assert (self.arena.snapshot(), self.arena.stats()) == before
        else:
            assert self.arena.commit(owner, index, h) is expected

    def _free(self, owner) -> None:
        entries = {h: self.arena.block_of(h) for h in KEYS}
        self.arena.free(owner)
        self.ref.release(owner)
        assert {h: self.arena.block_of(h) for h in KEYS} == entries, "free touched an entry (F3)"
        if owner in self.started:
            self.started.remove(owner)

    @rule(src=st.sampled_from(OWNERS), dst=st.sampled_from(OWNERS), start=st.integers(0, 3), count=st.integers(0, 4))
    def share(self, src, dst, start, count):
        """The choices of one request: a child takes some of the parent's blocks (one more reference)."""
        expected = self.ref.share(src, dst, start, count)
        if expected is None:
            before = (self.arena.snapshot(), self.arena.stats(), self.arena.table(dst))
            with pytest.raises(ValueError):
                self.arena.share(src, dst, start, count)
            assert (self.arena.snapshot(), self.arena.stats(), self.arena.table(dst)) == before
            return
        if not self.ref.table(dst)[:-len(expected) or None] and src in self.prompt:
            self.prompt[dst] = self.prompt[src]
        assert self.arena.share(src, dst, start, count) == expected
        if expected:
            self._note_start(dst)

    @rule(owner=st.sampled_from(OWNERS))
    def free(self, owner):
        """A sequence finished or was aborted (also an owner that holds nothing)."""
        self._free(owner)

    @precondition(lambda self: self.started)
    @rule()
    def preempt(self):
        """Blocks ran out: the scheduler preempts the newest sequence."""
        self._free(self.started[-1])

    @precondition(lambda self: self.started)
    @rule(keep=st.integers(0, 4))
    def preempt_keeping(self, keep):
        """A preemption that keeps the first blocks (those its sequence cannot recompute)."""
        owner = self.started[-1]
        entries = {h: self.arena.block_of(h) for h in KEYS}
        self.arena.truncate(owner, keep)
        self.ref.release(owner, keep)
        assert {h: self.arena.block_of(h) for h in KEYS} == entries, "truncate touched an entry (F3)"
        if not self.ref.table(owner) and owner in self.started:
            self.started.remove(owner)

    @rule(owner=st.sampled_from(OWNERS), c=st.sampled_from([0, 1]), k=st.integers(1, 6))
    def admit(self, owner, c, k):
        """A new sequence over prompt c's first k blocks: look up its prefix, allocate the rest."""
        if self.ref.table(owner):
            return
        self.lookup(owner, (c, k, []))
        self.allocate(owner, k - len(self.ref.table(owner)))

    @rule(owner=st.sampled_from(OWNERS), upto=st.integers(1, 6))
    def fill(self, owner, upto):
        """The sequence's KV is computed up to block `upto`: commit every full block so far."""
        for i in range(min(upto, len(self.ref.table(owner)))):
            self.commit(owner, i, True, KEYS[0])

    @rule(owner=st.sampled_from(OWNERS), c=st.sampled_from([0, 1]), k=st.integers(1, 6),
          abort=st.booleans())
    def request(self, owner, c, k, abort):
        """A whole request: admit, fill (all but the last block when it aborts), end."""
        self._free(owner)
        self.admit(owner, c, k)
        self.fill(owner, len(self.ref.table(owner)) - (1 if abort else 0))
        self._free(owner)

    @rule()
    def clear(self):
        assert self.arena.clear() == self.ref.clear()

    @invariant()
    def agrees_with_reference_and_pool(self):
        arena, ref = self.arena, self.ref
        n = ref.n
        refs = [arena.refcount(b) for b in range(n)]
        assert all(r >= 0 for r in refs), f"negative refcount {refs}"
        assert refs == [ref.refcount(b) for b in range(n)]
        free = arena.free_blocks()
        assert not [b for b in free if refs[b] > 0], "a block both free and referenced"
        assert free == ref.free()
        assert arena.evictable_blocks() == ref.evictable()
        assert [arena.hash_of(b) for b in range(n)] == [ref.hashes().get(b) for b in range(n)]
        for h in KEYS:
            block = arena.block_of(h)
            assert block == ref.entry.get(h)
            if block is not None:  # every entry's block holds what its hash says
                assert self.pool.get(block) == h, f"entry {h!r} → block {block} holding {self.pool.get(block)!r}"
        for owner in OWNERS:
            assert arena.table(owner) == ref.table(owner)
        assert arena.owners() == set(ref.tables)
        assert arena.num_free() == len(ref.free()) + len(ref.evictable())
        assert arena.num_used() == sum(r > 0 for r in refs)
        assert arena.num_cached() == len(ref.entry)
        ranks = {b: r for r, b in enumerate(ref.evictable())}
        hashes = ref.hashes()
        assert [(row.block, row.state, row.refcount, row.lru_rank) for row in arena.snapshot()] == [
            (b, REFERENCED if refs[b] else EVICTABLE, refs[b], ranks.get(b))
            for b in range(n) if refs[b] or b in hashes]
        s = arena.stats()
        assert (s.num_blocks, s.free_blocks, s.evictable_blocks, s.referenced_blocks, s.cached_blocks,
                s.owners) == (n, len(ref.free()), len(ref.evictable()), sum(r > 0 for r in refs),
                              len(ref.entry), len(ref.tables))
        assert (s.queries_blocks, s.hit_blocks, s.allocated_blocks, s.evictions, s.commits,
                s.duplicate_commits, s.cleared_entries) == (
            ref.queries, ref.hits, ref.allocated, ref.evictions, ref.commits, ref.duplicates, ref.cleared)
        if self.internal_checks:
            arena.check_invariants()

    def teardown(self):
        if not hasattr(self, "arena"):
            return
        for owner in OWNERS:
            self._free(owner)
        assert self.arena.owners() == set() and self.arena.num_used() == 0
        assert all(self.arena.refcount(b) == 0 for b in range(self.arena.num_blocks))
        assert self.arena.num_free() == self.arena.num_blocks
        self.agrees_with_reference_and_pool()
        # Nothing referenced: every entry is evictable, and clearing frees every block.
        assert self.arena.clear() == self.ref.clear()
        assert self.arena.free_blocks() == list(range(self.arena.num_blocks))
        if self.internal_checks:
            self.arena.check_invariants()


ArenaMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestArenaAgainstReference = ArenaMachine.TestCase


# -- mutants: the state machine must catch each, from observable behaviour alone -------------------


class StaleEntryKept(BlockArena):
    """F3: a reused block keeps the entry that described its old content."""

    def _drop_entry(self, block):
        return self._hash_of[block]  # neither map is updated


class RoundRobinBlocks(BlockArena):
    """F3 as shipped: a counter hands out blocks and advances on every free (abort)."""

    _next = 0

    def allocate_evicting(self, owner, n):
        if n > self.num_free():
            raise ArenaFull(n, self.num_free())
        out = []
        while len(out) < n:
            block = self._next % self.num_blocks
            self._next += 1
            if self._refs[block]:
                continue
            if block in self._free:
                self._free.take(block)
                out.append((block, None))
            else:
                del self._lru[block]
                out.append((block, self._drop_entry(block)))
        for block, _ in out:
            self._refs[block] = 1
            self._tables.setdefault(owner, []).append(block)
        self._referenced += n
        self._allocated_blocks += n
        return out

    def free(self, owner):
        self._next += 1
        super().free(owner)


class FreeErasesEntries(BlockArena):
    """An abort (any free) drops the entries of the blocks it releases."""

    def free(self, owner):
        super().free(owner)
        self.clear()
        self._cleared = 0


class NotAllOrNothing(BlockArena):
    """Allocate hands out what it can before finding out it cannot give all n."""

    def allocate_evicting(self, owner, n):
        if n > self.num_free() and self.num_free():
            super().allocate_evicting(owner, self.num_free())
        return super().allocate_evicting(owner, n)


class DuplicateCommitMovesEntry(BlockArena):
    """A commit of an already cached hash re-points the entry at the committing block."""

    def commit(self, owner, index, block_hash):
        old = self._block_of.get(block_hash)
        table = self._tables.get(owner) or []
        if old is not None and 0 <= index < len(table) and table[index] != old \
                and table[index] not in self._hash_of:
            self._drop_entry(old)
            if not self._refs[old]:
                del self._lru[old]
                self._free.give(old)
        return super().commit(owner, index, block_hash)


class HeadFirstRelease(BlockArena):
    """Blocks enter the LRU order head first: a chain is evicted from block 0."""

    def free(self, owner):
        table = self._tables.get(owner)
        if table:
            table.reverse()
        super().free(owner)


class EvictMostRecent(BlockArena):
    """"LRU" that evicts the most recently released block."""

    def allocate_evicting(self, owner, n):
        self._lru = type(self._lru)(reversed(self._lru.items()))
        try:
            return super().allocate_evicting(owner, n)
        finally:
            self._lru = type(self._lru)(reversed(self._lru.items()))


class LookupLeavesLru(BlockArena):
    """A hit does not take its block out of the LRU order: allocate may evict it while shared."""

    def _ref(self, block):
        if not self._refs[block]:
            self._referenced += 1
        self._refs[block] += 1


class CanAllocateIgnoresEvictable(BlockArena):
    """`can_allocate` counts free blocks only (admission by a wrong estimate, F5)."""

    def can_allocate(self, n):
        return n <= len(self._free)


MUTANTS = [StaleEntryKept, RoundRobinBlocks, FreeErasesEntries, NotAllOrNothing, DuplicateCommitMovesEntry,
           HeadFirstRelease, EvictMostRecent, LookupLeavesLru, CanAllocateIgnoresEvictable]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_state_machine_catches_mutant(mutant):
    machine = type(f"Machine{mutant.__name__}", (ArenaMachine,),
                   {"arena_cls": mutant, "internal_checks": False})
    with pytest.raises(Exception):
        run_state_machine_as_test(machine, settings=settings(
            max_examples=200, stateful_step_count=40, deadline=None, derandomize=True, database=None,
            phases=[Phase.generate], report_multiple_bugs=False, print_blob=False))


def test_free_blocks_refuses_what_would_corrupt_it():
    free = FreeBlocks(4)
    assert free.take_next(None, 2) == 0 and free.take_next(0, 1) == 1 and len(free) == 2
    with pytest.raises(ValueError):
        free.take(1)  # not free
    with pytest.raises(ValueError):
        free.give(3)  # already free
    free.give(0)
    assert free.blocks() == [0, 2, 3]
    free.check(4)
    with pytest.raises(ValueError):
        free.check(5)
    for b in (0, 2, 3):
        free.take(b)
    with pytest.raises(ValueError):
        free.take_next(None, 1)

"""A preempted sequence's `Resume`: the cache manager starts its table again with what is still
cached of its blocks, and takes them back when the generator stopped waiting for the answer."""

from __future__ import annotations

import trio

from mmserve.actors.messages import Release, Resume, Resumed
from mmserve.actors.prefix_cache import PrefixCacheManager
from mmserve.config import KVCacheConfig

A, B, C, D = (bytes([i]) * 16 for i in range(1, 5))


def manager_with_preempted(owner="r") -> PrefixCacheManager:
    """An arena where `owner` computed and committed three blocks, then was preempted; a newer
    sequence then evicted the last of them."""
    m = PrefixCacheManager("tiny", KVCacheConfig(block_size=4), num_blocks=5)
    m.arena.allocate(owner, 3)
    for i, h in enumerate((A, B, C)):
        m.arena.commit(owner, i, h)
    m._release(Release(owner))
    assert m.arena.table(owner) == ()
    m.arena.allocate("newer", 3)  # two free blocks, then the least recently released: C's
    assert m.arena.block_of(C) is None
    return m


def test_resume_starts_the_table_again_with_what_is_still_cached():
    m = manager_with_preempted()
    send, receive = trio.open_memory_channel(1)
    m._resume(Resume((("r", (A, B, C, D)), ("other", (D,))), send))
    reply = receive.receive_nowait()
    assert isinstance(reply, Resumed) and reply.epoch == m.epoch
    got = dict(reply.tables)
    assert got["r"] == m.arena.table("r") == (m.arena.block_of(A), m.arena.block_of(B))
    assert got["other"] == () and m.arena.table("other") == ()  # nothing of it is cached: a miss holds nothing
    m.arena.check_invariants()


def test_an_unheard_resume_gives_the_blocks_back():
    m = manager_with_preempted()
    send, receive = trio.open_memory_channel(1)
    receive.close()
    m._resume(Resume((("r", (A, B, C)),), send))
    assert m.arena.table("r") == ()  # the generator never learned of them
    assert sorted(m.arena.evictable_blocks()) == sorted({m.arena.block_of(A), m.arena.block_of(B)})
    m.arena.check_invariants()


def test_resume_with_prefix_caching_off_finds_nothing():
    m = PrefixCacheManager("tiny", KVCacheConfig(block_size=4, prefix_caching=False), num_blocks=8)
    send, receive = trio.open_memory_channel(1)
    m._resume(Resume((("r", (A, B)),), send))
    assert receive.receive_nowait().tables == (("r", ()),)

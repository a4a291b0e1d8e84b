"""A preempted sequence's `Resume`: the cache manager appends what is still cached of its blocks
to its table, and takes them back when the generator stopped waiting for the answer."""

from __future__ import annotations

import trio

from mmserve.actors.messages import Release, Resume, Resumed
from mmserve.actors.prefix_cache import PrefixCacheManager
from mmserve.config import KVCacheConfig

A, B, C, D = (bytes([i]) * 16 for i in range(1, 5))


def manager_with_preempted(owner="r") -> PrefixCacheManager:
    """An arena where `owner` computed and committed three blocks, then was preempted keeping one."""
    m = PrefixCacheManager("tiny", KVCacheConfig(block_size=4), num_blocks=8)
    m.arena.allocate(owner, 3)
    for i, h in enumerate((A, B, C)):
        m.arena.commit(owner, i, h)
    m._release(Release(owner, keep=1))
    return m


def test_resume_appends_the_cached_blocks_after_those_kept():
    m = manager_with_preempted()
    kept = m.arena.table("r")
    send, receive = trio.open_memory_channel(1)
    m._resume(Resume((("r", (A, B, C, D)), ("none-kept", (A,))), send))
    reply = receive.receive_nowait()
    assert isinstance(reply, Resumed) and reply.epoch == m.epoch
    got = dict(reply.tables)
    assert len(got["r"]) == 2 and m.arena.table("r") == kept + got["r"]
    assert [m.arena.hash_of(b) for b in m.arena.table("r")] == [A, B, C]
    # a sequence preempted keeping nothing gets its blocks back from the first
    assert got["none-kept"] == m.arena.table("none-kept") == (m.arena.block_of(A),)
    m.arena.check_invariants()


def test_an_unheard_resume_gives_the_blocks_back():
    m = manager_with_preempted()
    kept = m.arena.table("r")
    send, receive = trio.open_memory_channel(1)
    receive.close()
    m._resume(Resume((("r", (A, B, C)),), send))
    assert m.arena.table("r") == kept  # the generator never learned of them
    assert sorted(m.arena.evictable_blocks()) == sorted({m.arena.block_of(B), m.arena.block_of(C)})
    m.arena.check_invariants()


def test_resume_with_prefix_caching_off_finds_nothing():
    m = PrefixCacheManager("tiny", KVCacheConfig(block_size=4, prefix_caching=False), num_blocks=8)
    m.arena.allocate("r", 1)
    send, receive = trio.open_memory_channel(1)
    m._resume(Resume((("r", (A, B)),), send))
    assert receive.receive_nowait().tables == (("r", ()),)

"""KV events ([kv_events]) on a real ZMQ SUB socket, decoded with msgspec as vLLM's own structs
decode them: stored after commit, removed before reuse, cleared on reset, replay of missed batches,
both encodings. The arena is the reference: the events, applied in order, rebuild its cached set."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import trio
import zmq

from mmserve import Runtime
from mmserve.actors.kv_event_wire import ENCODINGS
from mmserve.actors.kv_events import END_SEQ, KVEventPublisher
from mmserve.cache.kv_event_records import (
    AllCleared, BlocksRemoved, BlocksStored, MMRouting, StoredBlock, routing_id)
from mmserve.config import KVEventsConfig
from mmserve.config.kv_events import KV_EVENT_ENCODINGS
from mmserve.models.demo import render_image
from tests.helpers import ask


# vLLM's structs (vllm/distributed/kv_events.py, positional form as llm-d decodes it)
class VBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VStored | VRemoved | VCleared]
    data_parallel_rank: int | None = None


class VStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list | None = None


class VRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class VCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


# the map form ("dynamo"): the same fields by name, with block_mm_infos
class MmObject(msgspec.Struct):
    mm_hash: int
    offsets: list[list[int]]


class MmInfo(msgspec.Struct):
    mm_objects: list[MmObject]


class DStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    block_mm_infos: list[MmInfo | None]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class DRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class DCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class DBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[DStored | DRemoved | DCleared]
    data_parallel_rank: int | None = None


KV_BUDGET = 40 << 10  # the tiny model's arena: 5 blocks, 2 a chat: the third image evicts
DECODERS = {"vllm": msgspec.msgpack.Decoder(VBatch), "dynamo": msgspec.msgpack.Decoder(DBatch)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


class Subscriber:
    """A SUB socket on the stream; `batches` decoded, with their sequence numbers."""

    def __init__(self, endpoint: str, encoding: str = "vllm", topic: str = ""):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.decoder = DECODERS[encoding]
        self.seen: list[tuple[int, object]] = []

    def drain(self, settle_s: float = 0.3) -> list:
        """Everything received until the stream has been quiet for `settle_s`."""
        while self.sub.poll(int(settle_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            self.seen.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        return self.seen

    def close(self):
        self.sub.close(linger=0)
        self.ctx.term()


class CacheModel:
    """The router's view, rebuilt from events: the set of cached routing ids; checks the protocol
    (a block stored once until removed, removed only while stored, parents known)."""

    def __init__(self):
        self.cached: dict[int, list[int]] = {}

    def apply(self, event):
        if isinstance(event, (VStored, DStored)):
            assert event.parent_block_hash is None or event.parent_block_hash in self.cached, "parent not announced"
            bs = event.block_size
            for k, h in enumerate(event.block_hashes):
                assert h not in self.cached, f"block {h} stored twice without a removal"
                self.cached[h] = event.token_ids[k * bs:(k + 1) * bs]
        elif isinstance(event, (VRemoved, DRemoved)):
            for h in event.block_hashes:
                assert h in self.cached, f"block {h} removed but never stored"
                del self.cached[h]
        else:
            self.cached.clear()


def arena_ids(rt: Runtime, model: str = "tiny") -> set[int]:
    arena = rt.registry.loaded[model].prefix_cache.arena
    return {routing_id(arena.hash_of(b)) for b in range(arena.num_blocks) if arena.hash_of(b) is not None}


def test_the_encodings_named_in_config_are_the_wire_module_s():
    assert KV_EVENT_ENCODINGS == ENCODINGS


def replay_model(seen) -> CacheModel:
    model = CacheModel()
    for _, batch in seen:
        for e in batch.events:
            model.apply(e)
    return model


def images_of(seen) -> set[int]:
    """The mm_hashes the stored events carry (per-block extra keys, or block_mm_infos)."""
    out = set()
    for _, batch in seen:
        for e in batch.events:
            if isinstance(e, VStored):
                out |= {k[0] for keys in e.extra_keys or () if keys for k in keys if isinstance(k, list)}
            elif isinstance(e, DStored):
                out |= {o.mm_hash for info in e.block_mm_infos if info for o in info.mm_objects}
    return out


@pytest.mark.parametrize("encoding", ["vllm", "dynamo"])
def test_stored_after_commit_removed_before_reuse_cleared_on_reset(tiny_config, encoding):
    """A small arena (evictions by the third image), five chats, an admin reset: the stream applied
    in order always names exactly what the arena caches, with each block's token ids; images tell
    their blocks apart."""
    pub_ep, _ = endpoints()
    config = tiny_config.replace(kv_events={"enabled": True, "endpoint": pub_ep, "encoding": encoding},
                                 kv_cache={"budget_bytes": KV_BUDGET})
    sub = Subscriber(pub_ep, encoding)

    async def main():
        async with Runtime.open(config) as rt:
            manager = rt.registry.loaded["tiny"].prefix_cache
            await trio.sleep(0.3)  # ZMQ's slow joiner: only what is published after the SUB joined arrives
            for i, (color, seed) in enumerate([("red", 0), ("blue", 1), ("green", 2), ("red", 0), ("blue", 4)]):
                await rt.chat_completion(ask(render_image(color, "circle", seed=seed)), temperature=0, max_tokens=8)
                await trio.to_thread.run_sync(sub.drain)
                model = replay_model(sub.seen)
                assert set(model.cached) == arena_ids(rt), f"chat {i}: the events disagree with the arena"
                arena = manager.arena
                for b in range(arena.num_blocks):  # each announced block's token ids are its own
                    if (h := arena.hash_of(b)) is not None:
                        assert len(model.cached[routing_id(h)]) == manager.block_size
            assert manager.arena.stats().evictions > 0, "the arena never evicted: no removal was tested"
            assert len(images_of(sub.seen)) == 4, "four images, four mm_hashes"
            await rt.reset_caches("tiny", ("prefix",))  # nothing is running: every entry goes
            await trio.to_thread.run_sync(sub.drain)
            assert isinstance(sub.seen[-1][1].events[-1], (VCleared, DCleared))
            assert arena_ids(rt) == set() and replay_model(sub.seen).cached == {}
            metrics = rt.metrics.render().decode()
            assert f"mmserve:kv_events_published_total {float(rt.kv_events.published)}" in metrics
            assert "mmserve:kv_events_dropped_total 0.0" in metrics

    try:
        trio.run(main)
    finally:
        sub.close()
    seqs = [s for s, _ in sub.seen]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers have no gap"


def test_replay_returns_missed_batches_and_ends_with_minus_one():
    """vLLM's replay protocol: 8-byte start sequence in, [seq, payload] for each buffered batch from
    it, then [-1, b""]. The batches were published before anyone subscribed (all missed)."""
    pub_ep, replay_ep = endpoints()
    pub = KVEventPublisher(KVEventsConfig(enabled=True, endpoint=pub_ep, replay_endpoint=replay_ep))
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        block = StoredBlock(routing_id(b"\x01" * 16), None, tuple(range(4)), (MMRouting(7, 1, 4),), None)
        for k in range(5):
            pub.publish([BlocksStored((block,), 4)] if k % 2 == 0 else [BlocksRemoved((block.block,))])
        deadline = time.time() + 5
        while pub.stats()["published"] < 6 and time.time() < deadline:  # 6: AllBlocksCleared first
            time.sleep(0.01)
        dealer.connect(replay_ep)
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])  # the empty delimiter a REQ socket adds
        got = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                break
            got.append((int.from_bytes(seq, "big"), DECODERS["vllm"].decode(payload)))
    finally:
        dealer.close(linger=0)
        ctx.term()
        pub.close()
    assert [s for s, _ in got] == [2, 3, 4, 5]
    kinds = [type(b.events[0]) for _, b in got]
    assert kinds == [VRemoved, VStored, VRemoved, VStored]
    assert got[1][1].events[0].extra_keys == [[[7, 1, 4]]]
    assert got[1][1].events[0].token_ids == [0, 1, 2, 3] and got[1][1].events[0].medium == "GPU"


def test_the_first_batch_is_all_blocks_cleared_and_a_full_queue_drops_then_clears():
    """A replica's stream starts with AllBlocksCleared. A batch that finds the queue full is dropped
    and counted; the next one published starts with AllBlocksCleared (a router forgets rather than
    trusts a gap), and `generation` tells the managers their announcements are void."""
    pub_ep, replay_ep = endpoints()
    pub = KVEventPublisher(KVEventsConfig(enabled=True, endpoint=pub_ep, replay_endpoint=replay_ep,
                                          queue_batches=1))
    try:
        # a burst far faster than one thread sends (the GIL switches every 5 ms): most batches drop
        results = [pub.publish([BlocksRemoved((k,))]) for k in range(2000)]
        assert not all(results) and pub.dropped == results.count(False)
        assert pub.generation >= 1
        deadline = time.time() + 5
        while pub.stats()["published"] < results.count(True) + 1 and time.time() < deadline:
            time.sleep(0.01)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_ep)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            batches.append(DECODERS["vllm"].decode(payload).events)
        dealer.close(linger=0)
        ctx.term()
    finally:
        pub.close()
    assert batches[0] == [VCleared()]
    # after each run of drops, the next batch that got through starts with AllBlocksCleared
    ok = [k for k, r in enumerate(results) if r]
    for prev, k in zip([-1] + ok, ok):
        batch = batches[1 + ok.index(k)]
        gap = k - prev > 1
        assert [type(e) for e in batch] == ([VCleared, VRemoved] if gap else [VRemoved]), (k, prev)
        assert batch[-1].block_hashes == [k]


def test_the_wire_forms_pinned():
    """The exact fields and positions routers decode (vLLM's positional form; Dynamo's map events
    in a positional batch), for one stored block with an image and a group, a removal, a reset."""
    from mmserve.actors.kv_event_wire import BatchEncoder

    block = StoredBlock(-5, 3, (1, 2, 3, 4), (MMRouting(2**64 - 1, 1, 3),), "00ff00ff00ff00ff")
    events = [AllCleared(), BlocksStored((block,), 4), BlocksRemoved((-5,))]
    assert msgspec.msgpack.decode(BatchEncoder("vllm").encode(1.5, events)) == [1.5, [
        ["AllBlocksCleared"],
        ["BlockStored", [-5], 3, [1, 2, 3, 4], 4, None, "GPU", None, [[[2**64 - 1, 1, 3], "00ff00ff00ff00ff"]]],
        ["BlockRemoved", [-5], "GPU"]], 0]
    assert msgspec.msgpack.decode(BatchEncoder("dynamo").encode(1.5, events)) == [1.5, [
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": 3, "token_ids": [1, 2, 3, 4],
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
         "block_mm_infos": [{"mm_objects": [{"mm_hash": 2**64 - 1, "offsets": [[1, 3]]}]}],
         "cache_salt": "00ff00ff00ff00ff"},
        {"type": "BlockRemoved", "block_hashes": [-5], "medium": "GPU"}], 0]


def test_tenants_publish_under_their_own_group_and_routing_keys_agree(tiny_config):
    """A salted request's blocks carry its routing group (a hash, never the salt), an unsalted one's
    none; the routing keys mmserve gives for a request name exactly the blocks it announced."""
    pub_ep, _ = endpoints()
    config = tiny_config.replace(kv_events={"enabled": True, "endpoint": pub_ep, "encoding": "dynamo"})
    sub = Subscriber(pub_ep, "dynamo")
    img = render_image("red", "circle", seed=11)

    async def main():
        async with Runtime.open(config) as rt:
            await trio.sleep(0.3)
            out = {}
            for salt in (None, "tenant-a"):
                body = {"model": "tiny", "messages": ask(img), **({"cache_salt": salt} if salt else {})}
                before = len(sub.seen)
                await rt.chat_completion(body["messages"], temperature=0, max_tokens=3, cache_salt=salt)
                await trio.to_thread.run_sync(sub.drain)
                stored = [e for _, b in sub.seen[before:] for e in b.events if isinstance(e, DStored)]
                out[salt] = (stored, await rt.routing_keys(body))
            return out

    try:
        out = trio.run(main)
    finally:
        sub.close()
    (plain, plain_keys), (salted, salted_keys) = out[None], out["tenant-a"]
    assert plain and all(e.cache_salt is None for e in plain) and plain_keys["cache_salt"] is None
    group = salted_keys["cache_salt"]
    assert group and "tenant" not in group and all(e.cache_salt == group for e in salted)
    for stored, keys in ((plain, plain_keys), (salted, salted_keys)):
        announced = [h for e in stored for h in e.block_hashes]
        assert announced == keys["block_hashes"][:len(announced)] and announced
        bs = keys["block_size"]
        assert [t for e in stored for t in e.token_ids] == keys["token_ids"][:len(announced) * bs]
        infos = [i for e in stored for i in e.block_mm_infos]
        assert [msgspec.to_builtins(i) for i in infos] == keys["block_mm_infos"][:len(announced)]
    assert set(h for e in plain for h in e.block_hashes).isdisjoint(h for e in salted for h in e.block_hashes)


def test_the_routing_keys_route_answers_what_the_runtime_gives(tiny_config):
    """`POST /v1/routing_keys` over a real socket: the same keys as `Runtime.routing_keys`."""
    import httpx

    from tests.helpers import ServerThread

    body = {"model": "tiny", "messages": ask(render_image("blue", "square", seed=3)), "cache_salt": "t"}
    with ServerThread(tiny_config) as server:
        got = httpx.post(server.url + "/v1/routing_keys", json=body, timeout=30)
        assert got.status_code == 200, got.text
        want = trio.from_thread.run(server.runtime.routing_keys, body, trio_token=server._token)
    keys = got.json()
    assert keys["block_size"] == tiny_config.kv_cache.block_size and keys["cache_salt"]
    assert len(keys["block_mm_infos"]) == len(keys["token_ids"]) // keys["block_size"]
    assert any(keys["block_mm_infos"]) and len(keys["block_hashes"]) == len(keys["block_mm_infos"])
    assert keys == want


def test_two_models_on_one_stream_a_reset_withdraws_only_its_own_blocks(tiny_config):
    """Two models publish on one replica's stream: an admin reset of one says BlockRemoved for its
    blocks (AllBlocksCleared would clear the other's too), and the stream still equals both arenas."""
    from mmserve.config import ModelConfig

    pub_ep, _ = endpoints()
    tiny = tiny_config.models[0]
    config = tiny_config.replace(models=(tiny, ModelConfig("tiny2", tiny.path, load="eager")),
                                 kv_events={"enabled": True, "endpoint": pub_ep})
    sub = Subscriber(pub_ep)

    async def main():
        async with Runtime.open(config) as rt:
            await trio.sleep(0.3)
            img = render_image("green", "circle", seed=2)
            for model in ("tiny", "tiny2"):
                await rt.chat_completion(ask(img), model=model, temperature=0, max_tokens=3)
            await trio.to_thread.run_sync(sub.drain)
            assert set(replay_model(sub.seen).cached) == arena_ids(rt, "tiny") | arena_ids(rt, "tiny2")
            kept = arena_ids(rt, "tiny2")
            await rt.reset_caches("tiny", ("prefix",))
            await trio.to_thread.run_sync(sub.drain)
            last = sub.seen[-1][1].events
            assert [type(e) for e in last] == [VRemoved]
            assert arena_ids(rt, "tiny") == set() and set(replay_model(sub.seen).cached) == kept != set()

    try:
        trio.run(main)
    finally:
        sub.close()


def test_a_restarted_cache_manager_says_all_blocks_cleared(tiny_config):
    """A fault kills the cache manager (at a refill, actor-wide): its restart starts a fresh arena,
    and the stream says AllBlocksCleared before anything of the new life; it equals the arena after."""
    from mmserve.actors import faults
    from mmserve.errors import MMServeError

    pub_ep, _ = endpoints()
    config = tiny_config.replace(kv_events={"enabled": True, "endpoint": pub_ep},
                                 supervisor={"restart_backoff_s": 0.05})
    sub = Subscriber(pub_ep)

    async def main():
        async with Runtime.open(config) as rt:
            await trio.sleep(0.3)
            await rt.chat_completion(ask(render_image("red", "square", seed=21)), temperature=0, max_tokens=3)
            await trio.to_thread.run_sync(sub.drain)
            before = len(sub.seen)
            assert replay_model(sub.seen).cached
            faults.configure("prefix.refill=raise@1")
            try:
                await rt.chat_completion(ask(render_image("blue", "square", seed=22)), temperature=0, max_tokens=3)
            except MMServeError:
                pass  # the request that held blocks in the dead life fails with a 503
            faults.configure(None)
            deadline = trio.current_time() + 10
            while rt.supervisor.states["prefix_cache[tiny]"].restarts < 1:
                assert trio.current_time() < deadline, "the manager never restarted"
                await trio.sleep(0.02)
            await rt.chat_completion(ask(render_image("green", "square", seed=23)), temperature=0, max_tokens=3)
            await trio.to_thread.run_sync(sub.drain)
            after = [type(e) for _, b in sub.seen[before:] for e in b.events]
            assert VCleared in after, after
            assert set(replay_model(sub.seen).cached) == arena_ids(rt) != set()

    try:
        trio.run(main)
    finally:
        faults.configure(None)
        sub.close()


def test_blocks_restored_from_the_shared_tier_are_announced_with_their_request_s_first_commit(tiny_config,
                                                                                            tmp_path):
    """Replica B restores a conversation's prefix from Redis (written by A): the restored blocks
    carry no token ids of their own, so B announces them with the request's first commit — before
    the blocks that chain from them (a router skips a block whose parent it does not know)."""
    from tests.redis_server import RedisServer

    pub_ep, _ = endpoints()
    with RedisServer(tmp_path / "redis", None) as redis:
        shared = {"url": redis.url, "secret": "k" * 32, "lookup_deadline_ms": 3000.0}
        a_config = tiny_config.replace(shared_cache=shared)
        b_config = a_config.replace(kv_events={"enabled": True, "endpoint": pub_ep})
        sub = Subscriber(pub_ep)
        first = ask(render_image("red", "circle", seed=31))

        async def main():
            async with Runtime.open(a_config) as a, Runtime.open(b_config) as b:
                await trio.sleep(0.3)
                answer = await a.chat_completion(first, temperature=0, max_tokens=20, min_tokens=20)
                tier = a.registry.require("tiny").actors["shared_tier"]
                with trio.fail_after(10):
                    while tier.pending_writes:
                        await trio.sleep(0.01)
                second = [*first, {"role": "assistant", "content": answer.text},
                          {"role": "user", "content": "and the shape?"}]
                got = await b.chat_completion(second, temperature=0, max_tokens=3)
                assert got.usage.cached_tokens > 0
                assert b.registry.require("tiny").prefix_cache.stats()["shared_restored_blocks"] > 0
                await trio.to_thread.run_sync(sub.drain)
                assert set(replay_model(sub.seen).cached) == arena_ids(b, "tiny")

        try:
            trio.run(main)
        finally:
            sub.close()


# -- the arena's journal: the order KV events are read from -------------------------------------------

from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import initialize, invariant  # noqa: E402

from mmserve.cache.block_arena import BlockArena  # noqa: E402
from tests.test_block_arena import ArenaMachine  # noqa: E402


class JournalMachine(ArenaMachine):
    """The arena's own state machine (lookups, allocations that evict, commits, duplicate commits,
    shares, frees, preemptions, clears), with a journal: replayed in order, it is always the arena's
    hash entries, a block is stored only while it holds none (its old entry was removed first: never
    announced while reused), and removed only with the entry it holds."""

    @initialize(num_blocks=st.integers(1, 8))
    def init(self, num_blocks):
        super().init(num_blocks)
        self.journal: list = []
        self.arena = BlockArena(num_blocks, journal=self.journal)
        self.seen = 0
        self.model: dict[int, bytes] = {}  # block → hash, as a router following the events sees it

    @invariant()
    def the_journal_replays_to_the_arena(self):
        for kind, block, h in self.journal[self.seen:]:
            if kind == "stored":
                assert block not in self.model and h not in self.model.values(), (block, h)
                self.model[block] = h
            else:
                assert self.model.get(block) == h, (block, h)
                del self.model[block]
        self.seen = len(self.journal)
        arena = self.arena
        assert self.model == {b: arena.hash_of(b) for b in range(arena.num_blocks) if arena.hash_of(b) is not None}


JournalMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestArenaJournal = JournalMachine.TestCase

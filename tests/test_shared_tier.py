"""The shared cache tier against a real redis-server (started here on a free loopback port): two
runtimes on one Redis share encoder outputs and KV blocks, answers stay those of cache-off, and a
corrupt, killed, restarted, slow or full Redis only costs the hits."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from mmserve import Runtime
from mmserve.cache.shared_values import NAMESPACE
from mmserve.config import ModelConfig
from mmserve.models.demo import Q_BACKGROUND, Q_SHAPE, render_image
from tests.helpers import ask
from tests.redis_server import RedisServer

SECRET = "shared-tier-test-secret"  # the replicas' shared secret (values in Redis are tagged with it)

RED = render_image("red", "circle", background="white", seed=3)
BLUE = render_image("blue", "square", background="black", seed=4)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis"), None, "--enable-debug-command", "yes") as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    client = redis_server.client()
    client.flushall()
    client.config_set("maxmemory", 0)
    return redis_server.url


def tier_config(demo_config, url: str, **shared):
    base = demo_config.replace(models=demo_config.models[:1])
    return base.replace(shared_cache=dict({"url": url, "secret": SECRET, "lookup_deadline_ms": 3000.0,
                                           "backoff_s": 0.05, "max_backoff_s": 0.2}, **shared))


def off_config(demo_config):
    return demo_config.replace(models=demo_config.models[:1], encoder_cache={"enabled": False},
                               kv_cache={"prefix_caching": False})


def tier(rt, model="demo"):
    return rt.registry.require(model).actors["shared_tier"]


async def settle(*rts) -> None:
    """Until every tier has written what it queued."""
    with trio.fail_after(10):
        while any(tier(rt).pending_writes for rt in rts):
            await trio.sleep(0.01)


async def answer(rt, msgs, **kw):
    c = await rt.chat_completion(msgs, temperature=0, max_tokens=12, **kw)
    return c.text.strip(), c.usage.cached_tokens


def turn(msgs, reply, question):
    return [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]


def conversation():
    """Three turns about one image, long enough that later turns fill several blocks."""
    first = [{"role": "user", "content": [{"type": "image", "image": RED}, {"type": "text", "text": "What color is the shape?"}]}]
    return first, [Q_BACKGROUND, Q_SHAPE, "What color is the shape?"]


async def run_conversation(rts, cache_salt=None, wait_for_writes=True):
    """Turn i runs on rts[i % len(rts)]; returns [(answer, cached_tokens)] per turn. Without
    `wait_for_writes` the next turn is sent the moment an answer ends."""
    msgs, later = conversation()
    out = []
    for i in range(len(later) + 1):
        rt = rts[i % len(rts)]
        text, cached = await answer(rt, msgs, cache_salt=cache_salt)
        out.append((text, cached))
        if rt.config.shared_cache.enabled and wait_for_writes:
            await settle(rt)
        if i < len(later):
            msgs = turn(msgs, text, later[i])
    return out


async def test_conversation_moves_between_replicas(demo_config, redis_url):
    async with Runtime.open(off_config(demo_config)) as off:
        expected = [a for a, _ in await run_conversation([off])]
    assert expected[:2] == ["red", "white"]
    async with Runtime.open(tier_config(demo_config, redis_url)) as a, \
            Runtime.open(tier_config(demo_config, redis_url)) as b:
        got = await run_conversation([a, b])
        assert [t for t, _ in got] == expected  # the same greedy answers as cache-off
        assert all(cached > 0 for _, cached in got[1:])  # every later turn starts from restored KV
        assert b.registry.require("demo").prefix_cache.stats()["shared_restored_blocks"] > 0
        # the image was never encoded on B: its KV (or its encoder output) came from Redis
        assert b.registry.require("demo").encoder.stats()["encoder_runs"] == 0
        assert tier(b).stats()["block_hits"] > 0 and tier(b).stats()["state"] == "on"
        # the same image under another prompt (no KV hit covers it) skips B's encoder too
        enc = b.registry.require("demo").encoder
        text, cached = await answer(b, [{"role": "system", "content": "Answer in one word."}, *ask(RED, Q_BACKGROUND)])
        assert text == "white" and enc.stats()["encoder_runs"] == 0 and enc.stats()["shared_hits"] >= 1


async def test_tenants_and_checkpoints_never_share(demo_config, redis_url):
    async with Runtime.open(tier_config(demo_config, redis_url)) as a:
        await run_conversation([a], cache_salt="tenant-1")
        await settle(a)
    other_checkpoint = tier_config(demo_config, redis_url).replace(
        models=(ModelConfig("demo", demo_config.models[1].path, default=True),))  # demo-wide, named demo
    async with Runtime.open(tier_config(demo_config, redis_url)) as b, Runtime.open(other_checkpoint) as c:
        msgs = turn(ask(RED), "red", Q_BACKGROUND)
        text, cached = await answer(b, msgs, cache_salt="tenant-2")
        assert (text, cached) == ("white", 0)
        assert tier(b).stats()["block_hits"] == 0 and b.registry.require("demo").encoder.stats()["shared_hits"] == 0
        text, cached = await answer(c, msgs, cache_salt="tenant-1")
        assert text == "white" and cached == 0
        assert tier(c).stats()["block_hits"] == 0 and c.registry.require("demo").encoder.stats()["shared_hits"] == 0
        text, cached = await answer(b, msgs, cache_salt="tenant-1")  # the tenant itself does hit
        assert text == "white" and cached > 0


async def test_corrupt_values_are_misses(demo_config, redis_server, redis_url):
    client = redis_server.client()
    async with Runtime.open(off_config(demo_config)) as off:
        expected = [a for a, _ in await run_conversation([off])]
    async with Runtime.open(tier_config(demo_config, redis_url)) as a:
        await run_conversation([a])
    keys = sorted(client.keys(NAMESPACE + b"*"))
    assert any(b":kv:" in k for k in keys) and any(b":enc:" in k for k in keys)
    values = {k: client.get(k) for k in keys}
    for i, k in enumerate(keys):  # garbage, truncated, a flipped byte, another key's value
        v = values[k]
        bad = [b"garbage", v[: len(v) // 2], v[:-1] + bytes([v[-1] ^ 1]), values[keys[(i + 1) % len(keys)]]][i % 4]
        client.set(k, bad)
    async with Runtime.open(tier_config(demo_config, redis_url)) as b:
        got = await run_conversation([b])
        assert [t for t, _ in got] == expected
        assert tier(b).stats()["corrupt"] > 0 and tier(b).stats()["block_hits"] == 0
        assert b.registry.require("demo").encoder.stats()["shared_hits"] == 0


async def test_killed_restarted_and_full_redis(demo_config, tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        async with Runtime.open(off_config(demo_config)) as off:
            expected = [a for a, _ in await run_conversation([off])]
        async with Runtime.open(tier_config(demo_config, server.url)) as a:
            assert [t for t, _ in await run_conversation([a])] == expected
            server.kill()
            for _ in range(2):  # Redis gone: answered from local compute, the tier switches itself off
                await a.reset_caches()
                assert [t for t, _ in await run_conversation([a])] == expected
            stats = tier(a).stats()
            assert stats["state"] == "off" and stats["errors"] >= 1 and stats["outages"] == 1
            health = a.health().to_json()
            assert health["status"] == "ok" and health["details"]["shared_tier[demo]"]["state"] == "off"
            assert health["details"]["shared_tier[demo]"]["last_error"] == "Redis is unreachable"
            assert str(server.port) not in str(health)  # never where Redis is (the log has it)
            assert 'mmserve:shared_cache_up{model_name="demo"} 0.0' in a.metrics.render().decode()
            server.start()  # back (empty): the tier probes its way back on, and fills again
            with trio.fail_after(10):
                while tier(a).stats()["state"] != "on":
                    tier(a).active()
                    await trio.sleep(0.05)
            await a.reset_caches()
            assert [t for t, _ in await run_conversation([a])] == expected
            await settle(a)
            assert server.client().dbsize() > 0
            server.client().config_set("maxmemory-policy", "noeviction")
            server.client().config_set("maxmemory", 1)  # full: every write is refused (OOM)
            server.client().flushall()
            writes = tier(a).stats()["writes"]
            await a.reset_caches()
            assert [t for t, _ in await run_conversation([a])] == expected
            with trio.fail_after(5):
                while tier(a).pending_writes:
                    await trio.sleep(0.01)
            stats = tier(a).stats()
            assert stats["write_errors"] >= 1 and stats["writes"] == writes and server.client().dbsize() == 0
            assert a.health().to_json()["details"]["shared_tier[demo]"]["last_error"] == \
                "Redis is full (it refuses writes)"
    finally:
        server.kill()


async def test_slow_redis_is_a_late_miss(demo_config, redis_server, redis_url):
    async with Runtime.open(tier_config(demo_config, redis_url)) as a:
        await run_conversation([a])
    msgs = turn(ask(RED, "What color is the shape?"), "red", Q_BACKGROUND)
    async with Runtime.open(tier_config(demo_config, redis_url, lookup_deadline_ms=100.0)) as b:
        sleeper = threading.Thread(target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "1.5"))
        sleeper.start()
        try:
            await trio.sleep(0.1)
            t0 = time.monotonic()
            text, cached = await answer(b, msgs)
            elapsed = time.monotonic() - t0
        finally:
            sleeper.join()
        assert text == "white" and cached == 0
        assert elapsed < 1.2  # never waited for Redis past the deadlines
        assert tier(b).stats()["late"] >= 1


def slow_writes(rt, seconds: float) -> None:
    """Every pipelined write round trip of `rt`'s tier takes `seconds` longer (a slow link)."""
    t = tier(rt)
    fast = t._set_many

    def slow(batch):
        time.sleep(seconds)  # a worker thread, as the real round trip
        return fast(batch)

    t._set_many = slow


@pytest.mark.parametrize("finish_flush_ms", [500.0, 0.0])
async def test_an_answer_ends_once_its_blocks_are_in_redis(demo_config, redis_url, finish_flush_ms):
    """Writes lag 150 ms behind; the next turn goes to the other replica the moment an answer
    ends. With the flush (the default) it finds every block the answer committed — as many cached
    tokens as when the test waits for the writes itself; without it, it finds fewer."""
    async with Runtime.open(tier_config(demo_config, redis_url, finish_flush_ms=finish_flush_ms)) as a, \
            Runtime.open(tier_config(demo_config, redis_url, finish_flush_ms=finish_flush_ms)) as b:
        slow_writes(a, 0.15)
        slow_writes(b, 0.15)
        waited = await run_conversation([a, b], cache_salt="waited")
        at_once = await run_conversation([a, b], cache_salt="at-once", wait_for_writes=False)
        assert [t for t, _ in at_once] == [t for t, _ in waited]
        if finish_flush_ms:
            assert at_once == waited
            assert tier(a).stats()["finish_flushed"] >= 1 and tier(a).stats()["finish_flush_late"] == 0
        else:
            assert sum(c for _, c in at_once) < sum(c for _, c in waited)


async def test_a_stalled_redis_delays_an_answer_by_at_most_finish_flush_ms(demo_config, redis_server, redis_url):
    msgs = ask(BLUE, Q_SHAPE)
    async with Runtime.open(tier_config(demo_config, redis_url, finish_flush_ms=300.0, lookup_deadline_ms=100.0)) as a:
        sleeper = threading.Thread(target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "2"))
        sleeper.start()
        try:
            await trio.sleep(0.1)
            t0 = time.monotonic()
            text, _ = await answer(a, msgs, cache_salt="stalled")
            elapsed = time.monotonic() - t0
        finally:
            sleeper.join()
        assert text == "square"
        assert elapsed < 1.2  # late look-ups (100 ms each), then at most 300 ms for the writes: not the 2 s stall
        assert tier(a).stats()["finish_flush_late"] >= 1


async def test_an_answer_ends_even_if_the_manager_dies_before_saying_its_blocks_are_in_redis(demo_config, redis_url):
    """The generator alone emits a finish; with a shared tier it holds it until the manager says the
    blocks the answer committed are in Redis (`FinishFlushed`). The manager dies handling that very
    Release, so it never says: the answer still ends, whole, `finish_flush_ms` + 1 s after its end
    at the latest, and the manager is restarted."""
    from mmserve.actors import faults
    from mmserve.actors.answers import HeldFinishes

    async with Runtime.open(tier_config(demo_config, redis_url, finish_flush_ms=200.0)) as a:
        msgs = ask(BLUE, Q_SHAPE)
        alone, _ = await answer(a, msgs, cache_salt="alone")
        faults.configure("prefix.release=raise@1")  # the next release the manager handles: this answer's
        try:
            t0 = time.monotonic()
            text, _ = await answer(a, msgs, cache_salt="unflushed")
            elapsed = time.monotonic() - t0
        finally:
            faults.configure(None)
        assert text == alone
        # a clock: the backstop's deadline is the behaviour (it never fires while the manager answers)
        assert 0.2 + HeldFinishes.FLUSH_SLACK_S <= elapsed < 0.2 + HeldFinishes.FLUSH_SLACK_S + 2.0
        assert a.supervisor.states["prefix_cache[demo]"].restarts == 1
        assert await answer(a, msgs, cache_salt="after") == (alone, 0)


async def test_a_slow_chain_read_keeps_the_blocks_that_arrived_in_time(demo_config, redis_url, monkeypatch):
    """KV blocks are read a chunk at a time (here one block per round trip, each taking 60 ms,
    against a 100 ms deadline): the blocks that arrived in time are restored — a shorter hit, not
    a miss — and the answer is cache-off's."""
    from mmserve.actors import shared_tier as tier_module

    msgs, later = conversation()
    async with Runtime.open(off_config(demo_config)) as off:
        first, _ = await answer(off, msgs)
        expected, _ = await answer(off, turn(msgs, first, later[0]))
    async with Runtime.open(tier_config(demo_config, redis_url)) as a:
        text, _ = await answer(a, msgs, cache_salt="slow")
        await settle(a)
    monkeypatch.setattr(tier_module, "FETCH_CHUNK_BYTES", 1)
    async with Runtime.open(tier_config(demo_config, redis_url, lookup_deadline_ms=100.0)) as b:
        t = tier(b)
        fast = t._get_decode

        def slow(*args):
            time.sleep(0.06)
            return fast(*args)

        t._get_decode = slow
        got, cached = await answer(b, turn(msgs, text, later[0]), cache_salt="slow")
        block = b.registry.require("demo").prefix_cache.block_size
    assert got == expected
    assert cached == block  # one block arrived in time (60 ms); the second would have come at 120 ms
    assert t.stats()["late"] >= 1


class SlowHandshakeProxy:
    """A TCP proxy in front of Redis that holds every new connection `delay_s` before it reaches
    Redis (a far Redis, a TLS handshake): round trips on a connection already open are not slowed."""

    def __init__(self, upstream_port: int, delay_s: float):
        import socket

        self.upstream_port, self.delay_s = upstream_port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client) -> None:
        import socket

        time.sleep(self.delay_s)
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            client.close()
            return
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self.listener.close()


async def test_a_fresh_replicas_first_lookup_hits(demo_config, redis_server, redis_url):
    """Opening a connection to Redis takes 400 ms here, a look-up may take 250: replica B, fresh,
    answers the conversation's second turn — its very first look-up — from the blocks A wrote,
    because the tier opened its connections when the model loaded, not at that look-up."""
    proxy = SlowHandshakeProxy(redis_server.port, 0.4)
    try:
        config = tier_config(demo_config, proxy.url, lookup_deadline_ms=250.0)
        async with Runtime.open(config) as a, Runtime.open(config) as b:
            msgs, later = conversation()
            first, _ = await answer(a, msgs)
            await settle(a)  # turn 1's blocks are in Redis
            assert tier(b).stats()["block_queries"] == 0  # B has looked nothing up yet
            text, cached = await answer(b, turn(msgs, first, later[0]))
            assert text == "white"
            assert cached > 0, tier(b).stats()
            assert tier(b).stats()["late"] == 0 and tier(b).stats()["block_hits"] > 0
    finally:
        proxy.close()


@pytest.mark.parametrize("redis_is", ["absent", "silent"])
async def test_a_redis_down_at_start_leaves_the_model_serving(demo_config, tmp_path, redis_is):
    """Connecting at start never keeps the model from loading: with nothing on the port (refused
    at once) or a port that accepts and never answers (bounded by the socket timeout), the model
    loads and answers, the tier is off, and it comes on once a Redis answers there."""
    import socket

    from tests.redis_server import free_port

    port, silent = free_port(), None
    if redis_is == "silent":
        silent = socket.create_server(("127.0.0.1", port))  # the kernel completes connects; nothing replies
    config = tier_config(demo_config, f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.3)
    server = RedisServer(tmp_path / "redis", port)
    try:
        t0 = time.monotonic()
        async with Runtime.open(config) as rt:
            assert time.monotonic() - t0 < 5
            stats = tier(rt).stats()
            assert stats["state"] == "off" and stats["outages"] == 1, stats
            assert rt.health().to_json()["status"] == "ok"
            text, _ = await answer(rt, ask(BLUE, Q_SHAPE))
            assert text == "square"
            if silent is not None:
                silent.close()
            server.start()
            with trio.fail_after(10):  # probed back on, as after any outage
                while tier(rt).stats()["state"] != "on":
                    tier(rt).active()
                    await trio.sleep(0.05)
            await answer(rt, ask(RED, Q_SHAPE))
            await settle(rt)
            assert server.client().dbsize() > 0
    finally:
        server.kill()
        if silent is not None:
            silent.close()


async def test_tenants_missing_one_image_together_write_one_entry_each(demo_config, redis_server, redis_url):
    """Two tenants (two cache_salts) send one new image in the same encoder batch: it is encoded
    once (one output for both), but each tenant's entry is written to the tier under the key
    salted with its own salt. A tenant's later look-up (on a fresh replica) reads its own entry,
    never the other's."""
    from mmserve.cache.shared_values import encoder_key

    client = redis_server.client()
    config = tier_config(demo_config, redis_url).replace(encoder_cache={"batch_wait_ms": 500.0})
    img = render_image("green", "triangle", background="white", seed=7)
    async with Runtime.open(config) as a:
        async with trio.open_nursery() as n:
            for salt in ("tenant-a", "tenant-b"):
                n.start_soon(lambda s=salt: answer(a, ask(img, Q_SHAPE), cache_salt=s))
        await settle(a)
        enc = a.registry.require("demo").encoder
        assert enc.stats()["items_encoded"] == 2  # one item per tenant (never one output for both)
        key_a, key_b = (encoder_key(k) for k in _encoder_keys(enc, img, ("tenant-a", "tenant-b")))
    stored = set(client.keys(NAMESPACE + b"enc:*"))
    assert stored == {key_a, key_b}  # one entry per tenant, each under its own salt
    values = {k: client.get(k) for k in (key_a, key_b)}
    other_prompt = [{"role": "system", "content": "Answer in one word."}, *ask(img, Q_BACKGROUND)]  # no KV hit

    async def tenant_b_alone(present: bytes) -> dict:
        """Tenant B's request on a fresh replica, with only the entry `present` in Redis."""
        client.flushall()
        client.set(present, values[present])
        async with Runtime.open(config) as fresh:
            text, _ = await answer(fresh, other_prompt, cache_salt="tenant-b")
            assert text == "white"
            return fresh.registry.require("demo").encoder.stats()

    own = await tenant_b_alone(key_b)
    assert (own["shared_hits"], own["encoder_runs"]) == (1, 0)  # its own entry
    foreign = await tenant_b_alone(key_a)
    assert (foreign["shared_hits"], foreign["encoder_runs"]) == (0, 1)  # never the other tenant's


@pytest.mark.parametrize("in_redis", ["tenant-a", "tenant-b"])
async def test_a_tenant_in_a_batch_with_another_reads_only_its_own_entry(demo_config, redis_server, redis_url,
                                                                         in_redis):
    """Two tenants miss one image in the same batch on a fresh replica, Redis holding the entry of
    only one of them: that tenant is served from its entry, the other's image is encoded (never
    served from the first one's entry) and its own entry written."""
    from mmserve.cache.shared_values import encoder_key

    config = tier_config(demo_config, redis_url).replace(encoder_cache={"batch_wait_ms": 500.0})
    img = render_image("yellow", "square", background="black", seed=8)
    async with Runtime.open(config) as first:  # writes the entry of `in_redis`
        await answer(first, ask(img, Q_SHAPE), cache_salt=in_redis)
        await settle(first)
    other_prompt = [{"role": "system", "content": "Answer in one word."}, *ask(img, Q_SHAPE)]  # no KV hit
    async with Runtime.open(config) as fresh:
        async with trio.open_nursery() as n:
            for salt in ("tenant-a", "tenant-b"):
                n.start_soon(lambda s=salt: answer(fresh, other_prompt, cache_salt=s))
        await settle(fresh)
        enc = fresh.registry.require("demo").encoder
        stats = enc.stats()
        local = _encoder_keys(enc, img, ("tenant-a", "tenant-b"))
        assert set(enc.cache.keys()) == set(local)  # the tier hit cached here under its tenant's key
    assert (stats["shared_hits"], stats["encoder_runs"], stats["items_encoded"]) == (1, 1, 1), stats
    keys = set(redis_server.client().keys(NAMESPACE + b"enc:*"))
    assert keys == {encoder_key(k) for k in local}


def _encoder_keys(enc, img, salts) -> list[bytes]:
    """The encoder keys of `img` for each of `salts` under the encoder's model."""
    from mmserve.cache.keys import encoder_cache_key

    mm_hash = enc.adapter.image_key(img.convert("RGB"))
    return [encoder_cache_key(mm_hash, s, algorithm=enc.adapter.hash_algorithm) for s in salts]


async def test_the_cache_salt_covers_the_encoder_cache_through_the_tier(demo_config, redis_server, redis_url):
    """Timing-free, through Redis: on a fresh replica, tenant B's request for an image (B's entry
    in Redis) is a tier hit, cached locally under B's key only — so a request without a salt is
    then a miss everywhere (encoded), A's request reads A's own entry, and B's repeat hits locally.
    A replica where B asks for A's image with only A's entry in Redis encodes it."""
    config = tier_config(demo_config, redis_url).replace(kv_cache={"prefix_caching": False})  # encoder only
    img = render_image("blue", "triangle", background="white", seed=9)
    msgs = ask(img, Q_SHAPE)

    def counts(rt):
        s = rt.registry.require("demo").encoder.stats()
        return s["hits"], s["misses"], s["shared_hits"], s["encoder_runs"]

    async with Runtime.open(config) as first:
        assert (await answer(first, msgs, cache_salt="tenant-a"))[0] == "triangle"
        await settle(first)
        assert counts(first) == (0, 1, 0, 1)
        await answer(first, msgs, cache_salt="tenant-b")  # A's image, B's salt: a miss, here and in Redis
        await settle(first)
        assert counts(first) == (0, 2, 0, 2)
    async with Runtime.open(config) as fresh:
        await answer(fresh, msgs, cache_salt="tenant-b")
        assert counts(fresh) == (0, 1, 1, 0)  # B's own entry, from Redis
        await answer(fresh, msgs)  # no salt: B's entry (now also local) is not its own
        assert counts(fresh) == (0, 2, 1, 1)
        await answer(fresh, msgs, cache_salt="tenant-a")
        assert counts(fresh) == (0, 3, 2, 1)  # A's own entry, from Redis
        await answer(fresh, msgs, cache_salt="tenant-a")
        await answer(fresh, msgs, cache_salt="tenant-b")
        assert counts(fresh) == (2, 3, 2, 1)  # each tenant's repeat hits its own local entry
        enc = fresh.registry.require("demo").encoder
        assert set(enc.cache.keys()) == set(_encoder_keys(enc, img, ("tenant-a", "tenant-b", None)))

"""Nothing anyone else writes to the shared tier is believed (issue 45), against a real
redis-server: values forged under real keys — another tensor tagged without the secret, with
another secret, or re-signed with version 1's public checksum — are misses and the answer is the
honest one; NaN values are refused even when correctly tagged; a 200 MB value planted under a key
is refused without being read; an honest write replaces a planted value; each refusal is counted by
reason; /health never says where Redis is.

The forgeries here are the security review's repros: one `SET` with redis-py under a key found in
Redis, which is all that anyone who can reach Redis needs."""

from __future__ import annotations

import struct

import pytest
import torch
import trio

from mmserve import Runtime
from mmserve.actors.shared_tier import Refused
from mmserve.cache.shared_values import (
    KIND_ENCODER, KIND_KV_BLOCK, MAGIC, MacKey, SHARED_VALUE_LAYOUT_VERSION, encode, encoder_key, header_size, value_size, verify)
from mmserve.models.demo import Q_BACKGROUND, Q_SHAPE, render_image
from tests.helpers import ask
from tests.redis_server import RedisServer
from tests.test_shared_tier import BLUE, RED, SECRET, answer, conversation, settle, tier, tier_config, turn

HONEST = MacKey(SECRET.encode())
OTHER_SECRET = MacKey(b"not-the-replicas-secret")
PUBLIC = MacKey.unauthenticated()
ONE_WORD = {"role": "system", "content": "Answer in one word."}  # another prompt: no KV hit covers the image


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis"), None) as server:
        yield server


@pytest.fixture
def client(redis_server):
    c = redis_server.client()
    c.flushall()
    return c


def v1_forgery(kind: int, redis_key: bytes, t: torch.Tensor) -> bytes:
    """A value as anyone could sign it before: layout 1 with its xxh3-64 checksum under the public
    seed — and the same bytes relabelled as layout 2 (its checksum where the tag goes)."""
    import xxhash

    t = t.contiguous()
    payload = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    head = struct.pack(f"<4sHBBB{t.dim()}IQ", MAGIC, 1, kind, {torch.float32: 1}[t.dtype], t.dim(), *t.shape,
                       len(payload))
    h = xxhash.xxh3_64(seed=0x4D4D_5345_5256_0006)
    for part in (head, redis_key, payload):
        h.update(part)
    return head + struct.pack("<Q", h.intdigest()) + payload


def relabelled(value: bytes) -> bytes:
    """`value` (layout 1) claiming layout 2, its checksum padded into the tag's place, the size right."""
    ndim = value[8]
    tag_at = 9 + 4 * ndim + 8
    head = value[:4] + struct.pack("<H", SHARED_VALUE_LAYOUT_VERSION) + value[6:tag_at]
    return head + value[tag_at:tag_at + 8] * 4 + value[tag_at + 8:]


async def encoder_entries(rt, images, salt=None) -> dict:
    """Each image answered on `rt` (its encoder output written to Redis): {image index: (key, tensor)}."""
    enc = rt.registry.require("demo").encoder
    out = {}
    for i, img in enumerate(images):
        before = set(enc.cache.keys())
        await answer(rt, ask(img, Q_SHAPE), cache_salt=salt)
        (cache_key,) = set(enc.cache.keys()) - before  # the encoder key: mm_hash and this salt
        out[i] = (encoder_key(cache_key), enc.cache.get(cache_key))
    await settle(rt)
    return out


@pytest.mark.parametrize("forgery", ["no_tag", "other_secret", "v1_checksum", "v1_relabelled", "insider"])
async def test_a_forged_encoder_output_is_a_miss(demo_config, client, forgery):
    """BLUE's encoder output planted under RED's key. Only a value tagged with the replicas' own
    secret (`insider`: the control, proving the planted value is read) changes the answer."""
    async with Runtime.open(tier_config(demo_config, url_of(client))) as a:
        entries = await encoder_entries(a, [RED, BLUE])
    (red_key, red_out), (_, blue_out) = entries[0], entries[1]
    blue_out = blue_out.to("cpu")
    assert blue_out.shape == red_out.shape
    honest_bytes = encode(KIND_ENCODER, red_key, blue_out, HONEST)
    tag_at = header_size(blue_out.dim()) - 32
    planted = {
        "no_tag": honest_bytes[:tag_at] + bytes(32) + honest_bytes[tag_at + 32:],  # zeros where the tag goes
        "other_secret": encode(KIND_ENCODER, red_key, blue_out, OTHER_SECRET),
        "v1_checksum": v1_forgery(KIND_ENCODER, red_key, blue_out),
        "v1_relabelled": relabelled(v1_forgery(KIND_ENCODER, red_key, blue_out)),
        "insider": honest_bytes,
    }[forgery]
    client.flushall()
    client.set(red_key, planted)
    async with Runtime.open(tier_config(demo_config, url_of(client))) as b:
        text, _ = await answer(b, [ONE_WORD, *ask(RED, "What color is the shape?")])
        enc = b.registry.require("demo").encoder.stats()
        rejected = tier(b).stats()["rejected"]
        await settle(b)
        with trio.fail_after(5):
            while tier(b)._tidy_pending:
                await trio.sleep(0.01)
    if forgery == "insider":  # a replica holding the secret is trusted: the planted output is used
        assert enc["shared_hits"] == 1 and text == "blue"
        return
    assert text == "red", (forgery, text)
    assert (enc["shared_hits"], enc["encoder_runs"]) == (0, 1)
    reason = "version" if forgery == "v1_checksum" else "mac"  # layout 1's: left to its replicas, overwritten
    assert rejected[reason] == 1 and sum(rejected.values()) == 1, rejected
    # the honest write replaced it: what is under the key now verifies, and is RED's output
    now = verify(KIND_ENCODER, red_key, client.get(red_key), HONEST)
    assert isinstance(now, torch.Tensor) and torch.equal(now, red_out.to("cpu"))


def recording_exports(rt) -> list[tuple[bytes, torch.Tensor]]:
    """Every KV block `rt`'s tier is handed to write, in order (the writes still happen)."""
    t, seen = tier(rt), []
    put = t.put_soon

    def spy(kind, key, tensor):
        if kind == KIND_KV_BLOCK:
            seen.append((key, tensor.detach().to("cpu").clone()))
        return put(kind, key, tensor)

    t.put_soon = spy
    return seen


def url_of(client) -> str:
    return f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"


async def victim_and_attacker_blocks(demo_config, client, **shared):
    """Turn 1 about RED under the victim's salt and about BLUE under the attacker's: the victim's
    block keys, the attacker's blocks (in chain order), and turn 2's messages for the victim."""
    msgs, later = conversation()
    blue_msgs = [{"role": "user", "content": [{"type": "image", "image": BLUE},
                                              {"type": "text", "text": "What color is the shape?"}]}]
    async with Runtime.open(tier_config(demo_config, url_of(client), **shared)) as a:
        seen = recording_exports(a)
        first, _ = await answer(a, msgs, cache_salt="victim")
        victim = [k for k, _ in seen]
        seen.clear()
        await answer(a, blue_msgs, cache_salt="attacker")
        attacker = [t for _, t in seen]
        await settle(a)
    assert first == "red" and len(victim) >= 1 and len(attacker) >= 1
    return victim, attacker, turn(msgs, first, later[0])


@pytest.mark.parametrize("forgery", ["other_secret", "v1_relabelled", "nan_with_the_secret", "insider"])
async def test_forged_and_nan_kv_blocks_are_misses(demo_config, client, forgery):
    """The attacker's KV blocks (or blocks of NaN, correctly tagged: only a replica holding the
    secret could write them, and they are refused still) planted under the victim's chain: the
    victim's next turn restores none of them and answers as if Redis were empty."""
    victim, attacker, second = await victim_and_attacker_blocks(demo_config, client)
    client.flushall()
    for key, t in zip(victim, attacker):
        if forgery == "other_secret":
            client.set(key, encode(KIND_KV_BLOCK, key, t, OTHER_SECRET))
        elif forgery == "v1_relabelled":
            client.set(key, relabelled(v1_forgery(KIND_KV_BLOCK, key, t)))
        elif forgery == "insider":
            client.set(key, encode(KIND_KV_BLOCK, key, t, HONEST))
        else:
            client.set(key, encode(KIND_KV_BLOCK, key, torch.full_like(t, float("nan")), HONEST))
    async with Runtime.open(tier_config(demo_config, url_of(client))) as b:
        text, cached = await answer(b, second, cache_salt="victim")
        stats = tier(b).stats()
        await settle(b)
        with trio.fail_after(5):
            while tier(b)._tidy_pending:
                await trio.sleep(0.01)
    if forgery == "insider":  # the control: blocks tagged with the secret are restored, whatever they hold
        assert cached > 0 and stats["block_hits"] == len(victim)
        return
    assert (text, cached) == ("white", 0)
    assert stats["block_hits"] == 0 and b.registry.require("demo").prefix_cache.stats()["shared_restored_blocks"] == 0
    reason = "non_finite" if forgery.startswith("nan") else "mac"
    assert stats["rejected"][reason] >= 1 and sum(stats["rejected"].values()) == stats["rejected"][reason]
    # the first refused block was deleted or rewritten; none of what is left under the chain is a forgery
    for key in victim:
        value = client.get(key)
        assert value is None or isinstance(verify(KIND_KV_BLOCK, key, value, HONEST), torch.Tensor)
    assert client.get(victim[0]) is not None  # the victim's own turn wrote its honest first block back


async def test_nan_blocks_are_refused_when_the_network_is_trusted(demo_config, client):
    """trust = "network", no secret: the tags are public (they catch corruption only), so any
    writer can plant NaN blocks under a valid tag — refused by the finite check, a miss, no 500."""
    network = {"secret": "", "trust": "network"}
    victim, attacker, second = await victim_and_attacker_blocks(demo_config, client, **network)
    client.flushall()
    for key, t in zip(victim, attacker):
        client.set(key, encode(KIND_KV_BLOCK, key, torch.full_like(t, float("nan")), PUBLIC))
    async with Runtime.open(tier_config(demo_config, url_of(client), **network)) as b:
        text, cached = await answer(b, second, cache_salt="victim")
        stats = tier(b).stats()
    assert (text, cached) == ("white", 0) and stats["block_hits"] == 0
    assert stats["rejected"]["non_finite"] >= 1


def _vm(field: str) -> int:
    """This process's /proc/self/status `field` (kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


async def test_a_200_mb_planted_value_is_refused_without_being_read(demo_config, client):
    """A 200 MB value under RED's encoder key (made inside Redis with SETRANGE: the test never holds
    it either). The replica reads at most one value's size of it: Redis sends it a few MB in all,
    and the process's peak RSS grows by far less than the value."""
    async with Runtime.open(tier_config(demo_config, url_of(client))) as a:
        (red_key, red_out), = (await encoder_entries(a, [RED])).values()
    client.flushall()
    big = 200 << 20
    client.setrange(red_key, big - 1, b"x")
    assert client.strlen(red_key) == big
    async with Runtime.open(tier_config(demo_config, url_of(client))) as b:
        await answer(b, [ONE_WORD, *ask(BLUE, Q_SHAPE)])  # warm: the first request's allocations
        sent_before = client.info("stats")["total_net_output_bytes"]
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak RSS (VmHWM) to the RSS now
            rss_measured = True
        except OSError:
            rss_measured = False
        rss_before = _vm("VmRSS")
        text, _ = await answer(b, [ONE_WORD, *ask(RED, "What color is the shape?")])
        peak_kb = _vm("VmHWM") - rss_before
        sent = client.info("stats")["total_net_output_bytes"] - sent_before
        stats = tier(b).stats()
        await settle(b)
        with trio.fail_after(5):
            while tier(b)._tidy_pending:
                await trio.sleep(0.01)
    assert text == "red"
    assert stats["rejected"]["size"] == 1 and b.registry.require("demo").encoder.stats()["shared_hits"] == 0
    assert sent < 8 << 20, sent  # one encoder output is ~1 KiB here; 200 MB were never sent
    if rss_measured:
        assert peak_kb < 64 << 10, peak_kb  # KiB: the peak grew by well under the 200 MB
    # gone: deleted, then the honest output written in its place
    assert client.strlen(red_key) == value_size(red_out.dtype, tuple(red_out.shape))


async def test_each_refusal_is_counted_by_reason_and_deleted_unless_rewritten(demo_config, client):
    """One look-up over keys holding one refused value per reason (and a hash under one key, and an
    honest value): each reason is counted in /metrics, every refused value but the other layout
    version's is deleted, the honest one is kept and its TTL renewed — a planted one's never is."""
    shape, dtype = (4, 8), torch.float32
    keys = [encoder_key(bytes([i]) * 16) for i in range(8)]
    t = torch.randn(shape)
    good = encode(KIND_ENCODER, keys[0], t, HONEST)
    newer = bytearray(encode(KIND_ENCODER, keys[5], t, HONEST))
    newer[4:6] = struct.pack("<H", SHARED_VALUE_LAYOUT_VERSION + 1)
    planted = {
        keys[0]: good,
        keys[1]: encode(KIND_ENCODER, keys[1], t, OTHER_SECRET),  # mac
        keys[2]: encode(KIND_ENCODER, keys[2], t, HONEST) + b"\0" * 1000,  # size (longer)
        keys[3]: encode(KIND_ENCODER, keys[3], torch.full(shape, float("inf")), HONEST),  # non_finite
        keys[4]: b"XXXX" + encode(KIND_ENCODER, keys[4], t, HONEST)[4:],  # format
        keys[5]: bytes(newer),  # version: another replica's layout, left alone
    }
    for k, v in planted.items():
        client.set(k, v, ex=100)
    client.hset(keys[6], "a", "b")  # another type under our key: format (never one of ours)
    async with Runtime.open(tier_config(demo_config, url_of(client), ttl_s=5000)) as rt:
        got = await tier(rt).get_many(KIND_ENCODER, keys, dtype, [shape] * len(keys))
        with trio.fail_after(5):
            while tier(rt)._tidy_pending:
                await trio.sleep(0.01)
        metrics = rt.metrics.render().decode()
        stats = tier(rt).stats()
    assert torch.equal(got[0], t) and all(x is None for x in got[1:])
    assert stats["rejected"] == {"format": 2, "version": 1, "size": 1, "mac": 1, "non_finite": 1}
    for reason, n in stats["rejected"].items():
        assert f'mmserve:shared_tier_rejected_total{{model_name="demo",reason="{reason}"}} {float(n)}' in metrics
    assert client.get(keys[0]) == good and client.ttl(keys[0]) > 100  # verified: renewed to ttl_s
    assert [client.exists(k) for k in keys[1:7]] == [0, 0, 0, 0, 1, 0]
    assert client.ttl(keys[5]) <= 100  # never renewed
    assert stats["deleted"] == 5


async def test_a_refused_value_rewritten_since_is_not_deleted_and_honest_writes_replace(demo_config, client):
    """The compare-and-delete: a value refused by a look-up, then replaced by an honest write before
    the deletion runs, stays. And an honest write replaces a planted value without reading it."""
    key, t = encoder_key(bytes(16)), torch.randn(2, 3)
    forged = encode(KIND_ENCODER, key, t, OTHER_SECRET)
    honest = encode(KIND_ENCODER, key, t, HONEST)
    async with Runtime.open(tier_config(demo_config, url_of(client))) as rt:
        tr = tier(rt)
        refused = Refused(key, "mac", forged[:128], len(forged), False)
        client.set(key, honest)  # written in between
        assert await trio.to_thread.run_sync(tr._renew_and_delete, [], [refused]) == 0
        assert client.get(key) == honest
        client.set(key, forged)
        assert await trio.to_thread.run_sync(tr._renew_and_delete, [], [refused]) == 1
        assert client.get(key) is None
        big = Refused(key, "size", b"x" * 128, 1001, True)  # read stopped at 1001 bytes of a longer value
        client.set(key, b"x" * 5000)
        assert await trio.to_thread.run_sync(tr._renew_and_delete, [], [big]) == 1
        # an honest write replaces whatever is under its key (SET, not SET NX): nothing locks it out
        client.set(key, forged)
        assert tr.put_soon(KIND_ENCODER, key, t)
        await settle(rt)
        assert client.get(key) == honest and 0 < client.ttl(key) <= rt.config.shared_cache.ttl_s
        # and a replica never writes a tensor that is not finite (its own fault is not spread)
        nan_key = encoder_key(bytes([9]) * 16)
        assert tr.put_soon(KIND_ENCODER, nan_key, torch.tensor([[1.0, float("nan")]]))
        await settle(rt)
        assert client.exists(nan_key) == 0 and tr.stats()["refused_writes"] == 1


async def test_health_never_names_where_redis_is(demo_config, tmp_path):
    """/health says the tier is off and why in words; the host and port are in the log and the
    admin's stats only."""
    from tests.redis_server import free_port

    port = free_port()
    async with Runtime.open(tier_config(demo_config, f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.3)) as rt:
        body = str(rt.health().to_json())
        details = rt.health().to_json()["details"]["shared_tier[demo]"]
        assert details["state"] == "off" and details["last_error"] == "Redis is unreachable"
        assert str(port) not in body and "127.0.0.1" not in body, body
        assert str(port) in tier(rt).stats()["last_error"]  # the full error is kept (logs, /debug)

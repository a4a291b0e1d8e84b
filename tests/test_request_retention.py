"""No request outlives its answer (issue 46): once a request ends — answered, streamed to the end,
aborted, disconnected, failed, refused, preempted and finished, forked into n choices, restored
from the shared tier — nothing in the runtime references its handle (its messages, every image's
data URL, its sampling parameters, its output channel), whatever `max_loaded_models` is; and a
model is still never unloaded while a request it serves lives.

Each test keeps a weak reference to every request handle started (`handles`), lets the requests
end, and checks that a full collection leaves none of them alive. The last test bounds what 40
requests with ~4 MB images leave behind in the process's resident memory."""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import gc
import io
import json
import socket
import struct
import urllib.parse
import weakref
import zlib

import numpy as np
import pytest
import trio
from PIL import Image

from mmserve import Runtime
from mmserve.actors import faults
from mmserve.errors import InternalError, MMServeError, ServiceUnavailable
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import (ServerThread, ask, assert_nothing_held, colour_question, image_part, runtime_idle,
                           wait_until, wait_until_sync)
from tests.redis_server import RedisServer


@pytest.fixture
def handles(monkeypatch):
    """Weak references to the handle of every request started from now on, by any Runtime in any
    thread (the HTTP server's included): `Runtime.chat` is the one door every request takes."""
    refs: list[weakref.ref] = []
    real = Runtime.chat

    def chat(self, *args, **kwargs):
        stream = real(self, *args, **kwargs)
        refs.append(weakref.ref(stream.handle))
        return stream

    monkeypatch.setattr(Runtime, "chat", chat)
    yield refs
    faults.configure(None)


def assert_released(refs: list[weakref.ref], started: int) -> None:
    """Every handle of `refs` (at least `started` of them) is gone after a full collection; a
    failure names what still holds each survivor."""
    assert len(refs) >= started, (len(refs), started)
    gc.collect()
    alive = [h for h in (r() for r in refs) if h is not None]
    held_by = [(h.client_request_id, sorted({type(o).__name__ for o in gc.get_referrers(h)} - {"list"}))
               for h in alive]
    del alive
    assert not held_by, f"request handles still alive after their requests ended: {held_by}"


def one_model(config, **overrides):
    return config.replace(models=config.models[:1], **overrides)


async def settled(rt) -> None:
    """Until no request is left anywhere in `rt`, and every model holds nothing for one."""
    await wait_until(lambda: runtime_idle(rt), timeout=10, what="the runtime idle")
    await assert_nothing_held(rt)


async def expect_error(awaitable, kind: type[MMServeError]) -> int:
    """The status of the `kind` error `awaitable` raises. Neither the error nor its traceback is
    kept: its frames (the stream's among them) would hold the handle this file checks is gone."""
    try:
        await awaitable
    except kind as e:
        return e.status
    raise AssertionError(f"expected {kind.__name__}")


IMG = render_image("red", "circle", seed=5)


@pytest.mark.parametrize("max_loaded_models", [0, 1])
async def test_every_ending_releases_the_request(demo_config, handles, max_loaded_models):
    config = one_model(demo_config, runtime={"max_loaded_models": max_loaded_models},
                       supervisor={"restart_backoff_s": 0.02})
    async with Runtime.open(config) as rt:
        # answered
        assert (await rt.chat_completion(ask(IMG), temperature=0, max_tokens=4)).text.strip() == "red"
        # streamed to the end
        async with rt.chat(ask(IMG, Q_SHAPE), temperature=0, max_tokens=4) as stream:
            assert "circle" in "".join([d.text async for d in stream])
        # forked into n choices
        many = await rt.chat_completion(ask(IMG), temperature=1.0, seed=3, n=3, max_tokens=4)
        assert len(many.choices) == 3
        # aborted mid-decode: the caller leaves
        async with rt.chat(ask(IMG), temperature=0, max_tokens=40, min_tokens=40) as stream:
            await stream.__anext__()
        del stream
        # failed: at each stage that holds it (intake, encoder, generator), and by an actor crash
        for seed, (spec, label) in enumerate([("intake.prepare[f-intake]=raise", "f-intake"),
                                              ("encoder.item[f-enc]=raise", "f-enc"),
                                              ("generator.sample[f-gen]=raise", "f-gen")]):
            faults.configure(spec)  # a new image each: none is served from the encoder cache
            fresh = ask(render_image("green", "square", seed=100 + seed))
            assert await expect_error(rt.chat_completion(fresh, temperature=0, max_tokens=4,
                                                         client_request_id=label), InternalError) == 500
        faults.configure("generator.step=raise@1")
        assert await expect_error(rt.chat_completion(ask(IMG), temperature=0, max_tokens=4),
                                  ServiceUnavailable) == 503
        faults.configure(None)
        await wait_until(lambda: rt.health().ok, what="the generator restarted")
        # refused by intake: an image that is no image
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                            {"type": "text", "text": Q_COLOR}]}]
        assert await expect_error(rt.chat_completion(bad, max_tokens=4), MMServeError) == 400
        await settled(rt)
        assert_released(handles, 9)
        assert not rt._live and not rt.registry.require("demo").routed
        # and the runtime still answers
        assert (await rt.chat_completion(colour_question("blue"), temperature=0, max_tokens=4)).text.strip() == "blue"


BLOCKS = 12  # of 8 tokens: 96 tokens of KV; a prompt with one 64x64 image is 29 tokens


async def test_preempted_and_finished_and_refused_for_the_arena(demo_config, handles):
    config = one_model(demo_config, kv_cache={"block_size": 8, "budget_bytes": BLOCKS * 16384})
    question = ask(render_image("blue", "square", background="white", seed=41), Q_COLOR)
    long = ask(render_image("green", "circle", background="white", seed=42), Q_SHAPE)
    async with Runtime.open(config) as rt:
        alone = (await rt.chat_completion(question, temperature=0, max_tokens=30, min_tokens=30)).text
        out = {}

        async def again():
            out["again"] = (await rt.chat_completion(question, temperature=0, max_tokens=30, min_tokens=30)).text

        async with trio.open_nursery() as nursery:  # it arrives while the long answer decodes: preempted
            long_answer = rt.chat(long, temperature=0, max_tokens=60, min_tokens=60)
            async for _ in long_answer:
                nursery.start_soon(again)
                break
            async for _ in long_answer:
                pass
        del long_answer
        assert rt.registry.require("demo").generator.preemptions >= 1
        assert out["again"] == alone
        # refused at admission: its prompt needs more KV than the whole arena holds
        too_long = [{"role": "user", "content": [image_part(IMG), {"type": "text", "text": "red " * 120}]}]
        assert await expect_error(rt.chat_completion(too_long, max_tokens=4), MMServeError) == 400
        await settled(rt)
        assert_released(handles, 4)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis"), None) as server:
        yield server.url


async def test_restored_from_the_shared_tier(demo_config, redis_url, handles):
    config = one_model(demo_config, shared_cache={"url": redis_url, "secret": "retention-test-secret-0123456789",
                                                      "lookup_deadline_ms": 3000.0})
    msgs = [{"role": "user", "content": [{"type": "image", "image": IMG}, {"type": "text", "text": Q_COLOR}]},
            {"role": "assistant", "content": "red"}, {"role": "user", "content": Q_SHAPE}]
    async with Runtime.open(config) as a, Runtime.open(config) as b:
        first = await a.chat_completion(msgs, temperature=0, max_tokens=4)  # its finish waits for its writes
        with trio.fail_after(10):
            while a.registry.require("demo").actors["shared_tier"].pending_writes:
                await trio.sleep(0.01)
        second = await b.chat_completion(msgs, temperature=0, max_tokens=4)
        assert second.text == first.text and second.usage.cached_tokens > 0
        assert b.registry.require("demo").prefix_cache.stats()["shared_restored_blocks"] > 0
        await settled(a)
        await settled(b)
        assert_released(handles, 2)


def test_disconnected_http_stream(demo_config, handles):
    with ServerThread(one_model(demo_config)) as server:
        body = json.dumps({"messages": ask(IMG), "temperature": 0, "max_tokens": 60, "min_tokens": 60,
                           "stream": True}).encode()
        url = urllib.parse.urlsplit(server.url)
        with socket.create_connection((url.hostname, url.port), timeout=10) as client:
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % (url.netloc.encode(), len(body)) + body)
            got = b""
            while got.count(b"data: ") < 2:  # the role chunk, then the first token's: it is decoding
                got += client.recv(65536)
        # the client hung up mid-answer: the server notices at its next chunk and aborts the request
        wait_until_sync(lambda: not any(h is not None and h.active for h in (r() for r in handles)), timeout=10,
                        what="the request aborted")
        wait_until_sync(lambda: server.run_sync(lambda: runtime_idle(server.runtime)), timeout=10,
                        what="the server idle")
        assert_released(handles, 1)
        assert server.run_sync(lambda: len(server.runtime.registry.require("demo").routed)) == 0


async def test_a_model_serving_a_live_request_is_not_unloaded(demo_config, handles, monkeypatch):
    """With one model slot, a request that lives — still in intake (its image decode hangs), or
    decoding — keeps its model loaded: another model's request is refused until it ends."""
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", "0.5")
    async with Runtime.open(demo_config.replace(runtime={"max_loaded_models": 1})) as rt:
        assert set(rt.registry.loaded) == {"demo"}
        faults.configure("image.decode[holder]=hang")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: rt.chat_completion(ask(IMG), temperature=0, max_tokens=2,
                                                          client_request_id="holder"))
            await wait_until(lambda: rt.intake.limiter.borrowed_tokens == 1, what="the holder in its decode")
            # only the registry knows it is demo's: no demo actor holds it yet
            assert not rt.registry.require("demo").encoder.in_flight
            assert await expect_error(rt.chat_completion(colour_question("red"), model="demo-wide", max_tokens=2),
                                      ServiceUnavailable) == 503
        faults.configure(None)
        async with rt.chat(ask(IMG), temperature=0, max_tokens=40, min_tokens=40) as stream:
            await stream.__anext__()  # decoding
            assert await expect_error(rt.chat_completion(colour_question("red"), model="demo-wide", max_tokens=2),
                                      ServiceUnavailable) == 503
        del stream
        await settled(rt)
        assert (await rt.chat_completion(colour_question("red"), model="demo-wide", temperature=0,
                                         max_tokens=2)).text.strip() == "red"
        assert set(rt.registry.loaded) == {"demo-wide"}
        await settled(rt)
        assert_released(handles, 5)


async def test_an_intake_restarted_while_a_lookup_waits_leaves_nothing_in_the_cache_manager(
        demo_config, handles, monkeypatch):
    """Intake is declared hung (stall_timeout_s 0.5) while a request waits for its prefix lookup
    (the manager takes 0.8 s to answer it) and restarted: the cancelled wait releases the lookup
    itself, so the manager forgets the request — no lookup record, no pinned block — instead of
    keeping it until the manager's own next restart."""
    monkeypatch.setenv("MMSERVE_FAULT_HANG_S", "0.8")
    config = one_model(demo_config, supervisor={"stall_timeout_s": 0.5, "restart_backoff_s": 0.02})
    async with Runtime.open(config) as rt:
        faults.configure("prefix.lookup[waits]=hang")
        assert await expect_error(rt.chat_completion(ask(IMG), temperature=0, max_tokens=2, client_request_id="waits"),
                                  ServiceUnavailable) == 503
        faults.configure(None)
        manager = rt.registry.require("demo").prefix_cache
        await wait_until(lambda: rt.health().ok and not manager.looked_up, what="the lookup released")
        # the manager answered in time: it was not restarted (a restart forgets everything anyway)
        assert rt.supervisor.states["intake"].restarts == 1
        assert rt.supervisor.states["prefix_cache[demo]"].restarts == 0
        await settled(rt)
        assert_released(handles, 1)
        assert (await rt.chat_completion(ask(IMG), temperature=0, max_tokens=4)).text.strip() == "red"


# -- memory ------------------------------------------------------------------------------------------

NOISE_SIDE = 1160  # RGB noise does not compress: 1160 x 1160 x 3 bytes is a ~4 MB PNG


def noise_pngs(count: int, seed: int = 0):
    """`count` distinct ~4 MB PNGs of random noise, as data URLs. One image is encoded; each copy
    differs by a text chunk of its own (distinct bytes, so distinct strings the runtime could keep)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (NOISE_SIDE, NOISE_SIDE, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
    png = buf.getvalue()
    head, rest = png[:33], png[33:]  # the signature and IHDR, then the image data
    for i in range(count):
        data = b"Comment\0" + f"request {i}".encode()
        chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
        yield len(png), "data:image/png;base64," + base64.b64encode(head + chunk + rest).decode()


def resident_bytes() -> int:
    """This process's resident memory after a full collection. glibc keeps the pages of freed
    heap chunks mapped (in every thread's arena) for reuse, so RSS alone would count memory the
    allocator caches, not objects that live; malloc_trim(0) hands those pages back first, so what
    is measured is what the process still holds."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


# slow (~15 s): the weak-reference tests above prove the mechanism in the fast suite; this one bounds RSS
@pytest.mark.slow
async def test_memory_is_bounded_with_large_images(demo_config, handles):
    config = one_model(demo_config, encoder_cache={"enabled": False}, kv_cache={"prefix_caching": False})
    urls = noise_pngs(45)
    async with Runtime.open(config) as rt:

        async def one() -> None:
            size, url = next(urls)
            assert size > 3_900_000
            msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": Q_COLOR}]}]
            del url
            await rt.chat_completion(msgs, temperature=0, max_tokens=2)

        for _ in range(5):  # warm-up: every code path and pool touched once
            await one()
        await settled(rt)
        before = resident_bytes()
        for _ in range(40):
            await one()
        await settled(rt)
        grown = resident_bytes() - before
        # 40 requests carried ~220 MB of data URLs (~5.5 MB each): kept, they would be all of it
        assert grown < 60 * 2**20, f"RSS grew {grown / 2**20:.1f} MB over 40 requests"
        assert_released(handles, 45)

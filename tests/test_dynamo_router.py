"""NVIDIA Dynamo's real KV router (`python -m dynamo.select_service` of the `ai-dynamo-runtime`
wheel, in its own virtual environment: it pins pydantic <= 2.13.5) fed by two replicas' KV events
(`[kv_events] encoding = "dynamo"`): image A routes to the replica holding A, image B to the other,
the match is that replica's cached tokens within one block, an eviction lowers it, a reset clears
it, and a restarted selector catches up by replay until its `/dump` agrees with the arenas. The
standalone indexer (`python -m dynamo.indexer`) fed the same streams holds the same blocks and
scores a text prompt to the replica that served it.

The selector's and the indexer's HTTP listeners bind 0.0.0.0 and have no flag to bind elsewhere:
the test asks them on 127.0.0.1 only, and the replicas' ZMQ sockets are bound to 127.0.0.1. Its venv comes from
`make test` (`.venv-dynamo`), or `MMSERVE_DYNAMO_PYTHON` names its python."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio

from mmserve import Runtime
from mmserve.cache.kv_event_records import routing_id
from mmserve.models.demo import render_image
from tests.helpers import ask
from tests.test_kv_events import free_port

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("MMSERVE_DYNAMO_PYTHON") or str(ROOT / ".venv-dynamo" / "bin" / "python")
pytestmark = pytest.mark.skipif(not Path(PYTHON).exists(),
                                reason=f"no Dynamo venv at {PYTHON} (`make test` makes .venv-dynamo)")
KV_BUDGET = 40 << 10  # 5 blocks of the tiny model: a few other images evict one chat's blocks


class Selector:
    """`python -m dynamo.select_service` (or `dynamo.indexer`) on a free port; stopped by SIGTERM,
    then SIGKILL."""

    module = "dynamo.select_service"
    ready = "/health"  # answers {"status": "ok"}

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([PYTHON, "-m", self.module, "--port", str(self.port), "--threads", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        try:
            while True:
                try:
                    if self.get(self.ready) is not None:
                        return
                except (urllib.error.URLError, ConnectionError):
                    pass
                assert self.proc.poll() is None and time.time() < deadline, f"{self.module} did not start"
                time.sleep(0.05)
        except BaseException:  # never left running behind a failed start
            self.stop()
            raise

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict):
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Indexer(Selector):
    """`python -m dynamo.indexer`: the standalone KV indexer (scores, no selection)."""

    module = "dynamo.indexer"
    ready = "/workers"  # its /health answers an empty body

    def register(self, worker: int, config, block_size: int):
        ev = config.kv_events
        self.post("/register", {"instance_id": worker, "model_name": "tiny", "block_size": block_size,
                                "endpoint": ev.endpoint, "replay_endpoint": ev.replay_endpoint})


def replica_config(tiny_config):
    ep, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    return tiny_config.replace(kv_events={"enabled": True, "endpoint": ep, "replay_endpoint": replay,
                                          "encoding": "dynamo"}, kv_cache={"budget_bytes": KV_BUDGET})


def register(sel: Selector, worker: int, config, block_size: int):
    ev = config.kv_events
    out = sel.post("/workers", {"worker_id": worker, "model_name": "tiny", "block_size": block_size,
                                "endpoint": f"http://127.0.0.1:{worker}/",  # never called: selection only
                                "kv_events_endpoint": ev.endpoint, "replay_endpoint": ev.replay_endpoint})
    assert out["lifecycle"] == "schedulable", out


def chat(color: str, seed: int) -> dict:
    return {"model": "tiny", "messages": ask(render_image(color, "circle", seed=seed))}


def cached_tokens(rt: Runtime, keys: dict) -> int:
    """What the replica's arena holds of the prompt: its cached prefix, in tokens."""
    arena = rt.registry.loaded["tiny"].prefix_cache.arena
    held = {routing_id(arena.hash_of(b)) for b in range(arena.num_blocks) if arena.hash_of(b) is not None}
    n = 0
    for h in keys["block_hashes"]:
        if h not in held:
            break
        n += 1
    return n * keys["block_size"]


def dumped(sel: Selector) -> dict[int, set[int]]:
    """The selector's tree, per worker: the block ids its stored events name."""
    out: dict[int, set[int]] = {}
    for group in sel.get("/dump").values():
        for e in group["events"]:
            stored = e["event"]["data"].get("stored")
            if stored:
                out.setdefault(e["worker_id"], set()).update(b["block_hash"] for b in stored["blocks"])
    return out


def arena_ids(rt: Runtime) -> set[int]:
    """The arena's cached blocks as the selector dumps them (our int64 ids, read back as u64)."""
    arena = rt.registry.loaded["tiny"].prefix_cache.arena
    return {routing_id(arena.hash_of(b)) % (1 << 64) for b in range(arena.num_blocks) if arena.hash_of(b) is not None}


async def until(predicate, timeout_s: float = 5.0, what=lambda: None):
    deadline = trio.current_time() + timeout_s
    while not await trio.to_thread.run_sync(predicate):
        assert trio.current_time() < deadline, f"timed out: {what()}"
        await trio.sleep(0.05)


def test_dynamo_routes_images_to_the_replica_that_holds_them(tiny_config):
    configs = [replica_config(tiny_config), replica_config(tiny_config)]
    sel = Selector()
    try:
        idx = Indexer()
    except BaseException:
        sel.stop()
        raise

    async def select(keys):
        body = {"model_name": "tiny", "token_ids": keys["token_ids"], "block_mm_infos": keys["block_mm_infos"]}
        return await trio.to_thread.run_sync(sel.post, "/select", body)

    async def main():
        nonlocal sel
        async with Runtime.open(configs[0]) as r1, Runtime.open(configs[1]) as r2:
            bs = r1.config.kv_cache.block_size
            for worker, cfg in ((1, configs[0]), (2, configs[1])):
                await trio.to_thread.run_sync(register, sel, worker, cfg, bs)
                await trio.to_thread.run_sync(idx.register, worker, cfg, bs)
            await trio.sleep(0.5)  # the selector's SUB sockets joined
            a, b = chat("red", 0), chat("blue", 1)
            await r1.chat_completion(a["messages"], temperature=0, max_tokens=8)
            await r2.chat_completion(b["messages"], temperature=0, max_tokens=8)
            ka, kb = await r1.routing_keys(a), await r1.routing_keys(b)
            assert ka["token_ids"] == kb["token_ids"], "the same placeholders: only the images tell them apart"
            await until(lambda: dumped(sel).get(1) == arena_ids(r1) and dumped(sel).get(2) == arena_ids(r2),
                        what=lambda: (dumped(sel), arena_ids(r1), arena_ids(r2)))
            pa, pb = await select(ka), await select(kb)
            assert (pa["worker_id"], pb["worker_id"]) == (1, 2)
            assert abs(pa["overlap"]["longest_matched"] - cached_tokens(r1, ka)) < bs and cached_tokens(r1, ka) > 0
            assert abs(pb["overlap"]["longest_matched"] - cached_tokens(r2, kb)) < bs and cached_tokens(r2, kb) > 0
            before = pa["overlap"]["longest_matched"]

            # the standalone indexer, fed the same streams, holds the same blocks; asked for a text
            # prompt (its /query takes no images) it scores the replica that served it
            text = {"model": "tiny", "messages": [{"role": "user", "content": "count to ten, slowly " * 4}]}
            await r2.chat_completion(text["messages"], temperature=0, max_tokens=4)
            kt = await r2.routing_keys(text)
            await until(lambda: dumped(idx) == {1: arena_ids(r1), 2: arena_ids(r2)},
                        what=lambda: (dumped(idx), arena_ids(r1), arena_ids(r2)))
            scores = await trio.to_thread.run_sync(idx.post, "/query", {"model_name": "tiny", "token_ids": kt["token_ids"]})
            assert scores["scores"] and {int(w) for w in scores["scores"]} == {2}, scores

            # other images evict A's blocks on replica 1: its match drops with its arena
            for seed in (5, 6, 7):
                await r1.chat_completion(chat("green", seed)["messages"], temperature=0, max_tokens=8)
            assert cached_tokens(r1, ka) < before
            await until(lambda: dumped(sel).get(1) == arena_ids(r1))
            after = (await select(ka))["overlap"]["longest_matched"]
            assert after < before and abs(after - cached_tokens(r1, ka)) < bs

            # an admin reset of replica 2 clears what the selector knows of it
            await r2.reset_caches("tiny", ("prefix",))
            await until(lambda: not dumped(sel).get(2))
            assert (await select(kb))["overlap"]["longest_matched"] == 0

            # the selector restarts while replica 1 caches more: replay fills the gap
            await trio.to_thread.run_sync(sel.stop)
            await r1.chat_completion(chat("red", 0)["messages"], temperature=0, max_tokens=8)
            sel = await trio.to_thread.run_sync(Selector)
            for worker, cfg in ((1, configs[0]), (2, configs[1])):
                await trio.to_thread.run_sync(register, sel, worker, cfg, bs)
            await trio.sleep(0.5)
            # the next batch shows the new selector a gap from seq 0: it replays the whole history
            await r1.chat_completion(chat("blue", 9)["messages"], temperature=0, max_tokens=8)
            await r2.chat_completion(b["messages"], temperature=0, max_tokens=8)
            await until(lambda: dumped(sel).get(1) == arena_ids(r1) and dumped(sel).get(2) == arena_ids(r2))
            pa = await select(ka)
            assert pa["worker_id"] == 1 and abs(pa["overlap"]["longest_matched"] - cached_tokens(r1, ka)) < bs

    try:
        trio.run(main)
    finally:
        sel.stop()
        idx.stop()

"""Several replicas behind the real SMG (Shepherd Model Gateway, the `smg` wheel's Rust gateway):
`GET /v1/loads` agrees with `/metrics` and SMG reads it for both replicas, cache-aware routing keeps
each system prompt's conversations on one replica (its prefix cache hits from the group's second
request), a replica over SMG's KV-usage ceiling sheds its group, SMG's `--api-key` reaches keyed
replicas, a stream through SMG is the plain greedy answer with its usage, and (slow) a replica's
SIGTERM moves its conversations to the survivor, which continues them from the Redis tier.

Everything listens on 127.0.0.1 (replicas on port 0, SMG and its metrics listener on free loopback
ports); SMG is stopped by SIGTERM, then SIGKILL (it ignores SIGTERM while waiting for an
unreachable worker, and keeps its listener for a 5 s settle window after it)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve.bench.redis_server import free_port
from mmserve.config import Config
from mmserve.config.sections import ModelConfig
from mmserve.models.demo import render_image
from tests.conftest import _demo_dir, on_device
from tests.helpers import ServerThread, ask

SMG = Path(sys.executable).parent / "smg"
# long system prompts: SMG matches on message text only (images are ignored), so each group's
# text must be mostly its system prompt for the matched share to pass --cache-threshold
SYSTEM = {
    "A": "You are a careful assistant for a paint shop. Name the colour of the shape in the picture, "
         "one word, lower case, nothing else; never describe the background or the shape itself.",
    "B": "Du bist ein knapper Assistent in einer Werkstatt für Schilder. Nenne die Farbe der Form im "
         "Bild mit einem einzigen Wort, klein geschrieben, ohne Satzzeichen und ohne Erklärung.",
    "C": "Reply as a terse museum guide: state the colour of the figure shown, a single lower-case "
         "word, and never mention the figure's outline, its size or where it stands in the picture.",
    "L": "Load probe.",  # the /v1/loads test's own prompt, sent to one replica directly
}
ARENA_BLOCKS = 128
IMAGES = [("red", "circle"), ("green", "square"), ("blue", "triangle")]


def chat(group: str, image: int, **extra) -> dict:
    color, shape = IMAGES[image]
    return {"model": "demo", "temperature": 0, "max_tokens": 3,
            "messages": [{"role": "system", "content": SYSTEM[group]},
                         *ask(render_image(color, shape, seed=image))], **extra}


def scrape(url: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m: dict, name: str) -> float:
    return m.get((name, (("model_name", "demo"),)), 0.0)


def answered(url: str) -> int:
    m = scrape(url)
    return int(sum(v for (name, _), v in m.items() if name == "mmserve:request_success_total"))


class Gateway:
    """`smg launch` on 127.0.0.1 in front of `workers`, cache-aware, polling loads every second."""

    def __init__(self, workers: list[str], *extra: str, api_key: str | None = None):
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        extra = (*extra, "--api-key", api_key) if api_key else extra
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *workers,
             "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port",
             str(self.metrics_port), "--load-monitor-interval", "1", "--log-level", "warn", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def loads(self) -> dict[str, dict]:
        """SMG's own view: each worker's last load report, by worker URL."""
        body = httpx.get(self.url + "/get_loads", headers=self.headers, timeout=5).json()
        return {x["worker"]: x for x in body.get("loads", []) if x.get("worker")}

    def wait_for_loads(self, workers: list[str], timeout: float = 60) -> dict[str, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "smg exited: " + self.proc.stderr.read()[-2000:]
            try:
                loads = self.loads()
                if set(workers) <= set(loads):
                    return loads
            except (httpx.HTTPError, json.JSONDecodeError):
                pass  # not listening yet
            time.sleep(0.2)
        raise AssertionError(f"SMG never listed both replicas' loads: {self.loads()}")

    def stop(self, grace_s: float = 1.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`: SMG ignores SIGTERM while a worker is unreachable
        (after a replica's failover) and otherwise keeps its listener for a 5 s settle window, which
        no test needs (each gateway has ports of its own)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stderr.close()


def _block_bytes(config: Config) -> int:
    """Bytes of one KV block of the demo model (its arena is `budget_bytes` // this)."""
    with ServerThread(config) as probe:
        kv = probe.runtime.registry.require("demo").prefix_cache.stats()
    return config.kv_cache.budget_bytes // kv["num_blocks"]


@pytest.fixture(scope="module")
def replicas():
    # a small arena (128 blocks of 16 tokens): one long answer holds more than half of it
    config = on_device(Config(models=(ModelConfig("demo", _demo_dir("demo"), default=True),)))
    config = config.replace(kv_cache={"budget_bytes": ARENA_BLOCKS * _block_bytes(config)})
    with ServerThread(config) as a, ServerThread(config) as b:
        yield [a.url, b.url]


@pytest.fixture(scope="module")
def gateway(replicas):
    gw = Gateway(replicas, "--overload-token-usage-threshold", "0.5")
    try:
        gw.wait_for_loads(replicas)
        yield gw
    finally:
        gw.stop()


def test_loads_agree_with_metrics_with_integer_counts(replicas):
    """While answers are decoding, /v1/loads reports them running, with `token_usage` the
    `mmserve:kv_cache_usage_perc` gauge and the counts those of `/metrics` (compared on a report
    that did not change across the scrape: the demo model decodes a token in about a millisecond),
    and every count a JSON integer (SMG refuses a report whose counts are floats)."""
    url = replicas[0]

    def same(x, y):
        return {k: v for k, v in x.items() if k != "timestamp"} == {k: v for k, v in y.items() if k != "timestamp"}

    long = chat("L", 0, max_tokens=1200, min_tokens=1200, stream=True)
    checked = False
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json=long) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # decoding now
        for _ in range(50):
            before, m, report = c.get(url + "/v1/loads").json(), scrape(url), c.get(url + "/v1/loads").json()
            if not same(before, report) or not report["loads"][0]["num_running_reqs"]:
                continue
            [load] = report["loads"]
            assert load["model"] == "demo" and load["dp_rank"] == 0 and report["dp_rank_count"] == 1
            assert load["num_running_reqs"] == metric(m, "mmserve:num_requests_running") == 1
            assert load["num_waiting_reqs"] == metric(m, "mmserve:num_requests_waiting") == 0
            assert load["token_usage"] == metric(m, "mmserve:kv_cache_usage_perc") > 0
            assert load["num_used_tokens"] / load["max_total_num_tokens"] == load["token_usage"]
            for key in ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
                        "max_total_num_tokens", "max_running_requests", "num_waiting_uncached_tokens"):
                assert type(load[key]) is int, key
            assert report["aggregate"]["total_running_reqs"] == 1
            checked = True
            break
    assert checked, "no steady report while the answer decoded"
    deadline = time.monotonic() + 10  # the stream was closed early: its request ends as client_gone
    while (idle := httpx.get(url + "/v1/loads").json()["loads"][0])["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.02)
    m = scrape(url)
    assert idle["num_running_reqs"] == idle["num_waiting_reqs"] == 0
    assert idle["token_usage"] == metric(m, "mmserve:kv_cache_usage_perc") == 0.0
    assert idle["num_used_tokens"] == 0 and idle["max_total_num_tokens"] > 0


def test_smg_lists_both_replicas_loads(gateway, replicas):
    """SMG parsed both reports (a generic worker has no other load source: no entry without them)."""
    loads = gateway.loads()
    for url in replicas:
        direct = httpx.get(url + "/v1/loads").json()["loads"][0]
        assert loads[url]["max_total_num_tokens"] == direct["max_total_num_tokens"] > 0
        assert loads[url]["max_running_requests"] == direct["max_running_requests"]


def test_cache_aware_routing_splits_by_system_prompt(gateway, replicas):
    """12 chats, 2 system prompts × 3 images × 2: each prompt's 6 land on one replica, the two
    prompts on different ones, and every request after a group's first is a prefix-cache hit.
    SMG 1.13 breaks a least-load tie at random, so the groups' first requests overlap: B's starts
    while A's is decoding, and least-load sends it to the other replica."""
    served = {"A": [], "B": []}
    cached = {"A": [], "B": []}
    before = {u: answered(u) for u in replicas}
    with httpx.Client(timeout=60) as c:
        first_a = chat("A", 0, max_tokens=300, min_tokens=300, stream=True,
                       stream_options={"include_usage": True})
        with c.stream("POST", gateway.url + "/v1/chat/completions", json=first_a) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            r = c.post(gateway.url + "/v1/chat/completions", json=chat("B", 0))
            assert r.status_code == 200, r.text
            cached["B"].append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            usage = [json.loads(x[5:]) for x in lines if x.startswith("data:") and x != "data: [DONE]"][-1]["usage"]
            cached["A"].append(usage["prompt_tokens_details"]["cached_tokens"])
        after = {u: answered(u) for u in replicas}
        assert sorted(after[u] - before[u] for u in replicas) == [1, 1]  # one each
        for group, image in [("A", 1), ("B", 1), ("A", 2), ("B", 2), *((g, i) for i in range(3) for g in "AB")]:
            before = {u: answered(u) for u in replicas}
            r = c.post(gateway.url + "/v1/chat/completions", json=chat(group, image))
            assert r.status_code == 200, r.text
            cached[group].append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            [where] = [u for u in replicas if answered(u) - before[u] == 1]
            served[group].append(where)
    assert len(set(served["A"])) == 1 and len(set(served["B"])) == 1, served
    assert served["A"][0] != served["B"][0], served
    assert cached["A"][0] == 0 and cached["B"][0] == 0, cached
    assert all(n > 0 for n in cached["A"][1:] + cached["B"][1:]), cached


@pytest.mark.slow  # keeps make test under 10 minutes; run with -m slow
def test_a_replica_over_the_token_usage_ceiling_sheds_its_group(gateway, replicas):
    """SMG runs with --overload-token-usage-threshold 0.5: while one long answer holds more than half
    of its replica's arena (as that replica's /v1/loads says), the next request of its conversation
    group goes to the other replica, though that one holds none of its prefix. (Where the group goes
    after that is SMG's choice: both replicas now hold its prefix.)"""
    with httpx.Client(timeout=60) as c:
        def where(body) -> tuple[str, dict]:
            before = {u: answered(u) for u in replicas}
            r = c.post(gateway.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            [served] = [u for u in replicas if answered(u) - before[u] == 1]
            return served, r.json()["usage"]

        home, _ = where(chat("C", 0))
        again, usage = where(chat("C", 1))
        assert again == home and usage["prompt_tokens_details"]["cached_tokens"] > 0
        other = next(u for u in replicas if u != home)
        long = chat("C", 2, max_tokens=1800, min_tokens=1800, stream=True)  # 122 of the 128 blocks at its end
        with c.stream("POST", gateway.url + "/v1/chat/completions", json=long) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            deadline = time.monotonic() + 30
            while gateway.loads()[home]["token_usage"] <= 0.5:  # SMG's view, polled every second
                assert time.monotonic() < deadline, gateway.loads()
                time.sleep(0.1)
            assert httpx.get(home + "/v1/loads").json()["loads"][0]["token_usage"] > 0.5
            shed, _ = where(chat("C", 0))
            assert shed == other
        # (closed early: the long answer ends as client_gone)


def test_stream_through_smg_is_the_plain_greedy_answer(gateway, replicas):
    body = chat("A", 2, max_tokens=8)
    plain = httpx.post(replicas[1] + "/v1/chat/completions", json=body, timeout=60).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    with httpx.Client(timeout=60) as c, c.stream("POST", gateway.url + "/v1/chat/completions", json=streamed) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            text += [ch["delta"].get("content") or "" for ch in chunk["choices"]]
            usage = chunk.get("usage") or usage
    assert "".join(text) == plain["choices"][0]["message"]["content"]
    assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_nothing_listens_outside_loopback(gateway):
    """SMG's listeners (its API and its metrics listener) are all on 127.0.0.0/8."""
    assert _listening(gateway.proc.pid), "SMG listens nowhere?"
    for host, port in _listening(gateway.proc.pid):
        assert host.startswith("127."), (host, port)


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets process `pid` listens on (IPv4 and IPv6)."""
    import os
    import socket
    import struct

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = bytes.fromhex(addr)
            raw = b"".join(struct.pack("<I", *struct.unpack(">I", raw[i:i + 4])) for i in range(0, len(raw), 4))
            host = socket.inet_ntop(family, raw)
            if host.startswith("::ffff:"):
                host = host[7:]
            out.append((host if family == socket.AF_INET or host != "::1" else "127.0.0.1", int(port, 16)))
    return out


class ReplicaProcess:
    """`mmserve serve` as a real process on 127.0.0.1, port 0 (its URL read from `http.listening`)."""

    def __init__(self, config_path: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "mmserve.cli", "serve", "--config", str(config_path)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.url: str | None = None

    def wait_listening(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        for line in self.proc.stderr:  # one JSON event a line; the address is in the first http.listening
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "http.listening":
                self.url = event["urls"][0]
                # keep draining its log, so a full pipe never blocks the server
                threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
                return self.url
            assert time.monotonic() < deadline, "the replica never listened"
        raise AssertionError(f"the replica exited with {self.proc.wait()} before listening")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.mark.slow  # keeps make test under 10 minutes; run with -m slow
def test_smg_api_key_reaches_a_keyed_replica():
    """With `[auth] api_keys` on the replica, /v1/loads needs the key (it is under /v1/), and SMG's
    `--api-key` is what it sends: it reads the replica's load and its chats are answered."""
    config = on_device(Config(models=(ModelConfig("demo", _demo_dir("demo"), default=True),)))
    config = config.replace(auth={"api_keys": ("fleet-key",)})
    with ServerThread(config) as keyed:
        assert httpx.get(keyed.url + "/v1/loads").status_code == 401
        gw = Gateway([keyed.url], api_key="fleet-key")
        try:
            loads = gw.wait_for_loads([keyed.url])
            assert loads[keyed.url]["max_total_num_tokens"] > 0
            r = httpx.post(gw.url + "/v1/chat/completions", json=chat("A", 0), headers=gw.headers, timeout=60)
            assert r.status_code == 200, r.text
            assert httpx.post(gw.url + "/v1/chat/completions", json=chat("A", 0), timeout=60).status_code == 401
        finally:
            gw.stop()


@pytest.mark.slow  # two `mmserve serve` processes (torch imported in each): 8 s alone, ~20 s on busy cores
def test_failover_continues_from_the_shared_tier(tmp_path):
    """Two `mmserve serve` processes on one Redis tier behind SMG: a conversation group lives on one
    replica; after that replica's SIGTERM (it drains and exits 0), the first request of the group
    is answered by the survivor — which never saw the group — with its prefix found in the shared
    tier, and all 8 requests after the SIGTERM are answered."""
    from tests.redis_server import RedisServer

    redis = RedisServer(tmp_path / "redis").start()
    config = tmp_path / "replica.toml"
    config.write_text(f"""
[server]
host = "127.0.0.1"
port = 0
[shared_cache]
url = "{redis.url}"
secret = "{'s' * 32}"
lookup_deadline_ms = 3000.0
[[models]]
name = "demo"
path = "{_demo_dir('demo')}"
default = true
""")
    replicas = [ReplicaProcess(config), ReplicaProcess(config)]
    gw = None
    try:
        urls = [r.wait_listening() for r in replicas]
        gw = Gateway(urls)
        gw.wait_for_loads(urls)
        with httpx.Client(timeout=60) as c:
            def hits(url):
                return metric(scrape(url), "mmserve:shared_cache_block_hits_total")

            before = {u: answered(u) for u in urls}
            for image in range(2):
                r = c.post(gw.url + "/v1/chat/completions", json=chat("A", image))
                assert r.status_code == 200, r.text
            [home] = [u for u in urls if answered(u) - before[u] == 2]  # cache-aware: both on one replica
            survivor = next(u for u in urls if u != home)
            survivor_hits = hits(survivor)
            assert replicas[urls.index(home)].stop() == 0  # SIGTERM: drains (nothing in flight), exits 0
            codes, cached = [], []
            for image in [2, 0, 1, 2, 0, 1, 2, 0]:
                r = c.post(gw.url + "/v1/chat/completions", json=chat("A", image))
                codes.append(r.status_code)
                if r.status_code == 200:
                    cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert codes == [200] * 8, codes
            assert cached[0] > 0  # the survivor's first request of the group: its prefix came from Redis
            assert hits(survivor) > survivor_hits
    finally:
        if gw is not None:
            gw.stop()
        for r in replicas:
            r.stop()
        redis.kill()

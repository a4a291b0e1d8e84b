"""A slow or heavy client cannot starve the server (issue 45, items 3 and 4), on a real hypercorn
server and real sockets: a request body must arrive within `server.body_timeout_s` (else 408 and
the connection closed), bodies in flight are bounded in number and bytes (else 503 at once), a
request without a valid key is refused on its headers without waiting for its body, and large JSON
bodies are parsed off the event loop, so /health keeps answering throughout."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers import ServerThread
from tests.test_http_semantics import Reader, connect, raw_request

HEALTH_BOUND_S = 0.050  # the bound for /health under these loads
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def stalled(server, length: int = 1000, headers: dict | None = None, path: str = "/v1/chat/completions"):
    """A connection that sent a request's complete headers (announcing `length` bytes) and no body."""
    sock = connect(server)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n".encode()
                 + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode() + b"\r\n")
    return sock


POLLER = r"""
import json, select, socket, sys, time
host, port, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sock = socket.create_connection((host, port))
request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
latencies, statuses, buf = [], [], b""
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.perf_counter()
    sock.sendall(request)
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, buf = buf.split(b"\r\n\r\n", 1)
    length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0].split(b":")[1])
    while len(buf) < length:
        buf += sock.recv(65536)
    buf = buf[length:]
    latencies.append(time.perf_counter() - t0)
    statuses.append(int(head.split(b" ")[1]))
    time.sleep(pause)
print(json.dumps({"latencies": latencies, "statuses": statuses}), flush=True)
"""


class HealthPoller:
    """Polls /health on one kept-alive connection from another process (so that neither its own
    work nor the test's competes with the server for this process's GIL), recording each answer's
    latency as that client sees it."""

    def __init__(self, server, pause_s: float = 0.005):
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        self.proc = subprocess.Popen([sys.executable, "-c", POLLER, host, port, str(pause_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.latencies: list[float] = []
        self.statuses: list[int] = []

    def __enter__(self) -> "HealthPoller":
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate(input="stop\n", timeout=30)
        result = json.loads(out)
        self.latencies, self.statuses = result["latencies"], result["statuses"]

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]

    def summary(self) -> str:
        ordered = sorted(self.latencies)
        return (f"/health n={len(ordered)} p50={ordered[len(ordered) // 2] * 1e3:.1f} ms "
                f"p99={self.p99() * 1e3:.1f} ms max={ordered[-1] * 1e3:.1f} ms")


def assert_error(status, headers, body, want_status: int, want_code: str) -> dict:
    assert status == want_status, (status, body[:300])
    assert headers.get("content-type", "").startswith("application/json")
    err = json.loads(body)["error"]
    assert err["code"] == want_code and err["message"], err
    return err


@pytest.fixture(scope="module")
def server(tiny_config):
    with ServerThread(tiny_config.replace(server={"body_timeout_s": 1.0})) as s:
        yield s


# slow: its /health bound (50 ms, the issue's) holds on a quiet machine (p99 ~26 ms) but not beside
# the suite's other servers in one process; run with `pytest -m slow tests/test_slow_clients.py`
@pytest.mark.slow
def test_200_stalled_bodies_get_408_and_are_closed_by_the_deadline_while_health_answers(server, capsys):
    with HealthPoller(server) as health:
        time.sleep(0.1)
        t0 = time.monotonic()
        socks = [stalled(server) for _ in range(200)]
        opened = time.monotonic() - t0
        readers = [Reader(s) for s in socks]
        for r in readers:  # each answered 408 and closed by the deadline (1 s after its headers)
            r.sock.settimeout(1.0 + opened + 3.0)
            assert_error(*r.response(), 408, "request_timeout")
            assert r.closed_within(2.0)
        closed_after = time.monotonic() - t0
        time.sleep(0.1)
    for s in socks:
        s.close()
    with capsys.disabled():
        print(f"\n200 stalled bodies: opened in {opened:.2f} s, all 408 + closed {closed_after:.2f} s after the "
              f"first; {health.summary()}")
    assert closed_after < 1.0 + opened + 2.0
    assert set(health.statuses) == {200} and len(health.latencies) > 20
    assert max(health.latencies) < HEALTH_BOUND_S, health.summary()
    # the server is whole: a request after the flood is served
    sock = connect(server)
    sock.sendall(raw_request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                             body=json.dumps(CHAT).encode()))
    assert Reader(sock).response()[0] == 200
    sock.close()


def test_a_body_trickling_in_within_the_deadline_is_served(server):
    body = json.dumps(CHAT).encode()
    sock = stalled(server, length=len(body))
    for i in range(0, len(body), 10):  # ten bytes every 50 ms, done well inside the 1 s deadline
        time.sleep(0.05 if i else 0)
        sock.sendall(body[i:i + 10])
    status, _, payload = Reader(sock).response()
    assert status == 200, payload
    sock.close()


def test_a_request_without_a_key_is_refused_on_its_headers_without_waiting_for_its_body(tiny_config):
    config = tiny_config.replace(auth={"api_keys": ("k1",), "admin_key": "root"},
                                 server={"body_timeout_s": 30.0})
    with ServerThread(config) as server:
        for path, headers in [("/v1/chat/completions", {}),
                              ("/v1/chat/completions", {"Authorization": "Bearer nope"}),
                              ("/admin/cache/reset", {"Authorization": "Bearer k1"})]:
            t0 = time.monotonic()
            reader = Reader(stalled(server, headers=headers, path=path))
            assert_error(*reader.response(), 401, "invalid_api_key")
            assert time.monotonic() - t0 < 1.0  # at once, not at the 30 s body deadline
            assert reader.closed_within(1.0)  # its unread body is never waited for either
            reader.sock.close()
        # a good key's request is served as before
        sock = connect(server)
        sock.sendall(raw_request("POST", "/v1/chat/completions", body=json.dumps(CHAT).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer k1"}))
        assert Reader(sock).response()[0] == 200
        sock.close()


def test_bodies_in_flight_are_bounded_in_number_and_bytes(tiny_config):
    config = tiny_config.replace(server={"body_timeout_s": 1.0, "max_bodies_in_flight": 2,
                                         "max_body_bytes": 1000, "max_body_bytes_in_flight": 1500})
    with ServerThread(config) as server:
        first = stalled(server, length=800)
        time.sleep(0.05)
        over_bytes = Reader(stalled(server, length=800))  # 1600 of 1500 bytes
        err = assert_error(*over_bytes.response(), 503, "server_busy")
        assert "1500 bytes" in err["message"] and err["type"] == "service_unavailable"
        assert over_bytes.closed_within(1.0)
        second = stalled(server, length=100)
        time.sleep(0.05)
        status, headers, body = Reader(stalled(server, length=10)).response()  # a third body
        assert_error(status, headers, body, 503, "server_busy")
        assert headers["retry-after"] == "1" and headers["connection"] == "close"
        # requests without a body never count: /health answers while the budget is spent
        sock = connect(server)
        sock.sendall(raw_request("GET", "/health"))
        assert Reader(sock).response()[0] == 200
        # the stalled ones time out and give their places back
        for s in (first, second):
            assert_error(*Reader(s).response(), 408, "request_timeout")
            s.close()
        sock.sendall(raw_request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 body=json.dumps(CHAT).encode()))
        assert Reader(sock).response()[0] == 200
        sock.sendall(raw_request("GET", "/metrics"))
        metrics = Reader(sock).response()[2].decode()
        assert 'mmserve:request_rejected_total{reason="server_busy"} 2' in metrics
        assert 'mmserve:request_rejected_total{reason="request_timeout"} 2' in metrics
        sock.close()


def test_a_chunked_body_reserves_its_bytes_as_they_come(tiny_config):
    config = tiny_config.replace(server={"body_timeout_s": 5.0, "max_body_bytes": 1000,
                                         "max_body_bytes_in_flight": 1000})
    with ServerThread(config) as server:
        sock = connect(server)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"258\r\n" + b" " * 600 + b"\r\n")
        time.sleep(0.1)
        status, headers, body = Reader(stalled(server, length=500)).response()  # 600 + 500 > 1000
        assert_error(status, headers, body, 503, "server_busy")
        sock.close()


SENDER = r"""
import socket, sys
host, port, path, rounds = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
body = open(path, "rb").read()
head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
for _ in range(rounds):
    with socket.create_connection((host, port)) as s:
        s.sendall(head + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        print(reply.split(b"\r\n", 1)[0].decode(), flush=True)
"""


# slow: its /health bound (50 ms, the issue's) holds on a quiet machine (p99 ~26 ms) but not beside
# the suite's other servers in one process; run with `pytest -m slow tests/test_slow_clients.py`
@pytest.mark.slow
def test_two_30_mb_bodies_at_once_leave_health_under_50_ms(tiny_config, tmp_path, capsys):
    """Two clients (another process, so their own work takes nothing from the server's) post
    ~30 MB valid JSON chat bodies — an image data URL over max_image_bytes, so each is read,
    parsed and validated in full, then refused (413) without model work — while /health is polled."""
    config = tiny_config.replace(limits={"max_image_bytes": 20 * 1024 * 1024})
    url = "data:image/png;base64," + base64.b64encode(os.urandom(22_000_000)).decode()
    body = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what colour?"}, {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 2}).encode()
    assert 29_000_000 < len(body) < 32 * 1024 * 1024
    path = tmp_path / "body.json"
    path.write_bytes(body)
    with ServerThread(config) as server:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        with HealthPoller(server) as health:
            time.sleep(0.1)
            senders = [subprocess.Popen([sys.executable, "-c", SENDER, host, port, str(path), "2"],
                                        stdout=subprocess.PIPE, text=True) for _ in range(2)]
            replies = [p.communicate(timeout=120)[0].split() for p in senders]
            time.sleep(0.1)
    with capsys.disabled():
        print(f"\ntwo 30 MB senders, 2 bodies each: {health.summary()}")
    assert all(r.count("413") == 2 for r in replies), replies
    assert set(health.statuses) == {200} and len(health.latencies) > 50
    assert health.p99() < HEALTH_BOUND_S, health.summary()


def test_a_parsed_body_gives_its_place_back_while_its_request_runs_on(tiny_config):
    """max_bodies_in_flight = 1: a long stream in flight does not hold the one place, since its
    body was parsed long ago; a second request with a body is served meanwhile."""
    import httpx

    config = tiny_config.replace(server={"max_bodies_in_flight": 1})
    with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 2000,
                                                            "min_tokens": 2000}) as long:
            lines = long.iter_lines()
            next(lines)  # the stream is under way
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text

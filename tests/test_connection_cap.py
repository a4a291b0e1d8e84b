"""The HTTP server holds at most `[server] max_connections` connections open (issue 45, item 3):
silent connections beyond the cap wait in the listen backlog instead of taking descriptors, and
are served as slots free (a silent one is cut after `keep_alive_timeout_s`). Real hypercorn
handler, real sockets."""

from __future__ import annotations

import resource
import time

import pytest
from prometheus_client import generate_latest

from mmserve.api.connections import AUTO_MAX, RESERVED_FDS, connection_limit
from tests.helpers import ServerThread
from tests.test_http_semantics import Reader, connect, raw_request


def gauge(server, state: str) -> float:
    text = generate_latest(server.runtime.metrics.registry).decode()
    line = next(l for l in text.splitlines() if l.startswith(f'mmserve:http_connections{{state="{state}"}}'))
    return float(line.rsplit(" ", 1)[1])


def poll(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_silent_connections_beyond_the_cap_wait_in_the_backlog_and_are_served_as_slots_free(tiny_config):
    config = tiny_config.replace(server={"max_connections": 8, "keep_alive_timeout_s": 1.0})
    with ServerThread(config) as server:
        assert gauge(server, "limit") == 8
        silent = [connect(server) for _ in range(20)]  # the kernel completes all 20 handshakes
        poll(lambda: gauge(server, "open") == 8, "the server to take 8 of them")
        assert gauge(server, "open") == 8  # and only 8 (the /health below waits: it was not a ninth)
        t0 = time.monotonic()
        health = connect(server)
        health.sendall(raw_request("GET", "/health"))
        reader = Reader(health)
        reader.sock.settimeout(10.0)
        assert reader.response()[0] == 200  # served once the silent ones ahead of it were cut
        waited = time.monotonic() - t0
        assert 0.5 < waited < 8.0, waited  # it did wait: it was not accepted beside the 8
        for sock in silent:  # every silent connection is eventually accepted and cut by the timer
            sock.settimeout(10.0)
            assert sock.recv(1) == b""
            sock.close()
        health.close()
        poll(lambda: gauge(server, "open") == 0, "every slot given back")


def test_a_request_on_an_accepted_connection_is_unaffected_by_the_backlog(tiny_config):
    config = tiny_config.replace(server={"max_connections": 2, "keep_alive_timeout_s": 5.0})
    with ServerThread(config) as server:
        kept = connect(server)  # a client's kept-alive connection, accepted first
        kept.sendall(raw_request("GET", "/health"))
        assert Reader(kept).response()[0] == 200
        silent = [connect(server) for _ in range(5)]  # the second slot, then the backlog
        poll(lambda: gauge(server, "open") == 2, "the second slot taken")
        t0 = time.monotonic()
        kept.sendall(raw_request("GET", "/health"))  # the connection already held goes on at once
        assert Reader(kept).response()[0] == 200
        assert time.monotonic() - t0 < 1.0
        for sock in [kept, *silent]:
            sock.close()


def test_auto_leaves_descriptors_for_everything_else():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = AUTO_MAX if soft == resource.RLIM_INFINITY else max(16, min(AUTO_MAX, soft - RESERVED_FDS))
    assert connection_limit("auto") == want
    assert connection_limit(5) == 5


@pytest.mark.parametrize("bad", [0, -1, "many", 2.5, True])
def test_max_connections_is_checked(tiny_config, bad):
    with pytest.raises(ValueError, match="max_connections"):
        tiny_config.replace(server={"max_connections": bad})

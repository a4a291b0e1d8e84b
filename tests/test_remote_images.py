"""Remote image URLs against a real HTTP(S) server on 127.0.0.1: the fetch itself (resolution,
vetted connect, TLS by name, redirects, caps, cancellation), then end to end over HTTP with the demo model —
the right colour when allowed, a clean 4xx for every refusal, and the server serving on after."""

import json
import shutil
import socket
import ssl
import subprocess
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
import structlog
import trio
import trio.testing

from mmserve.errors import Forbidden, MMServeError, PayloadTooLarge, UnprocessableImage
from mmserve.models.demo import Q_COLOR, render_image
from mmserve.inputs import remote_images
from mmserve.config import LimitsConfig
from mmserve.inputs.remote_images import fetch_image, fetch_images
from tests.helpers import ServerThread, colour_question, data_url, wait_until_sync
from tests.image_server import ImageServer, png_bytes

CAP = 64 * 1024
TIMEOUT_S = 1.0
OPEN = {"remote_images": True, "remote_image_hosts": ("127.0.0.1",), "remote_image_allow_http": True,
        "remote_image_allow_private": True, "remote_image_max_bytes": CAP, "remote_image_timeout_s": TIMEOUT_S,
        "remote_image_max_redirects": 2}
log = structlog.get_logger("test")


@pytest.fixture(scope="module")
def images():
    with ImageServer() as s:
        yield s


def limits(**kw) -> LimitsConfig:
    """OPEN with `remote_image_<key>` overridden by `key=...`."""
    return LimitsConfig(**{**OPEN, **{f"remote_image_{k}": v for k, v in kw.items()}})


class FakeResolver(trio.abc.HostnameResolver):
    """Names of our choosing → addresses of our choosing (IP literals never reach it)."""

    def __init__(self, table: dict[str, list[str]]):
        self.table = table
        self.asked: list[str] = []

    async def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else host
        self.asked.append(name)
        if name not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port) if ":" not in a else (a, port, 0, 0)) for a in self.table[name]]

    async def getnameinfo(self, sockaddr, flags):
        raise NotImplementedError


def resolve(table: dict[str, list[str]]) -> FakeResolver:
    r = FakeResolver(table)
    trio.socket.set_custom_hostname_resolver(r)
    return r


# -- the fetch, in process ---------------------------------------------------------------------------


async def test_fetch_connects_to_the_vetted_address_and_keeps_the_host_name(images):
    resolver = resolve({"images.test": ["127.0.0.1"]})
    lim = limits(hosts=["images.test"])
    data = await fetch_image(f"http://images.test:{images.port}/red.png", lim, "w", log)
    assert data == png_bytes("red")
    assert resolver.asked == ["images.test"]  # resolved once, by us
    assert images.requests[-1] == ("/red.png", f"images.test:{images.port}")  # Host header = the name


async def test_a_host_with_any_forbidden_address_is_refused_before_connecting(images):
    resolve({"mixed.test": ["93.184.216.34", "127.0.0.1"], "inner.test": ["10.0.0.7"]})
    before = len(images.paths())
    for host in ("mixed.test", "inner.test"):
        with pytest.raises(Forbidden) as e:
            await fetch_image(f"http://{host}:{images.port}/red.png", limits(hosts=[host], allow_private=False),
                              "w", log)
        assert e.value.code == "image_address_not_allowed" and "allow_private" in e.value.message
        assert "127.0.0.1" not in e.value.message and "10.0.0.7" not in e.value.message  # not revealed
    assert len(images.paths()) == before


async def test_every_redirect_hop_is_resolved_and_vetted_again(images, monkeypatch):
    resolver = resolve({"a.test": ["127.0.0.1"], "b.test": ["127.0.0.2"], "c.test": ["127.0.0.1"]})
    real = remote_images.address_refusal
    monkeypatch.setattr(remote_images, "address_refusal",
                        lambda a, allow_private=False: "private" if a == "127.0.0.2" else real(a, allow_private))
    lim = limits(hosts=["a.test", "b.test", "c.test"])
    ok = f"http://c.test:{images.port}/red.png"
    assert await fetch_image(f"http://a.test:{images.port}/redirect?to={ok}", lim, "w", log) == png_bytes("red")
    assert resolver.asked == ["a.test", "c.test"] and images.requests[-1] == ("/red.png", f"c.test:{images.port}")
    resolver.asked.clear()
    target = f"http://b.test:{images.port}/red.png"
    with pytest.raises(Forbidden, match="private"):
        await fetch_image(f"http://a.test:{images.port}/redirect?to={target}", lim, "w", log)
    assert resolver.asked == ["a.test", "b.test"]
    assert images.paths()[-1] == "/redirect"


async def test_unresolvable_host_is_a_clean_400(images):
    resolve({})
    with pytest.raises(UnprocessableImage, match="could not be resolved") as e:
        await fetch_image(f"http://nowhere.test:{images.port}/red.png", limits(hosts=["nowhere.test"]), "w", log)
    assert e.value.code == "image_fetch_failed"


async def test_time_cap_covers_the_whole_fetch(images):
    t0 = time.monotonic()
    with pytest.raises(UnprocessableImage) as e:
        await fetch_image(images.url("/hold"), limits(timeout_s=0.3), "w", log)
    # a clock: the cap is the behaviour (a real socket on a real server: no MockClock); the upper
    # bound is 5x the cap
    assert e.value.code == "image_fetch_timeout" and 0.3 <= time.monotonic() - t0 < 1.5


async def test_cancelling_a_fetch_closes_its_connection(images):
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetch_image, images.url("/hold?id=cancel"), limits(timeout_s=30), "w", log)
        assert await trio.to_thread.run_sync(images.wait, lambda: "cancel" in images.holds), "never held"
        nursery.cancel_scope.cancel()  # while the server holds the request
    cancelled_at = time.monotonic()
    assert await trio.to_thread.run_sync(images.wait, lambda: images.holds["cancel"] is not None), "still open"
    # a clock: closed promptly by the cancel (~20 ms, the server's poll), not at the fetch's 30 s cap
    assert images.holds["cancel"] - cancelled_at < 0.5


async def test_downloads_share_one_global_limit(images):
    limiter = trio.CapacityLimiter(1)
    urls = {1: (images.url("/hold?id=limit-a"), "a"), 2: (images.url("/hold?id=limit-b"), "b")}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetch_images, urls, limits(timeout_s=5), log, limiter)
        held = lambda: "limit-a" in images.holds or "limit-b" in images.holds  # noqa: E731
        assert await trio.to_thread.run_sync(images.wait, held), "no download reached the server"
        await trio.testing.wait_all_tasks_blocked()  # the other download has gone as far as it can
        stats = limiter.statistics()
        assert (stats.borrowed_tokens, stats.tasks_waiting) == (1, 1)
        nursery.cancel_scope.cancel()


async def test_size_cap_with_and_without_content_length(images):
    for path in (f"/big?n={CAP + 1}", f"/big-stream?n={20 * CAP}"):
        with pytest.raises(PayloadTooLarge):
            await fetch_image(images.url(path), limits(), "w", log)
    assert len(await fetch_image(images.url(f"/big?n={CAP}"), limits(), "w", log)) == CAP


def make_tls(tmp: Path, names: list[str]) -> tuple[str, tuple[str, str]]:
    """A throw-away CA and a server certificate for `names` (openssl CLI): (CA file, (cert, key))."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=mmserve test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    run("req", *ec, "-keyout", "srv.key", "-out", "srv.csr", "-subj", f"/CN={names[0]}")
    (tmp / "ext").write_text("subjectAltName=" + ",".join(f"DNS:{n}" for n in names) + "\n")
    run("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "srv.pem",
        "-days", "1", "-extfile", "ext")
    return str(tmp / "ca.pem"), (str(tmp / "srv.pem"), str(tmp / "srv.key"))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_https_verifies_the_host_name_while_connecting_to_the_vetted_address(tmp_path, monkeypatch):
    ca, tls = make_tls(tmp_path, ["images.test"])
    ctx = ssl.create_default_context(cafile=ca)
    monkeypatch.setattr(remote_images, "_ssl_context", lambda: ctx)
    resolve({"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    lim = limits(hosts=["images.test", "other.test"], allow_http=False)
    with ImageServer(tls=tls) as secure:
        data = await fetch_image(secure.url("/blue.png", host="images.test"), lim, "w", log)
        assert data == png_bytes("blue") and secure.requests[-1] == ("/blue.png", f"images.test:{secure.port}")
        # same address, a name the certificate does not cover: refused by certificate verification
        with pytest.raises(UnprocessableImage, match="TLS handshake failed"):
            await fetch_image(secure.url("/blue.png", host="other.test"), lim, "w", log)
        # https only: a redirect down to plain http is refused
        down = f"http://images.test:{secure.port}/blue.png"
        with pytest.raises(MMServeError, match="plain http"):
            await fetch_image(secure.url(f"/redirect?to={down}", host="images.test"), lim, "w", log)


# -- end to end over HTTP, with the demo model -------------------------------------------------------


@pytest.fixture(scope="module")
def server(demo_config):
    with ServerThread(demo_config.replace(limits=OPEN)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def url_question(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": Q_COLOR}]}]


def answer(client, messages) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 4})


def assert_colour(client, messages, colour: str) -> None:
    r = answer(client, messages)
    assert r.status_code == 200, r.text
    assert colour in r.json()["choices"][0]["message"]["content"]


def assert_error(resp, status, code):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["param"]
    return err


@pytest.mark.parametrize("colour", ["red", "blue", "purple"])
def test_remote_image_gets_the_right_colour(client, images, colour):
    assert_colour(client, url_question(images.url(f"/{colour}.png")), colour)


def test_redirect_within_the_allow_list_is_followed(client, images):
    assert_colour(client, url_question(images.url(f"/redirect?to={images.url('/green.png')}")), "green")


def test_remote_and_inline_images_share_one_cache_key(server, client, images):
    stats = lambda: server.run_sync(lambda: server.runtime.stats()["demo"]["encoder"])  # noqa: E731
    assert_colour(client, url_question(images.url("/orange.png")), "orange")
    before = stats()
    # the same pixels inline, as lossless WebP (other bytes): an encoder-cache hit, nothing encoded
    inline = data_url(render_image("orange", "circle", seed=0), "WEBP", lossless=True)
    assert_colour(client, url_question(inline), "orange")
    after = stats()
    assert after["items_encoded"] == before["items_encoded"] and after["hits"] == before["hits"] + 1


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("case, status, code, says", [
    ("not_allow_listed", 403, "image_host_not_allowed", "'localhost'"),
    ("redirect_to_foreign_host", 403, "image_host_not_allowed", "redirected to host 'localhost'"),
    ("redirect_loop", 400, "image_fetch_failed", "more than 2 redirects"),
    ("missing", 400, "image_fetch_failed", "HTTP 404 from '127.0.0.1'"),
    ("not_an_image", 400, "invalid_image", "not a decodable image"),
    ("too_large_by_length", 413, "payload_too_large", f"{CAP} byte limit"),
    ("too_large_streamed", 413, "payload_too_large", f"{CAP} byte limit"),
    ("slow", 400, "image_fetch_timeout", f"within {TIMEOUT_S:g}s"),
    ("unreachable", 400, "image_fetch_failed", "could not connect"),
    ("ftp", 400, "invalid_request_error", "http(s) URL"),
])
def test_refusals_are_clean_and_the_server_serves_on(client, images, case, status, code, says):
    url = {
        "not_allow_listed": images.url("/red.png", host="localhost"),
        "redirect_to_foreign_host": images.url(f"/redirect?to={images.url('/red.png', host='localhost')}"),
        "redirect_loop": images.url("/loop"),
        "missing": images.url("/missing"),
        "not_an_image": images.url("/text"),
        "too_large_by_length": images.url(f"/big?n={CAP + 1}"),
        "too_large_streamed": images.url(f"/big-stream?n={20 * CAP}"),
        "slow": images.url("/hold"),
        "unreachable": f"http://127.0.0.1:{_dead_port()}/red.png",
        "ftp": "ftp://127.0.0.1/red.png",
    }[case]
    t0 = time.monotonic()
    resp = answer(client, url_question(url))
    if code == "invalid_request_error":  # a plain 400 has no code; its type says it
        assert resp.status_code == status and resp.json()["error"]["type"] == code, resp.text
    else:
        assert_error(resp, status, code)
    assert says in resp.json()["error"]["message"]
    # a clock: no refusal takes longer than the fetch's own cap ("slow" takes it whole; 3x margin)
    assert time.monotonic() - t0 < TIMEOUT_S + 2
    assert_colour(client, url_question(images.url("/yellow.png")), "yellow")


def test_client_disconnect_cancels_the_fetch(server, images):
    body = json.dumps({"messages": url_question(images.url("/hold?id=disconnect")), "temperature": 0,
                       "max_tokens": 4}).encode()
    url = urllib.parse.urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=5) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % (url.netloc.encode(), len(body)) + body)
        assert images.wait(lambda: "disconnect" in images.holds), "the fetch never reached the image server"
    gone = time.monotonic()  # the client hung up while its image was being fetched
    assert images.wait(lambda: images.holds["disconnect"] is not None), "the fetch's connection stayed open"
    # a clock: closed by the disconnect (within the abort poll), well before the fetch's own 1 s cap
    assert images.holds["disconnect"] - gone < 0.5
    wait_until_sync(lambda: server.run_sync(lambda: len(server.runtime.intake.in_flight)) == 0, timeout=2,
                    what="intake let go of the request")
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert_colour(c, url_question(images.url("/red.png")), "red")


def test_disabled_by_default(demo_server, images):
    before = len(images.paths())
    with httpx.Client(base_url=demo_server.url, timeout=30) as c:
        err = assert_error(answer(c, url_question(images.url("/red.png"))), 400, "remote_images_disabled")
        assert "remote_images = true" in err["message"] and "[limits]" in err["message"]
        assert_colour(c, colour_question("red"), "red")
    assert len(images.paths()) == before  # nothing was fetched


def test_loopback_refused_unless_allow_private(demo_config, images):
    cfg = demo_config.replace(limits=dict(OPEN, remote_image_allow_private=False))
    before = len(images.paths())
    with ServerThread(cfg) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        err = assert_error(answer(c, url_question(images.url("/red.png"))), 403, "image_address_not_allowed")
        assert "loopback" in err["message"] and "remote_image_allow_private" in err["message"]
        assert_colour(c, colour_question("blue"), "blue")
    assert len(images.paths()) == before  # refused before connecting


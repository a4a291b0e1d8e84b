"""A real HTTP server on 127.0.0.1 (stdlib, in a thread) serving images and misbehaving on purpose,
for the remote-image-URL tests.

Routes: `/<colour>.png` (a demo image), `/redirect?to=URL` (302), `/loop` (redirects to itself),
`/missing` (404), `/text` (200, not an image), `/big?n=N` (N bytes with a Content-Length),
`/big-stream?n=N` (N bytes, no Content-Length, body ends at close), `/hold[?id=NAME]` (accepts,
answers nothing, and records when the peer closes the connection; with an id, in `holds[NAME]`).
Tests wait on what the server saw with `wait(predicate)`, never on a clock.
"""

from __future__ import annotations

import functools
import io
import select
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from mmserve.models.demo import COLORS, render_image


def png_bytes(color: str, shape: str = "circle", seed: int = 0) -> bytes:
    buf = io.BytesIO()
    render_image(color, shape, seed=seed).save(buf, "PNG")
    return buf.getvalue()


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        self.server.owner._seen(parts.path, self.headers.get("Host"))
        name = parts.path.strip("/")
        if name.endswith(".png") and name[:-4] in COLORS:
            self._send(200, png_bytes(name[:-4]), "image/png")
        elif name == "redirect":
            self._send(302, b"", headers={"Location": query["to"]})
        elif name == "loop":
            self._send(302, b"", headers={"Location": "/loop"})
        elif name == "clip.mp4":  # a 2 s video (tests/test_video_runtime.py)
            self._send(200, _clip(), "video/mp4")
        elif name == "text":
            self._send(200, b"hello, this is not an image", "text/plain")
        elif name == "big":
            self._send(200, b"\0" * int(query["n"]), "image/png")
        elif name == "big-stream":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                left = int(query["n"])
                while left > 0:
                    self.wfile.write(b"\0" * min(left, 16384))
                    left -= 16384
            except OSError:
                pass  # the client hung up at its cap: expected
        elif name == "hold":
            self._hold(query.get("id"))
        else:
            self._send(404, b"not found", "text/plain")

    def _send(self, status: int, body: bytes, ctype: str | None = None, headers: dict | None = None) -> None:
        self.send_response(status)
        if ctype:
            self.send_header("Content-Type", ctype)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def _hold(self, tag: str | None) -> None:
        """Answers nothing; returns when the peer closes (recorded) or after 20 s (a server that
        hangs, on purpose: the select below only watches for the close)."""
        owner = self.server.owner
        with owner.changed:
            if tag is not None:
                owner.holds[tag] = None
            owner.changed.notify_all()
        deadline = time.monotonic() + 20
        sock = self.connection
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0.02)
            if readable:
                try:
                    if sock.recv(1024) == b"":
                        break
                except OSError:
                    break
        with owner.changed:
            owner.hold_closed.append(time.monotonic())
            if tag is not None:
                owner.holds[tag] = owner.hold_closed[-1]
            owner.changed.notify_all()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: "ImageServer"

    def handle_error(self, request, client_address) -> None:  # refused TLS handshakes: expected, quiet
        pass


class ImageServer:
    """`with ImageServer() as s: s.url("/red.png")` — serves until the block ends."""

    def __init__(self, tls: tuple[str, str] | None = None):
        """`tls`: (certificate chain file, key file) to serve https instead of http."""
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # notified at each request and each /hold event
        self.scheme = "https" if tls else "http"
        self.requests: list[tuple[str, str | None]] = []  # (path, Host header)
        self.hold_closed: list[float] = []  # when each /hold connection was closed by its peer
        self.holds: dict[str, float | None] = {}  # /hold?id=NAME: None while held, then when closed
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def _seen(self, path: str, host: str | None) -> None:
        with self.changed:
            self.requests.append((path, host))
            self.changed.notify_all()

    def wait(self, predicate, timeout: float = 5.0) -> bool:
        """Waits until `predicate()` (called under the lock) holds; False after `timeout` s."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout)

    def paths(self) -> list[str]:
        with self.lock:
            return [p for p, _ in self.requests]

    def __enter__(self) -> "ImageServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


@functools.cache
def _clip() -> bytes:
    """The 2 s clip, encoded once: every fetch gets the very same bytes (tests compare sizes)."""
    from mmserve.models.demo.render_video import encode_mp4, render_clip
    return encode_mp4(render_clip("red", "circle", True, frames=16), fps=8)

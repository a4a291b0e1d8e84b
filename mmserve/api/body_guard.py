"""Request bodies under a deadline and a budget: an ASGI wrapper in front of the app.

Hypercorn bounds a request's headers (`h11_max_incomplete_size`, the idle timer) but not its body:
a client that sends complete headers with a `Content-Length` and then nothing holds its connection
(and a task) for ever, and its `read_timeout` cannot help, since it also cuts a client that sends
nothing while it reads a long streamed answer. So each request that announces a body
(`Content-Length` > 0 or chunked) passes this guard:

- it takes a place among `max_bodies` bodies in flight and reserves its declared bytes (at most
  `max_body_bytes`, what the app keeps of it; a chunked body reserves as its chunks come) from
  `max_bytes`; when either is spent it is refused at once with a 503 + Retry-After, its body
  unread, and the connection closed (a flood of stalled bodies then costs sockets only briefly);
- its whole body must arrive within `timeout_s` of its headers, or the app is cancelled, the
  client gets a 408 and the connection is closed (hypercorn closes a connection whose request
  body is incomplete when the response ends);
- the place and the bytes are given back when the app has parsed the body (`release_body`,
  called by the app) or when the request ends, whichever is first: a long generation does not
  hold the bytes of a body parsed long ago.

A request without a body (GET /health, a probe) passes straight through: nothing here can make
/health wait.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import trio

from mmserve.errors import MMServeError, RequestTimeout, ServiceUnavailable

# the key of a request's ticket in its ASGI scope (read back by `release_body`)
TICKET_KEY = "mmserve.body_ticket"


class BodyBudget:
    """How many bodies, and how many of their bytes, are in flight; tickets are taken and given
    back here only (one trio thread, so plain counters)."""

    def __init__(self, max_bodies: int, max_bytes: int):
        self.max_bodies, self.max_bytes = max_bodies, max_bytes
        self.bodies = 0
        self.bytes = 0

    def take(self, nbytes: int) -> "BodyTicket | None":
        if self.bodies >= self.max_bodies or self.bytes + nbytes > self.max_bytes:
            return None
        self.bodies += 1
        self.bytes += nbytes
        return BodyTicket(self, nbytes)


class BodyTicket:
    """One request's place and reserved bytes; `release` is idempotent."""

    def __init__(self, budget: BodyBudget, nbytes: int):
        self.budget, self.nbytes, self.released = budget, nbytes, False

    def grow(self, more: int) -> bool:
        """Reserves `more` bytes (a chunked body's next chunk); False when the budget is spent."""
        if self.released:
            return True
        if self.budget.bytes + more > self.budget.max_bytes:
            return False
        self.budget.bytes += more
        self.nbytes += more
        return True

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget.bodies -= 1
            self.budget.bytes -= self.nbytes


def release_body(scope: dict) -> None:
    """The app has its body parsed: its place and bytes go back to the budget now."""
    ticket = scope.get(TICKET_KEY)
    if ticket is not None:
        ticket.release()


def declared_body(headers) -> tuple[int | None, bool]:
    """(Content-Length, chunked) from ASGI headers; a malformed length is left to the server's
    own parser (h11 refuses it before the app is called)."""
    length, chunked = None, False
    for name, value in headers:
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                pass
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
    return length, chunked


class BodyGuard:
    """The ASGI wrapper (see the module's docstring). `on_refuse(err)` is told of each request
    the guard itself answers (for the rejection log and counter)."""

    def __init__(self, app, *, timeout_s: float, max_bodies: int, max_bytes: int, max_body_bytes: int,
                 on_refuse: Callable[[MMServeError], None] = lambda err: None):
        self.app = app
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.budget = BodyBudget(max_bodies, max_bytes)
        self.on_refuse = on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length, chunked = declared_body(scope["headers"])
        if not chunked and not length:
            return await self.app(scope, receive, send)
        ticket = self.budget.take(0 if chunked else min(length, self.max_body_bytes))
        if ticket is None:
            return await self._refuse(send, ServiceUnavailable(
                f"this server is receiving as many request bodies as it accepts at once "
                f"({self.budget.max_bodies} bodies, {self.budget.max_bytes} bytes); retry shortly",
                retry_after_s=1.0, code="server_busy"))
        try:
            await self._guarded(dict(scope, **{TICKET_KEY: ticket}), receive, send, ticket, chunked)
        finally:
            ticket.release()

    async def _guarded(self, scope, receive, send, ticket: BodyTicket, chunked: bool) -> None:
        body_done = trio.Event()
        started = False
        failure: MMServeError | None = None
        kept = 0  # a chunked body's bytes reserved so far (the app keeps at most max_body_bytes)

        async with trio.open_nursery() as nursery:
            def fail(err: MMServeError) -> None:
                nonlocal failure
                if not started:  # a response under way is left to end (hypercorn then closes)
                    failure = err
                    nursery.cancel_scope.cancel()

            async def guarded_receive():
                nonlocal kept
                message = await receive()
                if message["type"] == "http.request":
                    more = min(len(message.get("body", b"")), max(0, self.max_body_bytes - kept))
                    if chunked and more:
                        if not ticket.grow(more):
                            fail(ServiceUnavailable(
                                f"this server is receiving as many request body bytes as it accepts at once "
                                f"({self.budget.max_bytes}); retry shortly", retry_after_s=1.0, code="server_busy"))
                            await trio.lowlevel.checkpoint()  # the cancellation lands here
                        kept += more
                    if not message.get("more_body", False):
                        body_done.set()
                else:  # http.disconnect: nothing more will come
                    body_done.set()
                return message

            async def guarded_send(message):
                nonlocal started
                if message["type"] == "http.response.start":
                    started = True
                await send(message)

            async def deadline() -> None:
                with trio.move_on_after(self.timeout_s):
                    await body_done.wait()
                    return
                fail(RequestTimeout(f"the request body did not arrive within {self.timeout_s:g} s"))

            nursery.start_soon(deadline)
            await self.app(scope, guarded_receive, guarded_send)
            nursery.cancel_scope.cancel()
        if failure is not None:
            await self._refuse(send, failure)

    async def _refuse(self, send, err: MMServeError) -> None:
        self.on_refuse(err)
        payload = json.dumps(err.to_body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]  # the rest of the body may still come: never reuse it
        retry = getattr(err, "retry_after_s", None)
        if retry is not None:
            headers.append((b"retry-after", str(max(1, round(retry))).encode()))
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

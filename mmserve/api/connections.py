"""A bound on the connections the HTTP server holds open at once (`[server] max_connections`).

Hypercorn accepts every connection the kernel hands it: a client that opens connections and
sends nothing holds a file descriptor each until the keep-alive timer cuts it (75 s by default),
so about a thousand of them exhaust a 1,024-descriptor limit and `/health` stops answering. Its
configuration has no setting for this, so the server runs hypercorn's own per-connection handler
(`TCPServer`, HTTP/1.1 and HTTP/2) behind its own accept loop (`serve_capped`): with `limit`
connections open, the loop stops accepting; later connections wait in the kernel's listen
backlog — holding no descriptor of the server's — and are accepted as slots free (an idle one
within `keep_alive_timeout_s`, a stalled body within `body_timeout_s`). Stopping the accept rather
than closing the newcomer is nginx's `worker_connections` behaviour: a burst of honest clients
waits instead of failing.

`"auto"` (the default) leaves `RESERVED_FDS` of the process's descriptor limit for everything
else the server opens (model files, Redis, the compute threads' pipes).
"""

from __future__ import annotations

import errno
import resource
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app
from prometheus_client.core import GaugeMetricFamily

from mmserve.logs import get_logger

RESERVED_FDS = 256
"""Descriptors an `"auto"` cap leaves to everything but client connections."""
LOG_EVERY_S = 10.0
"""At most one `http.connections_full` line in this long."""
AUTO_MAX = 16384
"""The `"auto"` cap where the descriptor limit is unlimited or very large."""


_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


def connection_limit(setting: int | str) -> int:
    """`[server] max_connections` as a number: itself, or for `"auto"` the process's soft
    descriptor limit less `RESERVED_FDS` (at least 16, at most `AUTO_MAX`)."""
    if setting != "auto":
        return int(setting)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return AUTO_MAX
    return max(16, min(AUTO_MAX, soft - RESERVED_FDS))


class ConnectionCap:
    """At most `limit` connections open: `accept` waits for a slot before it takes a connection
    from the listener, and the slot is given back when the connection's handler returns."""

    def __init__(self, limit: int):
        self.limit = limit
        self.slots = trio.Semaphore(limit)
        self.open = 0  # connections accepted and not yet closed (a slot waiting in accept is not one)
        self.saturated = 0  # accepts that found every slot taken
        self._logged_at = -LOG_EVERY_S
        self._log = get_logger("http")

    async def accept(self, listener: trio.SocketListener) -> trio.SocketStream:
        if self.slots.value == 0:
            self.saturated += 1
            now = trio.current_time()
            if now - self._logged_at >= LOG_EVERY_S:  # one line per episode, not one per connection
                self._logged_at = now
                self._log.warning("http.connections_full", limit=self.limit, times=self.saturated,
                                  hint="[server] max_connections; idle connections close after "
                                       "keep_alive_timeout_s")
        await self.slots.acquire()
        try:
            stream = await listener.accept()
        except BaseException:
            self.slots.release()
            raise
        self.open += 1
        return stream

    async def handle(self, handler, stream: trio.SocketStream) -> None:
        try:
            await handler(stream)
        finally:
            self.open -= 1
            self.slots.release()

    def collect(self):
        """Prometheus collector: the connections open and the limit."""
        gauge = GaugeMetricFamily("mmserve:http_connections", "HTTP connections open, and the limit "
                                  "([server] max_connections); at the limit, new ones wait in the listen "
                                  "backlog.", labels=["state"])
        gauge.add_metric(["open"], self.open)
        gauge.add_metric(["limit"], self.limit)
        yield gauge


async def serve_capped(app, hc: HypercornConfig, sockets, cap: ConnectionCap, *,
                       shutdown_trigger=None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """hypercorn's trio worker (`hypercorn.trio.run.worker_serve`: lifespan, graceful shutdown) over
    plain-TCP `sockets` already bound, with `cap`'s accept loop in place of `trio.serve_listeners`."""
    app = wrap_app(app, hc.wsgi_max_body_size, "asgi")
    lifespan_state: dict = {}
    lifespan = Lifespan(app, hc, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            listeners, binds = [], []
            for sock in sockets:
                sock.listen(hc.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            handler = partial(TCPServer, app, hc, context, ConnectionState(lifespan_state.copy()))
            task_status.started(binds)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    if shutdown_trigger is not None:
                        nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    for listener in listeners:
                        nursery.start_soon(_accept_loop, listener, cap, handler, connections)
            except BaseExceptionGroup as error:
                _, others = error.split((ShutdownError, KeyboardInterrupt))
                if others is not None:
                    raise others
            finally:
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + hc.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _accept_loop(listener: trio.SocketListener, cap: ConnectionCap, handler, connections) -> None:
    async with listener:
        while True:
            try:
                stream = await cap.accept(listener)
            except OSError as e:
                if e.errno not in _OUT_OF_RESOURCES:
                    raise
                # out of descriptors or memory despite the cap: wait, as trio.serve_listeners does
                get_logger("http").error("http.accept_failed", error=str(e))
                await trio.sleep(0.1)
                continue
            connections.start_soon(cap.handle, handler, stream)

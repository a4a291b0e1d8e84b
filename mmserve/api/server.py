"""Serving the HTTP API on hypercorn's trio worker."""

from __future__ import annotations

import trio
from hypercorn.config import Config as HypercornConfig

from mmserve.api.app import create_app
from mmserve.api.connections import ConnectionCap, connection_limit, serve_capped
from mmserve.api.listening import bind
from mmserve.logs import get_logger
from mmserve.config import Config
from mmserve.runtime.runtime import Runtime


async def serve(config: Config, *, shutdown: trio.Event | None = None, on_runtime=None,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Opens a Runtime and serves it over HTTP until `shutdown` is set (or cancelled).

    Setting `shutdown` drains first: the socket stays open while requests in flight finish (up
    to `[server] shutdown_grace_s`), new ones get a 503 with Retry-After and /health says
    "draining"; then the server closes. `task_status.started` receives the bound URLs (e.g.
    `http://127.0.0.1:54321`), so a caller binding port 0 learns the real port. `on_runtime(rt)`
    is called with the running Runtime before the socket opens (for embedding programs and tests
    that inspect it).

    The address is bound first: one that cannot be had (in use, not this machine's) raises
    CannotListen before any model loads.
    """
    log = get_logger("http")
    hc = HypercornConfig()
    hc.bind = [f"{config.server.host}:{config.server.port}"]
    hc.accesslog = None
    hc.errorlog = None
    hc.keep_alive_timeout = config.server.keep_alive_timeout_s
    hc.graceful_timeout = 5.0  # after the drain only idle keep-alive connections are left
    sockets = bind(hc, config.server.host, config.server.port)  # CannotListen before any model loads
    try:
        async with Runtime.open(config) as rt:
            if on_runtime is not None:
                on_runtime(rt)
            app = _close_safely(create_app(rt))
            cap = ConnectionCap(connection_limit(config.server.max_connections))
            rt.metrics.registry.register(cap)
            closed = trio.Event()

            async def drain_then_close() -> None:
                await shutdown.wait()
                await rt.drain()
                closed.set()

            async with trio.open_nursery() as nursery:
                if shutdown is not None:
                    nursery.start_soon(drain_then_close)
                binds = await nursery.start(lambda task_status: serve_capped(
                    app, hc, sockets, cap, shutdown_trigger=closed.wait if shutdown is not None else None,
                    task_status=task_status))
                log.info("http.listening", urls=binds, models=rt.registry.names(), max_connections=cap.limit)
                task_status.started(binds)
    finally:
        for sock in sockets:
            sock.close()


def _close_safely(app):
    """`app` with its last `http.response.body` send shielded from cancellation.

    Hypercorn's h11 protocol finishes a connection that must close (`Connection: close`, HTTP/1.0,
    `keep_alive_max_requests` reached) from inside that send: it tells the app `http.disconnect`,
    then shuts the socket down. quart-trio's message task sees the disconnect and cancels the
    nursery the send runs in, and that cancellation lands on the first checkpoint of the socket
    close (`send_eof`), before `aclose`: the response is complete but the socket stays open until
    the client gives up (and the server holds its descriptor). A kept-alive connection is recycled
    in the same send, and the same cancellation stops hypercorn restarting its idle timer, so
    `keep_alive_timeout` would never close it. Shielding this one send lets both finish; it adds
    no wait of its own (hypercorn already shields the socket write, the
    disconnect goes to a queue quart drains, the close is immediate).
    """

    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_final_shielded(message):
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        return await app(scope, receive, send_final_shielded)

    return asgi

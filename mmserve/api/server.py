"""Serving the HTTP API on hypercorn's trio worker."""

from __future__ import annotations

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from mmserve.api.app import create_app
from mmserve.logs import get_logger
from mmserve.runtime.config import Config
from mmserve.runtime.runtime import Runtime


async def serve(config: Config, *, shutdown: trio.Event | None = None, on_runtime=None,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Opens a Runtime and serves it over HTTP until `shutdown` is set (or cancelled).

    `task_status.started` receives the bound URLs (e.g. `http://127.0.0.1:54321`), so a
    caller binding port 0 learns the real port. `on_runtime(rt)` is called with the running
    Runtime before the socket opens (for embedding programs and tests that inspect it).
    """
    log = get_logger("http")
    async with Runtime.open(config) as rt:
        if on_runtime is not None:
            on_runtime(rt)
        hc = HypercornConfig()
        hc.bind = [f"{config.server.host}:{config.server.port}"]
        hc.accesslog = None
        hc.errorlog = None
        hc.keep_alive_timeout = 75
        app = create_app(rt)
        async with trio.open_nursery() as nursery:
            trigger = shutdown.wait if shutdown is not None else None
            binds = await nursery.start(lambda task_status: hypercorn_serve(
                app, hc, shutdown_trigger=trigger, task_status=task_status))
            log.info("http.listening", urls=binds, models=rt.registry.names())
            task_status.started(binds)

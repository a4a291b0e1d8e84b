"""structlog set-up, following structlog's production recipe.

Events are JSON lines by default (`format = "console"` for humans). Every event carries `actor`
and `request_id` where one applies; request-scoped context is bound with
`structlog.contextvars`. Only the sync log methods are used: the async ones assume asyncio.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure_logging(format: str = "json", level: str = "info", stream: TextIO | None = None) -> None:
    """Configures structlog once for the process. Idempotent; later calls replace the set-up."""
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if format == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(actor: str, **bound):
    """A logger bound to an actor name (and any other fixed fields). Lazy: it follows later
    re-configuration (and structlog.testing.capture_logs)."""
    return structlog.get_logger(actor=actor, **bound)

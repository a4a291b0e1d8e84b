"""structlog set-up: events go through the standard `logging` module, under the `mmserve` logger.

Every event carries `actor` and `request_id` where one applies; request-scoped context is bound
with `structlog.contextvars`. Only the sync log methods are used: the async ones assume asyncio.
An event is rendered by structlog (a JSON line by default, `format = "console"` for humans) and
handed to the stdlib logger `mmserve.<actor>` as its message, so any `logging` handler prints it
as it is. Two set-ups:

- `configure_logging(format, level, stream)` — the process is mmserve's (`mmserve serve`, the
  bench's server, tests): one JSON line per event on `stream` (stderr by default), at `level`.
- `use_default_logging(format, level)` — what `Runtime.open` does in a host program: it leaves
  alone whatever the host has configured. If structlog is not configured, it is configured to
  hand events to `logging`. If the `mmserve` logger has no level, it gets `[logging] level`. A
  handler on `mmserve` writes to stderr only while the host has no handler of its own (on the
  root logger or on `mmserve`), and then only warnings and errors unless `[logging]
  embedded_verbose` (a library is quiet unless asked): once the host has a handler, the events go
  to the host's handlers, at the host's levels. Nothing is ever written to stdout, and the root logger is never touched.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

LOGGER = "mmserve"
"""The stdlib logger every event goes through (as `mmserve.<actor>`): a host sets its level or
handlers to govern mmserve's logs."""

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
           "error": logging.ERROR, "exception": logging.ERROR, "critical": logging.CRITICAL,
           "fatal": logging.CRITICAL}


def _level(name: str) -> int:
    return logging.getLevelNamesMapping()[name.upper()]


class _StdlibLogger(structlog.stdlib.BoundLogger):
    """structlog's stdlib BoundLogger, dropping an event before any processor runs when it is
    below `min_level` or its `logging` logger is not enabled for it (a debug event costs a level
    check, not a rendering)."""

    min_level = logging.NOTSET

    def _proxy_to_logger(self, method_name, event=None, *event_args, **event_kw):
        level = _LEVELS.get(method_name, logging.CRITICAL)
        if level < self.min_level:
            return None
        enabled = getattr(self._logger, "isEnabledFor", None)
        if enabled is not None and not enabled(level):
            return None
        return super()._proxy_to_logger(method_name, event, *event_args, **event_kw)

    def exception(self, event=None, *args, **kw):
        """An error with the traceback rendered into the event (`logging.Logger.exception` would
        append it again below the line)."""
        kw.setdefault("exc_info", True)
        return self._proxy_to_logger("error", event, *args, **kw)


class _Emitter:
    """What structlog's logger factory hands out: a stdlib logger's level check and record
    hand-off, without `Logger.findCaller` (it would name structlog's frame, not the caller's, and
    is about a third of `Logger.info`'s cost). Anything else is the logger's own."""

    __slots__ = ("logger",)

    def __init__(self, logger: logging.Logger):
        self.logger = logger

    def __getattr__(self, name: str):
        return getattr(self.logger, name)

    def isEnabledFor(self, level: int) -> bool:
        return self.logger.isEnabledFor(level)

    def _emit(self, level: int, msg: str) -> None:
        logger = self.logger
        if logger.isEnabledFor(level):
            logger.handle(logger.makeRecord(logger.name, level, "(unknown file)", 0, msg, (), None))

    def debug(self, msg: str) -> None:
        self._emit(logging.DEBUG, msg)

    def info(self, msg: str) -> None:
        self._emit(logging.INFO, msg)

    def warning(self, msg: str) -> None:
        self._emit(logging.WARNING, msg)

    def error(self, msg: str) -> None:
        self._emit(logging.ERROR, msg)

    def critical(self, msg: str) -> None:
        self._emit(logging.CRITICAL, msg)


class _LoggerFactory:
    """`structlog.stdlib.LoggerFactory` for `get_logger`'s names, one cached `_Emitter` a name."""

    def __init__(self):
        self._emitters: dict[str, _Emitter] = {}

    def __call__(self, *args) -> _Emitter:
        name = args[0] if args else LOGGER
        emitter = self._emitters.get(name)
        if emitter is None:
            emitter = self._emitters[name] = _Emitter(logging.getLogger(name))
        return emitter


def _wrapper_class(min_level: int) -> type:
    return type(f"MMServeLoggerAt{logging.getLevelName(min_level).title()}", (_StdlibLogger,),
                {"min_level": min_level})


def _configure_structlog(format: str, min_level: int) -> None:
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
            renderer,  # the rendered line is the stdlib record's message
        ],
        wrapper_class=_wrapper_class(min_level),
        logger_factory=_LoggerFactory(),
        cache_logger_on_first_use=False,  # loggers follow re-configuration and capture_logs
    )


class _Handler(logging.StreamHandler):
    """Writes each record's message, one a line, to `stream` or else to whatever `sys.stderr` is
    when the record comes (so a redirected stderr is followed). With `defer`, it stays silent while
    the host has a handler of its own on the root logger or on `mmserve`."""

    def __init__(self, stream: TextIO | None = None, defer: bool = False):
        self._fixed = stream
        super().__init__(stream)
        self.defer = defer
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self) -> TextIO:
        return self._fixed if self._fixed is not None else sys.stderr

    @stream.setter
    def stream(self, value: TextIO | None) -> None:
        self._fixed = value

    def filter(self, record: logging.LogRecord):
        if self.defer and _host_has_handlers():
            return False
        return super().filter(record)


def _host_has_handlers() -> bool:
    ours = logging.getLogger(LOGGER)
    return bool(logging.getLogger().handlers) or any(not isinstance(h, _Handler) for h in ours.handlers)


# what this module did to the `mmserve` logger: "explicit" (configure_logging), "default"
# (use_default_logging) or None; and the level use_default_logging set (None: it set none)
_mode: str | None = None
_default_level: int | None = None


def _remove_our_handlers(logger: logging.Logger) -> None:
    for h in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(h)


def configure_logging(format: str = "json", level: str = "info", stream: TextIO | None = None) -> None:
    """The process's logging is mmserve's: events at `level` and above, one per line on `stream`
    (default: stderr), rendered as `format`. Idempotent; later calls replace the set-up.

    The level lives in structlog's configuration (its wrapper class), so code that saves and
    restores `structlog.get_config()` restores the level too; the `mmserve` logger lets every
    record through to this one handler and does not propagate to the root logger."""
    global _mode, _default_level
    _configure_structlog(format, _level(level))
    logger = logging.getLogger(LOGGER)
    _remove_our_handlers(logger)
    logger.addHandler(_Handler(stream))
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    _mode, _default_level = "explicit", None


def use_default_logging(format: str = "json", level: str = "info", verbose: bool = False) -> None:
    """`[logging]` as a default under a host program's own configuration (see the module's
    docstring); does nothing after `configure_logging`. Without `verbose` (`[logging]
    embedded_verbose`), the stderr handler used while the host has none writes warnings and errors
    only: a library is quiet unless asked (the host's own handlers still get every event)."""
    global _mode, _default_level
    if _mode == "explicit":
        return
    ours = isinstance(structlog.get_config()["wrapper_class"], type) and issubclass(
        structlog.get_config()["wrapper_class"], _StdlibLogger)
    if ours or not structlog.is_configured():  # a host's structlog set-up stays the host's
        _configure_structlog(format, logging.NOTSET)
    logger = logging.getLogger(LOGGER)
    if logger.level == logging.NOTSET or logger.level == _default_level:  # never a level the host set
        _default_level = _level(level)
        logger.setLevel(_default_level)
    handler = next((h for h in logger.handlers if isinstance(h, _Handler)), None)
    if handler is None:
        handler = _Handler(defer=True)
        logger.addHandler(handler)
    handler.setLevel(logging.NOTSET if verbose else logging.WARNING)
    _mode = "default"


def get_logger(actor: str, **bound):
    """A logger bound to an actor name (and any other fixed fields), logging through the stdlib
    logger `mmserve.<actor>`. Lazy: it follows later re-configuration (and
    structlog.testing.capture_logs)."""
    return structlog.get_logger(f"{LOGGER}.{actor}", actor=actor, **bound)

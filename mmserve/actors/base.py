"""What every actor shares: an inbox, the requests it is holding, a liveness record."""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod

import trio

from mmserve.actors.messages import RequestHandle
from mmserve.errors import InternalError, MMServeError
from mmserve.logs import get_logger


class Actor(ABC):
    """An actor owns its state alone and is driven by messages arriving in its inbox.

    `run()` is restarted by the supervisor when it raises; the inbox survives restarts, so queued
    messages are not lost. Requests the actor holds when it dies are failed by the supervisor via
    `fail_in_flight`. An actor is wired at construction — every channel, runner and shared resource
    it uses is an argument of its `__init__` — and nothing is set on it from outside afterwards (a
    restart runs the same actor, with the same wiring; see `runtime.model_actors`).
    """

    name = "actor"

    def __init__(self, inbox_size: float = math.inf,
                 inbox: tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel] | None = None, **log_fields):
        """`inbox`: the (send, receive) pair of a channel made before the actor — by whoever wires
        two actors that send to each other, so both are complete when built."""
        self.inbox_send, self.inbox = inbox if inbox is not None else trio.open_memory_channel(inbox_size)
        # the supervisor's name for it, and the compute thread's owner of its calls:
        # `generator[demo]` for a model's actor (its `model` log field), else the bare name
        self.key = f"{self.name}[{log_fields['model']}]" if "model" in log_fields else self.name
        self.log = get_logger(self.name, **log_fields)
        self.in_flight: dict[str, RequestHandle] = {}
        self.last_progress = time.monotonic()

    @abstractmethod
    async def run(self) -> None:
        """The actor's message loop; returns only on shutdown."""

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    def has_work(self) -> bool:
        """Whether the actor holds requests or has messages waiting (a hang is only possible then)."""
        return bool(self.in_flight) or self.inbox.statistics().current_buffer_used > 0

    def fail_request(self, handle: RequestHandle, exc: BaseException, stage: str) -> None:
        """Ends one request because handling it raised `exc` at `stage`; the actor goes on.

        A typed error (the input's fault) reaches the caller as it is; anything else becomes a 500
        naming the request id, and is logged with its traceback under that id."""
        error = exc if isinstance(exc, MMServeError) else InternalError(
            f"request {handle.request_id} failed in {stage} ({type(exc).__name__}); the server log has "
            "the details under this request id. Other requests are not affected.")
        self.log.log(logging.INFO if error.status < 500 else logging.ERROR, "request.failed",
                     request_id=handle.request_id, client_request_id=handle.client_request_id,
                     stage=stage, status=error.status, error=error.message,
                     exc_info=None if error is exc else exc)
        self.in_flight.pop(handle.request_id, None)
        handle.fail(error)

    def fail_in_flight(self, error: MMServeError) -> int:
        """Ends every request this actor holds with `error`; returns how many there were."""
        handles = list(self.in_flight.values())
        self.in_flight.clear()
        for h in handles:
            h.fail(error)
        return len(handles)

"""Typed errors a user can cause (or meet), each mapped to one HTTP status and one OpenAI error body.

Everything raised towards a caller is an `MMServeError`; the HTTP layer turns it into
``{"error": {"message", "type", "param", "code"}}`` with `status`, and embedded callers catch it
directly.
"""

from __future__ import annotations

import math

CLIP_CHARS = 256
"""The most characters of caller input an error message echoes (see `clip`)."""

# ints above this many bits are not rendered: repr() of one with more than 4300 digits raises, and
# even a shorter one is only noise in a message
_INT_BITS_SHOWN = 512


def clip(value: object, limit: int = CLIP_CHARS) -> str:
    """A repr-like rendering of caller input for an error message, at most `limit` characters.

    Error bodies echo what the caller sent so the mistake can be found, but a 1 MB model name or a
    10**400 temperature must not come back 1 MB long (or, for ints past 4300 digits, make repr()
    raise and turn a 400 into a 500). A cut value ends in an ellipsis and its original length.
    Lone surrogates and control characters come out escaped, so the text is always encodable.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _INT_BITS_SHOWN:
        digits = math.floor(value.bit_length() * math.log10(2)) + 1
        return f"<an integer of about {digits} digits>"
    if isinstance(value, str):
        text, size = repr(value[:limit]), len(value)  # slice first: repr of 1 MB is 1 MB of work
    else:
        try:
            text = repr(value)
        except (ValueError, RecursionError):  # a huge int inside a container, or a cycle too deep
            text = f"<{type(value).__name__}>"
        size = len(text)
    if len(text) <= limit and size <= limit:
        return text
    suffix = f"… ({size} characters)"
    return text[: max(0, limit - len(suffix))] + suffix


class MMServeError(Exception):
    """Base of every error mmserve reports to a caller."""

    status = 500
    type = "server_error"
    code: str | None = None
    rejected = False  # a `request.rejected` line was logged for it (`log_rejection`)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    @property
    def reason(self) -> str:
        """What kind of error it is, for logs and counters: its code, or else its type."""
        return self.code or self.type

    def to_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(MMServeError):
    """The request is malformed or asks for something invalid (HTTP 400)."""

    status = 400
    type = "invalid_request_error"


class ExceedsCapacity(BadRequest):
    """The request could never run on this server as configured — it needs more KV blocks than the
    arena holds, or more rows than a step carries: refused at admission (the message names the
    limit and its config key) rather than left waiting forever."""

    code = "context_length_exceeded"


class UnsupportedParameter(BadRequest):
    """A valid OpenAI parameter that mmserve does not implement: refused, never silently ignored."""

    code = "unsupported_parameter"


class UnsupportedMediaType(MMServeError):
    """A request body whose Content-Type is not JSON (HTTP 415): refused rather than guessed at."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class Unauthorized(MMServeError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(MMServeError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class ModelNotFound(MMServeError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(MMServeError):
    """Something other than a model that does not exist here (a stored response: none are kept)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class PayloadTooLarge(MMServeError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class RequestTimeout(MMServeError):
    """The request's body did not arrive within `server.body_timeout_s` (HTTP 408); the connection
    is closed, since the rest of the body may still come."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class UnprocessableImage(BadRequest):
    """An image that cannot be decoded, is of a refused format or shape, or could not be fetched
    (HTTP 400, as OpenAI answers; `code` invalid_image, image_too_large, image_fetch_failed or
    image_fetch_timeout). An image over the byte limits is a `PayloadTooLarge` (413)."""

    code = "invalid_image"


def is_rejection(error: MMServeError) -> bool:
    """A refusal rather than a failure: any 4xx, or 503 (not ready, draining, the model down).
    500 (a bug) and 504 (the deadline) are failures of work that was started."""
    return error.status < 500 or error.status == 503


def log_rejection(log, error: MMServeError, **fields) -> bool:
    """Logs the one `request.rejected` line of a refused request (`fields`: its ids, its model);
    False, logging nothing, when `error` was logged already (it passes several layers)."""
    if error.rejected or not is_rejection(error):
        return False
    error.rejected = True
    log.info("request.rejected", status=error.status, reason=error.reason, param=error.param,
             error=error.message, **fields)
    return True


class Overloaded(MMServeError):
    status = 429
    type = "rate_limit_error"
    code = "server_overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw):
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class InternalError(MMServeError):
    status = 500
    type = "server_error"
    code = "internal_error"


class DeadlineExceeded(MMServeError):
    """The request ran past `limits.request_timeout_s`; it was aborted (HTTP 504)."""

    status = 504
    type = "timeout_error"
    code = "deadline_exceeded"


class ServiceUnavailable(MMServeError):
    """The runtime (or the actor serving this request) is not able to answer now (HTTP 503)."""

    status = 503
    type = "service_unavailable"
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kw):
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s  # sent as Retry-After when known


# -- starting: a model that cannot be served, an address that cannot be listened on ---------------


class CheckpointError(ServiceUnavailable, ValueError):
    """A model's directory cannot be served: it is not a checkpoint, or its `model_type` is not one
    mmserve serves. It stops `mmserve serve` and `Runtime.open` (for a model loaded at start) with
    this one message; a request that loads the model on demand gets it as a 503. Also a ValueError:
    what `load_adapter` raised for an unknown family before this type existed."""

    code = "model_not_servable"


class NotACheckpoint(CheckpointError):
    """The directory has no readable `config.json` naming a `model_type`."""


class UnsupportedModelType(CheckpointError):
    """The checkpoint's `model_type` is not one of the families mmserve has an adapter for."""


class CannotListen(MMServeError):
    """The server cannot bind its address (in use, not this machine's, not permitted). Raised
    before any model loads; never an HTTP answer (there is no server to answer)."""

    code = "cannot_listen"

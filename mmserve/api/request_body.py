"""A request's JSON body: read within its limit, checked to be JSON, parsed — a large one on a
worker thread, so the event loop (every stream, /health) does not stop for it."""

from __future__ import annotations

import codecs
import json
import re

import trio
from quart import request

from mmserve.api import big_json
from mmserve.api.body_guard import release_body
from mmserve.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType, clip

# application/json, or a structured-syntax JSON type such as application/merge-patch+json (RFC 6839)
_JSON_MEDIA_TYPE = re.compile(r"application/(?:[a-z0-9!#$&^_.-]+\+)?json", re.I)
_UTF8_CHARSETS = {"utf-8", "utf8"}

# Bodies up to this size are parsed in place (well under a millisecond); larger ones on a thread.
# json.loads and bytes.decode hold the GIL for their whole call, so a thread alone would still stop
# the loop for a 30 MB parse: the body is decoded in pieces of _DECODE_PIECE and its long strings
# parsed apart (`big_json`), so the GIL changes hands between short calls.
THREAD_PARSE_BYTES = 64 * 1024
_DECODE_PIECE = 1 << 20
# parses on threads at once: more wait (their bytes are bounded by the body budget meanwhile)
PARSE_THREADS = 2


async def read_body(limit: int) -> list[bytes]:
    """The request body, at most `limit` bytes, as the chunks it came in (joined by whoever
    parses it: joining 30 MB on the event loop would stop it for tens of milliseconds). A larger body is drained (up to a bound, so the
    client can read our 413 instead of blocking on a full socket) and refused; the body guard's
    deadline (`server.body_timeout_s`) bounds the drain in time.

    Every body is read whole before it is judged (its Content-Type, its JSON), so an error answer
    never leaves unread bytes that would garble the next request on a kept-alive connection."""
    drain_cap = 4 * limit + (1 << 20)
    declared = request.content_length
    too_large = PayloadTooLarge(f"the request body is larger than this server's limit of {limit} bytes")
    if declared is not None and declared > drain_cap:
        raise too_large
    chunks, total = [], 0
    async for chunk in request.body:
        total += len(chunk)
        if total <= limit:
            chunks.append(chunk)
        elif total > drain_cap:
            break
    if total > limit:
        raise too_large
    return chunks


def check_json_content_type(content_type: str | None) -> None:
    """Refuses (415) a body that does not say it is JSON, in UTF-8.

    A body sent as text/plain or form data is a client bug (or a cross-site form post, which a
    browser may send without a CORS preflight); guessing that it is JSON would hide the bug. A
    `charset` other than UTF-8 would be decoded wrongly, so it is refused too."""
    media_type, *params = (content_type or "").split(";")
    if not _JSON_MEDIA_TYPE.fullmatch(media_type.strip()):
        got = f"Content-Type {clip(content_type)}" if content_type else "no Content-Type"
        raise UnsupportedMediaType(f"the request body must be JSON sent as 'Content-Type: application/json'; "
                                   f"got {got}")
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in _UTF8_CHARSETS:
            raise UnsupportedMediaType(f"the request body must be UTF-8 JSON; got charset {clip(value.strip())}")


class JsonBodies:
    """Parses request bodies; one per app (its limiter belongs to the app's trio run)."""

    def __init__(self, threads: int = PARSE_THREADS):
        self.limiter = trio.CapacityLimiter(threads)

    async def read(self, limit: int, *, empty=None, then=None):
        """The request's body read (`read_body`) and parsed (`parse`), then passed to `then` (a
        pure validation such as `Runtime.parse`: for a large body it runs on the same thread, since
        it walks every string too); the body guard's place is given back once that is done,
        refused or not. With `empty` given, a blank body is that value (no Content-Type needed);
        otherwise it is refused like any body that is not JSON."""
        try:
            chunks = await read_body(limit)
            if empty is not None and not b"".join(chunks).strip():  # an admin body: small
                return empty
            return await self.parse(chunks, request.headers.get("content-type"), then)
        finally:
            release_body(request.scope)

    async def parse(self, chunks: list[bytes], content_type: str | None, then=None):
        """The parsed JSON body (given as its chunks), or a 4xx naming what is wrong with it."""
        check_json_content_type(content_type)
        then = then or (lambda body: body)
        if sum(map(len, chunks)) <= THREAD_PARSE_BYTES:
            return then(parse_json(b"".join(chunks)))
        # joined on the thread too: a large join copies with the GIL released, the loop runs on
        return await trio.to_thread.run_sync(lambda: then(parse_json(b"".join(chunks))), limiter=self.limiter)


def parse_json(raw: bytes):
    """The parsed JSON of UTF-8 `raw`, or a 4xx naming what is wrong with it (never a 500: the json
    module raises RecursionError for deep nesting and ValueError for integers past 4300 digits)."""
    try:
        text = _decode_utf8(raw)
    except UnicodeDecodeError:
        raise BadRequest("the request body is not valid UTF-8") from None
    try:
        return big_json.loads(text) if len(raw) > THREAD_PARSE_BYTES else json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the request body nests arrays and objects too deeply to parse") from None
    except ValueError as e:  # int too long to convert: "Exceeds the limit (4300 digits) ..."
        raise BadRequest(f"the request body has a number that cannot be parsed: {e}") from None


def _decode_utf8(raw: bytes) -> str:
    if len(raw) <= _DECODE_PIECE or raw.isascii():  # ASCII (a data URL's body): one fast copy
        return raw.decode("utf-8")
    decoder = codecs.getincrementaldecoder("utf-8")()  # a character split across pieces is kept
    view = memoryview(raw)
    pieces = [decoder.decode(view[i:i + _DECODE_PIECE]) for i in range(0, len(raw), _DECODE_PIECE)]
    pieces.append(decoder.decode(b"", final=True))
    return "".join(pieces)

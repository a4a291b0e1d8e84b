"""The OpenAI-compatible HTTP API: a thin mapping of HTTP onto the embedded Runtime API."""

from __future__ import annotations

import hmac
import json
import re
import time

from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from mmserve.errors import BadRequest, Forbidden, InternalError, MMServeError, PayloadTooLarge, Unauthorized
from mmserve.logs import get_logger
from mmserve.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mmserve.api import openai_json, responses
from mmserve.api.body_guard import BodyGuard
from mmserve.api.loads import register_loads_route
from mmserve.api.request_body import JsonBodies
from mmserve.runtime.runtime import CACHE_KINDS, ChatStream, Delta, Runtime, complete, new_request_id
from mmserve.runtime.stream import Usage

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
log = get_logger("http")
# the routes an API key guards (when keys are set): the OpenAI API and vLLM's tokenizer routes
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")


def error_response(err: MMServeError) -> Response:
    resp = Response(json.dumps(err.to_body()), status=err.status, mimetype="application/json")
    retry = getattr(err, "retry_after_s", None)
    if retry is not None:
        resp.headers["Retry-After"] = str(max(1, round(retry)))
    return resp


def _http_error(exc: HTTPException) -> MMServeError:
    if exc.code == 413:
        return PayloadTooLarge("the request body is larger than this server accepts")
    err = MMServeError(exc.description or exc.name)
    err.status, err.type, err.code = exc.code or 500, "invalid_request_error", exc.name.lower().replace(" ", "_")
    return err


def create_app(rt: Runtime) -> QuartTrio:
    """The app; its ASGI entry (`app.asgi_app`) passes the body guard first (`body_guard`: every
    request body within `server.body_timeout_s`, bodies in flight bounded)."""
    app = QuartTrio("mmserve")
    app.config["MAX_CONTENT_LENGTH"] = None  # enforced by read_body, which can answer 413 cleanly
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    app.json.sort_keys = False  # answers keep their order: a legacy top_logprobs dict is most likely first
    server = rt.config.server
    app.asgi_app = BodyGuard(app.asgi_app, timeout_s=server.body_timeout_s, max_bodies=server.max_bodies_in_flight,
                             max_bytes=server.max_body_bytes_in_flight, max_body_bytes=server.max_body_bytes,
                             on_refuse=lambda err: rt.reject(err, None))
    bodies = JsonBodies()

    api_keys = [k.encode() for k in rt.config.auth.keys()]
    admin_key = rt.config.auth.admin().encode()

    @app.before_request
    async def read_client_request_id_and_authenticate():
        # the client's id is a label only (DESIGN.md F6): logged and echoed, never used as a key
        incoming = request.headers.get("x-request-id", "")
        g.client_request_id = incoming if _REQUEST_ID.match(incoming) else None
        g.request_id = new_request_id()  # names errors raised before admission; admission mints its own
        # on the headers alone: a refused request is answered at once, its body never waited for
        # (hypercorn closes a connection whose request body is unfinished when the answer ends)
        if request.path.startswith(("/debug/", "/admin/")):
            _require_admin(admin_key)
        elif api_keys and request.path.startswith(KEYED_PATHS):
            if not _matches(_bearer(), api_keys):
                raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")

    @app.after_request
    async def add_request_id(response):
        response.headers["x-request-id"] = getattr(g, "client_request_id", None) or getattr(g, "request_id", "")
        return response

    def rejected(err: MMServeError) -> Response:
        # every refused request is visible: one request.rejected line (unless a deeper layer logged
        # it already) and mmserve:request_rejected_total{reason}
        rt.reject(err, getattr(g, "request_id", None), getattr(g, "client_request_id", None))
        return error_response(err)

    @app.errorhandler(MMServeError)
    async def on_mmserve_error(err: MMServeError):
        return rejected(err)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException):
        return rejected(_http_error(exc))

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception):
        rid = getattr(g, "request_id", None)
        log.error("http.unhandled_error", request_id=rid, client_request_id=getattr(g, "client_request_id", None),
                  exc_info=exc)
        return error_response(InternalError(f"internal error; see the server log for request {rid}"))

    @app.get("/health")
    async def health():
        """The runtime's health; `?model=NAME` answers for one model (its actors and the intake):
        200 only once the model is loaded, so a load balancer routing by model sends its requests
        only where they are answered without a load (503 with its state otherwise; 404 unknown)."""
        h = rt.health(request.args.get("model"))
        resp = Response(json.dumps(h.to_json()), status=200 if h.serving else 503, mimetype="application/json")
        if h.retry_after is not None:
            resp.headers["Retry-After"] = str(max(1, round(h.retry_after)))
        return resp

    @app.get("/metrics")
    async def metrics():
        return Response(rt.metrics.render(), status=200, content_type=METRICS_CONTENT_TYPE)

    @app.get("/debug/cache")
    async def debug_cache():
        return rt.debug_cache()

    @app.post("/admin/cache/reset")
    async def reset_caches():
        """Body (optional): {"model": name, "caches": ["encoder", "prefix"]}; default: all of both."""
        body = await bodies.read(rt.config.server.max_body_bytes, empty={})
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object like {\"model\": \"demo\", \"caches\": [\"prefix\"]}")
        model, caches = body.get("model"), body.get("caches", list(CACHE_KINDS))
        if model is not None and not isinstance(model, str):
            raise BadRequest("'model' must be a string", param="model")
        if not isinstance(caches, list) or not all(isinstance(c, str) for c in caches):
            raise BadRequest(f"'caches' must be a list drawn from {list(CACHE_KINDS)}", param="caches")
        dropped = await rt.reset_caches(model, tuple(caches))
        return {"object": "cache.reset", "dropped": dropped}

    def model_card(m: dict) -> dict:
        return {"id": m["name"], "object": "model", "created": int(rt.started), "owned_by": "mmserve",
                "loaded": m["loaded"], "state": m["state"]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(m) for m in rt.models()]}

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str):
        """One model (OpenAI's `client.models.retrieve`); an unknown one is a 404 naming the others."""
        rt.registry.configured(model_id)
        return next(model_card(m) for m in rt.models() if m["name"] == model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions():
        parsed = await bodies.read(rt.config.server.max_body_bytes, then=rt.parse)
        stream = rt.chat(request=parsed, client_request_id=g.client_request_id, request_id=g.request_id)
        g.request_id, g.client_request_id = stream.request_id, stream.client_request_id
        if not parsed.stream:
            return openai_json.completion(await complete(stream), parsed.options.tokens_as_ids)
        try:
            first = await stream.__anext__()
        except BaseException:
            stream.close()
            raise
        response = Response(_sse(stream, first, parsed.include_usage), mimetype="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None  # a long stream must not be cut by Quart's response timeout
        return response

    @app.post("/v1/responses")
    async def create_response():
        """OpenAI's Responses API, on the chat path (mmserve.api.responses)."""
        body = await bodies.read(rt.config.server.max_body_bytes)
        return await responses.answer(rt, body, g)

    @app.route("/v1/responses/<path:response_id>", methods=["GET", "DELETE", "POST"])
    async def stored_response(response_id: str):
        """Retrieve, delete, cancel, input items: a 404 that says nothing is stored."""
        raise responses.not_stored(response_id.split("/")[0])

    @app.post("/tokenize")
    async def tokenize():
        """vLLM's /tokenize (mmserve.runtime.tokenization): a prompt, or chat messages."""
        return await rt.tokenize(await bodies.read(rt.config.server.max_body_bytes))

    @app.post("/v1/routing_keys")
    async def routing_keys():
        """A chat request's keys for KV-aware routers fed by [kv_events] (mmserve.runtime.routing_keys)."""
        return await rt.routing_keys(await bodies.read(rt.config.server.max_body_bytes))

    @app.post("/detokenize")
    async def detokenize():
        return await rt.detokenize(await bodies.read(rt.config.server.max_body_bytes))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return await rt.tokenizer_info(request.args.get("model"))

    @app.post("/v1/completions")
    async def completions():
        """OpenAI's legacy completions: one request per prompt on the chat path, untemplated."""
        parsed = await bodies.read(rt.config.server.max_body_bytes, then=rt.parse_completions)
        streams: list[ChatStream] = []
        try:
            for one in parsed:
                streams.append(rt.chat(request=one, client_request_id=g.client_request_id,
                                       request_id=None if streams else g.request_id))
            g.request_id, g.client_request_id = streams[0].request_id, streams[0].client_request_id
            if not parsed[0].stream:
                done = [await complete(s) for s in streams]  # they run at once; read in order
                n = parsed[0].sampling.n
                u = Usage(sum(d.usage.prompt_tokens for d in done), sum(d.usage.completion_tokens for d in done),
                          sum(d.usage.cached_tokens for d in done))
                choices = [(k * n + ch.index, ch) for k, d in enumerate(done) for ch in d.choices]
                return openai_json.text_completion(streams[0].id, streams[0].model, done[0].created, parsed[0],
                                                   choices, u)
            first = await streams[0].__anext__()
        except BaseException:
            for s in streams:
                s.close()
            raise
        response = Response(_text_sse(streams, first, parsed[0].include_usage), mimetype="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None
        return response

    register_loads_route(app, rt)  # GET /v1/loads: this replica's load for a router (SMG)
    return app


def _bearer() -> bytes:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


def _matches(token: bytes, keys: list[bytes]) -> bool:
    """Constant-time comparison against every key (no early exit that would leak which matched)."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found and bool(token)


def _require_admin(admin_key: bytes) -> None:
    if not admin_key:
        raise Forbidden("admin endpoints are disabled: set auth.admin_key (or MMSERVE_ADMIN_KEY)")
    if not _matches(_bearer(), [admin_key]):
        raise Unauthorized("this endpoint needs the admin key: 'Authorization: Bearer <admin key>'")


async def _sse(stream: ChatStream, first: Delta, include_usage: bool):
    created = int(time.time())
    want_logprobs = stream.handle.request.sampling.logprobs
    ids = stream.handle.request.options.tokens_as_ids
    continuous = stream.handle.request.options.continuous_usage

    def event(delta: dict, finish_reason: str | None = None, index: int = 0, tokens=None) -> str:
        body = openai_json.chunk(stream.id, stream.model, created, delta, finish_reason, index,
                                 tokens if want_logprobs else None, ids)
        if stream.system_fingerprint:  # deterministic mode: every chunk says so, as OpenAI's do
            body["system_fingerprint"] = stream.system_fingerprint
        if continuous:  # vLLM's continuous_usage_stats: the usage so far on every chunk
            body["usage"] = openai_json.running_usage(stream.usage_so_far)
        return openai_json.sse(body)

    tools = stream.handle.request.tools
    # with tools, a choice's role chunk waits for its first text or call: an answer that is only
    # calls then streams `content: null`, as OpenAI's does (and as the whole answer has it)
    announced = set() if tools is not None and tools.parsed else set(range(stream.handle.choices))
    try:
        echo = stream.handle.request.echo  # vLLM's echo: the last message's text starts the answer

        def role(index: int, content: str | None) -> list[str]:
            out = [event({"role": "assistant", "content": content, "refusal": None}, index=index)]
            return out + [event({"content": echo}, index=index)] if echo else out

        for index in sorted(announced):
            for chunk in role(index, ""):
                yield chunk
        delta = first
        while True:
            if delta.index not in announced and (delta.text or delta.logprobs or delta.tool_calls
                                                 or delta.finish_reason):
                announced.add(delta.index)
                for chunk in role(delta.index, None if delta.tool_calls and not delta.text and not echo else ""):
                    yield chunk
            if delta.text or delta.logprobs:
                yield event({"content": delta.text}, index=delta.index, tokens=delta.logprobs)
            for piece in delta.tool_calls:  # one chunk each, as OpenAI sends them
                yield event({"tool_calls": [openai_json.tool_call_delta(piece)]}, index=delta.index)
            if delta.finish_reason is not None:
                yield event({}, delta.finish_reason, delta.index)
                if stream.done:
                    if include_usage:
                        yield openai_json.sse(openai_json.usage_chunk(stream.id, stream.model, created, stream.usage))
                    break
            try:
                delta = await stream.__anext__()
            except StopAsyncIteration:
                break
            except MMServeError as err:
                yield openai_json.sse(err.to_body())
                break
        yield openai_json.DONE
    finally:
        stream.close()


async def _text_sse(streams: list[ChatStream], first: Delta, include_usage: bool):
    """A legacy completion's stream: each prompt's chunks in turn (all of them run at once; later
    prompts' deltas wait in their channels), choices indexed prompt-major."""
    head, created = streams[0], int(time.time())
    n, request = head.handle.choices, head.handle.request
    try:
        for k, stream in enumerate(streams):
            offsets = [0] * n  # each choice's text so far, for text_offset
            delta = first if k == 0 else None
            while True:
                if delta is None:
                    try:
                        delta = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                    except MMServeError as err:
                        yield openai_json.sse(err.to_body())
                        yield openai_json.DONE
                        return
                lp = openai_json.choice_logprobs(request, delta.logprobs, delta.prompt_logprobs, offsets[delta.index])
                if delta.text or delta.logprobs or delta.prompt_logprobs or delta.finish_reason is not None:
                    choice = openai_json.text_choice(request, k * n + delta.index, delta.text, delta.finish_reason,
                                                     lp, delta.prompt_logprobs)
                    body = openai_json.text_chunk(head.id, head.model, created, choice)
                    if request.options.continuous_usage:  # vLLM's: this prompt's usage so far
                        body["usage"] = openai_json.running_usage(stream.usage_so_far)
                    yield openai_json.sse(body)
                offsets[delta.index] += len(delta.text)
                if stream.done:
                    break
                delta = None
        if include_usage:
            us = [s.usage for s in streams]
            u = Usage(sum(x.prompt_tokens for x in us), sum(x.completion_tokens for x in us),
                      sum(x.cached_tokens for x in us))
            yield openai_json.sse(openai_json.text_usage_chunk(head.id, head.model, created, u))
        yield openai_json.DONE
    finally:
        for s in streams:
            s.close()

"""The embedded Runtime API — the one path every caller takes, HTTP included.

    async with mmserve.Runtime.open(config) as rt:
        async with rt.chat(messages, max_tokens=32) as stream:
            async for delta in stream:
                print(delta.text, end="")
        completion = await rt.chat_completion(messages, temperature=0)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import weakref
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import torch
import trio

from mmserve.actors import compute
from mmserve.actors.intake import Intake
from mmserve.actors.messages import ClearCache, RequestHandle, Route, Submit
from mmserve.config import Config, load_config
from mmserve.errors import BadRequest, MMServeError, Overloaded, ServiceUnavailable, log_rejection
from mmserve.inputs.completions import parse_completion_requests
from mmserve.inputs.request import ChatRequest, parse_chat_request
from mmserve.inputs.tokenize import parse_detokenize, parse_tokenize
from mmserve.inputs.tools import bind_tools
from mmserve.logs import get_logger, use_default_logging
from mmserve.runtime import gc_heap, tokenization
from mmserve.runtime.host_memory import keep_freed_blocks
from mmserve.runtime.metrics import Metrics
from mmserve.runtime.model_actors import build_model_actors
from mmserve.runtime.registry import ModelRegistry
from mmserve.runtime.routing_keys import routing_keys
from mmserve.models.batch_invariant import fingerprint
from mmserve.runtime.stream import ChatCompletion, ChatStream, Delta, complete, new_request_id
from mmserve.runtime.supervisor import Health, Supervisor, not_serving_yet

__all__ = ["CACHE_KINDS", "ChatCompletion", "ChatStream", "Delta", "Runtime", "complete", "new_request_id"]

CACHE_KINDS = ("encoder", "prefix")  # what POST /admin/cache/reset can empty

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "default.toml"
"""The packaged default configuration, `Runtime.open()`'s: the three demo models, `demo` the
default. A copy of the repository's `config.toml`, byte for byte (tests/test_default_config.py)."""


def configure_device(device: str) -> None:
    """Process-wide settings for `device`, chosen at run time. CUDA: cuDNN's SDPA backend plans
    anew for every new sequence length (~55 ms each on an H100), and decode makes a new length
    every step, so attention uses torch's other SDPA kernels. The CPU: the C allocator keeps freed
    blocks for the next step (`host_memory`: a step's temporaries were faulted in anew every step)."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    else:
        keep_freed_blocks()


STEPS_SETTLE_S = 1.0
"""How long a drain waits, once its requests are done, for the compute thread's last steps."""

class Runtime:
    """A running mmserve: actors, models and the supervisor, inside the caller's trio run."""

    def __init__(self, config: Config, nursery: trio.Nursery):
        self.config = config
        self.supervisor = Supervisor(config.supervisor)
        self.supervisor.attach(nursery)
        self.metrics = Metrics()
        # KV events for external routers ([kv_events]): one stream per replica, every model's manager on
        # it. Imported only when on: a replica that does not publish never loads pyzmq
        self.kv_events = None
        if config.kv_events.enabled:
            from mmserve.actors.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(config.kv_events)
        self.registry = ModelRegistry(config, self.supervisor, functools.partial(
            build_model_actors, config, metrics=self.metrics, kv_events=self.kv_events))
        self.intake = Intake(config.limits, self._route, config.kv_cache, config.generator.lookup_timeout_s,
                             video=config.video, on_reject=self.metrics.rejected)
        self.log = get_logger("runtime")
        self.started = time.time()
        # every request admitted and not yet gone, held weakly: a handle leaves with its last
        # reference (its caller's stream, the actor holding it), never by a prune that may not run
        self._live: weakref.WeakSet[RequestHandle] = weakref.WeakSet()
        self.drained = {"in_flight_at_drain": 0, "finished_in_grace": 0, "cut": 0}
        self.metrics.attach(self)  # its gauges read this runtime's state when scraped

    @classmethod
    @asynccontextmanager
    async def open(cls, config: Config | str | Path | None = None) -> AsyncIterator["Runtime"]:
        """Loads the configured models, starts the actors, and yields the running Runtime.

        `config`: a Config, a path to a TOML file, or None for the packaged default
        (`DEFAULT_CONFIG`: the demo models, whatever the working directory).
        Logs go through the standard `logging` module (logger `mmserve`): a host program's logging
        configuration governs them; without one, warnings and errors go to stderr (every event at
        `[logging] level` with `embedded_verbose = true`; `mmserve.logs.use_default_logging`),
        never to stdout.

        Leaving the block drains: nothing new is admitted, requests in flight get up to
        `[server] shutdown_grace_s` to finish, and the rest end with a 503 `shutdown` error."""
        if not isinstance(config, Config):
            config = load_config(DEFAULT_CONFIG if config is None else config)
        use_default_logging(config.logging.format, config.logging.level, config.logging.embedded_verbose)
        if config.runtime.torch_threads:
            torch.set_num_threads(config.runtime.torch_threads)
        compute.configure(config.runtime.torch_threads)  # 0: torch's default (`compute.DEFAULT_THREADS`)
        configure_device(config.runtime.device)
        body_error: Exception | None = None
        async with trio.open_nursery() as nursery:
            rt = cls(config, nursery)
            try:
                await rt._start()
                yield rt
                await rt.drain()
            except Exception as e:  # re-raised below as itself, not wrapped in an ExceptionGroup
                body_error = e
            finally:
                nursery.cancel_scope.cancel()
                if rt.kv_events is not None:
                    rt.kv_events.close()
                if config.runtime.gc_freeze:
                    gc_heap.release()
                rt.log.info("runtime.stopped", **rt.drained)
        if body_error is not None:
            raise body_error

    async def _start(self) -> None:
        self.supervisor.start(self.intake)
        for mc in self.config.models:
            # the default model loads at start whether `default = true` names it or it is implied
            # (the first, or only, [[models]] table); `load = "on_demand"` keeps it lazy
            if mc.eager or (mc.load is None and mc.name == self.config.default_model):
                await self.registry.get(mc.name)
        self.supervisor.ready = True
        self.log.info("runtime.started", models=self.registry.names(), loaded=sorted(self.registry.loaded))

    async def drain(self, grace_s: float | None = None) -> None:
        """Stops admitting (new requests: 503 with Retry-After; /health: 503 "draining"), lets the
        requests in flight finish for up to `grace_s` (default `[server] shutdown_grace_s`), then
        ends the rest with a 503 `shutdown` error: a stream gets an error event and [DONE]."""
        if self.supervisor.draining:
            return
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        self.supervisor.draining = True
        at_start = self.in_flight()
        self.log.info("runtime.draining", in_flight=len(at_start), grace_s=grace)
        with trio.move_on_after(grace):
            while self.in_flight():
                await trio.sleep(0.02)
        cut = self.in_flight()
        for handle in cut:
            handle.fail(ServiceUnavailable("the server is shutting down and this request did not finish within "
                                           f"its grace period ({grace:g} s); retry", code="shutdown",
                                           retry_after_s=5.0))
        with trio.move_on_after(STEPS_SETTLE_S):  # a step launched ahead of an answer that has ended
            while not compute.idle():  # (overlap) returns, rather than being abandoned by the close
                await trio.sleep(0.005)
        self.drained = {"in_flight_at_drain": len(at_start), "finished_in_grace": len(at_start) - len(cut),
                        "cut": len(cut)}

    def in_flight(self) -> list[RequestHandle]:
        """The requests admitted and not yet ended."""
        return [h for h in self._live if h.active]

    @asynccontextmanager
    async def _route(self, handle: RequestHandle):
        """The request's model: its adapter and its actors' inboxes (the model is not unloaded
        while the request lives)."""
        async with self.registry.lease(handle) as loaded:
            prefix = loaded.prefix_cache
            kv = loaded.generator.runner.kv
            yield Route(loaded.adapter, loaded.encoder.inbox_send, prefix.inbox_send if prefix else None,
                        arena_tokens=kv.num_blocks * kv.block_size)

    # -- the API -------------------------------------------------------------------------

    def health(self, model: str | None = None) -> Health:
        """The runtime's health, or one model's (its actors and the shared intake): a load balancer
        can route around one sick model. ModelNotFound for a name that is not configured.

        One model's `ok` is what GET /health?model=NAME answers 200 for: the model is loaded and
        serving here (a model not loaded yet is not ok, though its first request would load it)."""
        if model is None:
            return self.supervisor.health(None, self.registry.states())
        self.registry.configured(model)
        health = self.supervisor.health(model, self.registry.states())
        if health.ok and not health.serving:
            health = dataclasses.replace(health, ok=False, reason=not_serving_yet(model, health.state))
        return health

    def models(self) -> list[dict[str, Any]]:
        states = self.health().models
        return [{"name": m.name, "loaded": m.name in self.registry.loaded, "state": states[m.name],
                 "default": m.name == self.config.default_model} for m in self.config.models]

    def stats(self) -> dict[str, dict]:
        """Per loaded model: its encoder's and encoder cache's counters."""
        return {name: {"encoder": m.encoder.stats(),
                       "prefix_cache": m.prefix_cache.stats()}
                for name, m in self.registry.loaded.items()}

    def debug_cache(self, oldest: int = 10) -> dict:
        """A JSON summary of both caches of every loaded model (admin endpoint /debug/cache)."""
        out = {}
        for name, m in self.registry.loaded.items():
            enc = m.encoder
            entry = {"encoder_cache": enc.stats()}
            if enc.cache is not None:
                entry["encoder_cache"]["oldest"] = [e._asdict() if hasattr(e, "_asdict") else e.__dict__
                                                    for e in enc.cache.snapshot()[:oldest]]
            arena = m.prefix_cache.arena
            snap = sorted((s for s in arena.snapshot() if s.lru_rank is not None), key=lambda s: s.lru_rank)
            entry["prefix_cache"] = dict(m.prefix_cache.stats(), owners_holding_blocks=len(arena.owners()),
                                         oldest=[s._asdict() for s in snap[:oldest]])
            out[name] = entry
        return out

    async def reset_caches(self, model: str | None = None, caches: tuple[str, ...] = CACHE_KINDS,
                           timeout_s: float = 10.0) -> dict:
        """Empties the encoder and/or prefix caches of `model` (every loaded model if None).

        Each cache's owning actor does it between its own steps, so nothing in flight is torn:
        entries pinned by running requests stay until released. Returns the entries dropped per
        model and cache. A model that is not loaded has nothing cached."""
        unknown = sorted(set(caches) - set(CACHE_KINDS))
        if unknown or not caches:
            raise BadRequest(f"caches must be a non-empty list of {', '.join(CACHE_KINDS)}; got {list(caches)!r}",
                             param="caches")
        if model is not None:
            self.registry.configured(model)  # ModelNotFound for a name that is not configured
        out = {}
        for name, m in list(self.registry.loaded.items()):
            if model is not None and name != model:
                continue
            owners = {"encoder": m.encoder, "prefix": m.prefix_cache}
            out[name] = {kind: await self._clear(owners[kind], timeout_s) for kind in caches}
        self.log.info("runtime.caches_reset", models=sorted(out), caches=list(caches), dropped=out)
        return out

    async def _clear(self, actor, timeout_s: float) -> int | None:
        """Entries `actor` dropped; None when that cache is disabled."""
        if actor is None or getattr(actor, "cache", True) is None:
            return None
        send, receive = trio.open_memory_channel(1)
        actor.inbox_send.send_nowait(ClearCache(send))
        with trio.move_on_after(timeout_s):
            return await receive.receive()
        raise ServiceUnavailable(f"{actor.name} did not answer the cache reset within {timeout_s} s; retry shortly")

    def parse(self, body: dict) -> ChatRequest:
        """Validates an OpenAI-shaped request body (raises a typed 4xx error); its tools are bound
        to the model (its `tool_parser`; the grammar of a forced call)."""
        return self._bind_tools(parse_chat_request(body, self.config.limits, self.config.default_model))

    def parse_completions(self, body: dict) -> tuple[ChatRequest, ...]:
        """Validates a legacy completions body (`/v1/completions`): one request per prompt, each
        started with `chat(request=...)` and served on the chat path, its prompt untemplated."""
        return parse_completion_requests(body, self.config.limits, self.config.default_model)

    # -- vLLM's tokenizer routes (mmserve.runtime.tokenization) -------------------------------

    async def _adapter(self, model: str | None):
        name = model or self.config.default_model
        self.registry.configured(name)  # ModelNotFound (404) for a name that is not configured
        return (await self.registry.get(name)).adapter

    async def tokenize(self, body: dict) -> dict:
        """vLLM's `/tokenize`: a `prompt`, or `messages` rendered as a chat request's prompt is
        (images expanded to the tokens the model sees): `{count, max_model_len, tokens, token_strs}`."""
        request = parse_tokenize(body, self.config.limits, self.config.default_model)
        adapter = await self._adapter(request.model)
        return await trio.to_thread.run_sync(tokenization.tokenize, adapter, request, self.config.limits,
                                             limiter=self.intake.limiter, abandon_on_cancel=True)

    async def routing_keys(self, body: dict) -> dict:
        """A chat request's keys for KV-aware routers (`runtime.routing_keys`): expanded token ids,
        per-block image hashes, routing group — as this replica's KV events name its blocks."""
        request = self.parse(body)
        adapter = await self._adapter(request.model)
        return await trio.to_thread.run_sync(routing_keys, adapter, request, self.config.limits,
                                             self.config.kv_cache.block_size, limiter=self.intake.limiter,
                                             abandon_on_cancel=True)

    async def detokenize(self, body: dict) -> dict:
        """vLLM's `/detokenize`: `{"tokens": [...]}` -> `{"prompt": text}`."""
        request = parse_detokenize(body, self.config.limits, self.config.default_model)
        adapter = await self._adapter(request.model)
        return tokenization.detokenize(adapter, request)

    async def tokenizer_info(self, model: str | None = None) -> dict:
        """vLLM's `/tokenizer_info`: the tokenizer's class, special tokens and chat template."""
        return tokenization.tokenizer_info(await self._adapter(model))

    async def text_completion(self, prompt: str | list, **params: Any) -> ChatCompletion:
        """One legacy completion of a single raw `prompt` (text or token ids), run to its end;
        the keywords are those of `/v1/completions` (`max_tokens` defaults to 16)."""
        requests = self.parse_completions(dict(params, prompt=prompt))
        if len(requests) != 1:
            raise BadRequest("text_completion takes one prompt; start each of a batch with chat(request=...)",
                             param="prompt")
        request = requests[0]
        return await complete(self.chat(request=request))

    def _bind_tools(self, request: ChatRequest) -> ChatRequest:
        model = self.config.model(request.model)  # an unknown model is refused by chat(): 404
        if request.tools is None or not request.tools.parsed or request.tools.parser is not None or model is None:
            return request  # nothing to bind, or bound already
        tools, grammar = bind_tools(request.tools, request.model, model.tool_parser)
        if grammar is not None:
            request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, grammar=grammar))
        return dataclasses.replace(request, tools=tools)

    def chat(self, messages: list | None = None, *, request: ChatRequest | dict | None = None,
             client_request_id: str | None = None, request_id: str | None = None, **params: Any) -> ChatStream:
        """Starts a chat request and returns its stream of deltas.

        Either `messages` plus OpenAI parameters as keywords (`model`, `max_tokens`, `temperature`,
        `top_p`, `top_k`, `seed`, `stop`, ...), or a whole `request` (a body dict or a parsed
        ChatRequest). Invalid input raises a typed `MMServeError` here, before any work starts.

        Every request gets a fresh internal id (`stream.request_id`) that keys all of its state;
        `client_request_id` is the caller's label for it, logged beside the internal id and
        searchable with `mmserve trace`, and may be shared by any number of requests (a body's vLLM
        `request_id` is used when it is not given). (`request_id`:
        an internal id the HTTP layer minted already, never a client's.) A refused request logs one
        `request.rejected` line and counts in `mmserve:request_rejected_total`.
        """
        request_id = request_id or new_request_id()
        try:
            if not isinstance(request, ChatRequest):
                body = dict(request or {}, **params)
                if messages is not None:
                    body["messages"] = messages
                request = self.parse(body)
            request = self._bind_tools(request)  # a ChatRequest parsed elsewhere
            # the body's vLLM `request_id` labels the request when the caller (header) gave none
            client_request_id = client_request_id or request.options.client_request_id
            self.registry.configured(request.model)
            health = self.supervisor.health(request.model)  # a model that failed to load is tried again
            if not health.ok:  # fail fast: never queue behind a dead, hung or draining actor
                raise ServiceUnavailable(f"model {request.model!r} cannot answer now: {health.reason}",
                                         retry_after_s=health.retry_after_s)
            self._admit_or_refuse()
        except MMServeError as e:
            model = request.model[:128] if isinstance(request, ChatRequest) else None
            self.reject(e, request_id, client_request_id, model)
            raise
        send, receive = trio.open_memory_channel(math.inf)
        handle = RequestHandle(request_id, request, send, client_request_id=client_request_id)
        self._live.add(handle)
        self.log.info("request.received", request_id=handle.request_id, client_request_id=client_request_id,
                      model=request.model,
                      images=request.num_images, messages=len(request.messages), stream=request.stream)
        self.intake.inbox_send.send_nowait(Submit(handle))
        return ChatStream(handle, receive, self.config.limits.request_timeout_s,
                          fingerprint(self.config.runtime.deterministic))

    def reject(self, error: MMServeError, request_id: str | None, client_request_id: str | None = None,
               model: str | None = None) -> None:
        """The one `request.rejected` line of a refused request, and its count by reason (once per
        error, however many layers it passes; failures — 500, 504 — are not rejections)."""
        if log_rejection(self.log, error, request_id=request_id, client_request_id=client_request_id, model=model):
            self.metrics.rejected(error.reason)

    def _admit_or_refuse(self) -> None:
        """Back-pressure: beyond `max_pending_requests` in flight, refuse with 429 + Retry-After."""
        limit = self.config.limits.max_pending_requests
        if len(self.in_flight()) >= limit:
            raise Overloaded(f"mmserve is at its limit of {limit} requests in flight; retry shortly",
                             retry_after_s=1.0)

    async def chat_completion(self, messages: list | None = None, **kwargs: Any) -> ChatCompletion:
        """Runs a chat request to the end and returns the whole answer."""
        return await complete(self.chat(messages, **kwargs))

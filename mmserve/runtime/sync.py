"""SyncRuntime: the embedded Runtime for programs that are not trio.

    with mmserve.SyncRuntime() as rt:          # or SyncRuntime("my.toml"), SyncRuntime(Config(...))
        print(rt.chat_completion(messages, temperature=0).text)
        for delta in rt.chat(messages):
            print(delta.text, end="")

The runtime runs in a background thread with its own trio loop; calls cross over with
`trio.from_thread`. `config` is as for `Runtime.open`: None is the packaged default config, and
logs go through the standard `logging` module (logger `mmserve`), never to stdout.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import trio

from mmserve.config import Config
from mmserve.errors import MMServeError
from mmserve.inputs.request import ChatRequest
from mmserve.runtime.runtime import CACHE_KINDS, ChatCompletion, Delta, Runtime
from mmserve.runtime.supervisor import Health


class SyncRuntime:
    def __init__(self, config: Config | str | Path | None = None):
        self._config = config
        self._rt: Runtime | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mmserve-runtime", daemon=True)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # surfaced to the caller of __enter__
            self._error = e
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with Runtime.open(self._config) as rt:
            self._rt = rt
            self._ready.set()
            await self._stop.wait()

    def start(self) -> "SyncRuntime":
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"mmserve failed to start: {self._error}") from self._error
        return self

    def close(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()

    def __enter__(self) -> "SyncRuntime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def runtime(self) -> Runtime:
        return self._rt

    def chat_completion(self, messages: list | None = None, **kwargs: Any) -> ChatCompletion:
        return trio.from_thread.run(lambda: self._rt.chat_completion(messages, **kwargs), trio_token=self._token)

    def chat(self, messages: list | None = None, **kwargs: Any) -> Iterator[Delta]:
        """Yields the answer's deltas; stopping early aborts the request."""
        stream = trio.from_thread.run_sync(lambda: self._rt.chat(messages, **kwargs), trio_token=self._token)
        try:
            while True:
                try:
                    yield trio.from_thread.run(stream.__anext__, trio_token=self._token)
                except StopAsyncIteration:
                    return
        finally:
            trio.from_thread.run_sync(stream.close, trio_token=self._token)

    # -- the rest of Runtime's API, each call crossing into the runtime's thread -------------------
    # (tests/test_sync_runtime.py walks Runtime's public methods: each has its twin here)

    def _call(self, fn, *args, **kwargs):
        return trio.from_thread.run_sync(lambda: fn(*args, **kwargs), trio_token=self._token)

    def _await(self, fn, *args, **kwargs):
        return trio.from_thread.run(lambda: fn(*args, **kwargs), trio_token=self._token)

    def text_completion(self, prompt: str | list, **params: Any) -> ChatCompletion:
        return self._await(self._rt.text_completion, prompt, **params)

    def health(self, model: str | None = None) -> Health:
        return self._call(self._rt.health, model)

    def models(self) -> list[dict[str, Any]]:
        return self._call(self._rt.models)

    def stats(self) -> dict:
        return self._call(self._rt.stats)

    def in_flight(self) -> list:
        """The requests admitted and not yet ended (their handles)."""
        return self._call(self._rt.in_flight)

    def debug_cache(self, oldest: int = 10) -> dict:
        return self._call(self._rt.debug_cache, oldest)

    def reset_caches(self, model: str | None = None, caches: tuple[str, ...] = CACHE_KINDS,
                     timeout_s: float = 10.0) -> dict:
        return self._await(self._rt.reset_caches, model, caches, timeout_s)

    def parse(self, body: dict) -> ChatRequest:
        return self._call(self._rt.parse, body)

    def parse_completions(self, body: dict) -> tuple[ChatRequest, ...]:
        return self._call(self._rt.parse_completions, body)

    def reject(self, error: MMServeError, request_id: str | None, client_request_id: str | None = None,
               model: str | None = None) -> None:
        return self._call(self._rt.reject, error, request_id, client_request_id, model)

    def drain(self, grace_s: float | None = None) -> None:
        """Stops admitting, lets requests in flight finish for up to `grace_s` (see Runtime.drain)."""
        return self._await(self._rt.drain, grace_s)

    def tokenize(self, body: dict) -> dict:
        """vLLM's /tokenize (see Runtime.tokenize)."""
        return self._await(self._rt.tokenize, body)

    def detokenize(self, body: dict) -> dict:
        return self._await(self._rt.detokenize, body)

    def routing_keys(self, body: dict) -> dict:
        """A chat request's keys for KV-aware routers (see Runtime.routing_keys)."""
        return self._await(self._rt.routing_keys, body)

    def tokenizer_info(self, model: str | None = None) -> dict:
        return self._await(self._rt.tokenizer_info, model)

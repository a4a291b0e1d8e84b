"""What every scenario gets: the parameters, the model, the baselines, the systems under test
(each warmed up before use) and a way to report progress."""

from __future__ import annotations

import itertools
from contextlib import asynccontextmanager
from functools import cached_property
from pathlib import Path
from typing import Callable

import httpx

from mmserve.bench.baselines import HFBaseline, SuffixPrefill
from mmserve.bench.common import QUESTIONS, ask, timed_chat, timed_http
from mmserve.bench.params import BenchParams
from mmserve.bench.servers import bench_config, http_server, open_runtime

WARMUP_IMAGE = 10_000  # image indices from here on are for warm-ups only


class Bench:
    def __init__(self, params: BenchParams, model_dir: Path, workdir: Path, note: Callable[[str], None] = print):
        self.params = params
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir)
        self.note = note
        self._images = itertools.count()
        self._warmups = itertools.count(WARMUP_IMAGE)

    def new_image(self) -> int:
        """An image index no earlier request of this run has used (so no cache can know it)."""
        return next(self._images)

    @cached_property
    def hf(self) -> HFBaseline:
        self.note("loading HF baseline")
        base = HFBaseline(self.model_dir)
        base.generate(ask(next(self._warmups)), 2)
        return base

    @cached_property
    def ref(self) -> SuffixPrefill:
        self.note("loading reference adapter")
        ref = SuffixPrefill(self.model_dir)
        ref.time(ask(next(self._warmups)), 0, repeats=1)
        return ref

    def config(self, prefix: bool = True, encoder: bool = True):
        return bench_config(self.model_dir, self.params.torch_threads, prefix=prefix, encoder=encoder)

    @asynccontextmanager
    async def runtime(self, prefix: bool = True, encoder: bool = True):
        """An embedded Runtime, warmed up by one request (on an image no scenario uses)."""
        self.note(f"starting runtime (prefix cache {'on' if prefix else 'off'}, encoder cache {'on' if encoder else 'off'})")
        async with open_runtime(self.config(prefix, encoder)) as rt:
            await timed_chat(rt, ask(next(self._warmups), QUESTIONS[1]), 2)
            yield rt

    @asynccontextmanager
    async def server(self, prefix: bool = True, encoder: bool = True):
        """(httpx client, URL) of an HTTP server, warmed up by one streamed request."""
        self.note(f"starting HTTP server ({self.params.http})")
        async with http_server(self.config(prefix, encoder), self.params.http, self.workdir) as url:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(limits=limits, timeout=None) as client:
                await timed_http(client, url, ask(next(self._warmups), QUESTIONS[1]), 2)
                yield client, url

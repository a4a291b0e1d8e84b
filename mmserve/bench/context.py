"""What every scenario gets: the parameters, the model, the baselines, the systems under test
(each warmed up before use) and a way to report progress."""

from __future__ import annotations

import itertools
from functools import partial
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

import httpx

from mmserve.bench.baselines import HFBaseline, SuffixPrefill, hf_baseline, release_device_memory
from mmserve.bench.common import MODEL, QUESTIONS, QWEN_IMAGE_SIZES, Images, Timing, timed_chat, timed_http
from mmserve.bench.model import family, sizes_vary
from mmserve.bench.params import BenchParams
from mmserve.bench.servers import bench_config, http_server, open_runtime
from mmserve.actors import compute
from mmserve.models.loading import load_adapter

WARMUP_IMAGE = 10_000  # image indices from here on are for warm-ups only


class Bench:
    def __init__(self, params: BenchParams, model_dir: Path, workdir: Path, note: Callable[[str], None] = print):
        self.params = params
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir)
        self.note = note
        self.family = family(self.model_dir)  # "llava", "qwen2_vl", "gemma3", ... from config.json
        # where the token count follows an image's size (the Qwens, LLaVA-OneVision's tiles,
        # Idefics3's): vary it; LLaVA and Gemma 3 (one fixed-size view) keep their 64x64 images
        self.images = Images(QWEN_IMAGE_SIZES if sizes_vary(self.family) else ())
        self._images = itertools.count()
        self._warmups = itertools.count(WARMUP_IMAGE)
        self._hf: HFBaseline | None = None
        self._hf_batch_warm = False
        self._ref: SuffixPrefill | None = None
        self._adapter = None  # one loaded model under both baselines (a 7B one twice would crowd a GPU)

    def new_image(self) -> int:
        """An image index no earlier request of this run has used (so no cache can know it)."""
        return next(self._images)

    def image(self, i: int):
        """Image i of this run (see `Images`)."""
        return self.images(i)

    def ask(self, i: int, question: str = QUESTIONS[0]) -> list[dict]:
        """A one-turn request about image i of this run."""
        return self.images.ask(i, question)

    # The baselines run on mmserve's compute thread, like mmserve's own model steps: torch work on
    # a second thread would start a second OpenMP team, and with more OpenMP threads than CPUs
    # libgomp stops spin-waiting between ops in *every* team, slowing both sides of a comparison
    # by different amounts (a 28-token suffix prefill went from ~24 ms to ~40 ms in this process).

    async def _baseline_adapter(self):
        if self._adapter is None:
            p = self.params
            self._adapter = await compute.run(partial(load_adapter, MODEL, self.model_dir, device=p.device,
                                                      dtype=p.dtype))
        return self._adapter

    async def model_adapter(self):
        """The benchmark's own loaded model (the one under the HF baselines; loaded on first use)."""
        return await self._baseline_adapter()

    async def _hf_baseline(self) -> HFBaseline:
        if self._hf is None:
            self.note("loading HF baseline")
            adapter = await self._baseline_adapter()
            self._hf = await compute.run(partial(hf_baseline, self.model_dir, self.params.device, self.params.dtype,
                                                 adapter=adapter))
            await compute.run(self._hf.generate, self.ask(next(self._warmups)), 2)
        return self._hf

    async def hf_generate(self, messages: list[dict], tokens: int) -> Timing:
        """Raw transformers `generate` of exactly `tokens` greedy tokens."""
        hf = await self._hf_baseline()
        return await compute.run(hf.generate, messages, tokens)

    async def hf_generate_batch(self, requests: list[list[dict]], tokens: int) -> Timing:
        """One raw transformers `generate` call over all `requests` (left-padded), exactly `tokens`
        greedy tokens each; warmed up first by a batch of two (batched shapes differ)."""
        hf = await self._hf_baseline()
        if not self._hf_batch_warm:
            await compute.run(hf.generate_batch, [self.ask(next(self._warmups)) for _ in range(2)], 2)
            self._hf_batch_warm = True
        return await compute.run(hf.generate_batch, requests, tokens)

    async def suffix_prefill(self, messages: list[dict], hit: int, repeats: int) -> tuple[float, int]:
        """(median seconds, suffix tokens) of the bare prefill of the prompt's tokens after `hit`."""
        if self._ref is None:
            self.note("loading reference adapter")
            adapter = await self._baseline_adapter()
            self._ref = await compute.run(partial(SuffixPrefill, self.model_dir, adapter=adapter))
            await compute.run(self._ref.time, self.ask(next(self._warmups)), 0, 1)
        return await compute.run(self._ref.time, messages, hit, repeats)

    def config(self, prefix: bool = True, encoder: bool = True, **sections):
        """The benchmark's config; `sections` override keys as `Config.replace` takes them."""
        p = self.params
        config = bench_config(self.model_dir, p.torch_threads, prefix=prefix, encoder=encoder, device=p.device,
                              dtype=p.dtype, kv_budget_bytes=p.kv_budget_bytes())
        if p.deterministic:  # every mmserve runtime and server of the run in the bit-exact mode
            config = config.replace(runtime={"deterministic": True})
        return config.replace(**sections) if sections else config

    @asynccontextmanager
    async def runtime(self, prefix: bool = True, encoder: bool = True, **sections):
        """An embedded Runtime, warmed up by one request (on an image no scenario uses); `sections`
        override config keys (e.g. `runtime={"cuda_graphs": False}`)."""
        self.note(f"starting runtime (prefix cache {'on' if prefix else 'off'}, encoder cache {'on' if encoder else 'off'})")
        try:
            async with open_runtime(self.config(prefix, encoder, **sections)) as rt:
                await timed_chat(rt, self.ask(next(self._warmups), QUESTIONS[1]), 2)
                yield rt
        finally:
            rt = None  # noqa: F841  (the closed runtime's model and KV arena can go now)
            release_device_memory(self.params.device)  # for the next runtime, or a server's own process

    @asynccontextmanager
    async def server(self, prefix: bool = True, encoder: bool = True, **sections):
        """(httpx client, URL) of an HTTP server, warmed up by one streamed request; `sections`
        override config keys as `config` takes them."""
        self.note(f"starting HTTP server ({self.params.http})")
        async with http_server(self.config(prefix, encoder, **sections), self.params.http, self.workdir) as url:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(limits=limits, timeout=None) as client:
                await timed_http(client, url, self.ask(next(self._warmups), QUESTIONS[1]), 2)
                yield client, url

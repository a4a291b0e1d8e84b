"""Model registry: the configured models; loads them on first use (or at start), unloads the least
recently used idle one beyond `max_loaded_models`, and gives each loaded model its own actors."""

from __future__ import annotations

import time
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch
import trio

from mmserve.actors import compute
from mmserve.actors.base import Actor
from mmserve.actors.encoder import Encoder
from mmserve.actors.generator import Generator
from mmserve.actors.prefix_cache import PrefixCacheManager
from mmserve.errors import CheckpointError, MMServeError, ModelNotFound, ServiceUnavailable, clip
from mmserve.logs import get_logger
from mmserve.models.adapter import Adapter
from mmserve.engine.attention import check_attention
from mmserve.models.loading import check_checkpoint, load_adapter
from mmserve.config import Config, ModelConfig
from mmserve.inputs.image_budget import UnknownLayout, processing_pixels
from mmserve.runtime import gc_heap
from mmserve.runtime.sizing import choose_dtype
from mmserve.runtime.supervisor import Supervisor


@dataclass
class LoadedModel:
    config: ModelConfig
    adapter: Adapter
    actors: dict[str, Actor]  # "encoder", "generator", "prefix_cache" (the KV arena's manager), "shared_tier"
    last_used: float = field(default_factory=time.monotonic)
    # the requests routed here, held weakly: an entry goes when the last reference to its handle
    # does (the caller's stream, the actor holding it), so an ended request leaves nothing here
    # whatever prunes or unloads ever run (issue 46: a strong set kept every handle, its images
    # and its output channel, until the model was unloaded)
    routed: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def encoder(self) -> Encoder:
        return self.actors["encoder"]

    @property
    def generator(self) -> Generator:
        return self.actors["generator"]

    @property
    def prefix_cache(self) -> PrefixCacheManager:
        return self.actors["prefix_cache"]

    @property
    def idle(self) -> bool:
        """No request it serves lives: none routed here is active, and no actor holds or awaits one."""
        return not (any(h.active for h in self.routed) or self.generator.running or any(
            a.in_flight or a.inbox.statistics().current_buffer_used for a in self.actors.values()))


class ModelRegistry:
    def __init__(self, config: Config, supervisor: Supervisor, build_actors):
        self.config = config
        self.supervisor = supervisor
        self.build_actors = build_actors
        self.loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, trio.Event] = {}
        self._failed: set[str] = set()  # the last load of these failed (the next request tries again)
        self.log = get_logger("registry")

    def states(self) -> dict[str, str]:
        """Each configured model's state: "ok" (loaded), "loading", "failed" or "not_loaded"."""
        def state(name: str) -> str:
            if name in self.loaded:
                return "ok"
            return "loading" if name in self._loading else "failed" if name in self._failed else "not_loaded"
        return {name: state(name) for name in self.names()}

    @asynccontextmanager
    async def lease(self, handle) -> AsyncIterator[LoadedModel]:
        """The loaded model of request `handle` (loading it if needed). The model is not unloaded
        while the request lives, wherever it is between the model's actors."""
        model = await self.get(handle.model)
        model.routed.add(handle)
        yield model

    def names(self) -> list[str]:
        return [m.name for m in self.config.models]

    def configured(self, name: str) -> ModelConfig:
        """The configuration of model `name`, or ModelNotFound naming the models that exist."""
        mc = self.config.model(name)
        if mc is None:
            raise ModelNotFound(
                f"the model {clip(name)} does not exist; available: {', '.join(self.names())}", param="model")
        return mc

    def require(self, name: str) -> LoadedModel:
        """The loaded model `name` (for inspection); raises if it is not loaded."""
        self.configured(name)
        if name not in self.loaded:
            raise ServiceUnavailable(f"the model {name!r} is not loaded")
        return self.loaded[name]

    async def get(self, name: str) -> LoadedModel:
        """The loaded model `name`, loading it first if needed (concurrent callers share one load)."""
        mc = self.configured(name)
        while name not in self.loaded:
            if name in self._loading:
                await self._loading[name].wait()
                continue
            await self._load(mc)
        model = self.loaded[name]
        model.last_used = time.monotonic()
        return model

    async def _load(self, mc: ModelConfig) -> None:
        """Loads in a worker thread of its own, on its own clock (`load_timeout_s`): a large
        checkpoint is not a stalled model step, and the compute thread keeps serving."""
        done = self._loading[mc.name] = trio.Event()
        try:
            self._make_room()
            rc = self.config.runtime
            t0 = time.monotonic()
            # a big checkpoint takes minutes on a CPU: the line that says it started tells a waiting
            # user (and a waiting request's log) that the server is busy, not hung
            self.log.info("registry.model_loading", model=mc.name, path=str(mc.resolved_path()),
                          device=rc.device, load_timeout_s=rc.load_timeout_s)
            with trio.move_on_after(rc.load_timeout_s) as timer:
                adapter = await trio.to_thread.run_sync(self._read_checkpoint, mc, abandon_on_cancel=True)
            if timer.cancelled_caught:
                raise TimeoutError(f"the load took longer than load_timeout_s = {rc.load_timeout_s} s")
            # wired at construction (`runtime.model_actors`), on this event loop: one torch thread, or a
            # parallel op there (deterministic mode packs every weight for oneDNN) starts a second OpenMP
            # team and every later step pays a futex wake-up per op (`actors.compute`; measured on the
            # 2-core bench: the mode's decode 20.8 ms a token with the second team, 15.9 without)
            with compute.single_threaded():
                actors = self.build_actors(adapter)
            model = LoadedModel(mc, adapter, actors)
            # decode graphs captured before the first request (CUDA only). Elsewhere the compute thread
            # is not started here: started during a load, its OpenMP team cost every later step of
            # the CPU bench a third of its batched throughput (measured: @8 concurrent 234 -> 155 tok/s)
            runner = actors["generator"].runner
            captured = await compute.run(runner.capture, owner=f"registry[{mc.name}]") if runner.captures else 0
            vision = actors["encoder"].vision  # the vision tower's graphs after the runner's (their own pool)
            vision_graphs = await compute.run(vision.capture, owner=f"registry[{mc.name}]") if vision.captures else 0
            for kind, failed in [*runner.failed_captures.items(), ("vision", vision.failed_captures)]:
                if failed:  # those buckets run eagerly: slower, still right
                    self.log.warning("registry.graphs_failed", model=mc.name, steps=kind, buckets=sorted(failed),
                                     error=next(iter(failed.values())))
            for actor in model.actors.values():
                self.supervisor.start(actor)
            if (tier := model.actors.get("shared_tier")) is not None:
                await tier.connect()  # bounded; a Redis that is down leaves the tier off, the model serving
            self.loaded[mc.name] = model
            self._failed.discard(mc.name)
            self._warn_if_unbounded(adapter)
            # a full collection over the model's objects would stall the event loop ~200 ms at a time
            heap = gc_heap.settle() if rc.gc_freeze else {}
            kv = runner.kv
            self.log.info("registry.model_loaded", model=mc.name, path=str(mc.resolved_path()),
                          load_s=round(time.monotonic() - t0, 3), decode_graphs=captured, vision_graphs=vision_graphs,
                          dtype=str(adapter.dtype).removeprefix("torch."), dtype_from=getattr(adapter, "dtype_from", "?"),
                          kv_budget_bytes=kv.nbytes, kv_tokens=kv.num_blocks * kv.block_size,
                          kv_budget_from=getattr(runner, "kv_budget_from", "?"), **heap)
        except CheckpointError as e:  # its message says it all: no traceback to log
            self._failed.add(mc.name)
            self.log.error("registry.load_failed", model=mc.name, path=str(mc.resolved_path()), error=e.message)
            raise
        except MMServeError:
            raise
        except Exception as e:  # any loader error (a corrupt file, a bad config): the model's, not the caller's
            self._failed.add(mc.name)
            self.log.error("registry.load_failed", model=mc.name, path=str(mc.resolved_path()),
                           error=f"{type(e).__name__}: {e}", exc_info=e)
            raise ServiceUnavailable(f"model {mc.name!r} could not be loaded ({type(e).__name__}: "
                                     f"{clip(str(e))}); see the server log") from None
        finally:
            del self._loading[mc.name]
            done.set()

    def _read_checkpoint(self, mc: ModelConfig) -> Adapter:
        # one torch thread: a second OpenMP team in the process would make libgomp stop
        # spin-waiting in the compute thread's team for good (actors/compute.py)
        torch.set_num_threads(1)
        rc = self.config.runtime
        dtype = choose_dtype(rc.dtype, mc.resolved_path(), rc.device)
        check_checkpoint(mc.name, mc.resolved_path())
        check_attention(mc.name, mc.resolved_path())  # before the weights load: a feature we lack is refused
        adapter = load_adapter(mc.name, mc.resolved_path(), device=rc.device, dtype=dtype.value,
                               hash_algorithm=self.config.kv_cache.hash)
        adapter.dtype_from = dtype.why  # for the load log line
        compute.beat_per_layer(adapter.model)  # a slow forward reports progress: not taken for a hung one
        return adapter

    def _warn_if_unbounded(self, adapter: Adapter) -> None:
        try:
            processing_pixels(adapter.image_processor, 1, 1)
        except UnknownLayout as e:
            self.log.warning("registry.image_budget_unknown", model=adapter.name, error=str(e))

    def _make_room(self) -> None:
        """Unloads idle models until the loads in progress (this one included) fit the limit."""
        limit = self.config.runtime.max_loaded_models
        while limit and len(self.loaded) + len(self._loading) > limit:
            idle = [m for m in self.loaded.values() if m.idle]
            if not idle:
                raise ServiceUnavailable(
                    f"all {limit} model slots are busy (max_loaded_models); retry shortly")
            self.unload(min(idle, key=lambda m: m.last_used).name)

    def unload(self, name: str) -> None:
        """Stops an idle model's actors. Should a request have reached one after all, it is
        answered with a 503 (retry: the model loads again), never left waiting."""
        model = self.loaded.pop(name)
        gone = ServiceUnavailable(f"the model {name!r} was unloaded while this request waited for it; retry",
                                  retry_after_s=1.0)
        stranded = 0
        for actor in model.actors.values():
            self.supervisor.stop(actor.key)
            stranded += actor.fail_in_flight(gone)
            while True:
                try:
                    msg = actor.inbox.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                if getattr(msg, "handle", None) is not None:
                    msg.handle.fail(gone)
                    stranded += 1
        if (manager := model.actors.get("prefix_cache")) is not None:
            manager.detach_events()  # its blocks were withdrawn by its reset above; the stream goes on
        if self.config.runtime.gc_freeze:
            gc_heap.release()  # the model's cycles are collectable again; the next load freezes anew
        self.log.info("registry.model_unloaded", model=name, stranded=stranded)

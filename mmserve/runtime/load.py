"""A loaded model's load right now: the figures both `/metrics` and `/v1/loads` report.

One function reads them from the runtime's own state, so the Prometheus gauges a router scrapes
(`mmserve:num_requests_running`, `…_waiting`, `mmserve:kv_cache_usage_perc`) and the JSON load
report a router polls (`GET /v1/loads`) agree by construction, never by two copies of one sum.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mmserve.actors.kv_events import KVEventPublisher
    from mmserve.actors.messages import RequestHandle
    from mmserve.config import Config
    from mmserve.runtime.registry import LoadedModel, ModelRegistry
    from mmserve.runtime.supervisor import Health, Supervisor


class RuntimeState(Protocol):
    """What the load figures and the metrics read of a running `Runtime`. A Protocol, so neither
    this module nor `runtime.metrics` imports the runtime that imports them (no import cycle)."""

    config: "Config"
    registry: "ModelRegistry"
    supervisor: "Supervisor"
    kv_events: "KVEventPublisher | None"  # the replica's KV event stream ([kv_events]; None: off)

    def health(self, model: str | None = None) -> "Health": ...

    def in_flight(self) -> "Iterable[RequestHandle]":
        """The requests admitted and not yet ended."""
        ...


@dataclass(frozen=True)
class ModelLoad:
    model: str
    running: int  # requests the scheduler admitted (n choices count once)
    waiting: int  # accepted but not running yet (being prepared, or waiting for admission)
    used_blocks: int  # KV blocks held by running requests (cached blocks nobody holds are free)
    evictable_blocks: int  # KV blocks holding cached prefixes nobody holds
    num_blocks: int  # the KV arena's size
    block_size: int  # tokens a block holds
    max_running: int  # [generator] max_running_requests
    hit_tokens: int  # prompt tokens the prefix cache served, since start
    query_tokens: int  # prompt tokens looked up in the prefix cache, since start

    @property
    def kv_usage(self) -> float:
        """Fraction of the arena held by running requests (0-1): mmserve:kv_cache_usage_perc."""
        return self.used_blocks / (self.num_blocks or 1)

    @property
    def evictable(self) -> float:
        return self.evictable_blocks / (self.num_blocks or 1)


def model_load(rt: RuntimeState, m: "LoadedModel", live_ids: dict[str, set[str]]) -> ModelLoad:
    admitted = {s.handle.request_id for s in m.generator.running if s.admitted}
    kv = m.prefix_cache.stats()
    return ModelLoad(
        model=m.name, running=len(admitted),
        waiting=sum(1 for rid in live_ids.get(m.name, ()) if rid not in admitted),
        used_blocks=kv["referenced_blocks"], evictable_blocks=kv["evictable_blocks"], num_blocks=kv["num_blocks"],
        block_size=kv["block_size"], max_running=rt.config.generator.max_running_requests,
        hit_tokens=kv["hit_tokens"], query_tokens=kv["query_tokens"])


def model_loads(rt: RuntimeState) -> list[ModelLoad]:
    """Each loaded model's load, in the registry's order (one read of the live requests for all)."""
    live_ids: dict[str, set[str]] = {}
    for h in rt.in_flight():
        live_ids.setdefault(h.model, set()).add(h.request_id)
    return [model_load(rt, m, live_ids) for m in rt.registry.loaded.values()]

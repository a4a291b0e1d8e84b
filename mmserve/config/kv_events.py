"""The `[kv_events]` section: KV events (blocks cached, evicted, cleared) published over ZMQ in
vLLM's wire format, for the KV-aware routers of Dynamo and llm-d (`actors.kv_events`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mmserve.config.checks import check_bool, check_choice, check_int, check_str, fail

KV_EVENT_ENCODINGS = ("vllm", "dynamo")  # actors.kv_event_wire.ENCODINGS (a test keeps them equal)
_TCP = re.compile(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.*-]+):[0-9]{1,5}")


def _check_endpoint(key: str, value: str, empty: bool) -> None:
    check_str("[kv_events]", key, value, empty=empty)
    if value and not (_TCP.fullmatch(value) or value.startswith("ipc://")):
        fail("[kv_events]", key, "tcp://HOST:PORT or ipc://PATH" + (' (or "" for none)' if empty else ""), value)


@dataclass(frozen=True)
class KVEventsConfig:
    """KV events published by this replica; off unless `enabled`."""

    enabled: bool = False
    endpoint: str = "tcp://127.0.0.1:5557"  # the PUB socket this replica binds; routers connect to it
    replay_endpoint: str = ""  # the ROUTER socket for missed batches (vLLM's replay protocol); "": none
    topic: str = ""  # the first frame of every message ("" like vLLM's default)
    encoding: str = "vllm"  # "vllm": vLLM's positional form (llm-d); "dynamo": map form with block_mm_infos
    replay_batches: int = 10_000  # batches kept for replay (vLLM's buffer_steps)
    queue_batches: int = 10_000  # batches waiting for the publisher thread; beyond: dropped (counted)

    def __post_init__(self) -> None:
        check_bool("[kv_events]", "enabled", self.enabled)
        _check_endpoint("endpoint", self.endpoint, empty=False)
        _check_endpoint("replay_endpoint", self.replay_endpoint, empty=True)
        if self.replay_endpoint and self.replay_endpoint == self.endpoint:
            fail("[kv_events]", "replay_endpoint", "an endpoint other than endpoint", self.replay_endpoint)
        check_str("[kv_events]", "topic", self.topic, empty=True)
        check_choice("[kv_events]", "encoding", self.encoding, KV_EVENT_ENCODINGS)
        check_int("[kv_events]", "replay_batches", self.replay_batches, 1)
        check_int("[kv_events]", "queue_batches", self.queue_batches, 1)

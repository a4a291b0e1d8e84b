"""The benchmark scenarios, one module per group: throughput (1 decode, 2 concurrency), caching
(3 multi-turn, 4 same image, 5 three images) and versus_peer (6 peer), replicas (7 two servers on one Redis), scaleout (11 two servers behind SMG, cache-aware vs round-robin), structured (8 JSON-schema
decoding), engine (9 the host's overhead around a stand-in forward) and absolute (10 the device's
copy bandwidth and prefill time per token count, for the absolute figures) and video (12, opt-in: a
second question about one clip, decode rate, peak memory) and deterministic (13, opt-in: the
`[runtime] deterministic` mode's cost, two servers side by side). Each compares side by side,
in the same run, and returns a dict of measurements plus `rows` for the report's summary table.
Times are seconds unless named `_ms`. Part of the `mmserve bench` entry point: it may import
anything in mmserve."""

from mmserve.bench.scenarios.absolute import absolute
from mmserve.bench.scenarios.caching import multiturn, same_image, three_images
from mmserve.bench.scenarios.deterministic import deterministic
from mmserve.bench.scenarios.engine import engine_overhead
from mmserve.bench.scenarios.replicas import replicas
from mmserve.bench.scenarios.scaleout import scaleout
from mmserve.bench.scenarios.structured import structured
from mmserve.bench.scenarios.throughput import concurrency, decode
from mmserve.bench.scenarios.versus_peer import peer
from mmserve.bench.scenarios.video import video

SCENARIOS = {
    "decode": decode,
    "concurrency": concurrency,
    "multiturn": multiturn,
    "same_image": same_image,
    "three_images": three_images,
    "peer": peer,
    "replicas": replicas,
    "scaleout": scaleout,
    "structured": structured,
    "engine_overhead": engine_overhead,
    "absolute": absolute,
    "video": video,
    "deterministic": deterministic,
}

__all__ = ["SCENARIOS", "absolute", "concurrency", "deterministic", "engine_overhead", "decode", "multiturn", "peer", "replicas", "same_image", "scaleout", "structured", "three_images", "video"]

"""Prometheus metrics (vLLM-compatible names under the `mmserve:` prefix, `model_name` label).

Request metrics are observed as requests finish; cache and actor gauges are read from the
runtime's own state at scrape time, so a scrape never waits on model work. Each Runtime has its
own registry (several runtimes may live in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mmserve.runtime.load import RuntimeState, model_loads

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        label = ["model_name"]
        self.ttft = Histogram("mmserve:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("mmserve:inter_token_latency_seconds", "Time between consecutive tokens.", label,
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("mmserve:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             label, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("mmserve:prompt_tokens", "Prompt tokens of finished requests.", label,
                                     registry=self.registry)
        self.generation_tokens = Counter("mmserve:generation_tokens", "Generated tokens.", label,
                                         registry=self.registry)
        self.success = Counter("mmserve:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.prefill_tokens = Counter("mmserve:prefill_tokens", "Prompt tokens computed by prefill (those the "
                                      "prefix cache served are not; a request's n choices prefill once).",
                                      label, registry=self.registry)
        self.preemptions = Counter("mmserve:num_preemptions", "Sequences preempted when the KV arena ran out "
                                   "of blocks (recomputed later).", label, registry=self.registry)
        self.reencoded = Counter("mmserve:reencoded_images", "Images encoded again by preempted sequences "
                                 "whose cached KV of them was evicted before they resumed.", label,
                                 registry=self.registry)
        self.step_time = Histogram("mmserve:step_seconds", "A model step's time by part: 'forward' awaits the "
                                   "compute thread (the forward and the sampling), 'host' is the generator's own "
                                   "work on the event loop between two back-to-back steps.", ["model_name", "part"],
                                   buckets=_ITL_BUCKETS, registry=self.registry)
        self.rejections = Counter("mmserve:request_rejected", "Requests refused before any model work (4xx, "
                                  "503), by reason: the error's code, or its type.", ["reason"],
                                  registry=self.registry)

    def attach(self, runtime: RuntimeState) -> None:
        self.registry.register(_RuntimeCollector(runtime))

    def request_finished(self, model: str, reason: str, prompt_tokens: int, completion_tokens: int,
                         ttft_s: float, e2e_s: float) -> None:
        self.ttft.labels(model).observe(ttft_s)
        self.e2e.labels(model).observe(e2e_s)
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(completion_tokens)
        self.success.labels(model, reason).inc()

    def prefilled(self, model: str, tokens: int) -> None:
        self.prefill_tokens.labels(model).inc(tokens)

    def preempted(self, model: str) -> None:
        self.preemptions.labels(model).inc()

    def step_timed(self, model: str, forward_s: float, host_s: float | None) -> None:
        self.step_time.labels(model, "forward").observe(forward_s)
        if host_s is not None:
            self.step_time.labels(model, "host").observe(host_s)

    def reencoded_images(self, model: str, images: int) -> None:
        self.reencoded.labels(model).inc(images)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def token_gap(self, model: str, seconds: float) -> None:
        self.itl.labels(model).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RuntimeCollector:
    """Gauges and cache counters read from actor state when scraped."""

    def __init__(self, runtime: RuntimeState):
        self.rt = runtime

    def describe(self):
        return []

    def collect(self):
        rt = self.rt
        g = lambda name, doc, labels=("model_name",): GaugeMetricFamily(name, doc, labels=list(labels))  # noqa: E731
        c = lambda name, doc, labels=("model_name",): CounterMetricFamily(name, doc, labels=list(labels))  # noqa: E731
        running = g("mmserve:num_requests_running",
                    "Requests the scheduler admitted (at most max_running_requests; n choices count once).")
        waiting = g("mmserve:num_requests_waiting",
                    "Requests accepted but not running yet (being prepared, or waiting for admission).")
        kv_usage = g("mmserve:kv_cache_usage_perc",
                     "Fraction of KV blocks held by running requests (0-1); cached blocks nobody holds count as free.")
        kv_evictable = g("mmserve:kv_cache_evictable_perc",
                         "Fraction of KV blocks holding cached prefixes nobody holds (free to evict, 0-1).")
        quarantined = g("mmserve:kv_cache_quarantined_blocks",
                        "KV blocks held for model steps abandoned by a restart that still run (they may "
                        "still write them): never granted until those steps return; 0 in steady state.")
        enc_bytes = g("mmserve:encoder_cache_bytes", "Bytes of encoder outputs held in the encoder cache.")
        pq = c("mmserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        ph = c("mmserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        mq = c("mmserve:mm_cache_queries", "Multimodal items looked up in the encoder cache.")
        mh = c("mmserve:mm_cache_hits", "Multimodal items found in the encoder cache.")
        loads = {load.model: load for load in model_loads(rt)}  # the figures /v1/loads reports too
        for name, m in rt.registry.loaded.items():
            load = loads[name]
            running.add_metric([name], load.running)
            waiting.add_metric([name], load.waiting)
            enc = m.encoder.stats()
            enc_bytes.add_metric([name], enc.get("bytes_in_use", 0))
            mq.add_metric([name], enc.get("hits", 0) + enc.get("misses", 0))
            mh.add_metric([name], enc.get("hits", 0))
            kv_usage.add_metric([name], load.kv_usage)
            kv_evictable.add_metric([name], load.evictable)
            quarantined.add_metric([name], m.prefix_cache.stats()["quarantined_blocks"])
            pq.add_metric([name], load.query_tokens)
            ph.add_metric([name], load.hit_tokens)
        yield from (running, waiting, kv_usage, kv_evictable, quarantined, enc_bytes, pq, ph, mq, mh)
        yield from _step_path_metrics(rt, c)
        yield from _encoder_path_metrics(rt, c)
        yield from _shared_tier_metrics(rt, g, c)
        yield from _kv_event_metrics(rt, c)
        restarts = c("mmserve:actor_restarts", "Actor restarts by the supervisor.", ("actor",))
        for key, state in rt.supervisor.states.items():
            restarts.add_metric([key], state.restarts)
        yield restarts
        healthy = GaugeMetricFamily("mmserve:healthy", "1 when every actor is alive, else 0.")
        healthy.add_metric([], 1.0 if rt.health().ok else 0.0)
        yield healthy


_SHARED_COUNTERS = {  # stats key → (metric, help)
    "encoder_queries": ("shared_cache_encoder_queries", "Encoder outputs asked of the shared tier (Redis)."),
    "encoder_hits": ("shared_cache_encoder_hits", "Encoder outputs found in the shared tier."),
    "block_queries": ("shared_cache_block_queries", "KV blocks asked of the shared tier."),
    "block_hits": ("shared_cache_block_hits", "KV blocks found in the shared tier (a chain from the first)."),
    "late": ("shared_cache_late_lookups", "Shared-tier look-ups answered after their deadline (misses)."),
    "corrupt": ("shared_cache_rejected_values", "Stored values refused (any reason; shared_tier_rejected by reason): misses."),
    "deleted": ("shared_cache_deleted_values", "Refused values deleted from the shared tier (not rewritten since they were read)."),
    "refused_writes": ("shared_cache_refused_writes", "Values never written because they were not finite."),
    "errors": ("shared_cache_errors", "Shared-tier errors (each turns the tier off for a backoff)."),
    "writes": ("shared_cache_writes", "Values written to the shared tier."),
    "dropped_full": ("shared_cache_dropped_writes", "Writes dropped because the write queue was full."),
    "dropped_off": ("shared_cache_skipped_writes", "Writes skipped while the tier was off."),
    "finish_flushed": ("shared_cache_finish_flushes", "Answers that ended once their blocks were written "
                       "(they had to wait for the writes)."),
    "finish_flush_late": ("shared_cache_finish_flush_timeouts", "Answers that ended after finish_flush_ms "
                          "with writes still pending."),
}


def _step_path_metrics(rt, c):
    """How the model runner ran its steps: from the static buffers (a replayed graph on CUDA), by
    kind, and eagerly, by reason — a step larger than the largest bucket ("too_many_tokens",
    "too_many_sequences", "too_long"), one wanting a prompt's logprobs, a backend without static
    steps ("backend_not_capturable": the CPU's sdpa)."""
    static = c("mmserve:static_steps", "Model steps run from the static buffers (replayed graphs on CUDA), "
               "by kind (decode: a batch bucket; mixed: prefill chunks and decode tokens, a token bucket).",
               ("model_name", "kind"))
    eager = c("mmserve:eager_steps", "Model steps run eagerly (no graph), by why: too_many_tokens (past the "
              "largest token bucket), too_many_sequences, too_long (a block table past the static width), "
              "prompt_logprobs, bidirectional_spans, family_inputs, backend_not_capturable.", ("model_name", "reason"))
    for name, m in rt.registry.loaded.items():
        runner = m.generator.runner
        static.add_metric([name, "decode"], runner.static_steps)
        static.add_metric([name, "mixed"], runner.mixed_steps)
        for reason, count in sorted(runner.eager_reasons.items()):
            eager.add_metric([name, reason], count)
    yield from (static, eager)


def _encoder_path_metrics(rt, c):
    """How the vision tower ran (engine.vision_step): from the static buffers per view bucket (a
    replayed graph on CUDA), calls split past the largest bucket, and eager calls by reason."""
    static = c("mmserve:encoder_static_runs", "Vision-tower runs from the static buffers (replayed graphs on "
               "CUDA), by view-count bucket (images, crops or tiles padded to it).", ("model_name", "bucket"))
    split = c("mmserve:encoder_split_calls", "Encoder calls of more views than the largest graph_image_buckets "
              "bucket (split into runs of the largest: still static).")
    eager = c("mmserve:encoder_eager_runs", "Vision-tower calls run eagerly, by why: static_off (no image buckets: "
              "the default off CUDA), dynamic_shapes (a family whose views change shape: Qwen-VL, OneVision), "
              "view_shape (views not of the tower's size).", ("model_name", "reason"))
    for name, m in rt.registry.loaded.items():
        vision = m.encoder.vision
        for bucket, count in sorted(vision.static_runs.items()):
            static.add_metric([name, str(bucket)], count)
        split.add_metric([name], vision.static.oversized_calls if vision.static is not None else 0)
        for reason, count in sorted(vision.eager_reasons.items()):
            eager.add_metric([name, reason], count)
    yield from (static, split, eager)


def _shared_tier_metrics(rt, g, c):
    """The shared cache tier's counters, and `shared_cache_up` (1 on, 0 off for a backoff)."""
    up = g("mmserve:shared_cache_up", "1 while the shared cache tier is on, 0 while it is off (backing off).")
    families = {key: c(f"mmserve:{name}", doc) for key, (name, doc) in _SHARED_COUNTERS.items()}
    rejected = c("mmserve:shared_tier_rejected", "Values read from the shared tier and refused (misses), by reason: "
                 "mac (the tag does not verify: written without the secret), size (not the exact size of its key's "
                 "value; a longer one is not read), non_finite (NaN or inf), format, version (another layout's).",
                 ("model_name", "reason"))
    for name, m in rt.registry.loaded.items():
        tier = m.actors.get("shared_tier")
        if tier is None:
            continue
        stats = tier.stats()
        up.add_metric([name], 1.0 if stats["state"] == "on" else 0.0)
        for key, family in families.items():
            family.add_metric([name], stats[key])
        for reason, n in stats["rejected"].items():
            rejected.add_metric([name, reason], n)
    yield up
    yield from families.values()
    yield rejected


def _kv_event_metrics(rt, c):
    """The replica's KV event stream ([kv_events]): batches published, dropped (queue full), replays."""
    pub = rt.kv_events
    if pub is None:
        return
    stats = pub.stats()
    for key, doc in (("published", "KV event batches published ([kv_events])."),
                     ("dropped", "KV event batches dropped because the publisher's queue was full (the next "
                                 "batch starts with AllBlocksCleared)."),
                     ("replays", "KV event replay requests answered.")):
        family = c(f"mmserve:kv_events_{key}", doc, ())
        family.add_metric([], stats[key])
        yield family

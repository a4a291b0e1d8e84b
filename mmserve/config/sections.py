"""The config sections: one frozen dataclass per `config.toml` table, each checking its keys
when built (so `Config.replace` checks too). Every key is documented in config.toml."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserve.config.checks import (
    ATTENTION_BACKENDS, BUILTIN_PREFIX, DEMO_CHECKPOINTS, DEVICE, DTYPES, HASH_ALGORITHMS, IMAGE_FORMATS, LOG_FORMATS,
    LOG_LEVELS, TOOL_PARSERS, check_bool, check_buckets, check_choice, check_int,
    check_number, check_str, check_strings, fail)
from mmserve.config.hosts import normalize_host_pattern
from mmserve.config.shared_cache import SharedCacheConfig  # noqa: F401 (a section, kept with its secret's rules)
from mmserve.config.kv_events import KVEventsConfig  # noqa: F401 (a section of its own module)
from mmserve.config.video import VideoConfig


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: str
    default: bool = False
    load: str | None = None  # "eager" | "on_demand"; None: eager for the default model only
    tool_parser: str | None = None  # how tool_choice "auto" finds calls in its answers; None: refused

    def __post_init__(self) -> None:
        check_str("[[models]]", "name", self.name)
        w = f"[[models]] {self.name!r}"
        check_str(w, "path", self.path)
        check_bool(w, "default", self.default)
        if self.load is not None:
            check_choice(w, "load", self.load, ("eager", "on_demand"))
        if self.tool_parser is not None:
            check_choice(w, "tool_parser", self.tool_parser, TOOL_PARSERS)

    @property
    def eager(self) -> bool:
        return self.load == "eager" or (self.load is None and self.default)

    def resolved_path(self) -> Path:
        """The checkpoint directory; `builtin:NAME` names a committed demo checkpoint."""
        if self.path.startswith(BUILTIN_PREFIX):
            return DEMO_CHECKPOINTS / self.path[len(BUILTIN_PREFIX):]
        return Path(self.path).expanduser()


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 32 * 1024 * 1024
    shutdown_grace_s: float = 30.0  # on SIGTERM/SIGINT, requests in flight get this long to finish
    keep_alive_timeout_s: float = 75.0  # an idle keep-alive connection is closed after this
    body_timeout_s: float = 30.0  # a request's whole body must arrive within this of its headers (else 408)
    max_bodies_in_flight: int = 256  # requests whose body is being received or parsed; more get 503
    max_body_bytes_in_flight: int = 256 * 1024 * 1024  # bytes of those bodies together; beyond, 503
    max_connections: int | str = "auto"  # connections open at once; more wait in the listen backlog (api.connections)

    def __post_init__(self) -> None:
        w = "[server]"
        check_str(w, "host", self.host)
        check_int(w, "port", self.port, 0, 65535)
        check_int(w, "max_body_bytes", self.max_body_bytes, 1)
        check_number(w, "shutdown_grace_s", self.shutdown_grace_s, 0)
        check_number(w, "keep_alive_timeout_s", self.keep_alive_timeout_s, 0, lo_open=True)
        check_number(w, "body_timeout_s", self.body_timeout_s, 0, lo_open=True)
        check_int(w, "max_bodies_in_flight", self.max_bodies_in_flight, 1)
        if self.max_connections != "auto":
            check_int(w, "max_connections", self.max_connections, 1, bound='of at least 1, or "auto"')
        # one body of the largest accepted size must fit, or such a request could never be served
        check_int(w, "max_body_bytes_in_flight", self.max_body_bytes_in_flight, self.max_body_bytes,
                  bound=f"of at least max_body_bytes ({self.max_body_bytes})")


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "cpu"
    dtype: str = "auto"  # "auto": the checkpoint's own dtype where the device runs it (runtime.sizing)
    torch_threads: int = 0
    max_loaded_models: int = 0  # 0: no limit; else the least recently used idle model is unloaded
    load_timeout_s: float = 600.0  # a model load that takes longer fails (its own clock, not the stall watchdog's)
    attention_backend: str = "auto"  # auto | sdpa | triton (auto: triton on CUDA, sdpa on the CPU)
    cuda_graphs: bool = True  # on CUDA with a capturable backend, every step that fits a bucket replays a graph
    graph_token_buckets: tuple[int, ...] = ()  # token counts of the mixed-step buckets; (): 16, 32, ... max_batched_tokens
    graph_image_buckets: tuple[int, ...] = ()  # views a fixed-shape vision tower is padded to (vision_step)
    gc_freeze: bool = True  # after a model loads, its objects leave the garbage collector's walks (runtime.gc_heap)
    overlap: bool = True  # step n+1 built and queued while step n runs (actors.step_overlap); false: serial steps
    deterministic: bool = False  # every logit a function of its request alone (models.batch_invariant); CPU only

    def __post_init__(self) -> None:
        w = "[runtime]"
        check_choice(w, "attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_bool(w, "cuda_graphs", self.cuda_graphs)
        buckets = self.graph_token_buckets
        if not isinstance(buckets, (list, tuple)) or any(
                not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
            fail(w, "graph_token_buckets", "a list of positive integers (empty: the default buckets)", buckets)
        object.__setattr__(self, "graph_token_buckets", tuple(sorted(set(buckets))))
        object.__setattr__(self, "graph_image_buckets", check_buckets(w, "graph_image_buckets", self.graph_image_buckets))
        check_bool(w, "gc_freeze", self.gc_freeze)
        check_bool(w, "overlap", self.overlap)
        check_bool(w, "deterministic", self.deterministic)
        if not isinstance(self.device, str) or not DEVICE.fullmatch(self.device):
            fail(w, "device", "'cpu', 'cuda', 'cuda:N' or 'mps'", self.device)
        check_choice(w, "dtype", self.dtype, ("auto", *DTYPES))
        check_int(w, "torch_threads", self.torch_threads, 0)
        check_int(w, "max_loaded_models", self.max_loaded_models, 0)
        check_number(w, "load_timeout_s", self.load_timeout_s, 0, lo_open=True)


@dataclass(frozen=True)
class RemoteImagesConfig:
    """The `remote_image*` keys of `[limits]`, checked and normalized: the policy for fetching
    `http(s)` image URLs (rules in `mmserve.inputs.remote_images`). Build it from a LimitsConfig
    (`limits.remote_image_policy`); tests may build one directly."""

    enabled: bool = False
    allowed_hosts: tuple[str, ...] = ()  # exact host names / IP literals, or "*.example.com"
    allow_http: bool = False
    allow_private: bool = False
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0
    max_redirects: int = 3
    fetch_concurrency: int = 16

    def __post_init__(self) -> None:
        w = "[limits]"  # named by their [limits] keys
        hosts = self.allowed_hosts
        if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)) or not all(isinstance(h, str) for h in hosts):
            fail(w, "remote_image_hosts", "a list of host names", hosts)
        object.__setattr__(self, "allowed_hosts", tuple(
            normalize_host_pattern(h, f"config {w} remote_image_hosts") for h in hosts))
        check_bool(w, "remote_images", self.enabled)
        check_bool(w, "remote_image_allow_http", self.allow_http)
        check_bool(w, "remote_image_allow_private", self.allow_private)
        check_int(w, "remote_image_max_bytes", self.max_bytes, 1)
        check_number(w, "remote_image_timeout_s", self.timeout_s, 0, lo_open=True)
        check_int(w, "remote_image_max_redirects", self.max_redirects, 0)
        check_int(w, "remote_image_fetch_concurrency", self.fetch_concurrency, 1)


@dataclass(frozen=True)
class LimitsConfig:
    max_messages: int = 256
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000  # decoded, and in every step of the image processor
    max_image_aspect_ratio: float = 200.0  # longer side / shorter side; beyond, HTTP 400 (image_too_large)
    max_json_depth: int = 64  # nesting of arrays and objects in a request body
    image_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096
    default_max_tokens: int = 256
    max_stop_sequences: int = 4
    decode_concurrency: int = 4
    max_pending_requests: int = 256
    request_timeout_s: float = 600.0
    # remote http(s) image URLs: off unless enabled (see config.toml and mmserve.inputs.remote_images)
    remote_images: bool = False
    remote_image_hosts: tuple[str, ...] = ()
    remote_image_allow_http: bool = False
    remote_image_allow_private: bool = False
    remote_image_max_bytes: int = 0  # 0: max_image_bytes
    remote_image_timeout_s: float = 10.0
    remote_image_max_redirects: int = 3
    remote_image_fetch_concurrency: int = 16

    def __post_init__(self) -> None:
        w = "[limits]"
        check_int(w, "max_messages", self.max_messages, 1)
        check_int(w, "max_images_per_request", self.max_images_per_request, 0)  # 0: text only
        check_int(w, "max_image_bytes", self.max_image_bytes, 1)
        check_int(w, "max_image_pixels", self.max_image_pixels, 1)
        check_number(w, "max_image_aspect_ratio", self.max_image_aspect_ratio, 1)
        check_int(w, "max_json_depth", self.max_json_depth, 2, 1000)
        check_strings(self, w, "image_formats", IMAGE_FORMATS, nonempty=True)
        check_int(w, "max_prompt_tokens", self.max_prompt_tokens, 1)
        check_int(w, "max_tokens", self.max_tokens, 1)
        check_int(w, "default_max_tokens", self.default_max_tokens, 1, self.max_tokens,
             bound=f"from 1 to max_tokens ({self.max_tokens})")
        check_int(w, "max_stop_sequences", self.max_stop_sequences, 0)  # 0: "stop" refused
        check_int(w, "decode_concurrency", self.decode_concurrency, 1)
        check_int(w, "max_pending_requests", self.max_pending_requests, 1)
        check_number(w, "request_timeout_s", self.request_timeout_s, 0, lo_open=True)
        check_int(w, "remote_image_max_bytes", self.remote_image_max_bytes, 0)  # 0: max_image_bytes
        self.remote_image_policy  # the other remote_image_* keys: checked (and hosts normalized) there

    @functools.cached_property
    def remote_image_policy(self) -> RemoteImagesConfig:
        """The `remote_image*` keys, checked and normalized."""
        max_bytes = self.remote_image_max_bytes or self.max_image_bytes
        return RemoteImagesConfig(
            enabled=self.remote_images, allowed_hosts=self.remote_image_hosts,
            allow_http=self.remote_image_allow_http, allow_private=self.remote_image_allow_private,
            max_bytes=max_bytes, timeout_s=self.remote_image_timeout_s,
            max_redirects=self.remote_image_max_redirects, fetch_concurrency=self.remote_image_fetch_concurrency)


@dataclass(frozen=True)
class EncoderCacheConfig:
    enabled: bool = True
    budget_bytes: int = 256 * 1024 * 1024
    max_entries: int = 0  # 0: no cap besides the byte budget
    max_batch_images: int = 8
    batch_wait_ms: float = 2.0

    def __post_init__(self) -> None:
        w = "[encoder_cache]"
        check_bool(w, "enabled", self.enabled)
        check_int(w, "budget_bytes", self.budget_bytes, 0)
        check_int(w, "max_entries", self.max_entries, 0)
        check_int(w, "max_batch_images", self.max_batch_images, 1)
        check_number(w, "batch_wait_ms", self.batch_wait_ms, 0)


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV arena of each model: running sequences' KV and cached prefixes in one budget."""

    budget_bytes: int | str = "auto"  # bytes, or "auto": memory_fraction of what the device has left (runtime.sizing)
    memory_fraction: float = 0.5  # of the memory left after the weights, for budget_bytes = "auto"
    block_size: int = 16
    prefix_caching: bool = True
    inflight_wait_s: float = 10.0  # wait this long for blocks another request is computing; 0: never wait
    hash: str = "xxh3_128"  # "xxh3_128" | "sha256": the hash of block and multimodal content keys

    def __post_init__(self) -> None:
        w = "[kv_cache]"
        if self.budget_bytes != "auto":
            check_int(w, "budget_bytes", self.budget_bytes, 1, bound='>= 1, or "auto"')
        check_number(w, "memory_fraction", self.memory_fraction, 0, 1, lo_open=True)
        check_int(w, "block_size", self.block_size, 1, 4096)
        check_bool(w, "prefix_caching", self.prefix_caching)
        check_number(w, "inflight_wait_s", self.inflight_wait_s, 0)
        check_choice(w, "hash", self.hash, HASH_ALGORITHMS)


# `[prefix_cache]` (until 0.1): its keys, renamed, now live in `[kv_cache]`
DEPRECATED_PREFIX_CACHE_KEYS = {"enabled": "prefix_caching", "block_size": "block_size", "budget_bytes": "budget_bytes",
                                "inflight_wait_s": "inflight_wait_s", "hash": "hash"}


def kv_cache_from_prefix_cache(values: dict, current: "KVCacheConfig", where: str = "[prefix_cache]") -> dict:
    """`[prefix_cache]` keys as `[kv_cache]` keys, with a deprecation warning naming each."""
    unknown = sorted(set(values) - set(DEPRECATED_PREFIX_CACHE_KEYS))
    if unknown:
        raise ValueError(f"config {where}: unknown key(s) {unknown}; known: {sorted(DEPRECATED_PREFIX_CACHE_KEYS)}")
    renamed = {DEPRECATED_PREFIX_CACHE_KEYS[k]: v for k, v in values.items()}
    warnings.warn(f"config {where} is deprecated: use [kv_cache] "
                  + ", ".join(f"{DEPRECATED_PREFIX_CACHE_KEYS[k]} (was {k})" for k in values), DeprecationWarning,
                  stacklevel=3)
    return renamed


@dataclass(frozen=True)
class GeneratorConfig:
    max_batched_tokens: int = 2048  # tokens one forward carries: decode tokens first, then prefill chunks
    max_running_requests: int = 256  # requests running at once (n choices count once); more wait, by priority then age
    lookup_timeout_s: float = 2.0  # a KV-cache answer slower than this is treated as a miss (or a skipped step)
    # a request's effective priority improves by one level per this many seconds since it arrived:
    # a request of priority p ranks ahead of any of priority q arriving (p - q + 1) × this later (no starvation)
    priority_aging_s: float = 10.0

    def __post_init__(self) -> None:
        w = "[generator]"
        check_int(w, "max_batched_tokens", self.max_batched_tokens, 1)
        check_int(w, "max_running_requests", self.max_running_requests, 1)
        check_number(w, "lookup_timeout_s", self.lookup_timeout_s, 0, lo_open=True)
        check_number(w, "priority_aging_s", self.priority_aging_s, 0, lo_open=True)


@dataclass(frozen=True)
class SupervisorConfig:
    restart_backoff_s: float = 0.1
    max_restart_backoff_s: float = 5.0
    stall_timeout_s: float = 30.0  # an actor with work pending and no progress this long is hung
    healthy_reset_s: float = 60.0  # an actor that ran this long since its last restart starts its backoff afresh

    def __post_init__(self) -> None:
        w = "[supervisor]"
        check_number(w, "restart_backoff_s", self.restart_backoff_s, 0, lo_open=True)
        check_number(w, "max_restart_backoff_s", self.max_restart_backoff_s, self.restart_backoff_s,
                bound=f">= restart_backoff_s ({self.restart_backoff_s})")
        check_number(w, "stall_timeout_s", self.stall_timeout_s, 0, lo_open=True)
        check_number(w, "healthy_reset_s", self.healthy_reset_s, 0, lo_open=True)


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    api_keys_env: str = "MMSERVE_API_KEYS"   # comma-separated keys, added to api_keys
    admin_key: str = ""
    admin_key_env: str = "MMSERVE_ADMIN_KEY"

    def __post_init__(self) -> None:
        w = "[auth]"
        check_strings(self, w, "api_keys")
        check_str(w, "api_keys_env", self.api_keys_env, empty=True)  # "": no environment variable
        check_str(w, "admin_key", self.admin_key, empty=True)  # "": admin endpoints off (unless admin_key_env)
        check_str(w, "admin_key_env", self.admin_key_env, empty=True)

    def keys(self) -> tuple[str, ...]:
        import os

        extra = tuple(k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip())
        return self.api_keys + extra

    def admin(self) -> str:
        import os

        return self.admin_key or os.environ.get(self.admin_key_env, "")


@dataclass(frozen=True)
class LoggingConfig:
    format: str = "json"
    level: str = "info"
    embedded_verbose: bool = False  # embedded, with no logging set up by the host: every event to stderr (else warnings)

    def __post_init__(self) -> None:
        check_choice("[logging]", "format", self.format, LOG_FORMATS)
        check_choice("[logging]", "level", self.level, LOG_LEVELS)
        check_bool("[logging]", "embedded_verbose", self.embedded_verbose)


@dataclass(frozen=True)
class Config:
    models: tuple[ModelConfig, ...] = (ModelConfig("demo", "builtin:demo", default=True, tool_parser="hermes"),)
    server: ServerConfig = field(default_factory=ServerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    encoder_cache: EncoderCacheConfig = field(default_factory=EncoderCacheConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    shared_cache: SharedCacheConfig = field(default_factory=SharedCacheConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    video: VideoConfig = field(default_factory=VideoConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"config [{name}]: must be a {cls.__name__}, got {getattr(self, name)!r}")
        models = self.models
        if not isinstance(models, (list, tuple)) or not all(isinstance(m, ModelConfig) for m in models):
            raise ValueError(f"config [[models]]: must be a list of ModelConfig, got {models!r}")
        if not models:
            raise ValueError("config [[models]]: is empty; configure at least one model")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            fail("[[models]]", "name", "unique across models", sorted({n for n in names if names.count(n) > 1}))
        defaults = [m.name for m in models if m.default]
        if len(defaults) > 1:
            fail("[[models]]", "default", "true for at most one model", defaults)
        object.__setattr__(self, "models", tuple(models))

    @property
    def default_model(self) -> str:
        for m in self.models:
            if m.default:
                return m.name
        return self.models[0].name

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def replace(self, **sections: Any) -> "Config":
        """A copy with whole sections replaced or, given dicts, individual keys overridden."""
        changes = {}
        if "prefix_cache" in sections:  # the old name of [kv_cache]'s prefix keys
            old = sections.pop("prefix_cache")
            merged = dict(sections.get("kv_cache") or {})
            merged.update(kv_cache_from_prefix_cache(old, self.kv_cache))
            sections["kv_cache"] = merged
        for key, value in sections.items():
            current = getattr(self, key)
            if isinstance(value, dict) and dataclasses.is_dataclass(current):
                value = dataclasses.replace(current, **value)
            changes[key] = value
        return dataclasses.replace(self, **changes)


SECTIONS = {
    "server": ServerConfig,
    "runtime": RuntimeConfig,
    "limits": LimitsConfig,
    "encoder_cache": EncoderCacheConfig,
    "kv_cache": KVCacheConfig,
    "generator": GeneratorConfig,
    "supervisor": SupervisorConfig,
    "logging": LoggingConfig,
    "auth": AuthConfig,
    "shared_cache": SharedCacheConfig,
    "kv_events": KVEventsConfig,
    "video": VideoConfig,
}

"""Runtime configuration: a typed view of `config.toml` (every key is documented there)."""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
HASH_ALGORITHMS = ("xxh3_128", "sha256")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: str
    default: bool = False
    load: str | None = None  # "eager" | "on_demand"; None: eager for the default model only

    @property
    def eager(self) -> bool:
        return self.load == "eager" or (self.load is None and self.default)

    def resolved_path(self) -> Path:
        """The checkpoint directory; `builtin:NAME` names a committed demo checkpoint."""
        if self.path.startswith(BUILTIN_PREFIX):
            from mmserve.models.demo import checkpoint_dir

            return checkpoint_dir(self.path[len(BUILTIN_PREFIX):])
        return Path(self.path).expanduser()


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 32 * 1024 * 1024
    shutdown_grace_s: float = 30.0  # on SIGTERM/SIGINT, requests in flight get this long to finish
    keep_alive_timeout_s: float = 75.0  # an idle keep-alive connection is closed after this


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "cpu"
    dtype: str = "float32"
    torch_threads: int = 0
    max_loaded_models: int = 0  # 0: no limit; else the least recently used idle model is unloaded
    load_timeout_s: float = 600.0  # a model load that takes longer fails (its own clock, not the stall watchdog's)


@dataclass(frozen=True)
class RemoteImagesConfig:
    """The `remote_image*` keys of `[limits]`, checked and normalized: the policy for fetching
    `http(s)` image URLs (rules in `mmserve.runtime.remote_images`). Build it from a LimitsConfig
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
        from mmserve.runtime.remote_images import normalize_host_pattern

        where = "config [limits]"
        hosts = self.allowed_hosts
        if isinstance(hosts, str) or not all(isinstance(h, str) for h in hosts):
            raise ValueError(f"{where}: remote_image_hosts must be a list of host names, got {hosts!r}")
        object.__setattr__(self, "allowed_hosts", tuple(
            normalize_host_pattern(h, f"{where} remote_image_hosts") for h in hosts))
        for key, name in (("enabled", "remote_images"), ("allow_http", "remote_image_allow_http"),
                          ("allow_private", "remote_image_allow_private")):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{where}: {name} must be true or false")
        for key, name, lo in (("max_bytes", "remote_image_max_bytes", 1), ("max_redirects", "remote_image_max_redirects", 0),
                              ("fetch_concurrency", "remote_image_fetch_concurrency", 1)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{where}: {name} must be an integer >= {lo}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ValueError(f"{where}: remote_image_timeout_s must be a number > 0")


@dataclass(frozen=True)
class LimitsConfig:
    max_messages: int = 256
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000  # decoded, and in every step of the image processor
    max_image_aspect_ratio: float = 200.0  # longer side / shorter side; beyond, HTTP 422
    max_json_depth: int = 64  # nesting of arrays and objects in a request body
    image_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096
    default_max_tokens: int = 256
    max_stop_sequences: int = 4
    decode_concurrency: int = 4
    max_pending_requests: int = 256
    request_timeout_s: float = 600.0
    # remote http(s) image URLs: off unless enabled (see config.toml and mmserve.runtime.remote_images)
    remote_images: bool = False
    remote_image_hosts: tuple[str, ...] = ()
    remote_image_allow_http: bool = False
    remote_image_allow_private: bool = False
    remote_image_max_bytes: int = 0  # 0: max_image_bytes
    remote_image_timeout_s: float = 10.0
    remote_image_max_redirects: int = 3
    remote_image_fetch_concurrency: int = 16

    def __post_init__(self) -> None:
        v = self.remote_image_max_bytes
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError("config [limits]: remote_image_max_bytes must be an integer >= 0 (0: max_image_bytes)")
        self.remote_image_policy  # a bad remote_image_* value fails at load time, not at the first request

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


@dataclass(frozen=True)
class PrefixCacheConfig:
    enabled: bool = True
    block_size: int = 16
    budget_bytes: int = 256 * 1024 * 1024
    inflight_wait_s: float = 10.0  # wait this long for blocks another request is computing; 0: never wait
    hash: str = "xxh3_128"  # "xxh3_128" | "sha256": the hash of block and multimodal content keys

    def __post_init__(self) -> None:
        if self.hash not in HASH_ALGORITHMS:
            raise ValueError(f"config [prefix_cache]: hash must be one of {list(HASH_ALGORITHMS)}, got {self.hash!r}")


@dataclass(frozen=True)
class GeneratorConfig:
    prefill_chunk_tokens: int = 512
    lookup_timeout_s: float = 2.0  # a prefix-cache look-up slower than this is treated as a miss


@dataclass(frozen=True)
class SupervisorConfig:
    restart_backoff_s: float = 0.1
    max_restart_backoff_s: float = 5.0
    stall_timeout_s: float = 30.0  # an actor with work pending and no progress this long is hung
    healthy_reset_s: float = 60.0  # an actor that ran this long since its last restart starts its backoff afresh


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    api_keys_env: str = "MMSERVE_API_KEYS"   # comma-separated keys, added to api_keys
    admin_key: str = ""
    admin_key_env: str = "MMSERVE_ADMIN_KEY"

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


@dataclass(frozen=True)
class Config:
    models: tuple[ModelConfig, ...] = (ModelConfig("demo", "builtin:demo", default=True),)
    server: ServerConfig = field(default_factory=ServerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    encoder_cache: EncoderCacheConfig = field(default_factory=EncoderCacheConfig)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)

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
        for key, value in sections.items():
            current = getattr(self, key)
            if isinstance(value, dict) and dataclasses.is_dataclass(current):
                value = dataclasses.replace(current, **value)
            changes[key] = value
        return dataclasses.replace(self, **changes)


_SECTIONS = {
    "server": ServerConfig,
    "runtime": RuntimeConfig,
    "limits": LimitsConfig,
    "encoder_cache": EncoderCacheConfig,
    "prefix_cache": PrefixCacheConfig,
    "generator": GeneratorConfig,
    "supervisor": SupervisorConfig,
    "logging": LoggingConfig,
    "auth": AuthConfig,
}


def _section(cls: type, raw: dict, where: str):
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(known)
    if unknown:
        raise ValueError(f"config [{where}]: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    return cls(**values)


def config_from_dict(raw: dict, base_dir: Path | None = None) -> Config:
    """Builds a Config from parsed TOML; relative model paths resolve against `base_dir`."""
    raw = dict(raw)
    kwargs: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        if name in raw:
            kwargs[name] = _section(cls, raw.pop(name), name)
    if "models" in raw:
        models = []
        for entry in raw.pop("models"):
            m = _section(ModelConfig, entry, "models")
            if base_dir is not None and not m.path.startswith(BUILTIN_PREFIX):
                p = Path(m.path).expanduser()
                if not p.is_absolute():
                    m = dataclasses.replace(m, path=str(base_dir / p))
            models.append(m)
        for m in models:
            if m.load not in (None, "eager", "on_demand"):
                raise ValueError(f"config [[models]] {m.name!r}: load must be 'eager' or 'on_demand', got {m.load!r}")
        if not models:
            raise ValueError("config: [[models]] is empty; configure at least one model")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"config: duplicate model names in {names}")
        kwargs["models"] = tuple(models)
    if raw:
        raise ValueError(f"config: unknown section(s) {sorted(raw)}")
    return Config(**kwargs)


def load_config(path: str | Path | None) -> Config:
    """Reads a TOML config file; None gives the built-in defaults (the `demo` model)."""
    if path is None:
        return Config()
    path = Path(path)
    with path.open("rb") as f:
        return config_from_dict(tomllib.load(f), base_dir=path.parent.resolve())


def with_models(config: Config, names: list[str]) -> Config:
    """Keeps only the named models (CLI `--model`, repeatable), the first one becoming the default.

    A name not in the config but naming a directory is added as a local checkpoint; `demo` and
    `demo-wide` are always known as built-ins.
    """
    models = []
    for i, name in enumerate(names):
        m = config.model(name)
        if m is None:
            if Path(name).expanduser().is_dir():
                m = ModelConfig(Path(name).name, str(Path(name).expanduser().resolve()))
            elif name in ("demo", "demo-wide"):
                m = ModelConfig(name, BUILTIN_PREFIX + name)
            else:
                raise ValueError(f"--model {name!r}: not in the config and not a directory")
        models.append(dataclasses.replace(m, default=(i == 0)))
    return dataclasses.replace(config, models=tuple(models))

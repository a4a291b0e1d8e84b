"""Runtime configuration: a typed view of `config.toml` (every key is documented there)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
HASH_ALGORITHMS = ("xxh3_128", "sha256")
DTYPES = ("float32", "float16", "bfloat16")
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # PIL's names (Image.format), upper case
LOG_FORMATS = ("json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
_DEVICE = re.compile(r"(cpu|mps|cuda(:[0-9]+)?)")


# -- validation ---------------------------------------------------------------------------------
# Every check raises ValueError("config [SECTION] KEY: must be WHAT, got VALUE"); `where` is the part
# after "config " ("[server]", "[[models]] 'demo'"), so one line of __post_init__ checks one key.


def _fail(where: str, key: str, want: str, value: Any) -> None:
    raise ValueError(f"config {where} {key}: must be {want}, got {value!r}")


def _range(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"from {lo} to {hi}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"<= {hi}" if hi is not None else ""


def _int(where: str, key: str, value: Any, lo: int | None = None, hi: int | None = None, bound: str = "") -> None:
    """An int (not a bool) in [lo, hi]; `bound` words the range when a bound is another key."""
    if (not isinstance(value, int) or isinstance(value, bool)
            or (lo is not None and value < lo) or (hi is not None and value > hi)):
        _fail(where, key, f"an integer {bound or _range(lo, hi)}".rstrip(), value)


def _number(where: str, key: str, value: Any, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, bound: str = "") -> None:
    """A finite int or float (not a bool) in [lo, hi], or (lo, hi] with lo_open; `bound` as in _int."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        _fail(where, key, f"a number {bound or _range(lo, hi, lo_open)}".rstrip(), value)


def _bool(where: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(where, key, "true or false", value)


def _str(where: str, key: str, value: Any, empty: bool = False) -> None:
    """A string; a non-empty one (not just spaces) unless `empty`."""
    if not isinstance(value, str) or (not empty and not value.strip()):
        _fail(where, key, "a string" if empty else "a non-empty string", value)


def _choice(where: str, key: str, value: Any, choices: tuple) -> None:
    if isinstance(value, bool) or value not in choices:
        _fail(where, key, "one of " + ", ".join(repr(c) for c in choices), value)


def _strings(obj: Any, where: str, key: str, choices: tuple[str, ...] | None = None, nonempty: bool = False) -> None:
    """A list of non-empty strings (of `choices`, if given; at least one if `nonempty`); stored as a tuple."""
    value = getattr(obj, key)
    want = ("a non-empty list" if nonempty else "a list") + (
        " with entries among " + ", ".join(repr(c) for c in choices) if choices
        else " of non-empty strings without surrounding spaces")
    if not isinstance(value, (list, tuple)) or (nonempty and not value):
        _fail(where, key, want, value)
    for item in value:
        if not isinstance(item, str) or (item not in choices if choices else (not item or item != item.strip())):
            _fail(where, key, want, value)
    object.__setattr__(obj, key, tuple(value))


def _known_builtins() -> tuple[str, ...]:
    """The demo checkpoints `builtin:NAME` can name (found without importing torch)."""
    spec = importlib.util.find_spec("mmserve.models.demo")
    root = Path(spec.origin).parent / "checkpoints" if spec and spec.origin else None
    if root is None or not root.is_dir():
        return ()
    return tuple(sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))))


def check_model_path(m: "ModelConfig") -> None:
    """That a model's checkpoint exists: a directory, or a known `builtin:NAME` (config files only;
    a ModelConfig built in code may name a missing directory, which the registry reports at load)."""
    where = f"[[models]] {m.name!r}"
    if m.path.startswith(BUILTIN_PREFIX):
        known = _known_builtins()
        if m.path[len(BUILTIN_PREFIX):] not in known:
            builtins = ", ".join(repr(BUILTIN_PREFIX + k) for k in known)
            _fail(where, "path", f"a checkpoint directory or one of {builtins}", m.path)
    elif not Path(m.path).expanduser().is_dir():
        _fail(where, "path", "an existing checkpoint directory", m.path)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: str
    default: bool = False
    load: str | None = None  # "eager" | "on_demand"; None: eager for the default model only

    def __post_init__(self) -> None:
        _str("[[models]]", "name", self.name)
        w = f"[[models]] {self.name!r}"
        _str(w, "path", self.path)
        _bool(w, "default", self.default)
        if self.load is not None:
            _choice(w, "load", self.load, ("eager", "on_demand"))

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

    def __post_init__(self) -> None:
        w = "[server]"
        _str(w, "host", self.host)
        _int(w, "port", self.port, 0, 65535)
        _int(w, "max_body_bytes", self.max_body_bytes, 1)
        _number(w, "shutdown_grace_s", self.shutdown_grace_s, 0)
        _number(w, "keep_alive_timeout_s", self.keep_alive_timeout_s, 0, lo_open=True)


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "cpu"
    dtype: str = "float32"
    torch_threads: int = 0
    max_loaded_models: int = 0  # 0: no limit; else the least recently used idle model is unloaded
    load_timeout_s: float = 600.0  # a model load that takes longer fails (its own clock, not the stall watchdog's)

    def __post_init__(self) -> None:
        w = "[runtime]"
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            _fail(w, "device", "'cpu', 'cuda', 'cuda:N' or 'mps'", self.device)
        _choice(w, "dtype", self.dtype, DTYPES)
        _int(w, "torch_threads", self.torch_threads, 0)
        _int(w, "max_loaded_models", self.max_loaded_models, 0)
        _number(w, "load_timeout_s", self.load_timeout_s, 0, lo_open=True)


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

        w = "[limits]"  # named by their [limits] keys
        hosts = self.allowed_hosts
        if isinstance(hosts, str) or not isinstance(hosts, (list, tuple)) or not all(isinstance(h, str) for h in hosts):
            _fail(w, "remote_image_hosts", "a list of host names", hosts)
        object.__setattr__(self, "allowed_hosts", tuple(
            normalize_host_pattern(h, f"config {w} remote_image_hosts") for h in hosts))
        _bool(w, "remote_images", self.enabled)
        _bool(w, "remote_image_allow_http", self.allow_http)
        _bool(w, "remote_image_allow_private", self.allow_private)
        _int(w, "remote_image_max_bytes", self.max_bytes, 1)
        _number(w, "remote_image_timeout_s", self.timeout_s, 0, lo_open=True)
        _int(w, "remote_image_max_redirects", self.max_redirects, 0)
        _int(w, "remote_image_fetch_concurrency", self.fetch_concurrency, 1)


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
        w = "[limits]"
        _int(w, "max_messages", self.max_messages, 1)
        _int(w, "max_images_per_request", self.max_images_per_request, 0)  # 0: text only
        _int(w, "max_image_bytes", self.max_image_bytes, 1)
        _int(w, "max_image_pixels", self.max_image_pixels, 1)
        _number(w, "max_image_aspect_ratio", self.max_image_aspect_ratio, 1)
        _int(w, "max_json_depth", self.max_json_depth, 2, 1000)
        _strings(self, w, "image_formats", IMAGE_FORMATS, nonempty=True)
        _int(w, "max_prompt_tokens", self.max_prompt_tokens, 1)
        _int(w, "max_tokens", self.max_tokens, 1)
        _int(w, "default_max_tokens", self.default_max_tokens, 1, self.max_tokens,
             bound=f"from 1 to max_tokens ({self.max_tokens})")
        _int(w, "max_stop_sequences", self.max_stop_sequences, 0)  # 0: "stop" refused
        _int(w, "decode_concurrency", self.decode_concurrency, 1)
        _int(w, "max_pending_requests", self.max_pending_requests, 1)
        _number(w, "request_timeout_s", self.request_timeout_s, 0, lo_open=True)
        _int(w, "remote_image_max_bytes", self.remote_image_max_bytes, 0)  # 0: max_image_bytes
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
        _bool(w, "enabled", self.enabled)
        _int(w, "budget_bytes", self.budget_bytes, 0)
        _int(w, "max_entries", self.max_entries, 0)
        _int(w, "max_batch_images", self.max_batch_images, 1)
        _number(w, "batch_wait_ms", self.batch_wait_ms, 0)


@dataclass(frozen=True)
class PrefixCacheConfig:
    enabled: bool = True
    block_size: int = 16
    budget_bytes: int = 256 * 1024 * 1024
    inflight_wait_s: float = 10.0  # wait this long for blocks another request is computing; 0: never wait
    hash: str = "xxh3_128"  # "xxh3_128" | "sha256": the hash of block and multimodal content keys

    def __post_init__(self) -> None:
        w = "[prefix_cache]"
        _bool(w, "enabled", self.enabled)
        _int(w, "block_size", self.block_size, 1, 4096)
        _int(w, "budget_bytes", self.budget_bytes, 0)
        _number(w, "inflight_wait_s", self.inflight_wait_s, 0)
        _choice(w, "hash", self.hash, HASH_ALGORITHMS)


@dataclass(frozen=True)
class GeneratorConfig:
    prefill_chunk_tokens: int = 512
    lookup_timeout_s: float = 2.0  # a prefix-cache look-up slower than this is treated as a miss

    def __post_init__(self) -> None:
        w = "[generator]"
        _int(w, "prefill_chunk_tokens", self.prefill_chunk_tokens, 1)
        _number(w, "lookup_timeout_s", self.lookup_timeout_s, 0, lo_open=True)


@dataclass(frozen=True)
class SupervisorConfig:
    restart_backoff_s: float = 0.1
    max_restart_backoff_s: float = 5.0
    stall_timeout_s: float = 30.0  # an actor with work pending and no progress this long is hung
    healthy_reset_s: float = 60.0  # an actor that ran this long since its last restart starts its backoff afresh

    def __post_init__(self) -> None:
        w = "[supervisor]"
        _number(w, "restart_backoff_s", self.restart_backoff_s, 0, lo_open=True)
        _number(w, "max_restart_backoff_s", self.max_restart_backoff_s, self.restart_backoff_s,
                bound=f">= restart_backoff_s ({self.restart_backoff_s})")
        _number(w, "stall_timeout_s", self.stall_timeout_s, 0, lo_open=True)
        _number(w, "healthy_reset_s", self.healthy_reset_s, 0, lo_open=True)


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    api_keys_env: str = "MMSERVE_API_KEYS"   # comma-separated keys, added to api_keys
    admin_key: str = ""
    admin_key_env: str = "MMSERVE_ADMIN_KEY"

    def __post_init__(self) -> None:
        w = "[auth]"
        _strings(self, w, "api_keys")
        _str(w, "api_keys_env", self.api_keys_env, empty=True)  # "": no environment variable
        _str(w, "admin_key", self.admin_key, empty=True)  # "": admin endpoints off (unless admin_key_env)
        _str(w, "admin_key_env", self.admin_key_env, empty=True)

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

    def __post_init__(self) -> None:
        _choice("[logging]", "format", self.format, LOG_FORMATS)
        _choice("[logging]", "level", self.level, LOG_LEVELS)


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

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"config [{name}]: must be a {cls.__name__}, got {getattr(self, name)!r}")
        models = self.models
        if not isinstance(models, (list, tuple)) or not all(isinstance(m, ModelConfig) for m in models):
            raise ValueError(f"config [[models]]: must be a list of ModelConfig, got {models!r}")
        if not models:
            raise ValueError("config [[models]]: is empty; configure at least one model")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            _fail("[[models]]", "name", "unique across models", sorted({n for n in names if names.count(n) > 1}))
        defaults = [m.name for m in models if m.default]
        if len(defaults) > 1:
            _fail("[[models]]", "default", "true for at most one model", defaults)
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


def _section(cls: type, raw: Any, where: str):
    """`where` is the label: "[server]", "[[models]]"."""
    if not isinstance(raw, dict):
        raise ValueError(f"config {where}: must be a table, got {raw!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(known)
    if unknown:
        raise ValueError(f"config {where}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    missing = [k for k, f in known.items()
               if k not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"config {where}: missing key(s) {missing}, got {raw!r}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    return cls(**values)


def config_from_dict(raw: dict, base_dir: Path | None = None) -> Config:
    """Builds a Config from parsed TOML, checking every key (ValueError names the section, the key
    and the value); relative model paths resolve against `base_dir`, and must exist."""
    raw = dict(raw)
    kwargs: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        if name in raw:
            kwargs[name] = _section(cls, raw.pop(name), f"[{name}]")
    if "models" in raw:
        entries = raw.pop("models")
        if not isinstance(entries, list):
            raise ValueError(f"config [[models]]: must be an array of tables ([[models]]), got {entries!r}")
        models = []
        for entry in entries:
            m = _section(ModelConfig, entry, "[[models]]")
            if base_dir is not None and not m.path.startswith(BUILTIN_PREFIX):
                p = Path(m.path).expanduser()
                if not p.is_absolute():
                    m = dataclasses.replace(m, path=str(base_dir / p))
            models.append(m)
        kwargs["models"] = tuple(models)
    if raw:
        raise ValueError(f"config: unknown section(s) {sorted(raw)}")
    config = Config(**kwargs)  # every section and model checked (their __post_init__s)
    for m in config.models:
        check_model_path(m)
    return config


def load_config(path: str | Path | None) -> Config:
    """Reads a TOML config file; None gives the built-in defaults (the `demo` model)."""
    if path is None:
        return Config()
    path = Path(path)
    with path.open("rb") as f:
        try:
            raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config {path}: not valid TOML: {e}") from None
    return config_from_dict(raw, base_dir=path.parent.resolve())


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

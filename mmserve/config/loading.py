"""Reading `config.toml` into a checked `Config`."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from mmserve.config.checks import BUILTIN_PREFIX, check_model_path, known_builtins
from mmserve.config.sections import SECTIONS, Config, KVCacheConfig, ModelConfig, kv_cache_from_prefix_cache




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
    if "prefix_cache" in raw:  # deprecated: its keys moved to [kv_cache]
        old = raw.pop("prefix_cache")
        if not isinstance(old, dict):
            raise ValueError(f"config [prefix_cache]: must be a table, got {old!r}")
        raw["kv_cache"] = {**kv_cache_from_prefix_cache(old, KVCacheConfig()), **raw.get("kv_cache", {})}
    kwargs: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
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
        check_model_path(m.name, m.path)
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

    A name not in the config but naming a directory is added as a local checkpoint; the committed
    demo checkpoints (`demo`, `demo-wide`, `demo-qwen`) are always known as built-ins.
    """
    models = []
    for i, name in enumerate(names):
        m = config.model(name)
        if m is None:
            if Path(name).expanduser().is_dir():
                m = ModelConfig(Path(name).name, str(Path(name).expanduser().resolve()))
            elif name in known_builtins():
                m = ModelConfig(name, BUILTIN_PREFIX + name, tool_parser="hermes")  # their templates' format
            else:
                raise ValueError(f"--model {name!r}: not in the config and not a directory")
        models.append(dataclasses.replace(m, default=(i == 0)))
    return dataclasses.replace(config, models=tuple(models))

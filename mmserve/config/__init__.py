"""Configuration: the typed, checked view of `config.toml`. The bottom layer with `errors` and
`logs`: it imports nothing else from mmserve."""

from mmserve.config.checks import BUILTIN_PREFIX, DEMO_CHECKPOINTS, DTYPES, HASH_ALGORITHMS
from mmserve.config.loading import config_from_dict, load_config, with_models
from mmserve.config.sections import (
    AuthConfig, Config, EncoderCacheConfig, GeneratorConfig, LimitsConfig, LoggingConfig, ModelConfig,
    KVCacheConfig, KVEventsConfig, RemoteImagesConfig, RuntimeConfig, ServerConfig, SharedCacheConfig, SupervisorConfig)
from mmserve.config.video import VideoConfig

__all__ = [
    "AuthConfig", "BUILTIN_PREFIX", "Config", "DEMO_CHECKPOINTS", "DTYPES", "EncoderCacheConfig", "GeneratorConfig",
    "HASH_ALGORITHMS", "LimitsConfig", "LoggingConfig", "ModelConfig", "KVCacheConfig", "KVEventsConfig", "RemoteImagesConfig",
    "RuntimeConfig", "ServerConfig", "SharedCacheConfig", "SupervisorConfig", "VideoConfig", "config_from_dict", "load_config", "with_models",
]

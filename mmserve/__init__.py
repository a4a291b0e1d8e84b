"""mmserve: an actor-based, asynchronous serving runtime for multimodal language models."""

from mmserve.errors import MMServeError
from mmserve.config import Config, load_config
from mmserve.runtime.runtime import ChatCompletion, ChatStream, Delta, Runtime
from mmserve.runtime.sync import SyncRuntime

__all__ = ["ChatCompletion", "ChatStream", "Config", "Delta", "MMServeError", "Runtime", "SyncRuntime", "load_config"]

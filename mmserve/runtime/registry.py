"""Model registry: the configured models, and for each loaded one its adapter and actors."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from mmserve.actors.encoder import Encoder
from mmserve.actors.generator import Generator
from mmserve.errors import ModelNotFound
from mmserve.models.llava import LlavaAdapter
from mmserve.runtime.config import Config, ModelConfig


@dataclass
class LoadedModel:
    config: ModelConfig
    adapter: LlavaAdapter
    encoder: Encoder
    generator: Generator


class ModelRegistry:
    def __init__(self, config: Config):
        self.config = config
        self.loaded: dict[str, LoadedModel] = {}

    def names(self) -> list[str]:
        return [m.name for m in self.config.models]

    def require(self, name: str) -> LoadedModel:
        """The loaded model `name`, or ModelNotFound naming the models that exist."""
        model = self.loaded.get(name)
        if model is None:
            raise ModelNotFound(
                f"the model {name!r} does not exist; available: {', '.join(self.names())}", param="model")
        return model

    async def load(self, mc: ModelConfig) -> LoadedModel:
        rc = self.config.runtime
        adapter = await trio.to_thread.run_sync(
            lambda: LlavaAdapter(mc.name, mc.resolved_path(), device=rc.device, dtype=rc.dtype))
        generator = Generator(adapter)
        encoder = Encoder(adapter, generator.inbox_send)
        model = LoadedModel(mc, adapter, encoder, generator)
        self.loaded[mc.name] = model
        return model

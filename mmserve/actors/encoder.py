"""Encoder actor: turns each request's images into encoder outputs (vision tower + projector).

Runs one model's vision tower in a worker thread and hands the prompt, with one embedding tensor
per image, to that model's generator.
"""

from __future__ import annotations

import trio

from mmserve.actors.base import Actor
from mmserve.actors.messages import EncodeJob, GenerateJob
from mmserve.models.llava import LlavaAdapter


class Encoder(Actor):
    name = "encoder"

    def __init__(self, adapter: LlavaAdapter, generator_inbox: trio.MemorySendChannel):
        super().__init__(model=adapter.name)
        self.adapter = adapter
        self.generator_inbox = generator_inbox

    async def run(self) -> None:
        async for job in self.inbox:
            self.progressed()
            await self._encode(job)
            self.progressed()

    async def _encode(self, job: EncodeJob) -> None:
        handle = job.handle
        if not handle.active:
            return
        embeds: tuple = ()
        if job.prompt.pixel_values is not None:
            self.in_flight[handle.request_id] = handle
            try:
                embeds = tuple(await trio.to_thread.run_sync(self.adapter.encode_images, job.prompt.pixel_values))
            finally:
                self.in_flight.pop(handle.request_id, None)
            self.log.info("encoder.encoded", request_id=handle.request_id, images=len(embeds))
        if handle.active:
            self.generator_inbox.send_nowait(GenerateJob(handle, job.prompt, embeds))

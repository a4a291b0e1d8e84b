"""Generator actor: owns the model forward for one model.

It admits new sequences between steps and advances every running sequence by one step at a time
(prefill, then one decode step per turn), so a long generation never starves a new request and a
caller that went away is dropped at its next step. Each step runs in a worker thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import trio

from mmserve.actors.base import Actor
from mmserve.actors.messages import FinishEvent, GenerateJob, RequestHandle, TokenEvent, Usage
from mmserve.models.llava import LlavaAdapter
from mmserve.runtime.sampling import make_generator, sample
from mmserve.runtime.stops import TextAssembler


@dataclass(eq=False)
class Sequence:
    """One request being generated: its prompt, KV cache, tokens so far and text state."""

    job: GenerateJob
    assembler: TextAssembler
    rng: torch.Generator | None
    cache: object = None
    tokens: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    @property
    def handle(self) -> RequestHandle:
        return self.job.handle

    @property
    def prompt_len(self) -> int:
        return len(self.job.prompt.input_ids)

    @property
    def params(self):
        return self.handle.request.sampling


class Generator(Actor):
    name = "generator"

    def __init__(self, adapter: LlavaAdapter):
        super().__init__(model=adapter.name)
        self.adapter = adapter
        self.running: list[Sequence] = []
        self.max_positions = int(getattr(adapter.text_config, "max_position_embeddings", 0) or 1 << 30)
        self._image_token = torch.tensor([adapter.image_token_id])
        self._eos = torch.tensor(sorted(adapter.eos_token_ids), dtype=torch.long)

    async def run(self) -> None:
        self.running.clear()
        while True:
            if not self.running:
                self._admit(await self.inbox.receive())
            self._admit_waiting()
            for seq in list(self.running):
                await self._step(seq)
            self.progressed()

    def _admit_waiting(self) -> None:
        while True:
            try:
                job = self.inbox.receive_nowait()
            except trio.WouldBlock:
                return
            self._admit(job)

    def _admit(self, job: GenerateJob) -> None:
        handle = job.handle
        if not handle.active:
            return
        params = handle.request.sampling
        seq = Sequence(job, TextAssembler(self.adapter.decode_text, params.stop), make_generator(params))
        self.running.append(seq)
        self.in_flight[handle.request_id] = handle

    def _drop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.in_flight.pop(seq.handle.request_id, None)
        seq.cache = None

    async def _step(self, seq: Sequence) -> None:
        if not seq.handle.active:
            self.log.info("generator.aborted", request_id=seq.handle.request_id, tokens=len(seq.tokens))
            self._drop(seq)
            return
        token = await trio.to_thread.run_sync(self._compute, seq)
        self._accept(seq, token)

    def _banned(self, seq: Sequence) -> torch.Tensor:
        if len(seq.tokens) < seq.params.min_tokens:
            return torch.cat([self._image_token, self._eos])
        return self._image_token

    def _compute(self, seq: Sequence) -> int:
        """One model step for `seq` (worker thread): prefill the prompt or decode one token."""
        a = self.adapter
        if seq.cache is None:
            prompt = seq.job.prompt
            pieces = [(span.start, emb) for span, emb in zip(prompt.spans, seq.job.image_embeds)]
            out = a.prefill(a.embed(prompt.input_ids, pieces))
        else:
            pos = seq.prompt_len + len(seq.tokens) - 1
            out = a.decode([seq.tokens[-1]], seq.cache, [pos])
        seq.cache = out.cache
        return sample(out.logits[0], seq.params, seq.rng, self._banned(seq))

    def _accept(self, seq: Sequence, token: int) -> None:
        handle = seq.handle
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        if token in self.adapter.eos_token_ids:
            return self._finish(seq, "stop")
        seq.tokens.append(token)
        text = seq.assembler.add(token)
        if text and not handle.emit(TokenEvent(text, token)):
            return self._drop(seq)
        if seq.assembler.stopped:
            return self._finish(seq, "stop")
        if len(seq.tokens) >= seq.params.max_tokens or seq.prompt_len + len(seq.tokens) >= self.max_positions:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        handle = seq.handle
        tail = seq.assembler.finish()
        if tail:
            handle.emit(TokenEvent(tail, -1))
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.tokens))
        handle.emit(FinishEvent(reason, usage))
        self.log.info(
            "generator.finished", request_id=handle.request_id, finish_reason=reason,
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            ttft_s=round((seq.first_token_at or time.monotonic()) - handle.created, 6),
            total_s=round(time.monotonic() - handle.created, 6),
        )
        self._drop(seq)

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
from transformers import DynamicCache

from mmserve.actors.base import Actor
from mmserve.actors.messages import FinishEvent, GenerateJob, RequestHandle, TokenEvent, Usage
from mmserve.actors.prefix_cache import Abort, Commit, Lookup, LookupResult, sequence_block_hashes
from mmserve.errors import MMServeError
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
    hit_tokens: int = 0
    prefilled: bool = False
    looked_up: bool = False
    committed: bool = False
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

    def __init__(self, adapter: LlavaAdapter, prefix_cache: trio.MemorySendChannel | None = None,
                 block_size: int = 16):
        super().__init__(model=adapter.name)
        self.adapter = adapter
        self.prefix_cache = prefix_cache
        self.block_size = block_size
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
        seq = Sequence(job, TextAssembler(self.adapter.decode_text, params.stop, self.adapter.answer_lead), make_generator(params))
        self.running.append(seq)
        self.in_flight[handle.request_id] = handle

    def _drop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.in_flight.pop(seq.handle.request_id, None)
        if seq.looked_up and not seq.committed:
            self.prefix_cache.send_nowait(Abort(seq.handle.request_id))
        seq.cache = None

    def fail_in_flight(self, error: MMServeError) -> int:
        for seq in list(self.running):
            self._drop(seq)
        return super().fail_in_flight(error)

    def _hashes(self, seq: Sequence, token_ids) -> list[bytes]:
        prompt = seq.job.prompt
        return sequence_block_hashes(self.adapter.model_sig, seq.handle.request.cache_salt, token_ids,
                                     prompt.spans, prompt.mm_keys, self.block_size)

    async def _lookup(self, seq: Sequence) -> LookupResult:
        """The cached prefix of the prompt, capped so at least one prompt token is prefilled."""
        ids = seq.job.prompt.input_ids
        hashes = self._hashes(seq, ids)[: (len(ids) - 1) // self.block_size]
        if not hashes:
            return LookupResult(0)
        send, receive = trio.open_memory_channel(1)
        seq.looked_up = True
        self.prefix_cache.send_nowait(Lookup(seq.handle.request_id, tuple(hashes), send))
        try:
            return await receive.receive()
        except trio.EndOfChannel:
            return LookupResult(0)

    def _commit(self, seq: Sequence) -> None:
        if self.prefix_cache is None or seq.cache is None:
            return
        kv_len = seq.cache.get_seq_length()
        ids = (list(seq.job.prompt.input_ids) + seq.tokens)[:kv_len]
        hashes = self._hashes(seq, ids)
        if hashes:
            kv = tuple((layer.keys, layer.values) for layer in seq.cache.layers)
            self.prefix_cache.send_nowait(Commit(seq.handle.request_id, tuple(hashes), kv))
            seq.committed = True

    async def _step(self, seq: Sequence) -> None:
        if not seq.handle.active:
            self.log.info("generator.aborted", request_id=seq.handle.request_id, tokens=len(seq.tokens))
            self._drop(seq)
            return
        if seq.cache is None and self.prefix_cache is not None and not seq.looked_up:
            hit = await self._lookup(seq)
            seq.hit_tokens = hit.blocks * self.block_size
            seq.cache = self._restore(hit)
            if not seq.handle.active:
                return
        token = await trio.to_thread.run_sync(self._compute, seq)
        self._accept(seq, token)

    def _restore(self, hit: LookupResult):
        if not hit.blocks:
            return None
        return DynamicCache(ddp_cache_data=list(hit.kv), config=self.adapter.text_config)

    def _banned(self, seq: Sequence) -> torch.Tensor:
        if len(seq.tokens) < seq.params.min_tokens:
            return torch.cat([self._image_token, self._eos])
        return self._image_token

    def _compute(self, seq: Sequence) -> int:
        """One model step for `seq` (worker thread): prefill the prompt or decode one token."""
        a = self.adapter
        if not seq.prefilled:
            out = self._prefill(seq)
            seq.prefilled = True
        else:
            pos = seq.prompt_len + len(seq.tokens) - 1
            out = a.decode([seq.tokens[-1]], seq.cache, [pos])
        seq.cache = out.cache
        return sample(out.logits[0], seq.params, seq.rng, self._banned(seq))

    def _prefill(self, seq: Sequence):
        """Prefills the prompt after the cached prefix; an image cut by the hit boundary gets exactly
        the rows of its encoder output that lie after it."""
        prompt, hit = seq.job.prompt, seq.hit_tokens
        pieces = []
        for span, emb in zip(prompt.spans, seq.job.image_embeds):
            if span.start + span.length > hit:
                skip = max(0, hit - span.start)
                pieces.append((span.start + skip - hit, emb[skip:]))
        embeds = self.adapter.embed(prompt.input_ids[hit:], pieces)
        return self.adapter.prefill(embeds, seq.cache, start=hit)

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
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.tokens), cached_tokens=seq.hit_tokens)
        handle.emit(FinishEvent(reason, usage))
        self._commit(seq)
        self.log.info(
            "generator.finished", request_id=handle.request_id, finish_reason=reason,
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            ttft_s=round((seq.first_token_at or time.monotonic()) - handle.created, 6),
            total_s=round(time.monotonic() - handle.created, 6),
        )
        self._drop(seq)

"""Generator actor: owns the model forward for one model, with continuous batching.

Between steps it admits new sequences. Each loop turn runs at most `prefill_chunk_tokens` of
prompt prefill (chunked, so a long prompt never stalls the others for more than one chunk) and
then one batched decode forward over every prefilled sequence, whatever their lengths. A sequence
that finishes or whose caller went away leaves the batch at once. Model steps run in worker
threads; the prefix cache is consulted before prefill and given the finished sequence's blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import trio
from transformers.cache_utils import Cache

from mmserve.actors.base import Actor
from mmserve.actors.decode_batch import HEADROOM, DecodeBatch
from mmserve.actors.messages import FinishEvent, GenerateJob, RequestHandle, TokenEvent, Usage
from mmserve.actors.prefix_cache import (
    Abort, Commit, Lookup, LookupResult, PinnedBlocks, PrefixFailed, sequence_block_hashes)
from mmserve.errors import MMServeError
from mmserve.models.llava import LlavaAdapter
from mmserve.runtime.config import GeneratorConfig, PrefixCacheConfig
from mmserve.runtime import compute
from mmserve.runtime.faults import fault
from mmserve.runtime.sampling import make_generator, sample
from mmserve.runtime.stops import TextAssembler


@dataclass(eq=False)
class Sequence:
    """One request being generated: prompt, KV state, tokens so far and text state."""

    job: GenerateJob
    assembler: TextAssembler
    rng: torch.Generator | None
    cache: Cache | None = None    # own KV (batch 1, in place) while outside the decode batch
    kv_len: int = 0               # tokens whose KV exists
    hit_tokens: int = 0
    hit: PinnedBlocks | None = None  # the cached prefix, until copied into `cache`
    embeds: torch.Tensor | None = None  # prompt embeddings after the cached prefix, until prefilled
    prompt_hashes: tuple[bytes, ...] = ()  # block hashes of the prompt's full blocks
    looked_up: bool = False       # the prefix cache knows this request (pins or registrations)
    lookup_deadline: float | None = None  # set while the lookup's answer is awaited
    closed: bool = False          # the final commit or abort was sent
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def handle(self) -> RequestHandle:
        return self.job.handle

    @property
    def label(self) -> str | None:
        return self.job.handle.client_request_id

    @property
    def prompt_len(self) -> int:
        return len(self.job.prompt.input_ids)

    @property
    def params(self):
        return self.handle.request.sampling

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.tokens)

    @property
    def prefilled(self) -> bool:
        return self.kv_len >= self.prompt_len


class Generator(Actor):
    name = "generator"

    def __init__(self, adapter: LlavaAdapter, prefix_cache: trio.MemorySendChannel | None = None,
                 prefix_config: PrefixCacheConfig = PrefixCacheConfig(), config: GeneratorConfig = GeneratorConfig(),
                 metrics=None):
        super().__init__(model=adapter.name)
        self.adapter = adapter
        self.prefix_cache = prefix_cache
        self.block_size = prefix_config.block_size
        # a lookup may wait for another request's commit; past this the sequence computes alone
        self.lookup_wait_s = prefix_config.inflight_wait_s + config.lookup_timeout_s
        self.config = config
        self.metrics = metrics
        self.waiting: list[Sequence] = []   # admitted, prompt not yet fully prefilled
        self.batch = DecodeBatch(adapter)
        self.max_positions = int(getattr(adapter.text_config, "max_position_embeddings", 0) or 1 << 30)
        self._image_token = torch.tensor([adapter.image_token_id])
        self._eos = torch.tensor(sorted(adapter.eos_token_ids), dtype=torch.long)
        self.steps = 0

    @property
    def running(self) -> list[Sequence]:
        return self.waiting + list(self.batch.members)

    async def run(self) -> None:
        self.waiting.clear()
        self.batch = DecodeBatch(self.adapter)
        while True:
            await self._take_messages()
            self._drop_aborted()
            if self._prefillable():
                await self._prefill_round()
            if self.batch.members:
                await self._decode_round()
            self.progressed()

    # -- messages: new sequences and prefix-cache answers -----------------------------------------

    async def _take_messages(self) -> None:
        """Takes every waiting message; when there is nothing to compute, first waits for one
        (or for the earliest lookup deadline, waking at least once a second to show liveness)."""
        if not self.batch.members and not self._prefillable():
            deadlines = [s.lookup_deadline for s in self.waiting if s.lookup_deadline is not None]
            with trio.move_on_at(min([*deadlines, trio.current_time() + 1.0])):
                self._on_message(await self.inbox.receive())
        while True:
            try:
                self._on_message(self.inbox.receive_nowait())
            except trio.WouldBlock:
                break
        now = trio.current_time()
        for seq in self.waiting:
            if seq.lookup_deadline is not None and seq.lookup_deadline <= now:
                seq.lookup_deadline = None
                self.log.warning("generator.lookup_timeout", request_id=seq.handle.request_id,
                                 waited_s=self.lookup_wait_s)

    def _on_message(self, msg) -> None:
        if isinstance(msg, GenerateJob):
            self._admit(msg)
        elif isinstance(msg, LookupResult):
            self._on_lookup(msg)
        elif isinstance(msg, PrefixFailed):
            seq = self._find(msg.request_id)
            if seq is not None:
                self._fail(seq, msg.error, msg.stage)
        else:
            raise TypeError(f"generator: unexpected message {msg!r}")

    def _prefillable(self) -> bool:
        return any(s.lookup_deadline is None for s in self.waiting)

    # -- admission and departure -------------------------------------------------------------

    def _admit(self, job: GenerateJob) -> None:
        handle = job.handle
        if not handle.active:
            return
        params = handle.request.sampling
        assembler = TextAssembler(self.adapter.decode_text, params.stop, self.adapter.answer_lead)
        seq = Sequence(job, assembler, make_generator(params))
        self.waiting.append(seq)
        self.in_flight[handle.request_id] = handle
        if self.prefix_cache is not None:
            try:
                self._lookup(seq)
            except Exception as e:
                self._fail(seq, e, "generator (block hashes)")

    def _find(self, request_id: str) -> Sequence | None:
        return next((s for s in self.running if s.handle.request_id == request_id), None)

    def _fail(self, seq: Sequence, exc: Exception, stage: str) -> bool:
        """Ends `seq` alone because handling it raised; the other sequences go on. Returns False
        (for _accept: the sequence is finished)."""
        if seq.handle.active:
            self.fail_request(seq.handle, exc, stage)
        return self._finish(seq, None)

    def _drop_aborted(self) -> None:
        for seq in [s for s in self.running if not s.handle.active]:
            self.log.info("generator.aborted", request_id=seq.handle.request_id, tokens=len(seq.tokens),
                          prefilled=seq.prefilled)
            self._leave(seq)

    def _leave(self, seq: Sequence) -> None:
        """Removes `seq` from the generator; an uncommitted prefix-cache ticket is aborted."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.batch.members:
            self.batch.set_members([m for m in self.batch.members if m is not seq])
        self.in_flight.pop(seq.handle.request_id, None)
        self._close(seq)
        seq.cache = seq.embeds = seq.hit = None

    def _close(self, seq: Sequence) -> None:
        """Tells the prefix cache this request will commit nothing more (pins, registrations)."""
        if seq.looked_up and not seq.closed:
            self.prefix_cache.send_nowait(Abort(seq.handle.request_id))
        seq.closed = True

    def fail_in_flight(self, error: MMServeError) -> int:
        for seq in self.running:
            self._close(seq)
        self.waiting.clear()
        self.batch = DecodeBatch(self.adapter)
        return super().fail_in_flight(error)

    # -- prefill -------------------------------------------------------------------------------

    async def _prefill_round(self) -> None:
        """Up to `prefill_chunk_tokens` of prompt prefill, oldest ready sequence first (a sequence
        still waiting for its lookup's answer is passed over)."""
        budget = self.config.prefill_chunk_tokens
        for seq in [s for s in self.waiting if s.lookup_deadline is None]:
            if budget <= 0:
                break
            chunk = min(budget, seq.prompt_len - seq.kv_len)
            t0 = time.monotonic()
            budget -= chunk
            try:
                token = await compute.run(self._prefill_chunk, seq, chunk, abandon_on_cancel=True, owner=self.key)
            except Exception as e:  # this sequence's input or state: its own cache is dropped with it
                self._fail(seq, e, "generator (prefill)")
                continue
            self.log.info("generator.prefill", request_id=seq.handle.request_id, tokens=chunk,
                          start=seq.kv_len - chunk, cached_tokens=seq.hit_tokens, done=seq.prefilled,
                          duration_s=round(time.monotonic() - t0, 6))
            if seq.prefilled:
                self.waiting.remove(seq)
                self._commit_prompt(seq)
                if isinstance(token, Exception):
                    self._fail(seq, token, "generator (sampling)")
                elif self._accept(seq, token):
                    self.batch.set_members([*self.batch.members, seq])

    def _lookup(self, seq: Sequence) -> None:
        """Asks for the cached prefix of the prompt, capped so at least one prompt token is
        prefilled; the answer arrives in this actor's inbox."""
        ids = seq.job.prompt.input_ids
        seq.prompt_hashes = tuple(self._hashes(seq, ids))
        hashes = seq.prompt_hashes[: (len(ids) - 1) // self.block_size]
        if not hashes:
            return
        seq.looked_up = True
        seq.lookup_deadline = trio.current_time() + self.lookup_wait_s
        self.prefix_cache.send_nowait(Lookup(seq.handle.request_id, hashes, self.inbox_send, seq.label))

    def _capacity(self, seq: Sequence) -> int:
        """Columns a sequence's own cache starts with: its prompt and some of its answer."""
        return seq.prompt_len + min(seq.params.max_tokens, HEADROOM)

    def _on_lookup(self, hit: LookupResult) -> None:
        seq = next((s for s in self.waiting if s.handle.request_id == hit.request_id), None)
        if seq is None or seq.lookup_deadline is None:
            return  # it left or stopped waiting; its final commit or abort releases the pins
        seq.lookup_deadline = None
        if hit.blocks:
            seq.kv_len = seq.hit_tokens = hit.blocks * self.block_size
            seq.hit = hit.source

    def _prefill_chunk(self, seq: Sequence, n: int) -> int | Exception | None:
        """Prefills the next `n` prompt tokens (compute thread); once the whole prompt is in,
        returns the first sampled token (or why sampling it failed)."""
        fault("generator.prefill", seq.label)
        if seq.embeds is None:
            seq.embeds = self._suffix_embeds(seq)
        if seq.cache is None:
            seq.cache = self.adapter.new_cache(self._capacity(seq))
            if seq.hit is not None:
                seq.hit.copy_into(seq.cache)
                seq.hit = None
        offset = seq.kv_len - seq.hit_tokens
        out = self.adapter.prefill(seq.embeds[:, offset:offset + n], seq.cache, start=seq.kv_len)
        seq.kv_len += n
        if not seq.prefilled:
            return None
        seq.embeds = None
        return self._sample_contained(seq, out.logits[0])

    def _suffix_embeds(self, seq: Sequence) -> torch.Tensor:
        """Embeddings of the prompt after the cached prefix; an image cut by the hit boundary gets
        exactly the rows of its encoder output that lie after it."""
        prompt, hit = seq.job.prompt, seq.hit_tokens
        pieces = []
        for span, emb in zip(prompt.spans, seq.job.image_embeds):
            if span.start + span.length > hit:
                skip = max(0, hit - span.start)
                pieces.append((span.start + skip - hit, emb[skip:]))
        return self.adapter.embed(prompt.input_ids[hit:], pieces)

    # -- decode ----------------------------------------------------------------------------------

    async def _decode_round(self) -> None:
        members = list(self.batch.members)
        tokens = await compute.run(self._decode_step, members, abandon_on_cancel=True, owner=self.key)
        self.steps += 1
        self.log.debug("generator.step", batch=len(members), request_ids=[m.handle.request_id for m in members])
        finished = [seq for seq, token in zip(members, tokens)
                    if not (self._fail(seq, token, "generator (sampling)") if isinstance(token, Exception)
                            else self._accept(seq, token))]
        if finished:
            self.batch.set_members([m for m in self.batch.members if m not in finished])

    def _decode_step(self, members: list[Sequence]) -> list[int | Exception]:
        """One batched forward (a failure there is the actor's), then each sequence's own sampling
        (a failure there is that sequence's alone)."""
        fault("generator.step")
        logits = self.batch.step()
        return [self._sample_contained(seq, logits[b]) for b, seq in enumerate(members)]

    def _sample_contained(self, seq: Sequence, logits: torch.Tensor) -> int | Exception:
        try:
            fault("generator.sample", seq.label)
            return self._sample(seq, logits)
        except Exception as e:
            return e

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        banned = self._image_token
        if len(seq.tokens) < seq.params.min_tokens:
            banned = torch.cat([self._image_token, self._eos])
        return sample(logits, seq.params, seq.rng, banned)

    # -- tokens out ------------------------------------------------------------------------------

    def _accept(self, seq: Sequence, token: int) -> bool:
        """Takes a sampled token; False when the sequence has finished (it is then finalised)."""
        handle = seq.handle
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
        elif self.metrics is not None:
            self.metrics.token_gap(self.adapter.name, now - seq.last_token_at)
        seq.last_token_at = now
        if token in self.adapter.eos_token_ids:
            return self._finish(seq, "stop")
        seq.tokens.append(token)
        try:
            fault("generator.detokenize", seq.label)
            text = seq.assembler.add(token)
        except Exception as e:
            return self._fail(seq, e, "generator (detokenizing)")
        # the first token is always announced (its text may be held back, e.g. a leading space):
        # callers see the first token when it exists, and a client gone by then is noticed
        if (text or len(seq.tokens) == 1) and not handle.emit(TokenEvent(text, token)):
            return self._finish(seq, None)
        if seq.assembler.stopped:
            return self._finish(seq, "stop")
        if len(seq.tokens) >= seq.params.max_tokens or seq.prompt_len + len(seq.tokens) >= self.max_positions:
            return self._finish(seq, "length")
        return True

    def _finish(self, seq: Sequence, reason: str | None) -> bool:
        """Ends `seq` with `reason` (None: the caller went away). Returns False for _accept."""
        handle = seq.handle
        if reason is not None:
            try:
                tail = seq.assembler.finish()
                self._commit(seq)
            except Exception as e:
                return self._fail(seq, e, "generator (finishing)")
            if tail:
                handle.emit(TokenEvent(tail, -1))
            usage = Usage(seq.prompt_len, len(seq.tokens), seq.hit_tokens)
            handle.emit(FinishEvent(reason, usage))
            ttft, total = (seq.first_token_at or time.monotonic()) - handle.created, time.monotonic() - handle.created
            if self.metrics is not None:
                self.metrics.request_finished(self.adapter.name, reason, usage.prompt_tokens,
                                              usage.completion_tokens, ttft, total)
            self.log.info(
                "generator.finished", request_id=handle.request_id, finish_reason=reason,
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens, images=len(seq.job.prompt.spans),
                ttft_s=round(ttft, 6), total_s=round(total, 6))
        if seq not in self.batch.members:  # batch members leave in one re-formation per step
            self._leave(seq)
        else:
            self.in_flight.pop(handle.request_id, None)
            self._close(seq)
        return False

    def _hashes(self, seq: Sequence, token_ids) -> list[bytes]:
        fault("generator.hash", seq.label)
        prompt = seq.job.prompt
        return sequence_block_hashes(self.adapter.model_sig, seq.handle.request.cache_salt, token_ids,
                                     prompt.spans, prompt.mm_keys, self.block_size, self.adapter.hash_algorithm)

    def _commit_prompt(self, seq: Sequence) -> None:
        """The prompt's full blocks, as soon as they are prefilled: requests waiting for them go on."""
        if self.prefix_cache is not None and seq.prompt_hashes:
            self.prefix_cache.send_nowait(Commit(seq.handle.request_id, seq.prompt_hashes, self.batch.kv_of(seq),
                                                 self.inbox_send, seq.label))
            seq.looked_up = True

    def _commit(self, seq: Sequence) -> None:
        """Hands the full blocks of prompt and generated tokens to the prefix cache."""
        if self.prefix_cache is None or not seq.kv_len:
            return
        ids = (list(seq.job.prompt.input_ids) + seq.tokens)[: seq.kv_len]
        hashes = self._hashes(seq, ids)
        if hashes:
            self.prefix_cache.send_nowait(Commit(seq.handle.request_id, tuple(hashes), self.batch.kv_of(seq),
                                                 self.inbox_send, seq.label))
            seq.closed = True

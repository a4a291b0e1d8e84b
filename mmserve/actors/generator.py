"""Generator actor: owns the model forward for one model, with continuous batching.

It receives prepared sequences — the cached prefix already pinned by intake's lookup, encoder
outputs for the images the prefix does not cover — and never calls back for hashes or hits.
Each loop turn runs at most `prefill_chunk_tokens` of prompt prefill (chunked, so a long prompt
never stalls the others for more than one chunk) and then one batched decode forward over every
prefilled sequence, whatever their lengths. A sequence that ends (finished, failed, its caller
gone) leaves the batch at the next re-formation. Model steps run on the compute thread; the
prompt's blocks are committed once prefilled, the answer's when the sequence finishes.
"""

from __future__ import annotations

import time

import torch
import trio

from mmserve.actors import compute
from mmserve.actors.base import Actor
from mmserve.actors.faults import fault
from mmserve.actors.messages import Abort, Commit, FinishEvent, GenerateJob, PrefixFailed, TokenEvent, Usage
from mmserve.actors.sequence import LIVE, Sequence, SeqState
from mmserve.cache.block_hash import prompt_block_hashes
from mmserve.config import GeneratorConfig, PrefixCacheConfig
from mmserve.errors import MMServeError
from mmserve.generation.decode_batch import HEADROOM, DecodeBatch
from mmserve.generation.sampling import make_generator, sample
from mmserve.generation.stops import TextAssembler
from mmserve.models.llava import LlavaAdapter


class Generator(Actor):
    name = "generator"

    def __init__(self, adapter: LlavaAdapter, prefix_cache: trio.MemorySendChannel | None = None,
                 prefix_config: PrefixCacheConfig = PrefixCacheConfig(), config: GeneratorConfig = GeneratorConfig(),
                 metrics=None):
        super().__init__(model=adapter.name)
        self.adapter = adapter
        self.prefix_cache = prefix_cache
        self.block_size = prefix_config.block_size
        self.config = config
        self.metrics = metrics
        self.waiting: list[Sequence] = []  # PREFILLING, oldest first
        self.batch = DecodeBatch(adapter)  # its members are DECODING
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
            if self.waiting:
                await self._prefill_round()
            if self.batch.members:
                await self._decode_round()
            self.progressed()

    # -- messages ------------------------------------------------------------------------------

    async def _take_messages(self) -> None:
        """Takes every waiting message; with nothing to compute, first waits for one (waking at
        least once a second to show liveness)."""
        if not self.running:
            with trio.move_on_after(1.0):
                self._on_message(await self.inbox.receive())
        while True:
            try:
                self._on_message(self.inbox.receive_nowait())
            except trio.WouldBlock:
                break
        self._prune()

    def _on_message(self, msg) -> None:
        if isinstance(msg, GenerateJob):
            self._admit(msg)
        elif isinstance(msg, PrefixFailed):  # one of its commits failed: it fails alone
            seq = next((s for s in self.running if s.request_id == msg.request_id), None)
            if seq is not None and seq.state in LIVE:
                self._fail(seq, msg.error, msg.stage)
        else:
            raise TypeError(f"generator: unexpected message {msg!r}")

    # -- admission and departure -------------------------------------------------------------

    def _admit(self, job: GenerateJob) -> None:
        params = job.handle.request.sampling
        assembler = TextAssembler(self.adapter.decode_text, params.stop, self.adapter.answer_lead)
        seq = Sequence.admit(job, assembler, make_generator(params))
        if not job.handle.active:
            self._settle_ticket(seq)
            return
        self.waiting.append(seq)
        self.in_flight[seq.request_id] = seq.handle

    def _drop_aborted(self) -> None:
        for seq in [s for s in self.running if not s.handle.active and s.state in LIVE]:
            self.log.info("generator.aborted", request_id=seq.request_id, tokens=len(seq.tokens),
                          prefilled=seq.prefilled)
            self._end(seq, SeqState.ABORTED)
        self._prune()

    def _end(self, seq: Sequence, state: SeqState) -> None:
        """Moves `seq` to an end state; what the prefix cache holds for it is released, and it
        leaves the waiting list or the batch at the next `_prune`."""
        seq.move(state)
        self.in_flight.pop(seq.request_id, None)
        self._settle_ticket(seq)
        seq.embeds = seq.hit = None

    def _prune(self) -> None:
        """Removes ended sequences: the batch re-forms once, whoever left it."""
        self.waiting = [s for s in self.waiting if s.state is SeqState.PREFILLING]
        live = [m for m in self.batch.members if m.state is SeqState.DECODING]
        if len(live) != len(self.batch.members):
            self.batch.set_members(live)

    def _settle_ticket(self, seq: Sequence) -> None:
        """Tells the prefix cache this request will commit nothing more (pins, registrations)."""
        if seq.ticket_open and self.prefix_cache is not None:
            self.prefix_cache.send_nowait(Abort(seq.request_id))
        seq.ticket_open = False

    def _fail(self, seq: Sequence, exc: Exception, stage: str) -> None:
        """Ends `seq` alone because handling it raised; the other sequences go on."""
        if seq.handle.active:
            self.fail_request(seq.handle, exc, stage)
        self._end(seq, SeqState.FAILED)

    def fail_in_flight(self, error: MMServeError) -> int:
        for seq in self.running:
            self._settle_ticket(seq)
        self.waiting.clear()
        self.batch = DecodeBatch(self.adapter)
        return super().fail_in_flight(error)

    # -- prefill -------------------------------------------------------------------------------

    async def _prefill_round(self) -> None:
        """Up to `prefill_chunk_tokens` of prompt prefill, oldest sequence first."""
        budget = self.config.prefill_chunk_tokens
        for seq in list(self.waiting):
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
            self.log.info("generator.prefill", request_id=seq.request_id, tokens=chunk,
                          start=seq.kv_len - chunk, cached_tokens=seq.hit_tokens, done=seq.prefilled,
                          duration_s=round(time.monotonic() - t0, 6))
            if seq.prefilled:
                self._commit_prompt(seq)
                if isinstance(token, Exception):
                    self._fail(seq, token, "generator (sampling)")
                elif self._accept(seq, token):
                    seq.move(SeqState.DECODING)
                    self.batch.set_members([*self.batch.members, seq])
        self._prune()

    def _capacity(self, seq: Sequence) -> int:
        """Columns a sequence's own cache starts with: its prompt and some of its answer."""
        return seq.prompt_len + min(seq.params.max_tokens, HEADROOM)

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
        exactly the rows of its encoder output that lie after it (an image the hit covers whole
        has no encoder output at all)."""
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
        self.log.debug("generator.step", batch=len(members), request_ids=[m.request_id for m in members])
        for seq, token in zip(members, tokens):
            if seq.state is not SeqState.DECODING:
                continue  # ended while the step ran (its caller left): the token is dropped
            if isinstance(token, Exception):
                self._fail(seq, token, "generator (sampling)")
            else:
                self._accept(seq, token)
        self._prune()

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
        """Takes a sampled token; False when the sequence has ended (it is then finalised)."""
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
            self._fail(seq, e, "generator (detokenizing)")
            return False
        # the first token is always announced (its text may be held back, e.g. a leading space):
        # callers see the first token when it exists, and a client gone by then is noticed
        if (text or len(seq.tokens) == 1) and not seq.handle.emit(TokenEvent(text, token)):
            self._end(seq, SeqState.ABORTED)
            return False
        if seq.assembler.stopped:
            return self._finish(seq, "stop")
        if len(seq.tokens) >= seq.params.max_tokens or seq.prompt_len + len(seq.tokens) >= self.max_positions:
            return self._finish(seq, "length")
        return True

    def _finish(self, seq: Sequence, reason: str) -> bool:
        """Ends `seq` with `reason`: its blocks are committed, then the caller gets the rest of
        the text and the finish. Returns False for _accept."""
        handle = seq.handle
        try:
            tail = seq.assembler.finish()
            self._commit(seq)
        except Exception as e:
            self._fail(seq, e, "generator (finishing)")
            return False
        if tail:
            handle.emit(TokenEvent(tail, -1))
        usage = Usage(seq.prompt_len, len(seq.tokens), seq.hit_tokens)
        handle.emit(FinishEvent(reason, usage, seq.job.encoder_hits))
        self._end(seq, SeqState.FINISHED)
        ttft, total = (seq.first_token_at or time.monotonic()) - handle.created, time.monotonic() - handle.created
        if self.metrics is not None:
            self.metrics.request_finished(self.adapter.name, reason, usage.prompt_tokens,
                                          usage.completion_tokens, ttft, total)
        self.log.info(
            "generator.finished", request_id=handle.request_id, finish_reason=reason,
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens, images=len(seq.job.prompt.spans),
            ttft_s=round(ttft, 6), total_s=round(total, 6))
        return False

    # -- commits ---------------------------------------------------------------------------------

    def _commit_prompt(self, seq: Sequence) -> None:
        """The prompt's full blocks, as soon as they are prefilled: requests waiting for them go on."""
        if self.prefix_cache is not None and seq.prompt_hashes:
            self.prefix_cache.send_nowait(Commit(seq.request_id, seq.prompt_hashes, self.batch.kv_of(seq),
                                                 self.inbox_send, seq.label))
            seq.ticket_open = True

    def _commit(self, seq: Sequence) -> None:
        """Hands the full blocks of prompt and answer to the prefix cache (the answer's blocks
        are hashed here: only this actor knows its tokens)."""
        if self.prefix_cache is None or not seq.kv_len:
            return
        fault("generator.hash", seq.label)
        prompt = seq.job.prompt
        ids = (list(prompt.input_ids) + seq.tokens)[: seq.kv_len]
        hashes = prompt_block_hashes(self.adapter.model_sig, seq.handle.request.cache_salt, ids, prompt.spans,
                                     prompt.mm_keys, self.block_size, algorithm=self.adapter.hash_algorithm)
        if hashes:
            self.prefix_cache.send_nowait(Commit(seq.request_id, tuple(hashes), self.batch.kv_of(seq),
                                                 self.inbox_send, seq.label))
            seq.ticket_open = False

"""Generator actor: the scheduler and the model runner of one model, over its paged KV arena.

It receives prepared sequences — the cached prefix already at the start of their block tables,
encoder outputs for the images the prefix does not cover. Each step is ONE forward over the
arena's block tables (`Adapter.forward_paged`): a decode token of every running sequence and
prefill chunks of waiting ones, packed to `max_batched_tokens` (`generation.scheduler`); the
blocks those tokens need are asked of the cache manager in one message per step; when a decode
token finds no block, the newest sequence is preempted (its blocks released, recomputed later).
The whole batch is sampled on the device with one host transfer. Full blocks are committed as
they fill (bookkeeping, zero bytes copied).
"""

from __future__ import annotations

import itertools
import time

import torch
import trio

from mmserve.actors import compute
from mmserve.actors.base import Actor
from mmserve.actors.faults import fault
from mmserve.actors.messages import (
    Allocate, Allocated, Commit, FinishEvent, GenerateJob, KVEpoch, PrefixFailed, Release, TokenEvent, Usage)
from mmserve.actors.sequence import LIVE, Sequence, SeqState
from mmserve.cache.block_hash import BlockChain
from mmserve.config import GeneratorConfig, KVCacheConfig
from mmserve.errors import BadRequest, MMServeError, ServiceUnavailable
from mmserve.generation.sampler import sample_batch
from mmserve.generation.sampling import make_generator
from mmserve.generation.scheduler import Planned, newest, plan_step
from mmserve.generation.stops import TextAssembler
from mmserve.models.adapter import Adapter
from mmserve.models.paged import KVArena, Segment


class Generator(Actor):
    name = "generator"

    def __init__(self, adapter: Adapter, cache_manager: trio.MemorySendChannel, kv: KVArena,
                 kv_config: KVCacheConfig = KVCacheConfig(), config: GeneratorConfig = GeneratorConfig(),
                 metrics=None):
        super().__init__(model=adapter.name)
        self.adapter = adapter
        self.cache_manager = cache_manager
        self.kv = kv
        self.block_size = kv_config.block_size
        self.caching = kv_config.prefix_caching
        self.config = config
        self.metrics = metrics
        self.seqs: list[Sequence] = []  # every live sequence, oldest first
        self.max_positions = int(getattr(adapter.text_config, "max_position_embeddings", 0) or 1 << 30)
        self._image_token = torch.tensor([adapter.image_token_id])
        self._eos = torch.tensor(sorted(adapter.eos_token_ids), dtype=torch.long)
        self._orders = itertools.count()
        self.steps = 0
        self.preemptions = 0
        self._incarnation = 0  # a step abandoned by a restart must not write into released blocks

    @property
    def running(self) -> list[Sequence]:
        return list(self.seqs)

    async def run(self) -> None:
        self.seqs.clear()
        self._incarnation += 1
        while True:
            await self._take_messages()
            self._drop_aborted()
            if self.seqs and not await self._step_round():
                with trio.move_on_after(0.01):  # blocks are held elsewhere for now: wait a little
                    self._on_message(await self.inbox.receive())
            self.progressed()

    # -- messages ------------------------------------------------------------------------------

    async def _take_messages(self) -> None:
        """Takes every waiting message; with nothing to compute, first waits for one (waking at
        least once a second to show liveness)."""
        if not self.seqs:
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
        elif isinstance(msg, KVEpoch):  # the cache manager restarted: tables of its earlier life are void
            self._check_epoch(msg.epoch)
        elif isinstance(msg, PrefixFailed):  # one of its commits failed: it fails alone
            seq = next((s for s in self.seqs if s.request_id == msg.request_id), None)
            if seq is not None and seq.state in LIVE:
                self._fail(seq, msg.error, msg.stage)
        else:
            raise TypeError(f"generator: unexpected message {msg!r}")

    # -- admission and departure -------------------------------------------------------------

    def _admit(self, job: GenerateJob) -> None:
        params = job.handle.request.sampling
        assembler = TextAssembler(self.adapter.decode_text, params.stop, self.adapter.answer_lead)
        prompt = job.prompt
        chain = BlockChain.of(self.adapter.model_sig, job.handle.request.cache_salt, len(prompt.input_ids),
                              prompt.spans, prompt.mm_keys, self.block_size,
                              algorithm=self.adapter.hash_algorithm) if self.caching else None
        seq = Sequence.admit(job, assembler, make_generator(params), next(self._orders), chain)
        if not job.handle.active:
            self._release(seq)
            return
        if -(-(seq.target_len + 1) // self.block_size) > self.kv.num_blocks:
            self._fail(seq, BadRequest(
                f"the prompt needs {seq.target_len} tokens of KV; this server's KV cache holds "
                f"{self.kv.num_blocks * self.block_size}", param="messages", code="context_length_exceeded"), "admission")
            return
        self.seqs.append(seq)
        self.in_flight[seq.request_id] = seq.handle

    def _drop_aborted(self) -> None:
        for seq in [s for s in self.seqs if not s.handle.active and s.state in LIVE]:
            self.log.info("generator.aborted", request_id=seq.request_id, tokens=len(seq.tokens),
                          prefilled=seq.state is SeqState.DECODING)
            self._end(seq, SeqState.ABORTED)
        self._prune()

    def _end(self, seq: Sequence, state: SeqState) -> None:
        """Moves `seq` to an end state; its blocks are released (the committed ones stay cached)."""
        seq.move(state)
        self.in_flight.pop(seq.request_id, None)
        self._release(seq)

    def _release(self, seq: Sequence, keep: int = 0) -> None:
        if seq.registered or seq.table:
            self.cache_manager.send_nowait(Release(seq.request_id, keep))
        seq.table = seq.table[:keep]
        seq.registered = bool(keep)

    def _prune(self) -> None:
        self.seqs = [s for s in self.seqs if s.state in LIVE]

    def _fail(self, seq: Sequence, exc: Exception, stage: str) -> None:
        """Ends `seq` alone because handling it raised; the other sequences go on."""
        if seq.handle.active:
            self.fail_request(seq.handle, exc, stage)
        self._end(seq, SeqState.FAILED)

    def fail_in_flight(self, error: MMServeError) -> int:
        for seq in self.seqs:
            self._release(seq)
        self.seqs.clear()
        return super().fail_in_flight(error)

    # -- one step ------------------------------------------------------------------------------

    async def _step_round(self) -> bool:
        """One step; False when nothing could run."""
        plan = await self._granted(self._plan())
        if not plan:
            return False
        t0 = time.monotonic()
        results = await compute.run(self._step, plan, self._incarnation, abandon_on_cancel=True, owner=self.key)
        self.steps += 1
        duration = round(time.monotonic() - t0, 6)
        for p, result in zip(plan, results):
            self._apply(p, result)
        self.log.debug("generator.step", batch=len(plan), tokens=sum(p.tokens for p in plan),
                       request_ids=[p.seq.request_id for p in plan], duration_s=duration)
        self._prune()
        return True

    def _plan(self) -> list[Planned]:
        decoding = [s for s in self.seqs if s.state is SeqState.DECODING]
        prefilling = [s for s in self.seqs if s.state is SeqState.PREFILLING]
        return plan_step(decoding, prefilling, self.block_size, self.config.max_batched_tokens,
                         self.config.max_running_requests)

    async def _granted(self, plan: list[Planned]) -> list[Planned]:
        """The plan, with the blocks it needs granted. A decode token that finds no block preempts
        the newest sequence holding blocks, and the step is planned again; a prefill chunk that
        finds none waits — unless only prefills wait, holding blocks the oldest needs: then the
        newest of them gives way."""
        while plan:
            if not any(p.new_blocks for p in plan):
                return plan  # every token fits the blocks it holds: nothing to ask
            reply = await self._allocate(plan)
            if reply is None:
                return []
            self._check_epoch(reply.epoch)
            for rid, blocks in reply.granted:
                seq = next(s for s in self.seqs if s.request_id == rid)
                seq.table.extend(blocks)
                seq.epoch, seq.registered = reply.epoch, True
            refused = set(reply.refused)
            plan = [p for p in plan if p.seq.state in LIVE]
            going = [p for p in plan if p.seq.request_id not in refused]
            if not refused:
                return plan
            stuck = any(p.decode and p.seq.request_id in refused for p in plan)
            oldest_refused = min((p.seq for p in plan if p.seq.request_id in refused), key=lambda s: s.order)
            if stuck or not going:
                victim = self._preempt_newest(spare=None if stuck else oldest_refused)
                if victim is None:
                    if not going:
                        self._give_way()
                    return going
                plan = self._plan()
                continue
            return going
        return []

    def _preempt_newest(self, spare: Sequence | None = None) -> Sequence | None:
        """Frees the blocks of the newest sequence holding any it can recompute (not `spare`); it
        is prefilled again later, from its kept blocks on. None when there is no such sequence."""
        holders = [s for s in self.seqs if s.state in LIVE and s is not spare
                   and s.table_len > s.unrecomputable_blocks(self.block_size)]
        victim = newest(holders)
        if victim is None:
            return None
        keep = victim.unrecomputable_blocks(self.block_size)
        self._release(victim, keep)
        victim.kv_len = min(victim.kv_len, keep * self.block_size)
        victim.committed = min(victim.committed, keep)
        if victim.state is SeqState.DECODING:
            victim.move(SeqState.PREFILLING)
        self.preemptions += 1
        if self.metrics is not None:
            self.metrics.preempted(self.adapter.name)
        self.log.info("generator.preempted", request_id=victim.request_id, kept_blocks=keep,
                      tokens=len(victim.tokens))
        return victim

    def _give_way(self) -> None:
        """Nothing can run and nothing can be preempted: the blocks are held by sequences that kept
        what they cannot recompute (images their cached prefix covered, whose encoder output they
        never had). The newest of them fails with a retryable 503 so the others go on."""
        holders = [s for s in self.seqs if s.state in LIVE and s.table]
        if len(holders) > 1:
            victim = newest(holders)
            self._fail(victim, ServiceUnavailable("the KV cache is full of requests that cannot be preempted; "
                                                  "retry shortly", retry_after_s=1.0), "kv cache")
            self._prune()

    async def _allocate(self, plan: list[Planned]) -> Allocated | None:
        needs = tuple((p.seq.request_id, p.new_blocks) for p in plan if p.new_blocks)
        send, replies = trio.open_memory_channel(1)
        self.cache_manager.send_nowait(Allocate(needs, send))
        # closed on the way out: a grant that comes too late finds no one, and the manager takes it back
        with replies, trio.move_on_after(self.config.lookup_timeout_s):
            return await replies.receive()
        self.log.warning("generator.allocate_timeout", waited_s=self.config.lookup_timeout_s)
        return None

    def _check_epoch(self, epoch: int) -> None:
        """Tables from an earlier life of the cache manager point at blocks it may have given away."""
        for seq in [s for s in self.seqs if s.epoch is not None and s.epoch != epoch]:
            self._fail(seq, ServiceUnavailable("the KV cache of this model was restarted while the request "
                                               "ran; retry", retry_after_s=1.0), "kv cache")
        self._prune()

    # -- the forward (compute thread) ----------------------------------------------------------

    def _step(self, plan: list[Planned], incarnation: int) -> list[int | Exception | None]:
        """One forward over every planned sequence's new tokens, then one batched sample of those
        that need a token. A failure of one sequence's own work is reported for it alone."""
        results: list[int | Exception | None] = [None] * len(plan)
        rows, pieces, segments, positions = [], [], [], []
        for i, p in enumerate(plan):
            try:
                if not p.decode:
                    fault("generator.prefill", p.seq.label)
                start, end = p.seq.kv_len, p.seq.kv_len + p.tokens
                rope = self.adapter.rope_positions(p.seq.job.prompt, len(p.seq.ids), start, end)
                pieces.append(self._embeds(p.seq, start, end))
                segments.append(Segment(tuple(p.seq.table), start, p.tokens))
                positions.append(rope)
                rows.append(i)
            except Exception as e:
                results[i] = e
        if not rows:
            return results
        fault("generator.step")
        if incarnation != self._incarnation:  # abandoned (a hang, then a restart): its blocks are gone
            return results
        logits = self.adapter.forward_paged(torch.cat(pieces, dim=1), segments, self.kv,
                                            torch.cat(positions, dim=1) if self.adapter.mrope else None)
        wanted = [(r, i) for r, i in enumerate(rows) if plan[i].seq.kv_len + plan[i].tokens == plan[i].seq.target_len]
        for (r, i), token in zip(wanted, self._sample(logits, [(r, plan[i].seq) for r, i in wanted])):
            results[i] = token
        for i in rows:
            if results[i] is None:
                results[i] = -1  # computed, no token due (a prefill chunk before the prompt's end)
        return results

    def _embeds(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Input embeddings of tokens [start, end): the answer's tokens and the prompt's, with each
        image's encoder output over its placeholders (the rows that fall in the range)."""
        pieces = []
        for span, emb in zip(seq.job.prompt.spans, seq.job.image_embeds):
            lo, hi = max(span.start, start), min(span.start + span.length, end)
            if lo < hi:
                pieces.append((lo - start, emb[lo - span.start:hi - span.start]))
        return self.adapter.embed(seq.ids[start:end], pieces)

    def _sample(self, logits: torch.Tensor, rows: list[tuple[int, Sequence]]) -> list[int | Exception]:
        """The next token of each (row, sequence): one batched sample, one host transfer; a
        sequence whose own sampling fails fails alone."""
        out: list[int | Exception] = [None] * len(rows)  # type: ignore[list-item]
        ok = []
        for k, (_, seq) in enumerate(rows):
            try:
                fault("generator.sample", seq.label)
                ok.append(k)
            except Exception as e:
                out[k] = e
        if ok:
            seqs = [rows[k][1] for k in ok]
            # a seeded row draws from its own generator (reproducible); the others share the device's
            gens = [s.rng if s.params.seed is not None else None for s in seqs]
            ids = sample_batch(logits[[rows[k][0] for k in ok]], [s.params for s in seqs], gens,
                               [self._banned(s) for s in seqs], on_error="return")
            for k, token in zip(ok, ids):
                out[k] = token
        return out

    def _banned(self, seq: Sequence) -> torch.Tensor:
        if len(seq.tokens) < seq.params.min_tokens:
            return torch.cat([self._image_token, self._eos])
        return self._image_token

    # -- after the step ------------------------------------------------------------------------

    def _apply(self, p: Planned, result: int | Exception | None) -> None:
        seq = p.seq
        if seq.state not in LIVE:
            return
        if isinstance(result, Exception):
            self._fail(seq, result, "generator (prefill)" if not p.decode else "generator (sampling)")
            return
        seq.kv_len += p.tokens
        if not p.decode:
            self.log.info("generator.prefill", request_id=seq.request_id, tokens=p.tokens,
                          start=seq.kv_len - p.tokens, cached_tokens=seq.hit_tokens, done=seq.kv_len == seq.target_len)
        try:
            self._commit_full_blocks(seq)
        except Exception as e:
            self._fail(seq, e, "generator (hashing)")
            return
        if result == -1:
            return
        if seq.state is SeqState.PREFILLING:
            seq.move(SeqState.DECODING)
        self._accept(seq, result)

    def _commit_full_blocks(self, seq: Sequence) -> None:
        """The blocks this step filled, keyed and committed (bookkeeping: requests waiting for
        them go on)."""
        if seq.chain is None:
            return
        full = min(seq.kv_len // self.block_size, seq.table_len)
        if full <= seq.committed:
            return
        fault("generator.hash", seq.label)
        seq.hashes = seq.chain.extend(seq.hashes, seq.ids[:full * self.block_size])
        new = tuple((i, seq.hashes[i]) for i in range(seq.committed, min(full, len(seq.hashes))))
        seq.committed = full
        if new:
            self.cache_manager.send_nowait(Commit(seq.request_id, new, self.inbox_send, seq.label))

    def _accept(self, seq: Sequence, token: int) -> None:
        """Takes a sampled token; the sequence ends when it is a stop, or its last."""
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
        elif self.metrics is not None:
            self.metrics.token_gap(self.adapter.name, now - seq.last_token_at)
        seq.last_token_at = now
        if token in self.adapter.eos_token_ids:
            return self._finish(seq, "stop")
        seq.ids.append(token)
        try:
            fault("generator.detokenize", seq.label)
            text = seq.assembler.add(token)
        except Exception as e:
            return self._fail(seq, e, "generator (detokenizing)")
        # the first token is always announced (its text may be held back, e.g. a leading space):
        # callers see the first token when it exists, and a client gone by then is noticed
        if (text or len(seq.tokens) == 1) and not seq.handle.emit(TokenEvent(text, token)):
            return self._end(seq, SeqState.ABORTED)
        if seq.assembler.stopped:
            return self._finish(seq, "stop")
        if len(seq.tokens) >= seq.params.max_tokens or len(seq.ids) >= self.max_positions:
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Ends `seq` with `reason`: the caller gets the rest of the text and the finish."""
        handle = seq.handle
        try:
            tail = seq.assembler.finish()
        except Exception as e:
            return self._fail(seq, e, "generator (finishing)")
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

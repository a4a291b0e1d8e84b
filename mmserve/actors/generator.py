"""Generator actor: the scheduler and the model runner of one model, over its paged KV arena.

It receives prepared sequences — the cached prefix already at the start of their block tables,
encoder outputs for the images the prefix does not cover. Each step is ONE forward over the
arena's block tables (`engine.runner.ModelRunner`, which owns the arena): a decode token of every running sequence and
prefill chunks of waiting ones, packed to `max_batched_tokens` (`generation.scheduler`); the
blocks those tokens need are drawn from a reservation the cache manager refills — one report and
at most one refill per step, never awaited (`actors.block_grants`); when a decode token finds no
block left anywhere, the newest sequence is preempted (its blocks released, recomputed later).
The whole batch is sampled on the device with one host transfer, started asynchronously —
penalties, grammar masks (computed beside the forward) and logprobs included. Full blocks are committed as they fill
(bookkeeping, zero bytes copied). A request's n choices share its one prefill (`actors.choices`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch
import trio

from mmserve.actors import compute
from mmserve.actors.base import Actor
from mmserve.actors.choices import BlockCopy
from mmserve.actors.forking import Forking
from mmserve.actors.faults import fault
from mmserve.actors.answers import Answers
from mmserve.actors.block_grants import BlockGrants
from mmserve.actors.messages import (
    FinishEvent, GenerateJob, KVEpoch, PrefixFailed, Refill, Release, TokenEvent)
from mmserve.actors.step_fences import StepFences, written_blocks
from mmserve.actors.step_build import StepBuild, StepBuilding, StepOutput
from mmserve.actors.step_overlap import StepOverlap
from mmserve.actors.sequence import LIVE, Sequence, SeqState
from mmserve.actors.prompt_scores import prompt_logprobs, scores_prompt
from mmserve.actors.token_rows import TokenPieces, assembler as text_assembler, banned_ids
from mmserve.cache.block_hash import BlockChain
from mmserve.config import GeneratorConfig, KVCacheConfig
from mmserve.errors import MMServeError, ServiceUnavailable
from mmserve.engine.write_fence import STEP_IDS
from mmserve.generation.grammar import Grammars, MaskJob
from mmserve.generation.sampling import make_generator
from mmserve.engine.step_sampling import sample_on_device
from mmserve.generation.scheduler import Planned, never_fits, plan_step
from mmserve.models.adapter import Adapter
from mmserve.engine.runner import ModelRunner


class Generator(BlockGrants, StepFences, StepOverlap, StepBuilding, Answers, Forking, Actor):
    name = "generator"

    def __init__(self, adapter: Adapter, cache_manager: trio.MemorySendChannel, runner: ModelRunner,
                 kv_config: KVCacheConfig = KVCacheConfig(), config: GeneratorConfig = GeneratorConfig(),
                 metrics=None, overlap: bool = True):
        super().__init__(model=adapter.name)
        self.overlap = overlap  # step n+1 prepared while step n runs (`actors.step_overlap`)
        self._overlap_state()
        self.adapter = adapter
        self.cache_manager = cache_manager
        self.runner = runner
        self.kv = runner.kv  # the runner's arena (read here for its size and epoch; written only by the runner)
        self.block_size = kv_config.block_size
        self.caching = kv_config.prefix_caching
        self.config = config
        self.metrics = metrics
        self.seqs: list[Sequence] = []  # every live sequence, oldest first
        # a sequence longer than the arena could never run again after a preemption: it ends there
        self.max_positions = runner.max_positions
        self._image_token = torch.tensor([adapter.image_token_id])
        self._eos = torch.tensor(sorted(adapter.eos_token_ids), dtype=torch.long)
        self._image_and_eos = torch.cat([self._image_token, self._eos])
        self._orders = itertools.count()
        self.steps = 0
        # where a busy generator's time goes: awaiting the compute thread's steps, and its own work
        # between two back-to-back steps (results out, messages in, the next plan) on the event loop
        self.forward_s = 0.0
        self.host_s = 0.0
        self._step_end: float | None = None  # None: the last round did not lead straight to this one
        self.preemptions = 0
        self.resumed_blocks = 0  # blocks preempted sequences got back from the cache instead of recomputing
        self.reencoded_images = 0  # images preempted sequences encoded again (their cached KV was gone)
        self._incarnation = 0  # a step abandoned by a restart must not write into released blocks
        self._step_ids = STEP_IDS  # each step's own number (the quarantine of an abandoned one): one space with the fence's writers
        self.kv_epoch: int | None = None  # the latest life of the cache manager heard of
        self._copies: list[BlockCopy] = []  # forked choices' partial blocks, copied at the next step
        self._grammars: Grammars | None = None
        self._pieces: TokenPieces | None = None  # token id → text and bytes, for logprobs
        self.finish_after_flush = False  # set with a shared tier: the manager delivers the finish

    @property
    def grammars(self) -> Grammars:
        """Compiled grammars and token bytes (llguidance), made on first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.adapter.tokenizer, self.adapter.vocab_size, self.adapter.eos_token_ids)
        return self._grammars

    @property
    def running(self) -> list[Sequence]:
        return list(self.seqs)

    async def run(self) -> None:
        self.seqs.clear()
        self._flush_held(everything=True)  # steps of an earlier run are fenced (quarantined) by now
        self._incarnation += 1
        self._new_lease()  # a restart: whatever was reserved for an earlier run goes back
        while True:
            await self._take_messages()
            self._drop_aborted()
            if self.seqs and not await self._step_round():
                self._step_end = None
                self._report()  # what changed, and the blocks it waits for
                with trio.move_on_after(0.01):  # blocks are held elsewhere for now: wait a little
                    self._on_message(await self.inbox.receive())
            if not self.seqs:
                self._step_end = None
                self._report()  # idle: the last step's releases, and the reservation goes back
            self.progressed()

    # -- messages ------------------------------------------------------------------------------

    async def _take_messages(self) -> None:
        """Takes every waiting message; with nothing to compute, first waits for one (waking at
        least once a second to show liveness)."""
        if not self.seqs:
            with trio.move_on_after(1.0):
                self._on_message(await self.inbox.receive())
        self._take_waiting()

    def _take_waiting(self) -> None:
        """Takes the messages already waiting, without waiting for one (between chained steps)."""
        while True:
            try:
                self._on_message(self.inbox.receive_nowait())
            except trio.WouldBlock:
                break
        self._prune()

    def _on_message(self, msg) -> None:
        if isinstance(msg, GenerateJob):
            self._admit(msg)
        elif isinstance(msg, Refill):  # blocks for the reservation (`block_grants`)
            self._refilled(msg)
        elif isinstance(msg, KVEpoch):  # the cache manager restarted: tables of its earlier life are void
            self._check_epoch(msg.epoch)
        elif isinstance(msg, PrefixFailed):  # one of its commits failed: it fails alone
            seq = next((s for s in self.seqs if s.kv_owner == msg.request_id), None)
            if seq is not None and seq.state in LIVE:
                self._fail(seq, msg.error, msg.stage)
        else:
            raise TypeError(f"generator: unexpected message {msg!r}")

    # -- admission and departure -------------------------------------------------------------

    def _admit(self, job: GenerateJob) -> None:
        params = job.handle.request.sampling
        assembler = text_assembler(self.adapter, job.handle.request)
        prompt = job.prompt
        chain = BlockChain.of(self.adapter.model_sig, job.handle.request.cache_salt, len(prompt.input_ids),
                              prompt.spans, prompt.mm_keys, self.block_size,
                              algorithm=self.adapter.hash_algorithm) if self.caching else None
        seq = Sequence.admit(job, assembler, make_generator(params), next(self._orders), chain)
        if not job.handle.active:
            self._release(seq)
            return
        if seq.epoch is not None and self.kv_epoch is not None and seq.epoch != self.kv_epoch:
            # its hit was answered by a life of the cache manager that has died since: void
            self._fail(seq, ServiceUnavailable("the KV cache of this model was restarted while the request "
                                               "was prepared; retry", retry_after_s=1.0), "kv cache")
            return
        try:
            matchers = [self.grammars.matcher(params.grammar) if params.grammar else None for _ in range(params.n)]
            if params.logprobs or scores_prompt(job.handle.request):
                self._pieces = self._pieces or TokenPieces(self.grammars.token_bytes)
        except Exception as e:
            self._fail(seq, e, "admission (grammar)")
            return
        seq.matcher = matchers[0]
        seq.forks = [(make_generator(params, c), matchers[c]) for c in range(1, params.n)]
        refusal = never_fits(seq.target_len, params.n, self.kv.num_blocks, self.block_size,
                             self.config.max_batched_tokens)
        if refusal is not None:
            self._fail(seq, refusal, "admission")
            return
        self.seqs.append(seq)
        self.in_flight[seq.request_id] = seq.handle

    def _drop_aborted(self) -> None:
        for seq in [s for s in self.seqs if not s.handle.active and s.state in LIVE]:
            self.log.info("generator.aborted", request_id=seq.request_id, tokens=len(seq.tokens),
                          prefilled=seq.state is SeqState.DECODING)
            self._end(seq, SeqState.ABORTED)
        self._prune()

    def _end(self, seq: Sequence, state: SeqState, finish: FinishEvent | None = None) -> None:
        """Moves `seq` to an end state; its blocks are released (the committed ones stay cached).
        `finish` is its last event: emitted now, or by the manager once its blocks are in the
        shared tier (`finish_after_flush`)."""
        seq.move(state)
        if not any(s.handle is seq.handle and s.state in LIVE for s in self.seqs):
            self.in_flight.pop(seq.request_id, None)
        later = finish is not None and self.finish_after_flush and (seq.registered or bool(seq.table))
        if finish is not None and not later:
            seq.handle.emit(finish)
        self._release(seq, finish=(seq.handle, finish) if later else None)

    def _release(self, seq: Sequence, finish=None, final: bool = True) -> None:
        if seq.registered or seq.table:
            entry = Release(seq.kv_owner, finish, final)
            if not self._hold_release(seq, entry):  # a step in flight may still write its blocks
                self._note(entry)  # in the next step report
        seq.table = []
        seq.registered = False
        seq.epoch = None  # it holds nothing: a restart of the manager no longer concerns it

    def _prune(self) -> None:
        """Drops ended sequences, and the copy sources pinned for choices among them (a choice can
        end at its fork, before the step that would have copied its block)."""
        self.seqs = [s for s in self.seqs if s.state in LIVE]
        for c in [c for c in self._copies if c.child.state not in LIVE]:
            self._note(Release(c.pin))
            self._copies.remove(c)

    def _fail(self, seq: Sequence, exc: Exception, stage: str) -> None:
        """Ends `seq` alone because handling it raised; the other sequences go on."""
        if seq.handle.active:
            self.fail_request(seq.handle, exc, stage)
        self._end(seq, SeqState.FAILED)

    def fail_in_flight(self, error: MMServeError) -> int:
        self._flush_held(everything=True)  # the steps in flight were quarantined when abandoned
        for seq in self.seqs:
            self._release(seq)
        self.seqs.clear()
        self._release_copies()
        self._give_back()  # the releases, and the reservation, in one last report
        return super().fail_in_flight(error)

    # -- one step ------------------------------------------------------------------------------

    async def _step_round(self) -> bool:
        """One step; False when nothing could run."""
        plan = self._plan()
        if any(p.seq.resumable for p in plan):
            await self._resume([p.seq for p in plan if p.seq.resumable])
            plan = self._plan()
        plan = self._granted(plan)  # drawn from the reservation: no message
        if not plan:
            return False
        if self.overlap:  # this step, and the next ones launched while it runs (`step_overlap`)
            self._host_time = None if self._step_end is None else time.monotonic() - self._step_end
            self._step_end = None
            await self._chain(plan)  # its report, with the draws of the step launched behind it
            return True
        self._report(plan)  # one message per step, never awaited; the refill comes while it runs
        t0 = time.monotonic()
        host = None if self._step_end is None else t0 - self._step_end
        self._step_end = None
        try:
            out = await compute.run(self._step, plan, self._copies, self._incarnation, abandon_on_cancel=True,
                                    owner=self.key, if_abandoned=self._quarantine(plan))
        finally:
            self._release_copies()
        results = await self._results(out)
        self._step_end = time.monotonic()
        self._count_step(self._step_end - t0, host)
        await self._apply_results(plan, results, round(self._step_end - t0, 6))
        return True

    def _count_step(self, forward_s: float, host_s: float | None) -> None:
        self.steps += 1
        self._time_step(forward_s, host_s)

    async def _apply_results(self, plan: list[Planned], results: list, duration: float) -> None:
        """A step's results, to its sequences (tokens, echoes, forks, finishes)."""
        for p, result in zip(plan, results):
            if p.seq.job.handle.request.prompt is not None and not isinstance(result, (int, Exception)):
                self._echo(p.seq)  # a completions prompt's prefill ended: its echo before any token
            if isinstance(result, list):  # its prefill ended: every choice's first token
                result = await self._fork(p, result)
            self._apply(p, result)
        self.log.debug("generator.step", batch=len(plan), tokens=sum(p.tokens for p in plan),
                       request_ids=[p.seq.request_id for p in plan], duration_s=duration)
        self._prune()

    def _time_step(self, forward_s: float, host_s: float | None) -> None:
        self.forward_s += forward_s
        if host_s is not None:
            self.host_s += host_s
        if self.metrics is not None:
            self.metrics.step_timed(self.adapter.name, forward_s, host_s)

    def _plan(self) -> list[Planned]:
        """The next step's plan (`plan_step`); every sequence in it is admitted (running) from now
        until it ends, a preemption included: at most `max_running_requests` requests at once —
        after making room for a waiting request of a better priority (`_make_room`)."""
        self._make_room()
        decoding = [s for s in self.seqs if s.state is SeqState.DECODING]
        prefilling = [s for s in self.seqs if s.state is SeqState.PREFILLING]
        plan = plan_step(decoding, prefilling, self.block_size, self.config.max_batched_tokens,
                         self.config.max_running_requests, self.ranking)
        for p in plan:
            p.seq.admitted = True
        return plan

    # -- the forward (compute thread) ----------------------------------------------------------

    def _step(self, plan: list[Planned], copies: list[BlockCopy], incarnation: int,
              built: StepBuild | None = None) -> StepOutput:
        """Forked choices' block copies, then one forward over every planned sequence's new tokens
        (`built`: the step, built beforehand — on the event loop for a step launched ahead), then
        one batched sample on the device of those that need a token (their grammar masks computed
        beside the forward), its host copy started. A failure of one sequence's own work is
        reported for it alone; the samples become results on the event loop (`_results`). All of
        it inside the runner's write fence: tables granted in an earlier life of the cache manager
        than the fence's at entry write nothing, and if a new life begins meanwhile, it holds every
        block this step may write until it returns (on a GPU the device work it enqueued runs
        before any later write, in stream order)."""
        with self.runner.fence.writing(lambda: written_blocks(plan, copies)) as epoch:
            return self._fenced_step(plan, copies, incarnation, built, epoch)

    def _fenced_step(self, plan: list[Planned], copies: list[BlockCopy], incarnation: int,
                     built: StepBuild | None, epoch: int | None) -> StepOutput:
        def void(seq) -> bool:  # its table was granted in an earlier life of the manager
            return seq.epoch is not None and epoch is not None and seq.epoch != epoch
        if incarnation == self._incarnation:  # not abandoned: no block was released under it
            for c in copies:  # before any forward writes: the copy source may be written from now on
                if c.child.state in LIVE and c.target in c.child.table and not void(c.child):
                    self.runner.copy_block(c.source, c.target)
        carried, self._carried = self._carried, None  # the samples of the previous step, on the device (overlap)
        if built is None or any(void(p.seq) for p in plan):
            entered = built.entered if built is not None else None
            built = self._build(plan)
            built.entered = entered
        results = list(built.results)
        if not built.rows:
            return StepOutput(results)
        fault("generator.step")
        if incarnation != self._incarnation:  # abandoned (a hang, then a restart): its blocks are gone
            return StepOutput(results)
        fault("generator.forward")  # past that check: a step slowed here writes after its abandonment
        masks = MaskJob(self.grammars, [s.matcher for s in built.constrained]) if built.constrained else None
        step = built.step
        if built.carry_at:  # step n's tokens, gathered into this step's ids on the device
            step = dataclasses.replace(step, carry=self._gather_carried(built.carry_at, carried))
        logits = self.runner.forward(step, built.prepared, built.entered)
        allowed = masks.allowed(logits.device) if masks is not None else None
        scored = built.scored
        sample = sample_on_device(logits, built.sampling.plan, allowed,
                                  scored.packed(logits[len(built.segments):]) if scored else None)
        if self.overlap:
            self._carried = (sample.ids, built.sampling.carry_rows)
        return StepOutput(results, built, sample)

    def _gather_carried(self, carry_at: list[tuple[int, int]], carried) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices in the step's ids, the tokens the previous step sampled for those sequences, on
        the device): a gather there, no host round trip. A sequence whose sampling failed (its
        result discards this step's) gets token 0."""
        at = torch.tensor([i for i, _ in carry_at], dtype=torch.long)
        if carried is None:
            return at, torch.zeros(len(carry_at), dtype=torch.long)
        ids, rows = carried
        src = [rows.get(key, ids.shape[0]) for _, key in carry_at]  # the appended zero for a missing one
        pool = torch.cat([ids, ids.new_zeros(1)])
        return at, pool.index_select(0, torch.tensor(src, dtype=torch.long).to(ids.device, non_blocking=True)).clamp_min(0)

    async def _results(self, out: StepOutput) -> list:
        """A step's results on the event loop: its samples' host copy awaited (on CUDA; on the CPU
        they are there) without blocking the loop, then made into each row's token(s)."""
        if out.sample is None:
            return out.results
        while not out.sample.done():
            await trio.sleep(0.0002)
        built, results = out.built, out.results
        sampled, host = out.sample.unpack()
        for (_, i), token in zip(built.wanted, self._tokens(built.sampling, sampled, len(built.wanted))):
            results[i] = token
        if built.scored:
            built.scored.store(host, self.adapter.vocab_size)
        for i in built.rows:
            if results[i] is None:
                results[i] = -1  # computed, no token due (a prefill chunk before the prompt's end)
        return results

    def _banned(self, seq: Sequence) -> torch.Tensor:
        return banned_ids(seq, self._image_token, self._eos, self.adapter.vocab_size, self._image_and_eos)

    def _echo(self, seq: Sequence) -> None:
        """With `echo`, every choice's text starts with the prompt's (its text as sent, or its ids
        decoded), and with the prompt's logprobs asked for, every choice gets them: once per
        request (a sequence prefilled again after a preemption sends nothing)."""
        raw = seq.handle.request.prompt
        if not (raw.echo or raw.logprobs is not None) or seq.echoed or seq.choice:
            return
        seq.echoed = True
        text = "" if not raw.echo else raw.text if raw.text is not None else \
            self.adapter.decode_special(seq.job.prompt.input_ids)
        scores = prompt_logprobs(seq, self._pieces) if raw.logprobs is not None else ()
        for c in range(seq.handle.choices):
            seq.handle.emit(TokenEvent(text, -1, c, prompt=scores))

    def _release_copies(self) -> None:
        """The copy sources of forked choices are no longer needed (copied, or their child is gone)."""
        for c in self._copies:
            self.cache_manager.send_nowait(Release(c.pin))
        self._copies = []

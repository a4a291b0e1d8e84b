"""Generator actor: the scheduler of one model, over the paged KV arena its model runner owns.

Each step is ONE forward over the arena's block tables (`engine.runner.ModelRunner`): a decode
token of every running sequence and prefill chunks of waiting ones, packed to `max_batched_tokens`
(`generation.scheduler`), sampled on the device with one asynchronous host transfer. Its parts,
each the only owner of its state (docs/design.md, "The generator's parts"): `grants` (the blocks,
drawn from a reservation the cache manager refills: `actors.block_grants`), `builder` (a step's
inputs: `engine.step_inputs`), `executor` (the step on the compute thread), `fences` (an abandoned
step's quarantine), `overlap` (steps launched ahead), `answers` (each token's way to its caller);
a request's n choices share its one prefill (`actors.forking`). It alone emits a finish.
"""

from __future__ import annotations

import itertools
import time

import trio

from mmserve.actors import compute
from mmserve.actors.answers import Answers, Ending, HeldFinishes
from mmserve.actors.base import Actor
from mmserve.actors.block_grants import BlockGrants, resume_wants
from mmserve.actors.faults import fault
from mmserve.actors.forking import fork_choices
from mmserve.actors.messages import (
    FinishEvent, FinishFlushed, GenerateJob, KVEpoch, PrefixFailed, Refill, Release)
from mmserve.actors.prompt_scores import scores_prompt
from mmserve.actors.sequence import LIVE, Sequence, SeqState
from mmserve.actors.step_executor import StepExecutor
from mmserve.actors.step_fences import StepFences
from mmserve.actors.step_overlap import Flight, StepOverlap
from mmserve.actors.token_rows import Lexicon, assembler as text_assembler
from mmserve.cache.block_hash import BlockChain
from mmserve.config import GeneratorConfig, KVCacheConfig
from mmserve.engine.step_inputs import StepBuilder
from mmserve.errors import MMServeError, ServiceUnavailable
from mmserve.engine.runner import ModelRunner
from mmserve.generation.sampling import make_generator
from mmserve.generation.scheduler import FIFO, Planned, Ranking, displaced, never_fits, plan_step
from mmserve.models.adapter import Adapter

class Generator(Actor):
    name = "generator"

    def __init__(self, adapter: Adapter, cache_manager: trio.MemorySendChannel, runner: ModelRunner,
                 kv_config: KVCacheConfig = KVCacheConfig(), config: GeneratorConfig = GeneratorConfig(),
                 metrics=None, overlap: bool = True, finish_flush_s: float | None = None):
        super().__init__(model=adapter.name)
        self.adapter = adapter
        self.cache_manager = cache_manager
        self.runner = runner
        self.arena = runner.kv  # the runner's arena (read here for its size; written only by the runner)
        self.block_size = kv_config.block_size
        self.caching = kv_config.prefix_caching
        self.config = config
        self.metrics = metrics
        self.seqs: list[Sequence] = []  # every live sequence, oldest first (changed in place only)
        # a sequence longer than the arena could never run again after a preemption: it ends there
        self.max_positions = runner.max_positions
        self.ranking: Ranking = FIFO  # who goes first (priority, aged, then arrival): fixed by each plan
        self._orders = itertools.count()
        self.steps = 0
        # where a busy generator's time goes: awaiting the compute thread's steps, and its own work
        # between two back-to-back steps (results out, messages in, the next plan) on the event loop
        self.forward_s = 0.0
        self.host_s = 0.0
        self._step_end: float | None = None  # None: the last round did not lead straight to this one
        self.preemptions = 0
        self.resumed_blocks = 0  # blocks preempted sequences got back from the cache instead of recomputing
        # with a shared tier, a finish waits until the blocks its answer committed are there (None: at once)
        self.finishes = HeldFinishes(finish_flush_s, self.log) if finish_flush_s is not None else None
        # the parts, each the only owner of its state
        self.lexicon = Lexicon(adapter)
        self.grants = BlockGrants(cache_manager, self.inbox_send, config, self.block_size, self.arena.num_blocks,
                                  self.log)
        self.builder = StepBuilder(adapter, runner, self.log, metrics, fault)
        self.executor = StepExecutor(runner, self.builder, self.lexicon, adapter.vocab_size, overlap)
        self.fences = StepFences(cache_manager, self.log)
        self.overlap = StepOverlap(overlap, self.executor, self.fences, self.grants, self.block_size,
                                   self.max_positions)
        self.answers = Answers(adapter, self.block_size, self.max_positions, self.grants, self.inbox_send,
                               self.lexicon, metrics, self.log)

    @property
    def running(self) -> list[Sequence]:
        return list(self.seqs)

    async def run(self) -> None:
        self.seqs.clear()
        self.overlap.flush_held(everything=True)  # steps of an earlier run are fenced (quarantined) by now
        self.executor.restarted()
        self.grants.new_lease()  # a restart: whatever was reserved for an earlier run goes back
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
        if self.finishes is not None and self.finishes.held:
            self.finishes.emit_due(time.monotonic())
        self._prune()

    def _on_message(self, msg) -> None:
        if isinstance(msg, GenerateJob):
            self._admit(msg)
        elif isinstance(msg, Refill):  # blocks for the reservation (`block_grants`)
            if self.grants.epoch is None or msg.epoch > self.grants.epoch:
                self._check_epoch(msg.epoch)
            self.grants.refilled(msg)
        elif isinstance(msg, FinishFlushed):  # an answer's blocks are in the shared tier: it ends
            if self.finishes is not None:
                self.finishes.flushed(msg.request_id)
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
        epoch = self.grants.epoch
        if seq.epoch is not None and epoch is not None and seq.epoch != epoch:
            # its hit was answered by a life of the cache manager that has died since: void
            self._fail(seq, ServiceUnavailable("the KV cache of this model was restarted while the request "
                                               "was prepared; retry", retry_after_s=1.0), "kv cache")
            return
        try:
            grammars = self.lexicon.grammars if params.grammar else None
            matchers = [grammars.matcher(params.grammar) if grammars else None for _ in range(params.n)]
            if params.logprobs or scores_prompt(job.handle.request):
                self.lexicon.want_pieces()
        except Exception as e:
            self._fail(seq, e, "admission (grammar)")
            return
        seq.matcher = matchers[0]
        seq.forks = [(make_generator(params, c), matchers[c]) for c in range(1, params.n)]
        refusal = never_fits(seq.target_len, params.n, self.arena.num_blocks, self.block_size,
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

    def _settle(self, seq: Sequence, ending: Ending | None) -> None:
        """What `Answers` decided for `seq`: nothing (it goes on), a failure, or its end."""
        if ending is None:
            return
        if ending.error is not None:
            self._fail(seq, ending.error, ending.stage)
        else:
            self._end(seq, ending.state, ending.finish)

    def _end(self, seq: Sequence, state: SeqState, finish: FinishEvent | None = None) -> None:
        """Moves `seq` to an end state; its blocks are released (the committed ones stay cached).
        `finish` is its last event: emitted now, or — with a shared tier — once the manager says
        the blocks it committed are there (`FinishFlushed`, asked for by its Release)."""
        seq.move(state)
        if not any(s.handle is seq.handle and s.state in LIVE for s in self.seqs):
            self.in_flight.pop(seq.request_id, None)
        later = finish is not None and self.finishes is not None and (seq.registered or bool(seq.table))
        if later:
            self.finishes.hold(seq.kv_owner, seq.handle, finish)
        elif finish is not None:
            seq.handle.emit(finish)
        self._release(seq, flushed=later)

    def _release(self, seq: Sequence, final: bool = True, flushed: bool = False) -> None:
        if seq.registered or seq.table:
            entry = Release(seq.kv_owner, final, self.inbox_send if flushed else None)
            if not self.overlap.hold_release(seq, entry):  # a step in flight may still write its blocks
                self.grants.note(entry)  # in the next step report
        seq.table = []
        seq.registered = False
        seq.epoch = None  # it holds nothing: a restart of the manager no longer concerns it

    def _release_copies(self, copies) -> None:
        """The copy sources of forked choices are no longer needed (copied, or their child is gone)."""
        for c in copies:
            self.grants.note(Release(c.pin))

    def _prune(self) -> None:
        """Drops ended sequences, and the copy sources pinned for choices among them (a choice can
        end at its fork, before the step that would have copied its block)."""
        self.seqs[:] = [s for s in self.seqs if s.state in LIVE]
        self._release_copies(self.executor.drop_copies_of_ended())

    def _fail(self, seq: Sequence, exc: Exception, stage: str) -> None:
        """Ends `seq` alone because handling it raised; the other sequences go on."""
        if seq.handle.active:
            self.fail_request(seq.handle, exc, stage)
        self._end(seq, SeqState.FAILED)

    def fail_in_flight(self, error: MMServeError) -> int:
        self.overlap.flush_held(everything=True)  # the steps in flight were quarantined when abandoned
        for seq in self.seqs:
            self._release(seq)
        self.seqs.clear()
        self._release_copies(self.executor.take_copies())
        if self.finishes is not None:  # complete answers: their finish does not wait for this restart
            self.finishes.emit_due(float("inf"))
        self.grants.new_lease()  # the releases, and the reservation, in one last report
        self._report()
        return super().fail_in_flight(error)

    # -- one step ------------------------------------------------------------------------------

    def _report(self, plan: list[Planned] = ()) -> None:
        self.grants.report(self.seqs, self.ranking, plan)

    def _quarantined(self, entry) -> None:
        """An abandoned step's quarantine: noted, and reported at once."""
        self.grants.note(entry)
        self._report()

    async def _step_round(self) -> bool:
        """One step; False when nothing could run."""
        plan = self._plan()
        if any(p.seq.resumable for p in plan):
            await self._resume([p.seq for p in plan if p.seq.resumable])
            plan = self._plan()
        plan = self.grants.granted(plan, self.seqs, self.ranking, self._preempt)  # drawn from the reservation
        if not plan:
            return False
        if self.overlap.enabled:  # this step, and the next ones launched while it runs (`step_overlap`)
            host = None if self._step_end is None else time.monotonic() - self._step_end
            self._step_end = None
            await self.overlap.chain(plan, self.seqs, self.key, host, self._report, self._stepped)
            self._step_end = time.monotonic()
            return True
        self._report(plan)  # one message per step, never awaited; the refill comes while it runs
        t0 = time.monotonic()
        host = None if self._step_end is None else t0 - self._step_end
        self._step_end = None
        copies = self.executor.take_copies()
        try:
            out = await compute.run(self.executor.step, plan, copies, self.executor.incarnation,
                                    abandon_on_cancel=True, owner=self.key,
                                    if_abandoned=self.fences.quarantine(plan, copies, self._quarantined))
        finally:
            self._release_copies(copies)
        results = await self.executor.results(out)
        self._step_end = time.monotonic()
        self._count_step(self._step_end - t0, host)
        await self._apply_results(plan, results, round(self._step_end - t0, 6))
        return True

    async def _stepped(self, flight: Flight, forward_s: float, host_s: float | None) -> None:
        """A step of the overlap chain returned (the next one may run already): its results, the
        releases it held, the messages that came meanwhile."""
        self._count_step(forward_s, host_s)
        flight.results = await self.executor.results(flight.out)  # its tokens' host copy, awaited here
        await self._apply_results(flight.plan, flight.results, round(forward_s, 6))
        self.overlap.landed(flight)
        self._take_waiting()
        self._drop_aborted()
        self.progressed()  # a step returned: the stall watchdog times the next one from here

    def _count_step(self, forward_s: float, host_s: float | None) -> None:
        self.steps += 1
        self.forward_s += forward_s
        if host_s is not None:
            self.host_s += host_s
        if self.metrics is not None:
            self.metrics.step_timed(self.adapter.name, forward_s, host_s)

    async def _apply_results(self, plan: list[Planned], results: list, duration: float) -> None:
        """A step's results, to its sequences (tokens, echoes, forks, finishes)."""
        for p, result in zip(plan, results):
            if p.seq.job.handle.request.prompt is not None and not isinstance(result, (int, Exception)):
                self.answers.echo(p.seq)  # a completions prompt's prefill ended: its echo before any token
            if isinstance(result, list):  # its prefill ended: every choice's first token
                result = await self._fork(p, result)
            self._settle(p.seq, self.answers.apply(p, result))
        self.log.debug("generator.step", batch=len(plan), tokens=sum(p.tokens for p in plan),
                       request_ids=[p.seq.request_id for p in plan], duration_s=duration)
        self._prune()

    async def _fork(self, p: Planned, firsts: list):
        """The other choices of a request whose prefill this step ended become sequences of their
        own (`forking`), each with its first token; the parent's first token is returned."""
        request = p.seq.handle.request
        first, made = await fork_choices(p, firsts, self.cache_manager, self.block_size,
                                         self.config.lookup_timeout_s, self._orders,
                                         lambda: text_assembler(self.adapter, request), self.grants.note, self.log)
        for child, copy, token in made:
            self.seqs.append(child)
            if copy is not None:
                self.executor.copies.append(copy)
            self._settle(child, self.answers.accept(child, token))
        return first

    # -- scheduling: plans, preemptions, resumes, manager lives --------------------------------

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

    def _make_room(self) -> None:
        """Fixes this step's ranking, then puts admitted requests of a worse priority back in the
        queue when the best-ranked waiting request finds no room (`scheduler.displaced`)."""
        self.ranking = Ranking(time.monotonic(), self.config.priority_aging_s)
        decoding = [s for s in self.seqs if s.state is SeqState.DECODING]
        prefilling = [s for s in self.seqs if s.state is SeqState.PREFILLING]
        out = displaced(decoding, prefilling, self.config.max_batched_tokens, self.config.max_running_requests,
                        self.ranking)
        if out:
            self._displace(out)

    def _displace(self, requests) -> None:
        """Puts the admitted `requests` back in the queue for a waiting request of a better
        priority (`generation.scheduler.displaced`): each of their sequences is preempted (blocks
        given back, prefilled again later from what is still cached) and loses its admission, so
        it is admitted again by rank, like any waiting request."""
        for seq in [s for s in self.seqs if s.state in LIVE and s.request_id in requests]:
            if seq.table or seq.kv_len or seq.state is SeqState.DECODING:
                self._preempt(seq)
            seq.admitted = False
        self.log.info("generator.displaced", request_ids=list(requests))

    def _preempt(self, victim: Sequence) -> None:
        """Gives every block of `victim` back (in the next report); it is prefilled again later,
        from what is still cached of its blocks on (its images encoded again where their KV is
        gone)."""
        self._release(victim, final=False)
        victim.kv_len, victim.committed = 0, 0
        victim.resumable = victim.chain is not None and bool(victim.hashes)
        if victim.state is SeqState.DECODING:
            victim.move(SeqState.PREFILLING)
        self.preemptions += 1
        if self.metrics is not None:
            self.metrics.preempted(self.adapter.name)
        self.log.info("generator.preempted", request_id=victim.request_id, tokens=len(victim.tokens))

    async def _resume(self, seqs: list[Sequence]) -> None:
        """Preempted sequences about to be prefilled again get back, from the manager, the blocks
        of theirs still cached (`BlockGrants.resume`): a round trip, after the report that carries
        their releases."""
        wants = resume_wants(seqs, self.block_size)
        if wants:
            # their releases reach the manager first — while they are still resumable, so that this
            # report neither asks for their prefill nor places tables for them: the refill would
            # evict the very blocks the resume is about to take back
            self._report()
        for seq in seqs:
            seq.resumable = False
        if not wants:
            return
        reply = await self.grants.resume(wants)
        self._take_waiting()  # what came meanwhile — a restart of the manager above all — before any draw
        if reply is not None:  # (None: their prefill recomputes everything: slower, never wrong)
            self._check_epoch(reply.epoch)
            self.resumed_blocks += self.grants.take_resumed(reply, self.seqs)

    def _check_epoch(self, epoch: int) -> None:
        """Tables from an earlier life of the cache manager point at blocks it may have given away:
        their sequences fail; those that held nothing go on. The reservation died with that life."""
        self.grants.saw_epoch(epoch)
        current = self.grants.epoch
        for seq in [s for s in self.seqs if s.epoch is not None and s.epoch != current and s.state in LIVE]:
            self._fail(seq, ServiceUnavailable("the KV cache of this model was restarted while the request "
                                               "ran; retry", retry_after_s=1.0), "kv cache")
        self._prune()

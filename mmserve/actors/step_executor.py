"""A planned step as the compute thread runs it (`StepExecutor`, a part the generator holds):
forked choices' block copies, the step's inputs (`engine.step_inputs`, unless built beforehand on
the event loop), the forward, the grammar masks beside it, one batched sample on the device with
its host copy started — all of it inside the runner's write fence — and, back on the event loop,
the samples made into each row's result.

It owns what lives between steps on this side: the block copies due before the next forward, the
previous step's samples still on the device (overlap: the next step launched ahead gathers its
tokens there), and the incarnation (a step abandoned by a restart must not write into released
blocks)."""

from __future__ import annotations

import dataclasses

import torch
import trio

from mmserve.actors.choices import BlockCopy
from mmserve.actors.faults import fault
from mmserve.actors.sequence import LIVE
from mmserve.actors.step_fences import written_blocks
from mmserve.actors.token_rows import Lexicon
from mmserve.engine.step_inputs import StepBuild, StepBuilder, StepOutput
from mmserve.generation.grammar import MaskJob
from mmserve.engine.runner import ModelRunner
from mmserve.generation.scheduler import Planned
from mmserve.engine.step_sampling import sample_on_device


class StepExecutor:
    def __init__(self, runner: ModelRunner, builder: StepBuilder, lexicon: Lexicon, vocab_size: int, overlap: bool):
        self.runner, self.builder, self.lexicon = runner, builder, lexicon
        self.vocab_size = vocab_size
        self.overlap = overlap  # keep each step's samples on the device for the next one
        self.incarnation = 0  # the generator's run (a restart abandons the steps of the one before)
        self.copies: list[BlockCopy] = []  # forked choices' partial blocks, copied at the next step
        # compute thread: the last step's sampled ids, on the device, and id(sequence) -> its row there
        self._carried: tuple | None = None

    def restarted(self) -> None:
        """A new run of the generator: steps of an earlier one still running write nothing more."""
        self.incarnation += 1

    def take_copies(self) -> list[BlockCopy]:
        """The block copies due, handed to the step that makes them (none are due after it)."""
        copies, self.copies = self.copies, []
        return copies

    def drop_copies_of_ended(self) -> list[BlockCopy]:
        """The copies whose choice ended before the step that would have made them."""
        ended = [c for c in self.copies if c.child.state not in LIVE]
        if ended:
            self.copies = [c for c in self.copies if c.child.state in LIVE]
        return ended

    # -- the compute thread --------------------------------------------------------------------

    def step(self, plan: list[Planned], copies: list[BlockCopy], incarnation: int,
             built: StepBuild | None = None) -> StepOutput:
        """Forked choices' block copies, then one forward over every planned sequence's new tokens
        (`built`: the step, built beforehand — on the event loop for a step launched ahead), then
        one batched sample on the device of those that need a token (their grammar masks computed
        beside the forward), its host copy started. A failure of one sequence's own work is
        reported for it alone; the samples become results on the event loop (`results`). All of
        it inside the runner's write fence: tables granted in an earlier life of the cache manager
        than the fence's at entry write nothing, and if a new life begins meanwhile, it holds every
        block this step may write until it returns (on a GPU the device work it enqueued runs
        before any later write, in stream order)."""
        with self.runner.fence.writing(lambda: written_blocks(plan, copies)) as epoch:
            return self._fenced(plan, copies, incarnation, built, epoch)

    def _fenced(self, plan: list[Planned], copies: list[BlockCopy], incarnation: int,
                built: StepBuild | None, epoch: int | None) -> StepOutput:
        def void(seq) -> bool:  # its table was granted in an earlier life of the manager
            return seq.epoch is not None and epoch is not None and seq.epoch != epoch
        if incarnation == self.incarnation:  # not abandoned: no block was released under it
            for c in copies:  # before any forward writes: the copy source may be written from now on
                if c.child.state in LIVE and c.target in c.child.table and not void(c.child):
                    self.runner.copy_block(c.source, c.target)
        carried, self._carried = self._carried, None  # the samples of the previous step, on the device (overlap)
        if built is None or any(void(p.seq) for p in plan):
            entered = built.entered if built is not None else None
            built = self.builder.build(plan)
            built.entered = entered
        results = list(built.results)
        if not built.rows:
            return StepOutput(results)
        fault("generator.step")
        if incarnation != self.incarnation:  # abandoned (a hang, then a restart): its blocks are gone
            return StepOutput(results)
        fault("generator.forward")  # past that check: a step slowed here writes after its abandonment
        masks = MaskJob(self.lexicon.grammars, [s.matcher for s in built.constrained]) if built.constrained else None
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

    @staticmethod
    def _gather_carried(carry_at: list[tuple[int, int]], carried) -> tuple[torch.Tensor, torch.Tensor]:
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

    # -- back on the event loop ----------------------------------------------------------------

    async def results(self, out: StepOutput) -> list:
        """A step's results on the event loop: its samples' host copy awaited (on CUDA; on the CPU
        they are there) without blocking the loop, then made into each row's token(s)."""
        if out.sample is None:
            return out.results
        if not out.sample.done():
            # waited for on a worker thread, which wakes the loop the moment they are there: a poll
            # (`trio.sleep`) wakes at epoll's millisecond granularity — measured 1.15 ms for a 0.2 ms
            # sleep, every step late by up to that much
            await trio.to_thread.run_sync(out.sample.wait, abandon_on_cancel=True)
        built, results = out.built, out.results
        sampled, host = out.sample.unpack()
        for (_, i), token in zip(built.wanted, self.builder.tokens(built.sampling, sampled, len(built.wanted))):
            results[i] = token
        if built.scored:
            built.scored.store(host, self.vocab_size)
        for i in built.rows:
            if results[i] is None:
                results[i] = -1  # computed, no token due (a prefill chunk before the prompt's end)
        return results

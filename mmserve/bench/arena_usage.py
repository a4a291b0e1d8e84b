"""How much of an embedded runtime's paged KV arena its running sequences take, sampled under load:
the bytes of the blocks in some block table (the arena's `referenced_blocks` × block bytes)
against the bytes of the tokens those sequences actually hold (Σ `kv_len` × block bytes /
block size). The difference is the paging's waste: each sequence's unfilled last block, plus the
blocks of a step in flight (taken before the step, counted in `kv_len` after it).

Reads the runtime's actors directly (`rt.registry.require(model)`): the generator's `running`
sequences and the cache manager's arena stats. Sampling is synchronous, from a task of the same
trio run, so each sample is one consistent moment of the trio loop (the generator may be waiting on
its step meanwhile: that step's blocks are counted, its tokens not yet)."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from mmserve.actors.sequence import SeqState
from mmserve.bench.common import ratio


@dataclass(frozen=True)
class Sample:
    referenced_blocks: int  # blocks in at least one block table
    held_tokens: int  # Σ kv_len over the running sequences
    running: int  # sequences in the generator
    all_decoding: bool  # every running sequence is decoding (no prefill chunk taken or in flight)


class ArenaUsage:
    """Samples of one model's arena; `summary()` says what they amount to."""

    def __init__(self, rt, model: str):
        loaded = rt.registry.require(model)
        self._generator, self._manager = loaded.generator, loaded.prefix_cache
        self.block_size: int = self._generator.block_size
        self.block_bytes: int = self._generator.arena.block_bytes
        self.num_blocks: int = self._generator.arena.num_blocks
        self.samples: list[Sample] = []

    def sample(self) -> None:
        """One sample, if any sequence is running."""
        running = self._generator.running
        if not running:
            return
        self.samples.append(Sample(self._manager.stats()["referenced_blocks"], sum(s.kv_len for s in running),
                                   len(running), all(s.state is SeqState.DECODING for s in running)))

    async def poll(self, interval: float) -> None:
        """Samples every `interval` s until cancelled."""
        while True:
            self.sample()
            await trio.sleep(interval)

    def _ratio(self, s: Sample) -> float:
        return ratio(s.referenced_blocks * self.block_size, s.held_tokens)

    def _describe(self, s: Sample) -> dict:
        return {"referenced_blocks": s.referenced_blocks, "held_tokens": s.held_tokens, "running": s.running,
                "bytes_in_use": s.referenced_blocks * self.block_bytes,
                "bytes_held": s.held_tokens * self.block_bytes // self.block_size, "ratio": self._ratio(s)}

    def summary(self, concurrency: int) -> dict:
        """`at_peak`: the sample with the most blocks in use (ties: the most tokens held), the ratio
        the target is about; `max_ratio_all_decoding`: the worst ratio among the samples where all
        `concurrency` sequences were decoding (the steady state, no prefill and no finished
        sequence's blocks awaiting release)."""
        out = {"block_size": self.block_size, "block_bytes": self.block_bytes, "num_blocks": self.num_blocks,
               "samples": len(self.samples), "at_peak": None, "max_ratio_all_decoding": None,
               "samples_all_decoding": 0}
        if not self.samples:
            return out
        out["at_peak"] = self._describe(max(self.samples, key=lambda s: (s.referenced_blocks, s.held_tokens)))
        steady = [s for s in self.samples if s.all_decoding and s.running == concurrency and s.held_tokens]
        out["samples_all_decoding"] = len(steady)
        if steady:
            out["max_ratio_all_decoding"] = max(self._ratio(s) for s in steady)
        return out

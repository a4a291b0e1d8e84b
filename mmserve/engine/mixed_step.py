"""The static mixed step: prefill chunks and decode tokens together, from buffers sized per bucket.

A step that is not a plain decode step — prefill chunks, image rows, decode tokens beside them — of
T new tokens over S sequences runs in the smallest token bucket (16, 32, 64, ... up to the
runner's `max_tokens`, the generator's `max_batched_tokens`; `[runtime] graph_token_buckets`
overrides the list) that holds T. Every tensor the step's body reads lives in `MixedBuffers`,
allocated once for the largest bucket:

- `embeds` [T, hidden]: the new tokens' input embeddings, image rows laid over their placeholders
  — the family's own `step_inputs` computes them before the body (one embedding gather and a copy
  per image: the image rows enter the graph through this buffer); `deepstack` [levels, T, hidden]
  (Qwen3-VL): each DeepStack level's rows at its image tokens' places, zero elsewhere;
- `positions` [R, T] (M-RoPE's rows), `slots` [T] (each token's arena slot), `q_ends` [T]
  (where each token's keys end: bidirectional spans, for a model that has them);
- per sequence (a bucket of T tokens carries at most min(T, max_seqs) sequences): `tables`,
  `seq_lens`, `cu_seqlens` (query starts) and `rows` (the index of its last new token: the logits
  the step returns).

Padding: tokens [n, T) belong to no sequence (their K/V go to the arena's spare scratch slot; the
attention writes no output for them, and no row of the model mixes tokens but attention, so they
touch nothing real); sequences [S, S_bucket) have no tokens and no keys. The attention launch is
sized by the bucket, never by the values, so it is capturable: with a tile map (`tile_seqs`,
`tile_ids`: the Triton backend's), ceil(T / tile) + S_bucket programs per KV head, the step's real
tiles first and the rest doing nothing; see docs/design.md "Captured steps".
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from mmserve.engine.arena import Segment
from mmserve.engine.attention import PagedMetadata
from mmserve.engine.attention.masks import key_ends, step_spans

SMALLEST_TOKEN_BUCKET = 16


def token_buckets(max_tokens: int, smallest: int = SMALLEST_TOKEN_BUCKET) -> tuple[int, ...]:
    """Token counts a mixed step is padded to: powers of two from `smallest`, then `max_tokens`."""
    sizes, t = [], smallest
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return tuple(sizes) + (max_tokens,)


class MixedBuffers:
    """The static inputs of a mixed step (see the module docstring), on the model's device."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, rope_rows: int, hidden: int,
                 dtype: torch.dtype, deepstack_levels: int, spans: bool, block_size: int, scratch_slot: int,
                 device: torch.device, tile_tokens: int | None = None):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.block_size, self.scratch_slot, self.device = block_size, scratch_slot, device
        self.tile_tokens = tile_tokens
        t, s = max_tokens, self.seqs(max_tokens)
        self.embeds = torch.zeros(t, hidden, dtype=dtype, device=device)
        self.deepstack = (torch.zeros(deepstack_levels, t, hidden, dtype=dtype, device=device)
                          if deepstack_levels else None)
        self.positions = torch.zeros(rope_rows, t, dtype=torch.long, device=device)
        self.slots = torch.full((t,), scratch_slot, dtype=torch.long, device=device)
        self.q_ends = torch.zeros(t, dtype=torch.int32, device=device) if spans else None
        self.tables = torch.zeros(s, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.rows = torch.zeros(s, dtype=torch.long, device=device)
        # the attention's tile map (`PagedMetadata.tile_map`): (sequence, tile) per program
        self.tile_seqs = self.tile_ids = None
        if tile_tokens:
            self.tile_seqs = torch.zeros(self.programs(t), dtype=torch.int32, device=device)
            self.tile_ids = torch.zeros(self.programs(t), dtype=torch.int32, device=device)
        # host staging of the metadata (pinned on CUDA: the copies in are asynchronous). The step's
        # samples go to the host asynchronously too, so nothing after the step orders its copies in
        # before the next fill: they record an event, and a fill or clear first waits for it (a mixed
        # step is never launched ahead of another, so on the GPU that wait finds it done; on the CPU
        # there is nothing to wait for)
        pin = device.type == "cuda"
        self._copied = torch.cuda.Event() if pin else None
        self._host = {name: torch.zeros_like(buf, device="cpu").pin_memory() if pin else
                      torch.zeros_like(buf, device="cpu")
                      for name, buf in self._metadata_buffers().items()}

    def seqs(self, bucket: int) -> int:
        """How many sequences a step of `bucket` tokens carries at most (each has a token)."""
        return min(bucket, self.max_seqs)

    def programs(self, bucket: int) -> int:
        """The tile map's length for a bucket: enough for any step it holds (each sequence wastes
        at most one partial tile)."""
        return -(-bucket // self.tile_tokens) + self.seqs(bucket)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every buffer (tests check that steps read only these, at fixed addresses)."""
        extra = tuple(t for t in (self.deepstack, self.q_ends, self.tile_seqs, self.tile_ids) if t is not None)
        return (self.embeds, self.positions, self.slots, self.tables, self.seq_lens, self.cu_seqlens,
                self.rows) + extra

    def _metadata_buffers(self) -> dict[str, torch.Tensor]:
        bufs = {"positions": self.positions, "slots": self.slots, "tables": self.tables,
                "seq_lens": self.seq_lens, "cu_seqlens": self.cu_seqlens, "rows": self.rows}
        if self.q_ends is not None:
            bufs["q_ends"] = self.q_ends
        if self.tile_seqs is not None:
            bufs["tile_seqs"], bufs["tile_ids"] = self.tile_seqs, self.tile_ids
        return bufs

    def fits(self, segments: Sequence[Segment], tokens: int,
             spans: Sequence[Sequence[tuple[int, int]]] | None = None) -> str | None:
        """Why a step of these segments cannot run from these buffers (None: it can)."""
        if self.q_ends is None and spans and any(spans):
            return "bidirectional_spans"  # a model without them never asks; the eager path has them
        if tokens > self.max_tokens:
            return "too_many_tokens"
        if len(segments) > self.max_seqs:
            return "too_many_sequences"
        if any(-(-s.end // self.block_size) > self.max_blocks for s in segments):
            return "too_long"
        return None

    def fill(self, segments: Sequence[Segment], embeds: torch.Tensor, positions: np.ndarray | None,
             spans: Sequence[Sequence[tuple[int, int]]] | None, bucket: int) -> None:
        """The step's metadata into the buffers' first `bucket` tokens and `seqs(bucket)` sequences,
        padding past them; `embeds` [n, hidden] (on the device) into `embeds` (the DeepStack rows:
        `fill_deepstack`). `positions` [R, n] (None: each token's own position); `spans`: per
        segment, its sequence's bidirectional spans."""
        n, s, bs = embeds.shape[0], len(segments), self.block_size
        s_bucket = self.seqs(bucket)
        if n > bucket or bucket > self.max_tokens or s > s_bucket:
            raise ValueError(f"{n} tokens of {s} sequences in a bucket of {bucket} tokens, {s_bucket} sequences")
        self._wait_copies()
        host = {k: v.numpy() for k, v in self._host.items()}
        lengths = np.array([seg.length for seg in segments], dtype=np.int64)
        starts = np.array([seg.start for seg in segments], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lengths)])
        if cu[-1] != n:
            raise ValueError(f"the segments hold {cu[-1]} new tokens, the embeddings {n}")
        own = np.concatenate([np.arange(st, st + ln) for st, ln in zip(starts, lengths)])  # each token's position
        host["cu_seqlens"][:s + 1] = cu
        host["cu_seqlens"][s + 1:s_bucket + 1] = n  # padding sequences: no tokens
        host["seq_lens"][:s_bucket] = 0
        host["seq_lens"][:s] = starts + lengths
        host["rows"][:s_bucket] = 0
        host["rows"][:s] = cu[1:] - 1
        tables = host["tables"]
        tables[:s_bucket] = 0
        slots = host["slots"]
        slots[:bucket] = self.scratch_slot
        for i, seg in enumerate(segments):
            used = -(-seg.end // bs)
            if used > self.max_blocks or len(seg.block_table) < used:
                raise ValueError(f"a block table of {used} blocks for a static width of {self.max_blocks}")
            tables[i, :used] = seg.block_table[:used]
        seq_of = np.repeat(np.arange(s), lengths)  # each token's sequence
        slots[:n] = tables[seq_of, own // bs].astype(np.int64) * bs + own % bs
        host["positions"][:, :bucket] = 0
        host["positions"][:, :n] = own if positions is None else positions
        if self.q_ends is not None:
            ends = host["q_ends"]
            ends[:bucket] = 0
            for i, seg in enumerate(segments):
                mine = step_spans(spans[i] if spans else (), seg.start, seg.length)
                ends[cu[i]:cu[i + 1]] = key_ends(seg.start, seg.length, mine)
        elif spans and any(step_spans(sp, seg.start, seg.length) for sp, seg in zip(spans, segments)):
            raise ValueError("a step with bidirectional spans for buffers built without them")
        if self.tile_seqs is not None:
            tiles = -(-lengths // self.tile_tokens)
            total, p = int(tiles.sum()), self.programs(bucket)
            first = np.repeat(np.cumsum(tiles) - tiles, tiles)  # each program's sequence's first tile
            host["tile_seqs"][:p] = 0
            host["tile_seqs"][:total] = np.repeat(np.arange(s), tiles)
            host["tile_ids"][:p] = -(-self.max_tokens // self.tile_tokens) + 1  # past every chunk: no work
            host["tile_ids"][:total] = np.arange(total) - first
        self._copy_in(bucket)
        self.embeds[:n].copy_(embeds)
        self.embeds[n:bucket].zero_()
        if self.deepstack is not None:
            self.deepstack[:, :bucket].zero_()

    def fill_deepstack(self, pieces: Sequence[tuple[int, torch.Tensor]], levels: Sequence[torch.Tensor]) -> None:
        """DeepStack's level rows (`Qwen3VLAdapter.step_inputs`: each level's rows in the order of
        the pieces' positions) at their tokens' places; `fill` zeroed the rest."""
        at = 0
        for pos, rows in sorted((p for p in pieces if p[1].shape[0]), key=lambda p: p[0]):
            r = rows.shape[0]
            for k, level in enumerate(levels):
                self.deepstack[k, pos:pos + r].copy_(level[at:at + r])
            at += r

    def clear(self, bucket: int) -> None:
        """Every token and sequence of the bucket padding (what a capture at load runs on)."""
        self._wait_copies()
        for host in self._host.values():
            host.zero_()
        self._host["slots"].fill_(self.scratch_slot)
        if self.tile_ids is not None:
            self._host["tile_ids"].fill_(-(-self.max_tokens // self.tile_tokens) + 1)
        self._copy_in(bucket)
        self.embeds[:bucket].zero_()
        if self.deepstack is not None:
            self.deepstack[:, :bucket].zero_()

    def _wait_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # (an event never recorded counts as done)

    def _copy_in(self, bucket: int) -> None:
        """The staged rows of the bucket into the device buffers (asynchronous from pinned memory)."""
        s = self.seqs(bucket)
        extent = {"positions": bucket, "slots": bucket, "q_ends": bucket, "tables": s, "seq_lens": s, "rows": s,
                  "cu_seqlens": s + 1}
        if self.tile_seqs is not None:
            extent["tile_seqs"] = extent["tile_ids"] = self.programs(bucket)
        for name, buf in self._metadata_buffers().items():
            rows = extent[name]
            if name == "positions":
                buf[:, :rows].copy_(self._host[name][:, :rows], non_blocking=True)
            else:
                buf[:rows].copy_(self._host[name][:rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def metadata(self, bucket: int) -> PagedMetadata:
        """The step's metadata as views of the buffers: every sequence a chunk (the prefill kernel;
        a decode token is a chunk of one), chunks of at most `bucket` tokens — host fields only the
        bucket's shape."""
        s = self.seqs(bucket)
        return PagedMetadata(block_tables=self.tables[:s], seq_lens=self.seq_lens[:s],
                             cu_seqlens_q=self.cu_seqlens[:s + 1], slot_mapping=self.slots[:bucket],
                             num_decodes=0, max_query_len=bucket, block_size=self.block_size,
                             starts=(), lengths=(1,) * s, tables=(),
                             q_ends=None if self.q_ends is None else self.q_ends[:bucket],
                             tile_map=None if self.tile_seqs is None else
                             (self.tile_seqs[:self.programs(bucket)], self.tile_ids[:self.programs(bucket)]))

"""ModelRunner: the generator's engine — the one room where a model step touches the device.

It owns the model's KV arena (`models.paged.KVArena`: nothing else writes its tensors — a forked
choice's block copy and a shared-tier restore go through `copy_block` and `write_blocks`), the
attention backend (`[runtime] attention_backend`, checked against what the model needs at
construction), and, with a capturable backend (the Triton kernels), the static decode step
(`decode_graphs`): its input buffers and, on CUDA, a graph per batch bucket. The generator hands
it a step (`StepInputs`: every sequence's new tokens, their segments of the arena, image rows,
M-RoPE positions) and gets back float logits on the device, which it samples right after, with
one transfer to the host (`generation.step_sampling`).

A step takes one of two paths:
- **static decode** — every sequence has one new token and no image row, and the backend is
  capturable: the buffers are filled (host → device copies only) and the bucket's body runs, or
  its graph replays. Nothing in it synchronises with the host.
- **eager** — everything else (prefill chunks, image rows, a prompt's own logprobs), and every
  step with the `sdpa` backend (the CPU's path: per-sequence SDPA reading consecutive blocks in
  place, `models.paged.PagedBatch`).

Families keep transformers' model classes: the runner calls the adapter's language model with
the paged attention as its implementation (`models.paged_forward`), never a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from mmserve.attention import AttentionBackend, ModelFeatures, PagedMetadata, select
from mmserve.generation.decode_graphs import DecodeBuffers, DecodeGraphs, bucket_of, buckets
from mmserve.models.paged import KVArena, PagedBatch, Segment
from mmserve.models.paged_forward import BackendStep, STEP_MASK, KWARG, forward_step, \
    step_positions, use_paged_attention


@dataclass(frozen=True, eq=False)
class StepInputs:
    """One step's work: `ids` are the new tokens of every segment, concatenated in order;
    `pieces` lay encoder-output rows over placeholders ((offset in ids, rows), `Adapter.embed`);
    `positions` [R, T] are M-RoPE positions (None: a token's position is its index);
    `extra_rows` index new tokens whose logits are wanted after the segments' last tokens';
    `spans`: per segment, its sequence's bidirectional spans ([lo, hi) positions whose tokens see
    each other: Gemma 3's images; None or empty: causal), which the step masks explicitly."""

    ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    pieces: tuple[tuple[int, torch.Tensor], ...] = ()
    positions: torch.Tensor | None = None
    extra_rows: torch.Tensor | None = None
    spans: tuple[tuple[tuple[int, int], ...], ...] | None = None

    @property
    def decode_only(self) -> bool:
        return not self.pieces and self.extra_rows is None and all(s.length == 1 for s in self.segments)


class ModelRunner:
    """See the module docstring. `max_batch`: the most sequences a decode step carries (the
    generator's `max_running_requests`, n choices included, bounds it; larger steps run eagerly)."""

    def __init__(self, adapter, kv_budget_bytes: int, block_size: int, backend: str | AttentionBackend = "auto",
                 max_batch: int = 256, cuda_graphs: bool = True):
        self.adapter = adapter
        self.device = adapter.device
        self.backend = select(backend, self.device) if isinstance(backend, str) else backend
        self.backend.check(ModelFeatures.from_config(adapter.config))
        static = self.backend.capturable
        self.kv = KVArena.for_model(adapter, kv_budget_bytes, block_size, spare_blocks=1 if static else 0)
        self.block_size = block_size
        use_paged_attention(adapter)
        limit = int(getattr(adapter.text_config, "max_position_embeddings", 0) or 1 << 30)
        self.max_positions = min(limit, self.kv.num_blocks * block_size)
        self.rope_rows = int(getattr(adapter, "rope_rows", 3 if adapter.mrope else 1))
        self.buffers: DecodeBuffers | None = None
        self.graphs: DecodeGraphs | None = None
        self.buckets: tuple[int, ...] = ()
        if static:
            self.buckets = buckets(max(1, max_batch))
            self.buffers = DecodeBuffers(self.buckets[-1], -(-self.max_positions // block_size), self.rope_rows,
                                         block_size, self.kv.scratch_slot, self.device)
            self.graphs = DecodeGraphs(self._decode_body, self.device, cuda_graphs)
        self.static_steps = 0  # decode steps that ran from the static buffers
        self.eager_steps = 0

    @property
    def captures(self) -> bool:
        """Whether decode steps run as captured CUDA graphs (`capture` then has work to do)."""
        return self.graphs is not None and self.graphs.capture

    @torch.inference_mode()
    def capture(self) -> int:
        """Captures the decode graph of every bucket now (CUDA with graphs on; else nothing), so
        no request pays for a capture: the generator calls it on the compute thread as it starts."""
        if self.graphs is None:
            return 0
        return self.graphs.capture_all(self.buckets, self.buffers.clear)

    # -- the arena -----------------------------------------------------------------------------

    @property
    def epoch(self) -> int | None:
        """The cache manager's life whose tables may write the arena (`KVArena.epoch`)."""
        return self.kv.epoch

    @epoch.setter
    def epoch(self, value: int | None) -> None:
        self.kv.epoch = value

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[2, layers, block_size, kv_heads, head_dim]: one block's keys and values, as
        `read_blocks` gives them (per block) and `write_blocks` takes them."""
        kv = self.kv
        return (2, kv.layers, kv.block_size, kv.kv_heads, kv.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    def copy_block(self, src: int, dst: int) -> None:
        self.kv.copy_block(src, dst)

    def write_blocks(self, blocks: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """A shared-tier restore (on the compute thread: between steps)."""
        self.kv.write_blocks(blocks, tensors)

    def read_blocks(self, blocks: Sequence[int]) -> torch.Tensor:
        return self.kv.read_blocks(blocks)

    # -- a step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """Float logits [len(segments) + len(extra_rows), vocab] on the device: each segment's last
        new token, then the `extra_rows`."""
        if self.buffers is not None and step.decode_only and self._fits(step.segments):
            self.static_steps += 1
            return self._decode(step)
        self.eager_steps += 1
        return self._eager(step)

    def _fits(self, segments: Sequence[Segment]) -> bool:
        width = self.buffers.max_blocks * self.block_size
        return len(segments) <= self.buckets[-1] and all(s.end <= width for s in segments)

    def _eager(self, step: StepInputs) -> torch.Tensor:
        adapter = self.adapter
        embeds, lm_kwargs = adapter.step_inputs(step.ids, step.pieces)
        spans = step.spans if step.spans and any(step.spans) else None
        if self.backend.name == "sdpa":
            attention = PagedBatch(self.kv, step.segments, spans)
            positions, last = attention.position_ids, attention.last_index
        else:
            meta = PagedMetadata.build(step.segments, self.block_size, self.device, spans=spans)
            attention = BackendStep(self.kv, self.backend, meta)
            positions = torch.from_numpy(np.concatenate(
                [np.arange(s.start, s.end) for s in step.segments])).unsqueeze(0).to(self.device)
            last = (meta.cu_seqlens_q[1:] - 1).long()
        if embeds.shape[:2] != (1, len(step.ids)):
            raise ValueError(f"inputs_embeds {tuple(embeds.shape)} do not hold the step's {len(step.ids)} tokens")
        rows = last if step.extra_rows is None else torch.cat([last, step.extra_rows.to(self.device)])
        return forward_step(adapter, embeds.to(self.device, adapter.dtype),
                            step_positions(positions, step.positions, self.device), attention, rows, lm_kwargs)

    def _decode(self, step: StepInputs) -> torch.Tensor:
        n = len(step.segments)
        bucket = bucket_of(n, self.buckets)
        positions = None if step.positions is None else step.positions.cpu().numpy()
        self.buffers.fill(step.ids, [s.block_table[:-(-s.end // self.block_size)] for s in step.segments],
                          [s.start for s in step.segments], positions, bucket)
        return self.graphs.run(bucket)[:n]

    def _decode_body(self, bucket: int) -> torch.Tensor:
        """The decode step over the buffers' first `bucket` rows -> logits [bucket, vocab]: reads
        the buffers, the model's weights and the arena only (capturable)."""
        buf, adapter = self.buffers, self.adapter
        embeds = adapter.model.get_input_embeddings()(buf.ids[:bucket]).unsqueeze(0)
        positions = buf.positions[:, :bucket]
        if self.rope_rows > 1:
            positions = positions.unsqueeze(1)  # [R, 1, bucket]
        step = BackendStep(self.kv, self.backend, buf.metadata(bucket))
        out = adapter.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=STEP_MASK,
                                      use_cache=False, **{KWARG: step})
        return adapter.model.lm_head(out.last_hidden_state[0]).float()

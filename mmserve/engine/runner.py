"""ModelRunner: the generator's engine — the one room where a model step touches the device.

It owns the model's KV arena (`engine.arena.KVArena`: nothing else writes its tensors — a forked
choice's block copy and a shared-tier restore go through `copy_block` and `write_blocks`), the
attention backend (`[runtime] attention_backend`, checked against what the model needs at
construction), and, with a capturable backend (the Triton kernels), the static decode step
(`decode_graphs`): its input buffers and, on CUDA, a graph per batch bucket. The generator hands
it a step (`StepInputs`: every sequence's new tokens, their segments of the arena, image rows,
M-RoPE positions) and gets back float logits on the device, which it samples right after, with
one transfer to the host (`engine.step_sampling`).

A step takes one of three paths:
- **static decode** — every sequence has one new token and no image row, and the backend is
  capturable: the buffers are filled (host → device copies only) and the batch bucket's body runs,
  or its graph replays. Nothing in it synchronises with the host.
- **static mixed** — any other step (prefill chunks, image rows, decode tokens beside them) that
  fits the largest token bucket (`mixed_step`): the family's `step_inputs` computes the input
  embeddings into the static embeddings buffer, the metadata is copied in, and the token
  bucket's body runs, or its graph replays.
- **eager** — a step too large for the static buffers (more tokens than the largest token
  bucket, more sequences than `max_batch`, a table wider than the static width), one that wants a
  prompt's own logprobs (`extra_rows`: a row count that follows the data), and every step with the
  `sdpa` backend (the CPU's path: SDPA per chunk, decode tokens read in place where their blocks
  are consecutive, `engine.attention.sdpa`). `eager_reasons` counts why (the `mmserve:eager_steps`
  metric). Every path runs the same `BackendStep` through the configured backend.

Families keep transformers' model classes: the runner calls the adapter's language model with
the paged attention as its implementation (`engine.paged_forward`), never a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from collections import Counter

import torch

from mmserve.engine.attention import AttentionBackend, ModelFeatures, PagedMetadata, select
from mmserve.engine.decode_graphs import DecodeBuffers, DecodeGraphs, bucket_of, buckets
from mmserve.engine.mixed_step import MixedBuffers, token_buckets
from mmserve.engine.write_fence import WriteFence
from mmserve.models import batch_invariant
from mmserve.engine.arena import KVArena, Segment
from mmserve.engine.paged_forward import BackendStep, STEP_MASK, KWARG, eager_rows, forward_step, \
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
    carry: tuple[torch.Tensor, torch.Tensor] | None = None
    """(indices in `ids` [C] on the host, token ids [C] on the device): tokens the previous step
    sampled and left on the device, gathered into this step's ids there (overlap scheduling; the
    `ids` at those indices are placeholders)."""

    @property
    def decode_only(self) -> bool:
        return not self.pieces and self.extra_rows is None and all(s.length == 1 for s in self.segments)


DEEPSTACK_KWARGS = frozenset({"visual_pos_masks", "deepstack_visual_embeds"})
"""The family inputs a static mixed step carries (Qwen3-VL's, as `MixedBuffers.deepstack`)."""


class ModelRunner:
    """See the module docstring. `max_batch`: the most sequences a step carries from the static
    buffers (the generator's `max_running_requests`, n choices included, bounds it; larger steps
    run eagerly). `max_tokens`: the largest token bucket of a mixed step (the generator's
    `max_batched_tokens`); `token_buckets` replaces the default list (`mixed_step.token_buckets`)."""

    def __init__(self, adapter, kv_budget_bytes: int, block_size: int, backend: str | AttentionBackend = "auto",
                 max_batch: int = 256, cuda_graphs: bool = True, max_tokens: int = 2048,
                 token_buckets: Sequence[int] | None = None, deterministic: bool = False):
        self.adapter = adapter
        self.device = adapter.device
        self.deterministic = deterministic  # [runtime] deterministic: batch-invariant ops (models.batch_invariant)
        if deterministic:
            batch_invariant.check_available(self.device)
            batch_invariant.install(adapter)
        self.backend = select(backend, self.device, deterministic) if isinstance(backend, str) else backend
        features = ModelFeatures.from_config(adapter.config)
        self.backend.check(features)
        static = self.backend.capturable
        self.kv = KVArena.for_model(adapter, kv_budget_bytes, block_size, spare_blocks=1 if static else 0)
        self.fence = WriteFence()  # every write of the arena happens inside it (`fence.writing`)
        self.block_size = block_size
        use_paged_attention(adapter)
        limit = int(getattr(adapter.text_config, "max_position_embeddings", 0) or 1 << 30)
        self.max_positions = min(limit, self.kv.num_blocks * block_size)
        self.rope_rows = int(getattr(adapter, "rope_rows", 3 if adapter.mrope else 1))
        self.buffers: DecodeBuffers | None = None
        self.graphs: DecodeGraphs | None = None
        self.buckets: tuple[int, ...] = ()
        self.mixed: MixedBuffers | None = None
        self.mixed_graphs: DecodeGraphs | None = None
        self.token_buckets: tuple[int, ...] = ()
        if static:
            max_blocks = -(-self.max_positions // block_size)
            self.buckets = buckets(max(1, max_batch))
            self.buffers = DecodeBuffers(self.buckets[-1], max_blocks, self.rope_rows,
                                         block_size, self.kv.scratch_slot, self.device)
            self.graphs = DecodeGraphs(self._decode_body, self.device, cuda_graphs)
            self.token_buckets = tuple(sorted(set(token_buckets))) if token_buckets else \
                mixed_buckets_for(max_tokens)
            if min(self.token_buckets) < 1:
                raise ValueError(f"token buckets must be positive, not {self.token_buckets}")
            self.mixed = MixedBuffers(self.token_buckets[-1], self.buckets[-1], max_blocks, self.rope_rows,
                                      int(adapter.text_config.hidden_size), adapter.dtype,
                                      int(getattr(adapter, "deepstack_levels", 0) or 0), features.bidirectional_spans,
                                      block_size, self.kv.scratch_slot, self.device,
                                      tile_tokens=self.backend.tile_tokens(*attention_heads(adapter.text_config)))
            # one memory pool for both sets: a runner replays one graph at a time
            self.mixed_graphs = DecodeGraphs(self._mixed_body, self.device, cuda_graphs, share_pool_with=self.graphs)
        self.static_steps = 0  # decode steps that ran from the static buffers
        self.mixed_steps = 0  # other steps that ran from the static buffers
        self.eager_steps = 0
        self.eager_reasons: Counter[str] = Counter()  # why the eager steps were eager
        self._launching: Callable[[], None] | None = None  # `forward`'s, until the model's work starts

    @property
    def captures(self) -> bool:
        """Whether static steps run as captured CUDA graphs (`capture` then has work to do)."""
        return self.graphs is not None and self.graphs.capture

    @torch.inference_mode()
    def capture(self) -> int:
        """Captures the graph of every token bucket (mixed steps) and batch bucket (decode steps)
        now (CUDA with graphs on; else nothing), so no request pays for a capture: the registry
        calls it on the compute thread as the model loads. Returns how many were captured."""
        if self.graphs is None:
            return 0
        # the mixed steps' largest buckets first: the smaller graphs reuse their pool's memory
        return (self.mixed_graphs.capture_all(self.token_buckets, self.mixed.clear)
                + self.graphs.capture_all(self.buckets, self.buffers.clear))

    @property
    def failed_captures(self) -> dict[str, dict[int, str]]:
        """The buckets whose capture failed (they run their body eagerly), with the error:
        {"decode": {batch bucket: error}, "mixed": {token bucket: error}}; empty without graphs."""
        if self.graphs is None:
            return {}
        return {k: dict(g.failed) for k, g in (("decode", self.graphs), ("mixed", self.mixed_graphs)) if g.failed}

    # -- the arena -----------------------------------------------------------------------------

    @property
    def epoch(self) -> int | None:
        """The cache manager's life whose tables may write the arena (the write fence's; moved only
        by `fence.new_epoch`)."""
        return self.fence.epoch

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

    def write_blocks(self, blocks: Sequence[int], tensors: Sequence[torch.Tensor], epoch: int) -> bool:
        """A shared-tier restore (on the compute thread: between steps) into `blocks`, granted in
        the manager's life `epoch`: the write fence refuses it — False, nothing written — when a
        later life has begun."""
        with self.fence.writing_granted(epoch, lambda: blocks) as granted:
            if not granted:
                return False
            self.kv.write_blocks(blocks, tensors)
        return True

    def read_blocks(self, blocks: Sequence[int]) -> torch.Tensor:
        return self.kv.read_blocks(blocks)

    # -- a step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, step: StepInputs) -> PagedMetadata | None:
        """The host-side metadata of `step`'s attention, built before the step reaches the compute
        thread — on the event loop while the step before it runs, for a step launched ahead
        (overlap scheduling): an eager step's `PagedMetadata` over a CPU arena and the backend's
        layout of it (`AttentionBackend.prepare`: the sdpa backends'; fresh tensors each step, so
        nothing a running step reads is written). None where `forward` builds it itself (the static
        buffers' fill is a few numpy writes; a GPU arena's metadata is uploaded on the compute
        thread's stream)."""
        if self.buffers is None and self.kv.device.type == "cpu":
            meta = self.kv.metadata(step.segments, step.spans if step.spans and any(step.spans) else None)
            self.backend.prepare(meta, *attention_heads(self.adapter.text_config))
            return meta
        return None

    @torch.inference_mode()
    def forward(self, step: StepInputs, prepared: PagedMetadata | None = None,
                launching: Callable[[], None] | None = None) -> torch.Tensor:
        """Float logits [len(segments) + len(extra_rows), vocab] on the device: each segment's last
        new token, then the `extra_rows`. `prepared`: `prepare(step)`'s result, if made;
        `launching`: called once the inputs are in place, as the model's own work starts (the
        overlap scheduler lets the event loop go on from there)."""
        self._launching = launching
        if self.buffers is None:
            return self._eager(step, "backend_not_capturable", prepared=prepared)
        if step.decode_only and self._fits(step.segments):
            self.static_steps += 1
            return self._decode(step)
        if step.extra_rows is not None:
            return self._eager(step, "prompt_logprobs")
        why = self.mixed.fits(step.segments, len(step.ids), step.spans)
        if why is not None:
            return self._eager(step, why)
        embeds, lm_kwargs = self._embeds(step)
        if set(lm_kwargs) - DEEPSTACK_KWARGS:
            return self._eager(step, "family_inputs", (embeds, lm_kwargs))
        self.mixed_steps += 1
        return self._mixed(step, embeds, lm_kwargs)

    def _launch(self) -> None:
        launching, self._launching = self._launching, None
        if launching is not None:
            launching()

    def _fits(self, segments: Sequence[Segment]) -> bool:
        width = self.buffers.max_blocks * self.block_size
        return len(segments) <= self.buckets[-1] and all(s.end <= width for s in segments)

    def _embeds(self, step: StepInputs) -> tuple[torch.Tensor, dict]:
        """The step's input embeddings and family arguments (`Adapter.step_inputs`); a step with
        carried tokens (no image rows: decode tokens only) has its ids completed on the device
        first, then looked up in the token embedding — what `Adapter.embed` does without pieces."""
        if step.carry is None:
            return self.adapter.step_inputs(step.ids, step.pieces)
        if step.pieces:
            raise ValueError("a step with carried tokens has no image rows")
        return self.adapter.model.get_input_embeddings()(self._carried_ids(step).unsqueeze(0)), {}

    def _carried_ids(self, step: StepInputs) -> torch.Tensor:
        """The step's ids on the device, its carried tokens gathered in there (no host round trip)."""
        at, tokens = step.carry
        ids = torch.tensor(step.ids, dtype=torch.long).to(self.device, non_blocking=True)
        return ids.index_copy_(0, at.to(self.device, non_blocking=True), tokens.to(self.device))

    def _eager(self, step: StepInputs, reason: str, inputs: tuple[torch.Tensor, dict] | None = None,
               prepared: PagedMetadata | None = None) -> torch.Tensor:
        self.eager_steps += 1
        self.eager_reasons[reason] += 1
        adapter = self.adapter
        embeds, lm_kwargs = inputs if inputs is not None else self._embeds(step)
        meta = prepared if prepared is not None else \
            self.kv.metadata(step.segments, step.spans if step.spans and any(step.spans) else None)
        attention = BackendStep(self.kv, self.backend, meta)
        positions, last = eager_rows(meta, self.device)
        if embeds.shape[:2] != (1, len(step.ids)):
            raise ValueError(f"inputs_embeds {tuple(embeds.shape)} do not hold the step's {len(step.ids)} tokens")
        rows = last if step.extra_rows is None else torch.cat([last, step.extra_rows.to(self.device)])
        embeds, positions = embeds.to(self.device, adapter.dtype), step_positions(positions, step.positions, self.device)
        self._launch()
        return forward_step(adapter, embeds, positions, attention, rows, lm_kwargs)

    def _decode(self, step: StepInputs) -> torch.Tensor:
        n = len(step.segments)
        bucket = bucket_of(n, self.buckets)
        positions = None if step.positions is None else step.positions.cpu().numpy()
        self.buffers.fill(step.ids, [s.block_table[:-(-s.end // self.block_size)] for s in step.segments],
                          [s.start for s in step.segments], positions, bucket)
        if step.carry is not None:  # the previous step's tokens, gathered on the device into the ids buffer
            at, tokens = step.carry
            self.buffers.ids.index_copy_(0, at.to(self.device, non_blocking=True), tokens.to(self.device))
        self._launch()
        return self.graphs.run(bucket)[:n]

    def _mixed(self, step: StepInputs, embeds: torch.Tensor, lm_kwargs: dict) -> torch.Tensor:
        n = len(step.ids)
        if embeds.shape[:2] != (1, n):
            raise ValueError(f"inputs_embeds {tuple(embeds.shape)} do not hold the step's {n} tokens")
        bucket = bucket_of(n, self.token_buckets)
        positions = None if step.positions is None else step.positions.cpu().numpy()
        spans = step.spans if step.spans and any(step.spans) else None
        self.mixed.fill(step.segments, embeds[0], positions, spans, bucket)
        if lm_kwargs.get("deepstack_visual_embeds"):
            self.mixed.fill_deepstack(step.pieces, lm_kwargs["deepstack_visual_embeds"])
        self._launch()
        return self.mixed_graphs.run(bucket)[:len(step.segments)]

    def _mixed_body(self, bucket: int) -> torch.Tensor:
        """The mixed step over the buffers' first `bucket` tokens -> logits [seqs(bucket), vocab]
        (each sequence's last new token; padding sequences' rows are junk): reads the buffers, the
        model's weights and the arena only (capturable)."""
        buf, adapter = self.mixed, self.adapter
        embeds = buf.embeds[:bucket].unsqueeze(0)
        positions = buf.positions[:, :bucket]
        if self.rope_rows > 1:
            positions = positions.unsqueeze(1)  # [R, 1, bucket]
        family = {}
        if buf.deepstack is not None:  # dense levels, zero off the images (`Qwen3VLAdapter` adds them whole)
            family = {"visual_pos_masks": None, "deepstack_visual_embeds": list(buf.deepstack[:, :bucket].unbind(0))}
        step = BackendStep(self.kv, self.backend, buf.metadata(bucket))
        out = adapter.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=STEP_MASK,
                                      use_cache=False, **family, **{KWARG: step})
        hidden = out.last_hidden_state[0].index_select(0, buf.rows[:buf.seqs(bucket)])
        return adapter.model.lm_head(hidden).float()

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


def mixed_buckets_for(max_tokens: int) -> tuple[int, ...]:
    """The default token buckets of a runner whose steps carry at most `max_tokens` tokens."""
    return token_buckets(max(1, max_tokens))


def attention_heads(text_config) -> tuple[int, int]:
    """(query heads, KV heads) of a transformers text config."""
    heads = int(text_config.num_attention_heads)
    return heads, int(getattr(text_config, "num_key_value_heads", None) or heads)

"""Paged KV: one arena of fixed-size blocks per model, and the segments of a step over it.

The arena holds, per layer, keys and values in blocks of `block_size` token slots. A sequence is a
block table (block ids in order; token `p` lives in slot `p % block_size` of block
`table[p // block_size]`). Sequences that share a prefix share its blocks: a prefix hit is a table
that starts with the cached blocks, and no KV moves. Which blocks are free, cached or owned is
bookkept elsewhere; this module holds only the tensors.

One step runs the language model once over a ragged batch: the new tokens of every `Segment` (a
decode token of each running sequence, a prefill chunk of each waiting one) concatenated into
`inputs_embeds` [1, T, hidden], with each token's absolute position in `position_ids`
(`engine.paged_forward` runs it; `KVArena.metadata` describes it to the attention backend, which
writes the step's K/V into their slots and reads each sequence's keys: `engine.attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mmserve.engine.attention.backend import PagedMetadata


class KVArena:
    """Per-layer key and value tensors [num_blocks, block_size, kv_heads, head_dim].

    Token-major blocks: the step's new tokens land with one `index_copy_` over the flattened
    [num_blocks * block_size, kv_heads, head_dim] view, and a sequence's KV is one `index_select`
    of its slots, giving [n, kv_heads, head_dim] whose transpose is the [kv_heads, n, head_dim]
    that SDPA takes (a view; SDPA reads it strided, measured as fast as a contiguous copy). A
    head-major layout [kv_heads, num_blocks * block_size, head_dim] gathers straight into SDPA's
    layout but copies kv_heads short rows per slot instead of one: gathering 4896 slots of the
    tiny model (2 kv heads x 16 dims, f32) took 16 us token-major against 38 us head-major.
    """

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], spare_blocks: int = 0):
        if len(keys) != len(values) or not keys:
            raise ValueError("an arena needs the same number (>= 1) of key and value tensors")
        shape = keys[0].shape
        if len(shape) != 4 or any(t.shape != shape for t in (*keys, *values)):
            raise ValueError("arena tensors must all be [num_blocks, block_size, kv_heads, head_dim]")
        self.keys = list(keys)
        self.values = list(values)
        self.num_blocks, self.block_size, self.kv_heads, self.head_dim = (int(s) for s in shape)
        if not 0 <= spare_blocks < self.num_blocks:
            raise ValueError(f"an arena of {self.num_blocks} blocks cannot keep {spare_blocks} spare")
        # the last `spare_blocks` blocks are never handed out: padded rows of a static decode step
        # write their (ignored) K/V into the first slot of them
        self.num_blocks -= spare_blocks
        self.scratch_slot = self.num_blocks * self.block_size if spare_blocks else None
        self.dtype = keys[0].dtype
        self.device = keys[0].device

    @classmethod
    def allocate(cls, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 spare_blocks: int = 0) -> "KVArena":
        """An arena of `num_blocks` uninitialised blocks (`torch.empty`) to hand out, plus
        `spare_blocks` never handed out: a block's content is defined once a step wrote its slots."""
        if min(layers, num_blocks, block_size, kv_heads, head_dim) < 1:
            raise ValueError("every arena dimension must be >= 1")
        shape = (num_blocks + spare_blocks, block_size, kv_heads, head_dim)
        keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        return cls(keys, values, spare_blocks)

    @classmethod
    def for_model(cls, adapter, budget_bytes: int, block_size: int, spare_blocks: int = 0) -> "KVArena":
        """The arena of `adapter`'s language model that fits `budget_bytes` (at least one block to
        hand out, and `spare_blocks` more)."""
        block_bytes = cls.block_bytes_for(adapter, block_size)
        return cls.allocate(adapter.kv_layers, max(1, budget_bytes // block_bytes - spare_blocks), block_size,
                            adapter.kv_heads, adapter.head_dim, adapter.dtype, adapter.device, spare_blocks)

    @staticmethod
    def block_bytes_for(adapter, block_size: int) -> int:
        """Bytes one block of `adapter`'s language model takes over all layers, keys and values."""
        elem = torch.empty((), dtype=adapter.dtype).element_size()
        return 2 * adapter.kv_layers * block_size * adapter.kv_heads * adapter.head_dim * elem

    @property
    def layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes of all key and value tensors."""
        return sum(t.nbytes for t in (*self.keys, *self.values))

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers, keys and values."""
        return self.nbytes // self.keys[0].shape[0]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as [num_blocks * block_size, kv_heads, head_dim] views."""
        n = self.keys[layer].shape[0] * self.block_size
        return (self.keys[layer].view(n, self.kv_heads, self.head_dim),
                self.values[layer].view(n, self.kv_heads, self.head_dim))

    def copy_block(self, src: int, dst: int) -> None:
        """Copies block `src` into block `dst` in every layer (copy-on-write of a partly filled
        shared block, before a sequence appends to it)."""
        for t in (*self.keys, *self.values):
            t[dst].copy_(t[src])

    def write_blocks(self, blocks: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        """Writes whole blocks: `tensors[i]` is [2, layers, block_size, kv_heads, head_dim] (keys,
        values) for block `blocks[i]` (a shared-tier restore, on the compute thread)."""
        for block, t in zip(blocks, tensors):
            t = t.to(self.device)
            for layer in range(self.layers):
                self.keys[layer][block].copy_(t[0, layer])
                self.values[layer][block].copy_(t[1, layer])

    def read_blocks(self, blocks: Sequence[int]) -> torch.Tensor:
        """Whole blocks, copied out: [2, layers, len(blocks), block_size, kv_heads, head_dim] (keys,
        values), as `write_blocks` takes them back one block at a time (a shared-tier export)."""
        ids = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        return torch.stack([torch.stack([t.index_select(0, ids) for t in self.keys]),
                            torch.stack([t.index_select(0, ids) for t in self.values])])

    def metadata(self, segments: Sequence["Segment"], spans: Sequence[Sequence[tuple[int, int]]] | None = None
                 ) -> PagedMetadata:
        """The attention metadata of a step of `segments` over this arena (on its device), block ids
        checked against it; `spans`: per segment, its sequence's bidirectional spans, or None."""
        return PagedMetadata.build(segments, self.block_size, self.device, spans=spans, num_blocks=self.num_blocks)

    def read(self, layer: int, block_table: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first `length` tokens of KV in layer `layer`, [kv_heads, length, head_dim]
        each (copies), in the layout of a transformers cache layer (less its batch dimension)."""
        slots = slot_index(block_table, 0, length, self.block_size, self.device)
        k, v = self.flat(layer)
        return k[slots].transpose(0, 1).contiguous(), v[slots].transpose(0, 1).contiguous()


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a step: `length` new tokens at positions [start, start+length).

    `block_table` lists the sequence's blocks in order and covers at least start+length tokens;
    the KV of positions [0, start) is already in those blocks (written by this sequence's earlier
    steps, or by another sequence that shares the prefix)."""

    block_table: tuple[int, ...]
    start: int
    length: int

    def __post_init__(self):
        if self.length < 1:
            raise ValueError(f"a segment needs at least one new token (length={self.length})")
        if self.start < 0:
            raise ValueError(f"a segment cannot start at a negative position (start={self.start})")

    @property
    def end(self) -> int:
        return self.start + self.length


def slot_index(block_table: Sequence[int], start: int, end: int, block_size: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Flat slot ids (block * block_size + offset) of positions [start, end) of a sequence."""
    pos = torch.arange(start, end, dtype=torch.long)
    table = torch.as_tensor(block_table, dtype=torch.long)
    return (table[pos // block_size] * block_size + pos % block_size).to(device)

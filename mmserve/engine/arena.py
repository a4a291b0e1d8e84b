"""Paged KV: one arena of fixed-size blocks per model, and the SDPA step that reads and writes it.

The arena holds, per layer, keys and values in blocks of `block_size` token slots. A sequence is a
block table (block ids in order; token `p` lives in slot `p % block_size` of block
`table[p // block_size]`). Sequences that share a prefix share its blocks: a prefix hit is a table
that starts with the cached blocks, and no KV moves. Which blocks are free, cached or owned is
bookkept elsewhere; this module holds only the tensors and the step that reads and writes them.

One step runs the language model once over a ragged batch: the new tokens of every `Segment` (a
decode token of each running sequence, a prefill chunk of each waiting one) concatenated into
`inputs_embeds` [1, T, hidden], with each token's absolute position in `position_ids`
(`engine.paged_forward` runs it; `PagedBatch` is the step of the CPU's SDPA path).

Per layer `PagedBatch.attend` scatters the step's new K/V into their slots (one `index_copy_`), then
reads each sequence's KV [0, start+length). A sequence whose blocks are consecutive ids (what the
block allocation aims for: `cache.free_blocks`) is read in place, as a view of the arena; any
other is gathered into contiguous tensors first. Each prefill segment is one
`scaled_dot_product_attention` call with a causal mask offset by `start`. On the CPU each decode
token read in place is a call of its own (~70 us each; the gather it saves cost more: a
16-sequence decode step of the bench model went from 39 ms to 27 ms); the other decode tokens go
together through one padded call (a key-padding mask, no causal mask) — as all of them do on a
GPU, where a call per sequence would be a kernel launch per sequence.

GQA: decode folds each KV head's group of query heads into the query-length dimension
([D, heads, 1, d] -> [D, kv_heads, group, d]; 4x faster than SDPA's enable_gqa for 16 x 300
tokens), prefill chunks use SDPA's enable_gqa (folding would break is_causal). KV is never
repeated per query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from mmserve.engine.attention.backend import step_mask, step_spans


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
        # the cache manager's life whose block tables may write here (None: not tracked); a step of
        # sequences granted blocks in another life writes nothing (their tables are void)
        self.epoch: int | None = None

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


class PagedBatch:
    """The metadata of one paged step, built once and read by every layer's attention call.

    Attributes (T = total new tokens, S = segments):
      arena           the `KVArena` the step reads and writes
      segments        the `Segment`s, in the order their tokens are concatenated
      position_ids    [1, T] absolute position of each new token
      write_slots     [T] flat arena slot of each new token
      last_index      [S] index in T of each segment's last token
      prefill         (q_offset, length, gather_slots [n], bool mask [length, n] or None) per segment
                      with length > 1 (mask: query i sees keys [0, start+i]; None from position 0,
                      where SDPA's is_causal is the same mask)
      decode_rows     [D] indices in T of the decode tokens (segments of length 1), or None
      decode_slots    [D, n_max] their sequences' slots, padded to the longest (with their own new slot),
                      or a slice of the flat arena for one sequence whose slots are consecutive
      decode_mask     [D, 1, 1, n_max] bool, True where a key is real
    """

    def __init__(self, arena: KVArena, segments: Sequence[Segment],
                 spans: Sequence[Sequence[tuple[int, int]]] | None = None):
        if not segments:
            raise ValueError("a paged step needs at least one segment")
        bs, device = arena.block_size, arena.device
        self.arena = arena
        self.segments = tuple(segments)
        # vectorised over segments: a per-segment loop of small tensor ops costs ~50 us a segment
        used = [-(-seg.end // bs) for seg in self.segments]
        for seg, n in zip(self.segments, used):
            if len(seg.block_table) < n:
                raise ValueError(f"block table of {len(seg.block_table)} blocks cannot hold {seg.end} tokens")
        width = max(used)
        # through numpy: torch.tensor() of a thousand python ints takes ~0.2 ms, numpy ~0.04 ms
        tables = torch.from_numpy(np.array([seg.block_table[:n] + (seg.block_table[n - 1],) * (width - n)
                                            for seg, n in zip(self.segments, used)], dtype=np.int64))
        if bool(((tables < 0) | (tables >= arena.num_blocks)).any()):
            bad = tables[(tables < 0) | (tables >= arena.num_blocks)].unique()[:4].tolist()
            raise ValueError(f"block ids {bad} are outside the arena (0..{arena.num_blocks - 1})")
        lengths = torch.tensor([seg.length for seg in self.segments], dtype=torch.long)
        ends = lengths.cumsum(0)
        self.tokens = int(ends[-1])
        seg_of, pos = [], []  # per new token (python lists: repeat_interleave costs ~0.1 ms a call)
        for i, seg in enumerate(self.segments):
            seg_of += [i] * seg.length
            pos += range(seg.start, seg.end)
        seg_of, pos = torch.tensor(seg_of), torch.tensor(pos)
        write_slots = tables[seg_of, pos // bs] * bs + pos % bs
        if write_slots.unique().numel() != self.tokens:
            raise ValueError("two new tokens of the step map to the same arena slot")
        self.position_ids = pos.unsqueeze(0).to(device)
        self.write_slots = write_slots.to(device)
        self.last_index = (ends - 1).to(device)
        # bidirectional spans per segment, those holding its new tokens (a span the step would
        # split is refused here: `step_spans`)
        self.spans = tuple(step_spans(sp, seg.start, seg.length) for sp, seg in zip(spans, self.segments)) \
            if spans is not None else ((),) * len(self.segments)
        self._tables, self._used, self._ends = tables, used, ends
        self._layouts: dict[int | None, _Layout] = {None: self._layout(None)}
        self.slots_read: dict[int, int] = {}  # layer -> key slots its last call read (tests)

    # the layout of the step without a window, as attributes (tests and tools read them)
    prefill = property(lambda self: self._layouts[None].prefill)
    decode_rows = property(lambda self: self._layouts[None].decode_rows)
    decode_slots = property(lambda self: self._layouts[None].decode_slots)
    decode_mask = property(lambda self: self._layouts[None].decode_mask)
    decode_views = property(lambda self: self._layouts[None].decode_views)

    def _layout(self, window: int | None) -> "_Layout":
        """What each query reads for a layer of sliding window `window` (None: every key): keys
        before a token's window are not read at all."""
        bs, device = self.arena.block_size, self.arena.device
        tables, used = self._tables, self._used
        lay = _Layout()
        decode = []
        views = device.type == "cpu"  # per-sequence calls: cheap on a CPU, a launch each on a GPU
        offset = 0
        for i, seg in enumerate(self.segments):
            lo = max(0, seg.start - window + 1) if window else 0
            run = _run(seg.block_table, used[i], bs, seg.end)
            if seg.length == 1:
                if run is not None and views:
                    lay.decode_views.append((offset, slice(run.start + lo, run.stop)))
                    lay.reads += seg.end - lo
                else:
                    decode.append(i)
            else:
                k = torch.arange(lo, seg.end)
                # from position 0 SDPA's own is_causal is the mask; after a prefix the causal
                # diagonal is offset by `start`, a window cuts each row's start, a bidirectional
                # span extends its end (`attention.step_mask`)
                mask = step_mask(seg.start, seg.length, lo, self.spans[i], window, device)
                slots = slice(run.start + lo, run.stop) if run is not None else (tables[i, k // bs] * bs + k % bs).to(device)
                lay.prefill.append((offset, seg.length, slots, mask))
                lay.reads += seg.end - lo
            offset += seg.length
        if decode:
            rows = torch.tensor(decode, dtype=torch.long)
            starts = torch.tensor([self.segments[i].start for i in decode], dtype=torch.long)
            first = (starts - window + 1).clamp(min=0) if window else torch.zeros_like(starts)
            kv_len = starts + 1 - first  # keys of a decode token: [first, start] inclusive
            k = torch.arange(int(kv_len.max()))
            real = k.unsqueeze(0) < kv_len.unsqueeze(1)  # [D, n_max]
            # padding repeats the sequence's own new slot: masked keys must still be finite
            # (a never-written slot of a torch.empty arena may hold NaN, and 0 * NaN = NaN)
            k_pos = first.unsqueeze(1) + torch.where(real, k.unsqueeze(0), (kv_len - 1).unsqueeze(1))
            slots = tables[rows].gather(1, k_pos // bs) * bs + k_pos % bs
            # one sequence whose blocks lie in order: a view, no gather
            lay.decode_slots = (len(decode) == 1 and _as_range(slots[0])) or slots.to(device)
            lay.decode_rows = (self._ends[rows] - 1).to(device)
            lay.decode_mask = None if bool(real.all()) else real[:, None, None, :].to(device)
            lay.reads += int(kv_len.sum())
        return lay

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, window: int | None = None) -> torch.Tensor:
        """Layer `layer`'s attention for this step (the module docstring): the step's new K/V
        (key/value [1, kv_heads, T, d], rotary applied) written into their slots, then every
        segment's queries (query [1, heads, T, d]) against its keys -> [1, T, heads, d]. `window`:
        the layer's sliding window (a token at p sees keys k with p - k < window; none before is
        read); the step's bidirectional spans apply in every layer."""
        if query.shape[0] != 1 or query.shape[2] != self.tokens:
            raise ValueError(f"paged attention takes one flattened batch of {self.tokens} tokens, "
                             f"got query {tuple(query.shape)}")
        window = int(window) if window else None
        lay = self._layouts.get(window)
        if lay is None:
            lay = self._layouts[window] = self._layout(window)
        self.slots_read[layer] = lay.reads
        heads, head_dim = query.shape[1], query.shape[3]
        kv_heads = key.shape[1]
        group = heads // kv_heads
        kbuf, vbuf = self.arena.flat(layer)
        # write the step's K/V into their slots: [T, kv_heads, d]
        kbuf.index_copy_(0, self.write_slots, key[0].transpose(0, 1).to(kbuf.dtype))
        vbuf.index_copy_(0, self.write_slots, value[0].transpose(0, 1).to(vbuf.dtype))
        q_all = query[0]  # [heads, T, d]
        out = query.new_empty(self.tokens, heads, head_dim)
        for offset, length, slots, mask in lay.prefill:
            # 4-D operands: CPU SDPA takes its fused (flash) kernel only for them; 3-D ones fall back
            # to the math path, ~5x slower for a 300-token chunk
            k = _keys(kbuf, slots).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, d]
            v = _keys(vbuf, slots).transpose(0, 1).unsqueeze(0)
            q = query[:, :, offset : offset + length]  # [1, heads, length, d]
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=mask is None,
                                               scale=scaling, enable_gqa=group > 1)
            out[offset : offset + length] = o[0].transpose(0, 1)
        if lay.decode_rows is not None:
            rows, slots = lay.decode_rows, lay.decode_slots
            d, n = (1, slots.stop - slots.start) if isinstance(slots, slice) else slots.shape
            flat = slots if isinstance(slots, slice) else slots.view(-1)
            k = _keys(kbuf, flat).view(d, n, kv_heads, head_dim).transpose(1, 2)
            v = _keys(vbuf, flat).view(d, n, kv_heads, head_dim).transpose(1, 2)
            q = q_all.index_select(1, rows).transpose(0, 1).reshape(d, kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=lay.decode_mask,
                                               scale=scaling)
            out[rows] = o.reshape(d, heads, head_dim)
        for row, run in lay.decode_views:
            # the sequence's keys read in place: [n, kv_heads, d] -> [1, kv_heads, n, d], no copy
            k, v = kbuf[run].transpose(0, 1).unsqueeze(0), vbuf[run].transpose(0, 1).unsqueeze(0)
            q = q_all[:, row].reshape(1, kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scaling)
            out[row] = o.reshape(heads, head_dim)
        return out.unsqueeze(0)


class _Layout:
    """One window's reads of a step (`PagedBatch._layout`); `reads`: key slots read per layer."""

    def __init__(self):
        self.prefill: list = []
        self.decode_rows = self.decode_slots = self.decode_mask = None
        self.decode_views: list[tuple[int, slice]] = []
        self.reads = 0


def _run(table: tuple[int, ...], blocks: int, block_size: int, end: int) -> slice | None:
    """Slots [0, end) of a sequence as one slice of the flat arena when its first `blocks` blocks
    are consecutive ids (what the block allocation aims for), else None."""
    first = table[0]
    if table[blocks - 1] - first != blocks - 1 or table[:blocks] != tuple(range(first, first + blocks)):
        return None
    return slice(first * block_size, first * block_size + end)


def _as_range(slots: torch.Tensor) -> slice | None:
    """`slots` as a slice of the flat arena when they are consecutive (blocks handed out in order,
    as the arena does lowest id first): the keys are then read through a view, not gathered."""
    n = slots.numel()
    if n and int(slots[-1]) - int(slots[0]) == n - 1 and (n == 1 or bool((slots[1:] - slots[:-1] == 1).all())):
        return slice(int(slots[0]), int(slots[0]) + n)
    return None


def _keys(buf: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
    return buf[slots] if isinstance(slots, slice) else buf.index_select(0, slots)

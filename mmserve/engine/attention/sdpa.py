"""The `sdpa` backend: paged attention through torch's `scaled_dot_product_attention` — the CPU's
serving path, and the reference the other backends are tested against.

A step's layout (`SdpaLayout`: what each query reads, per sliding window) is built on the host once
and kept with the step's metadata (`PagedMetadata.layouts`), read by every layer; `prepare` builds
the window-less one ahead, while the step before runs (overlap scheduling). Per layer:

- each prefill chunk is one SDPA call over its sequence's keys [lo, end) (lo: the first key its
  window lets any of its tokens see; keys before are never read), read in place as a view of the
  arena when the sequence's blocks are consecutive ids (what the block allocation aims for:
  `cache.free_blocks`), gathered otherwise, with the mask of `masks.step_mask` (None from position
  0: SDPA's is_causal is the same mask) and SDPA's enable_gqa (folding heads would break is_causal);
- on the CPU each decode token whose keys lie in place is a call of its own (~70 us each; the
  gather it saves cost more: a 16-sequence decode step of the bench model went from 39 ms to
  27 ms); the other decode tokens — all of them on a GPU, where a call per sequence would be a
  launch per sequence — go together through one padded call (a key-padding mask, no causal mask),
  each KV head's group of query heads folded into the query-length dimension ([D, heads, 1, d] ->
  [D, kv_heads, group, d]; 4x faster than enable_gqa for 16 x 300 tokens). KV is never repeated.

4-D operands throughout: CPU SDPA takes its fused (flash) kernel only for them; 3-D ones fall back
to the math path, ~5x slower for a 300-token chunk.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F

from .backend import AttentionBackend, PagedMetadata
from .masks import first_key, step_mask


class SdpaLayout:
    """One step's reads for a layer of one sliding window (`SdpaBackend.layout`):
      prefill       (q_offset, length, key slots (a slice of the flat arena, or [n] ids), mask or None)
                    per sequence with more than one new token
      decode_rows   [D] indices in T of the decode tokens that go through the padded call, or None
      decode_slots  [D, n_max] their keys' slots, padded with the sequence's own last key (masked
                    keys must still be finite: a never-written slot of a `torch.empty` arena may
                    hold NaN, and 0 * NaN = NaN), or a slice for one sequence whose slots are in order
      decode_mask   [D, 1, 1, n_max] bool, True where a key is real (None: every key is)
      decode_views  (row in T, slice of the flat arena) per decode token read in place (the CPU)
      reads         key slots one layer reads (tests: keys before a window are not read)"""

    def __init__(self):
        self.prefill: list = []
        self.decode_rows = self.decode_slots = self.decode_mask = None
        self.decode_views: list[tuple[int, slice]] = []
        self.reads = 0


class SdpaBackend(AttentionBackend):
    """See the module docstring. GQA, M-RoPE positions, sliding windows, bidirectional spans."""

    name = "sdpa"
    supports = frozenset({"gqa", "mrope_positions", "sliding_window", "bidirectional_spans"})

    def prepare(self, meta: PagedMetadata, heads: int, kv_heads: int) -> None:
        self.layout(meta, None, heads // kv_heads, kv_heads)

    def layout(self, meta: PagedMetadata, window: int | None = None, group: int = 1, kv_heads: int = 1):
        """The step's layout for a layer of `window` (None: every key), built once per step and
        kept in `meta.layouts` (a subclass's layouts may follow the GQA group and KV heads)."""
        key = (self.name, int(window) if window else None, group, kv_heads)
        lay = meta.layouts.get(key)
        if lay is None:
            lay = meta.layouts[key] = self._build(meta, key[1], group, kv_heads, meta.slot_mapping.device)
        return lay

    def _build(self, meta: PagedMetadata, window: int | None, group: int, kv_heads: int, device) -> SdpaLayout:
        # On the host in numpy, tensors made once at the end: on the event loop (a step launched
        # ahead), every torch op lets the GIL go to the compute thread and waits to get it back
        bs = meta.block_size
        spans = meta.spans or ((),) * meta.num_seqs
        lay = SdpaLayout()
        decode = []
        views = device.type == "cpu"  # per-sequence calls: cheap on a CPU, a launch each on a GPU
        offset = 0
        for i, (start, length, table) in enumerate(zip(meta.starts, meta.lengths, meta.tables)):
            end = start + length
            lo = first_key(start, window)
            run = _run(table, bs, end)
            if length == 1:
                if run is not None and views:
                    lay.decode_views.append((offset, slice(run.start + lo, run.stop)))
                    lay.reads += end - lo
                else:
                    decode.append(i)
            else:
                mask = step_mask(start, length, lo, spans[i], window, device)
                if run is not None:
                    slots = slice(run.start + lo, run.stop)
                else:
                    k = np.arange(lo, end)
                    row = np.asarray(table, dtype=np.int64)
                    slots = torch.from_numpy(row[k // bs] * bs + k % bs).to(device)
                lay.prefill.append((offset, length, slots, mask))
                lay.reads += end - lo
            offset += length
        if decode:
            # every decode sequence's table in one flat array (one conversion, not one per table)
            sizes = np.fromiter((len(meta.tables[i]) for i in decode), dtype=np.int64, count=len(decode))
            flat = np.fromiter(itertools.chain.from_iterable(meta.tables[i] for i in decode), dtype=np.int64,
                               count=int(sizes.sum()))
            at = np.cumsum(sizes) - sizes  # where each table starts in `flat`
            starts = np.asarray([meta.starts[i] for i in decode], dtype=np.int64)
            first = np.maximum(starts - window + 1, 0) if window else np.zeros_like(starts)
            kv_len = starts + 1 - first  # keys of a decode token: [first, start] inclusive
            k = np.arange(int(kv_len.max()))
            real = k[None, :] < kv_len[:, None]  # [D, n_max]
            k_pos = first[:, None] + np.where(real, k[None, :], (kv_len - 1)[:, None])
            slots = flat[at[:, None] + k_pos // bs] * bs + k_pos % bs
            lay.decode_slots = (len(decode) == 1 and _as_range(slots[0])) or torch.from_numpy(slots).to(device)
            ends = np.cumsum(meta.lengths)
            lay.decode_rows = torch.from_numpy(ends[decode] - 1).to(device)
            lay.decode_mask = None if bool(real.all()) else torch.from_numpy(real[:, None, None, :]).to(device)
            lay.reads += int(kv_len.sum())
        return lay

    def forward(self, query, key_cache, value_cache, meta: PagedMetadata, scale: float | None = None,
                out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        heads, head_dim = query.shape[1], query.shape[2]
        kv_heads = key_cache.shape[2]
        group = heads // kv_heads
        lay = self.layout(meta, window, group, kv_heads)
        kbuf = key_cache.view(-1, kv_heads, head_dim)
        vbuf = value_cache.view(-1, kv_heads, head_dim)
        out = torch.empty_like(query) if out is None else out
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        for offset, length, slots, mask in lay.prefill:
            k = _keys(kbuf, slots).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, d]
            v = _keys(vbuf, slots).transpose(0, 1).unsqueeze(0)
            q = query[offset:offset + length].transpose(0, 1).unsqueeze(0)  # [1, heads, length, d]
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=group > 1)
            out[offset:offset + length] = o[0].transpose(0, 1)
        if lay.decode_rows is not None:
            rows, slots = lay.decode_rows, lay.decode_slots
            d, n = (1, slots.stop - slots.start) if isinstance(slots, slice) else slots.shape
            flat = slots if isinstance(slots, slice) else slots.view(-1)
            k = _keys(kbuf, flat).view(d, n, kv_heads, head_dim).transpose(1, 2)
            v = _keys(vbuf, flat).view(d, n, kv_heads, head_dim).transpose(1, 2)
            q = query.index_select(0, rows).reshape(d, kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=lay.decode_mask, scale=scale)
            out[rows] = o.reshape(d, heads, head_dim)
        for row, run in lay.decode_views:
            # the sequence's keys read in place: [n, kv_heads, d] -> [1, kv_heads, n, d], no copy
            k, v = kbuf[run].transpose(0, 1).unsqueeze(0), vbuf[run].transpose(0, 1).unsqueeze(0)
            q = query[row].reshape(1, kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scale)
            out[row] = o.reshape(heads, head_dim)
        return out


def _run(table: tuple[int, ...], block_size: int, end: int) -> slice | None:
    """Slots [0, end) of a sequence as one slice of the flat arena when its blocks (the ones the
    step uses) are consecutive ids, else None."""
    first = table[0]
    if table[-1] - first != len(table) - 1 or table != tuple(range(first, first + len(table))):
        return None
    return slice(first * block_size, first * block_size + end)


def _as_range(slots: np.ndarray) -> slice | None:
    """`slots` as a slice of the flat arena when they are consecutive (blocks handed out in order,
    as the arena does lowest id first): the keys are then read through a view, not gathered."""
    n = slots.size
    if n and int(slots[-1]) - int(slots[0]) == n - 1 and (n == 1 or bool((np.diff(slots) == 1).all())):
        return slice(int(slots[0]), int(slots[0]) + n)
    return None


def _keys(buf: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
    return buf[slots] if isinstance(slots, slice) else buf.index_select(0, slots)

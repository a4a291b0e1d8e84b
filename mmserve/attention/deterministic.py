"""The `sdpa` path's deterministic variant (`[runtime] deterministic = true`): paged attention whose
result for a query is a function of that query and the keys it sees alone — whatever else shares
its call (other sequences, other tokens of its chunk), wherever its chunk starts, and whether its
keys were written by an earlier step (a prefix hit, a resumed sequence) or by this one.

Why SDPA is not: its CPU kernel computes a block of queries against a block of keys with a GEMM
whose per-element reduction follows the block's shape (the chunk's length picks the query split,
a tail block takes another kernel), and reduces P·V over all keys at once (MKL blocks that
reduction by the key count: measured, a query's output changes when the keys run from 300 to 304,
zeros or not). What this does instead, for every sequence of the step (`invariant_attention`):

- **scores**: one `bmm` of the query rows (a KV head's GQA group x tokens, padded to a multiple
  of 16 rows) against the keys (padded to a multiple of `KEY_BLOCK`), the reduction over
  head_dim only: measured on this torch, an element's bits depend on neither the row count, the
  row's position, the key count nor the batch (`tests/test_deterministic.py` pins it);
- **softmax**: masked keys (outside the causal/window/span interval) are -inf, the row max is
  exact whatever the order, p = exp(s - max) is elementwise (a masked key's p is exactly 0);
- **P·V and the normaliser** in fixed blocks of `KEY_BLOCK` keys aligned to absolute positions
  (a multiple of 16 from position 0: the KV arena's blocks), one `bmm` of fixed inner size per
  block (V carries a column of ones: the block's sum of p comes out of the same product), the
  blocks then summed in position order by a scan (`cumsum`: sequential on the CPU). A block the
  query does not see contributes exact zeros, so it does not matter how many of them a call
  holds, and the keys' K/V beyond a sequence's end are zeroed before they are read (the arena is
  `torch.empty`: 0 x NaN would be NaN).

The cost is the padding of decode rows to 16 and a gather of each sequence's keys (no view in
place); `docs/performance.md` has the figures.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .backend import AttentionBackend, PagedMetadata

KEY_BLOCK = 16
"""Keys per block of the P·V reduction (absolute positions [16 j, 16 j + 16)): the default KV
block size, and the inner size at which the CPU's batched GEMM was measured invariant."""

ROW_PAD = 4
"""Query rows of a call are padded to a multiple of this: MKL's GEMM computes rows in panels of 4,
a remainder (and a lone row: a GEMV) with other kernels."""


class DeterministicSdpaBackend(AttentionBackend):
    """`invariant_attention` over the paged arena (see the module docstring). Sequences with the
    same padded row count are computed in one batched call (a step's decode tokens: one call)."""

    name = "sdpa_deterministic"
    supports = frozenset({"gqa", "mrope_positions", "sliding_window", "bidirectional_spans"})

    def forward(self, query, key_cache, value_cache, meta: PagedMetadata, scale: float | None = None,
                out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        heads, head_dim = query.shape[1], query.shape[2]
        kv_heads, bs = key_cache.shape[2], key_cache.shape[1]
        group = heads // kv_heads
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        out = torch.empty_like(query) if out is None else out
        offsets = np.concatenate([[0], np.cumsum(meta.lengths)])
        q_ends = None if meta.q_ends is None else meta.q_ends.cpu().numpy()
        calls: dict[int, list[int]] = {}
        for i, n in enumerate(meta.lengths):
            calls.setdefault(_pad(n * group, ROW_PAD), []).append(i)
        kbuf = key_cache.view(-1, kv_heads, head_dim)
        vbuf = value_cache.view(-1, kv_heads, head_dim)
        for rows, seqs in calls.items():
            ends = [_key_ends(meta, i, offsets, q_ends) for i in seqs]
            los = [_first_key(meta.starts[i], window) for i in seqs]
            first = [lo // KEY_BLOCK * KEY_BLOCK for lo in los]  # block-aligned: absolute block boundaries
            width = max(_pad(int(e.max()) - f, KEY_BLOCK) for e, f in zip(ends, first))
            slots, real = _key_slots(meta, seqs, first, width, bs)
            # keys past a sequence's end are never seen (their scores are masked), but their values
            # must be zeros: p = 0 times NaN (a never-written slot of the arena) would be NaN
            k = kbuf.index_select(0, slots).view(len(seqs), width, kv_heads, head_dim).to(query.dtype)
            v = query.new_ones(len(seqs), kv_heads, width, head_dim + 1)  # the last column: p's sum
            v[..., :head_dim] = vbuf.index_select(0, slots).view(len(seqs), width, kv_heads, head_dim).transpose(1, 2)
            v.masked_fill_(~real[:, None, :, None], 0)
            q = query.new_zeros(len(seqs), rows, kv_heads, head_dim)
            mask = torch.zeros(len(seqs), rows, width, dtype=torch.bool)
            for j, i in enumerate(seqs):
                n = meta.lengths[i]
                # row r = token * group + g (the token's query heads of one KV head, consecutive)
                q[j, :n * group] = query[offsets[i]:offsets[i] + n].view(n, kv_heads, group, head_dim) \
                    .transpose(1, 2).reshape(n * group, kv_heads, head_dim)
                pos = np.arange(meta.starts[i], meta.starts[i] + n)
                keys = np.arange(first[j], first[j] + width)
                lo = (pos - window + 1) if window else np.zeros_like(pos)
                seen = (keys[None, :] >= lo[:, None]) & (keys[None, :] < ends[j][:, None])
                mask[j, :n * group] = torch.from_numpy(np.repeat(seen, group, axis=0))
            o = invariant_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v,
                                    mask.to(query.device)[:, None], scale)  # [S, kv_heads, rows, d]
            for j, i in enumerate(seqs):
                n = meta.lengths[i]
                out[offsets[i]:offsets[i] + n] = o[j, :, :n * group].reshape(kv_heads, n, group, head_dim) \
                    .permute(1, 0, 2, 3).reshape(n, heads, head_dim)
        return out


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """q [S, H, R, d] (R a multiple of `ROW_PAD`), k [S, H, N, d] (N a multiple of `KEY_BLOCK`,
    key j at an absolute position ≡ j mod KEY_BLOCK), v [S, H, N, d + 1] (the values and a column
    of ones; zeros where a key is not real), mask [S, 1|H, R, N] (True: the row sees the key) ->
    [S, H, R, d]; a row that sees no key gives NaN (padding). Every reduction has a fixed shape
    (the module docstring)."""
    s_, h, r, d = q.shape
    n = k.shape[2]
    blocks = n // KEY_BLOCK
    scores = torch.bmm(q.reshape(s_ * h, r, d).contiguous(), k.reshape(s_ * h, n, d).contiguous().transpose(1, 2))
    scores = torch.where(mask, scores.view(s_, h, r, n) * scale, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    p = pointwise(torch.exp, scores - top)  # [S, H, R, N]; exactly 0 where masked
    p = p.view(s_ * h, r, blocks, KEY_BLOCK).transpose(1, 2).reshape(s_ * h * blocks, r, KEY_BLOCK)
    vx = v.reshape(s_ * h * blocks, KEY_BLOCK, d + 1)
    parts = torch.bmm(p, vx).view(s_ * h, blocks, r, d + 1)
    total = parts.cumsum(1)[:, -1]  # the blocks summed in order, one after the other
    return (total[..., :d] / total[..., d:]).view(s_, h, r, d)


def _pad(n: int, to: int) -> int:
    return max(to, -(-n // to) * to)


def _first_key(start: int, window: int | None) -> int:
    """The first key any token of a chunk starting at `start` sees."""
    return max(0, start - window + 1) if window else 0


def _key_ends(meta: PagedMetadata, i: int, offsets: np.ndarray, q_ends: np.ndarray | None) -> np.ndarray:
    """Each new token's keys end (exclusive): its position + 1, or its bidirectional span's end."""
    start, n = meta.starts[i], meta.lengths[i]
    if q_ends is None:
        return np.arange(start + 1, start + n + 1)
    return q_ends[offsets[i]:offsets[i] + n].astype(np.int64)


def _key_slots(meta: PagedMetadata, seqs: list[int], first: list[int], width: int, bs: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The arena slots of keys [first[j], first[j] + width) of each sequence [S * width] (slot 0
    past its end), and which of them are real [S, width] (before its end)."""
    slots = np.zeros((len(seqs), width), dtype=np.int64)
    real = np.zeros((len(seqs), width), dtype=bool)
    for j, i in enumerate(seqs):
        end = meta.starts[i] + meta.lengths[i]
        pos = np.arange(first[j], min(end, first[j] + width))
        table = np.asarray(meta.tables[i], dtype=np.int64)
        slots[j, :len(pos)] = table[pos // bs] * bs + pos % bs
        real[j, :len(pos)] = True
    device = meta.slot_mapping.device
    return torch.from_numpy(slots.reshape(-1)).to(device), torch.from_numpy(real).to(device)


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """`fn` (an elementwise op) of `x`, with every element on the op's vectorized path. ATen's CPU
    loops compute the last `numel % 32` elements of a thread's chunk with the scalar function,
    whose last bit can differ from the vector one (measured: silu, tanh-gelu, quick-gelu, cos of a
    row of 344 elements differ between a call of 1 row and of 16): so a row's result would follow
    the number of rows. Padded with zeros to a multiple of 32 x lcm(1..threads) elements, every
    thread's chunk is whole vectors."""
    flat = x.reshape(-1)
    n = flat.numel()
    unit = _pointwise_unit(torch.get_num_threads())
    padded = -(-n // unit) * unit
    if padded != n or not flat.is_contiguous():
        flat = torch.cat([flat, flat.new_zeros(padded - n)])
    return fn(flat)[:n].view(x.shape)


def _pointwise_unit(threads: int) -> int:
    return 32 * math.lcm(*range(1, max(1, threads) + 1))

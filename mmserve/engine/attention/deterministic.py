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
  of `ROW_PAD` rows) against the keys from the first key's `KEY_BLOCK` boundary (the call's
  width padded to a multiple of it; a sequence's own keys read up to its written ones padded to
  `READ_BLOCK`, never past its blocks), the reduction over head_dim only: measured on this
  torch, an element's bits
  depend on neither the row count, the row's position, the key count nor the batch
  (`tests/test_deterministic.py` pins it);
- **softmax**: masked keys (outside the causal/window/span interval) are -inf, the row max is
  exact whatever the order, p = exp2(s x scale x log2 e - max) is elementwise on the vector path
  (`pointwise`; a masked key's p is exactly 0; exp2, not exp: on this CPU exp takes 2.5x longer,
  6x on -inf);
- **P·V** in fixed blocks of `KEY_BLOCK` (64) keys aligned to absolute positions (a multiple of
  64 from position 0: four of the KV arena's blocks), one `bmm` of inner size 64 per block, and
  each block's sum of p over its 64 keys (`mmserve-det1` used blocks of 16: four times the GEMMs,
  a quarter the size each; a decode step of 16 sequences at 650 tokens took 11% longer); the
  blocks then summed in a fixed order: without a sliding window
  (every call's keys start at position 0) by a tree anchored at position 0, log2(blocks) adds a
  layer; with one, in position order, one add after the other (`invariant_attention`). A block
  the query does not see contributes exact zeros, so it does not matter how many of them a call
  holds.
- **reads**: a sequence whose keys lie in consecutive slots (its blocks consecutive ids) has
  them read in place, one `bmm` per sequence over a strided view of the arena [kv_heads, d, its
  own width] (bmm gives the bits of a copy, whatever the batch and the strides; what lies past its
  end is masked); the other sequences of the call have their keys gathered, in one copy and one
  `bmm` (`_scores`). Values are always gathered (the P·V products' batch runs over KV heads,
  sequences and blocks, which no single stride of the arena spans), values past a sequence's end
  reading its last key again (finite: p = 0 times a never-written slot of the `torch.empty` arena
  could be NaN).

Sequences whose rows pad to the same count share one batched call (a step's decode tokens: one
call); the host-side layout of a step's calls is built once and read by every layer. The cost —
rows padded to 4, a gather of values (and of the keys of sequences in scattered blocks) a layer
where the default reads them in place, many small P·V products — is in `docs/performance.md`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mmserve.models.batch_invariant import pointwise

from .backend import PagedMetadata
from .masks import first_key, key_ends, key_starts
from .sdpa import SdpaBackend

LOG2E = 1.4426950408889634

KEY_BLOCK = 64
"""Keys per block of the P·V reduction (absolute positions [64 j, 64 j + 64)): four of the default
KV blocks, an inner size at which the CPU's batched GEMM was measured invariant."""

READ_BLOCK = 16
"""A sequence's keys are read (in place or gathered) up to its written ones padded to this many:
never past its own blocks."""

TILE_TOKENS = 64
"""A longer chunk's queries are computed in tiles of this many, each over the keys up to its own
end: the causal half of the scores is never computed, and a call's [rows, keys] products and
per-block partial sums stay small enough for the caches. A step of a 760-token chunk beside 8
decode tokens (bench model, 2 threads) cost 2.76x the default's untiled, 1.66x in tiles of 256,
1.13x of 64, 1.18x of 32; 256 tokens after 512: 2.20x, 1.35x of 64, 1.26x of 32. The bits are
those of a chunk of that many tokens, which they equal (the mode's guarantee)."""

ROW_PAD = 4
"""Query rows of a call are padded to a multiple of this: MKL's GEMM computes rows in panels of 4,
a remainder (and a lone row: a GEMV) with other kernels."""


class DeterministicSdpaBackend(SdpaBackend):
    """`invariant_attention` over the paged arena (see the module docstring). Sequences with the
    same padded row count are computed in one batched call (a step's decode tokens: one call). The
    sdpa backend's but for the arithmetic: the same masks (`masks`), and a step's layout (its
    `_Call`s, per window) built once and kept with its metadata (`SdpaBackend.layout`)."""

    name = "sdpa_deterministic"

    def forward(self, query, key_cache, value_cache, meta: PagedMetadata, scale: float | None = None,
                out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        heads, head_dim = query.shape[1], query.shape[2]
        kv_heads = key_cache.shape[2]
        group = heads // kv_heads
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        out = torch.empty_like(query) if out is None else out
        # [kv_heads, tokens, group, d]: a KV head's query rows in one place
        q_heads = query.view(-1, kv_heads, group, head_dim).transpose(0, 1)
        out_heads = out.view(-1, kv_heads, group, head_dim)
        vbuf = value_cache.view(-1, head_dim)  # row slot * kv_heads + h: one KV head's value of one slot
        for call in self.layout(meta, window, group, kv_heads):
            s_, rows, width = call.seqs, call.rows, call.width
            q = q_heads[:, call.token, call.head].reshape(kv_heads * s_, rows, head_dim)  # padding rows: unseen
            scores = _scores(q, key_cache, call)
            # values gathered so: keys past a sequence's end repeat its last slot (finite: never
            # seen, p = 0; a view would read past the end, where 0 x NaN is NaN)
            v = vbuf.index_select(0, call.rows_read).to(query.dtype).view(kv_heads * s_, width, head_dim)
            o = attend_scores(scores, v, call.mask, scale, anchored=not window)
            o = o.view(kv_heads, s_ * rows, head_dim)[:, call.real].transpose(0, 1)  # [real rows, kv_heads, d]
            out_heads[call.real_token, :, call.real_head] = o
        return out

    def _build(self, meta: PagedMetadata, window: int | None, group: int, kv_heads: int, device) -> list["_Call"]:
        """The step's calls for a layer of `window`: sequences grouped by their padded row count; a
        chunk longer than `TILE_TOKENS` is cut into tiles of that many queries, grouped with the
        tiles of the same key width (causal: a tile reads only the keys up to its own end, and
        computes no score its rows cannot see)."""
        offsets = np.concatenate([[0], np.cumsum(meta.lengths)])
        spans = meta.spans or ((),) * meta.num_seqs
        calls: dict[tuple, list[tuple[int, int, int]]] = {}
        for i, (start, n) in enumerate(zip(meta.starts, meta.lengths)):
            if n <= TILE_TOKENS:
                calls.setdefault((_pad(n * group, ROW_PAD),), []).append((i, start, n))
                continue
            for at in range(start, start + n, TILE_TOKENS):
                m = min(TILE_TOKENS, start + n - at)
                first = first_key(at, window) // KEY_BLOCK * KEY_BLOCK
                width = _pad(int(key_ends(at, m, spans[i]).max()) - first, KEY_BLOCK)
                calls.setdefault((_pad(m * group, ROW_PAD), width), []).append((i, at, m))
        return [_Call(meta, parts, key[0], group, window, offsets, kv_heads, device) for key, parts in calls.items()]


class _Call:
    """One batched call's layout, built on the host once a step: `parts` (each a sequence's new
    tokens, or a tile of them: (sequence, first position, count), `rows` padded query rows), each
    read from its first key's block boundary over `width` keys; as device tensors: the arena rows
    to read, each row's token and query head, the mask, the real rows; which parts' keys are read
    in place (`bases`) and which gathered."""

    def __init__(self, meta: PagedMetadata, parts: list[tuple[int, int, int]], rows: int, group: int,
                 window: int | None, offsets: np.ndarray, kv_heads: int, device):
        s_ = len(parts)
        seqs = [i for i, _, _ in parts]
        spans = meta.spans or ((),) * meta.num_seqs
        first = np.array([first_key(at, window) // KEY_BLOCK * KEY_BLOCK for _, at, _ in parts])
        ends = [key_ends(at, m, spans[i]) for i, at, m in parts]
        width = max(_pad(int(e.max()) - f, KEY_BLOCK) for e, f in zip(ends, first))
        keys = first[:, None] + np.arange(width)[None, :]  # [S, width] absolute positions
        slots = np.zeros((s_, width), dtype=np.int64)
        token = np.zeros((s_, rows), dtype=np.int64)  # row r of sequence j: token r // group ...
        head = np.zeros((s_, rows), dtype=np.int64)  # ... and query head r % group of a KV head
        real = np.zeros((s_, rows), dtype=bool)
        lo = np.full((s_, rows), 1 << 62, dtype=np.int64)  # padding rows see no key
        hi = np.zeros((s_, rows), dtype=np.int64)
        for j, (i, start, n) in enumerate(parts):
            table = np.asarray(meta.tables[i], dtype=np.int64)
            # past the sequence's last key written (this step's last, a tile's too): that key again;
            # before the first key a window lets the part see (the block boundary is up to 63 keys
            # earlier): that first key (a slot before a window may hold anything, and 0 x NaN is NaN)
            pos = np.clip(keys[j], first_key(start, window), meta.starts[i] + meta.lengths[i] - 1)
            slots[j] = table[pos // meta.block_size] * meta.block_size + pos % meta.block_size
            r = np.arange(n * group)
            token[j, :n * group] = offsets[i] + start - meta.starts[i] + r // group
            head[j, :n * group] = r % group
            real[j, :n * group] = True
            lo[j, :n * group] = np.repeat(key_starts(start, n, window), group)
            hi[j, :n * group] = np.repeat(ends[j], group)
        mask = (keys[:, None, :] >= lo[:, :, None]) & (keys[:, None, :] < hi[:, :, None])  # [S, rows, width]
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(-1)).to(device)  # noqa: E731
        self.seqs, self.rows, self.width = s_, rows, width
        # the arena's [slots * kv_heads, d] rows to read, heads first: [kv_heads, S, width]
        self.rows_read = as_tensor(slots[None] * kv_heads + np.arange(kv_heads)[:, None, None])
        # a sequence's keys are read in place when [first, first + its own padded width) lies in
        # consecutive slots of its blocks: (the arena slot of key `first`, that width); else None,
        # and the keys of every such sequence of the call are gathered in one copy
        bases = []
        for j, i in enumerate(seqs):
            own = _pad(int(ends[j].max()) - int(first[j]), READ_BLOCK)
            base = _consecutive(meta, i, int(first[j]), own)
            bases.append(None if base is None else (base, own))
        self.bases = tuple(bases)
        self.base = bases[0][0] if s_ == 1 and bases[0] is not None else None  # a lone sequence's
        gathered = [j for j, b in enumerate(bases) if b is None]
        self.gathered = tuple(gathered)
        # the gathered sequences' indices in the call and key rows, [kv_heads, G, width] (batch index h * G + m)
        self.gathered_index = as_tensor(np.array(gathered, dtype=np.int64))
        self.gather_rows = self.rows_read if len(gathered) == s_ else \
            as_tensor(slots[gathered][None] * kv_heads + np.arange(kv_heads)[:, None, None])
        self.token, self.head, self.real = as_tensor(token), as_tensor(head), as_tensor(real)
        self.real_token, self.real_head = self.token[self.real], self.head[self.real]
        self.mask = torch.from_numpy(mask).to(device).repeat(kv_heads, 1, 1)  # batch index h * S + j


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float, anchored: bool = True) -> torch.Tensor:
    """q [B, R, d] (R a multiple of `ROW_PAD`), k/v [B, N, d] (N a multiple of `KEY_BLOCK`, key j at
    an absolute position ≡ j mod KEY_BLOCK; v finite, k anything where masked), mask [B, R, N]
    (True: the row sees the key) -> [B, R, d]; a row that sees no key gives NaN (padding). `anchored`: key
    0 of every batch entry is at absolute position 0 (no sliding window): the blocks are then
    summed by a tree, else one after the other. Every reduction has a fixed shape (the module
    docstring)."""
    return attend_scores(torch.bmm(q, k.transpose(1, 2)), v, mask, scale, anchored)


def attend_scores(scores: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                  anchored: bool = True) -> torch.Tensor:
    """`invariant_attention` from its raw scores [B, R, N] (q . k, one `bmm` reducing over head_dim
    only; anything where masked: overwritten) -> [B, R, d]. Overwrites `scores`."""
    b, r, n = scores.shape
    d = v.shape[-1]
    blocks = n // KEY_BLOCK
    # scores in base 2 (exp2 is the fast one on the CPU, -inf included): s x scale x log2(e), a
    # correctly rounded elementwise op on any path; masked: -inf (whatever k held there)
    scores = scores.mul_(scale * LOG2E).masked_fill_(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).min)  # a row seeing nothing: p = 0
    p = pointwise(torch.exp2, scores.sub_(top))  # [B, R, N]; exactly 0 where masked
    p = p.view(b, r, blocks, KEY_BLOCK).transpose(1, 2).reshape(b * blocks, r, KEY_BLOCK)
    parts = torch.bmm(p, v.reshape(b * blocks, KEY_BLOCK, d)).view(b, blocks, r, d)
    sums = p.sum(-1).view(b, blocks, r, 1)  # each block's sum of p: 16 numbers, one fixed pattern
    acc = torch.cat([parts, sums], -1)  # [B, blocks, R, d + 1]
    # A block the row does not see adds exact zeros, so the sum is the row's own blocks', in one
    # fixed order, however many blocks the call holds. Anchored: a tree over the blocks from
    # position 0, as if padded with zero blocks to a power of two, halves added (block i + h to
    # block i for h = half that power, then half again): the blocks past the row's own power of
    # two are zero, so the levels above it change nothing, and a zero block is simply not added.
    # Otherwise one block after the other (a loop of adds, not `cumsum`: that one accumulates every
    # prefix, in float64). Products and sums in one tensor: one add a level for both (two trees
    # side by side cost more than the copy, measured from 8 to 128 batch entries).
    if anchored:
        m, h = blocks, (1 << (blocks - 1).bit_length()) // 2
        while h:
            if m > h:
                acc[:, :m - h] += acc[:, h:m]
                m = h
            h //= 2
        total = acc[:, 0]
    else:
        total = acc[:, 0].clone()
        for j in range(1, blocks):
            total += acc[:, j]
    return total[..., :d] / total[..., d:]


def _scores(q: torch.Tensor, key_cache: torch.Tensor, call: "_Call") -> torch.Tensor:
    """The raw scores q . k [kv_heads * S, R, width] of a call's queries q [kv_heads * S, R, d]
    (one `bmm` reducing over head_dim only; a product's bits follow neither the batch nor the
    operands' strides, tested): a sequence whose keys lie in consecutive slots (`call.bases`) has
    them read in place, a `bmm` over a strided view of the arena [kv_heads, d, its own width]; the
    others' keys are gathered in one copy and take one `bmm`. Keys past a sequence's own width
    are left unwritten (masked)."""
    kv_heads, d = key_cache.shape[2], key_cache.shape[3]
    s_, rows, width = call.seqs, call.rows, call.width
    per_seq: list[torch.Tensor | None] = [None] * s_
    if call.gathered:
        g = len(call.gathered)
        k = key_cache.view(-1, d).index_select(0, call.gather_rows).view(kv_heads * g, width, d)
        qg = q if g == s_ else q.view(kv_heads, s_, rows, d)[:, call.gathered_index].reshape(kv_heads * g, rows, d)
        scores = torch.bmm(qg, k.to(q.dtype).transpose(1, 2))
        if g == s_:
            return scores
        for m, j in enumerate(call.gathered):
            per_seq[j] = scores.view(kv_heads, g, rows, width)[:, m]
    keys = key_cache.view(-1, kv_heads, d)  # [slots, kv_heads, d]
    qs = q.view(kv_heads, s_, rows, d)
    for j, read in enumerate(call.bases):
        if read is not None:
            base, own = read
            per_seq[j] = torch.bmm(qs[:, j], keys[base:base + own].permute(1, 2, 0).to(q.dtype))
    # fresh results stacked in one copy: a bmm into a strided slice of one result runs GEMM by
    # GEMM on one thread (measured 2x slower at 2 threads)
    if s_ == 1 and per_seq[0].shape[-1] == width:
        return per_seq[0]
    if all(part.shape[-1] == width for part in per_seq):
        return torch.stack(per_seq, 1).view(kv_heads * s_, rows, width)
    scores = q.new_empty(kv_heads, s_, rows, width)
    for j, part in enumerate(per_seq):
        scores[:, j, :, :part.shape[-1]] = part
    return scores.view(kv_heads * s_, rows, width)


def _consecutive(meta: PagedMetadata, i: int, first: int, width: int) -> int | None:
    """The arena slot of key `first` of sequence i when its keys [first, first + width) are
    consecutive slots of its own blocks (its table consecutive ids there; those past its end in its
    last block), else None."""
    bs = meta.block_size
    if bs % READ_BLOCK:
        return None
    table = meta.tables[i]
    lo, hi = first // bs, -(-(first + width) // bs)
    if hi > len(table) or any(table[j + 1] != table[j] + 1 for j in range(lo, hi - 1)):
        return None
    return table[lo] * bs + first % bs


def _pad(n: int, to: int) -> int:
    return max(to, -(-n // to) * to)

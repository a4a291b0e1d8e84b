"""The Triton kernels' deterministic variant (`[runtime] deterministic = true` with
`attention_backend = "triton"`): paged attention whose result for a query is a function of that
query and the keys it sees alone, as `deterministic.py` is for the sdpa path.

Why the default kernels (`triton_paged`) are not: a decode token goes through the split-KV kernel
(its keys cut into splits by the table tensor's width, the splits combined by a second kernel,
a window's keys tiled from `seq_len - window`), a token of a chunk through the prefill kernel (its
keys tiled from the tile's first token's window, its row wherever the chunk's start puts it in
the tile): the same token's reductions take other shapes and orders by the step around it. What
this does instead, one kernel for every token (`_invariant_kernel`):

- **one KV split**, and **every token through the same kernel**, a decode token as a chunk of one;
- **query tiles aligned to absolute positions**: a tile holds the positions [BLOCK_Q t,
  BLOCK_Q (t + 1)) of one sequence (those of the step's chunk; the others are padding rows), so a
  token's row in the tile — (position mod BLOCK_Q) x GROUP + its head in the group — and the
  tile's shape [BLOCK_M, head_dim] are fixed by the token alone. A row of a dot (`tl.dot`: numpy's
  `matmul` in the interpreter, the tensor cores compiled) never depends on the values of the other
  rows, so it is the same wherever the chunk starts and whatever else it holds;
- **key tiles aligned to absolute positions** (multiples of `KEY_TILE`, a multiple of the KV
  block size 16), walked in position order with an online softmax. A key tile before the row's
  first key leaves its state (m = -inf, l = 0, acc = 0) exactly as it was (alpha = p = 0), one after
  its last key too (alpha = exp2(0) = 1, p = 0), so it does not matter how many of them a tile
  walks: the row's arithmetic is its own keys' tiles, in order, each of one fixed shape;
- keys outside the tile's interval are loaded as zeros (never a slot's garbage: 0 x NaN is NaN).

The cost (a decode token computes a tile of BLOCK_M rows) does not matter where this runs: the
CPU, under Triton's interpreter (tests). On CUDA deterministic mode is refused
(`models.batch_invariant.check_available`: the linear layers are not batch-invariant there), so
this kernel is tested only through the interpreter (`tests/test_deterministic_triton.py`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .backend import AttentionBackend, PagedMetadata
from .triton_paged import LOG2E, MIN_DOT, _check, _check_int32, _dot_args, _pow2

KEY_TILE = 32
"""Keys per tile: absolute positions [32 j, 32 j + 32), two blocks of the default KV block size."""

ROW_TILE = 16
"""Rows per query tile (at least, and the GQA group rounded up to a power of two when it is
larger): the smallest `tl.dot` takes compiled, and the least a decode token computes."""


@triton.jit
def _invariant_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, cu_q_ptr, q_ends_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, HAS_ENDS: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len
    t0 = (cached // BLOCK_Q + tile) * BLOCK_Q  # the tile's positions: [t0, t0 + BLOCK_Q), absolute
    if t0 < seq_len:
        r = tl.arange(0, BLOCK_M)  # rows: BLOCK_Q positions x GROUP query heads, fixed by the position
        pos = t0 + r // GROUP
        head = kvh * GROUP + r % GROUP
        row_ok = (r < BLOCK_Q * GROUP) & (pos >= cached) & (pos < seq_len)  # the step's tokens only
        q_row = (q_start + pos - cached).to(tl.int64)
        if HAS_ENDS:  # bidirectional spans: a token inside one sees its later tokens too
            q_end = tl.load(q_ends_ptr + q_row, mask=row_ok, other=0)
            hi = tl.max(q_end, 0)
        else:
            q_end = pos + 1
            hi = tl.minimum(t0 + BLOCK_Q, seq_len)
        q_lo = pos - window + 1  # window 0: every key from 0
        lo = tl.where(window > 0, tl.maximum(tl.maximum(t0, cached) - window + 1, 0), 0)  # the tile's first key
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (q_row * stride_qt + head * stride_qh)[:, None] + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        table = tables_ptr + seq.to(tl.int64) * stride_tb
        for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):  # key tiles from an absolute boundary, in order
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = (n >= lo) & (n < hi)
            block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = n % BLOCK_SIZE
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + (block * stride_kb + slot * stride_ks + kvh * stride_kh)[:, None] + d[None, :],
                        mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + (block * stride_vb + slot * stride_vs + kvh * stride_vh)[:, None] + d[None, :],
                        mask=kv_ok, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
            seen = n_ok[None, :] & (n[None, :] < q_end[:, None]) & ((n[None, :] >= q_lo[:, None]) | (window <= 0))
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # before the row's first key: alpha = p = 0
            alpha = tl.exp2(m - m_use)
            p = tl.exp2(s - m_use[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        o = acc / tl.where(l > 0, l, 1.0)[:, None]  # l = 0: a padding row (never stored)
        tl.store(out_ptr + (q_row * stride_ot + head * stride_oh)[:, None] + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def query_tile(group: int) -> tuple[int, int]:
    """(positions, rows) of a query tile for a GQA group: fixed by the group alone."""
    rows = max(ROW_TILE, _pow2(group, MIN_DOT))
    return rows // group, rows


def invariant_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: PagedMetadata, scale: float, out: torch.Tensor | None = None,
                        window: int | None = None) -> torch.Tensor:
    """Every new token of the step (decode tokens and chunks alike) through `_invariant_kernel`:
    query [T, heads, d] -> out [T, heads, d]; the step's host copies (`meta.starts`,
    `meta.lengths`) size the grid."""
    heads, kv_heads, group = _check(query, key_cache, value_cache)
    _check_int32(block_tables=meta.block_tables, seq_lens=meta.seq_lens, cu_seqlens_q=meta.cu_seqlens_q)
    head_dim, block_size = query.shape[2], key_cache.shape[1]
    out = torch.empty_like(query) if out is None else out
    if out.shape != query.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with a contiguous head dimension")
    if not meta.lengths:
        return out
    block_q, block_m = query_tile(group)
    tiles = max(-(-(s + n) // block_q) - s // block_q for s, n in zip(meta.starts, meta.lengths))
    _invariant_kernel[(meta.num_seqs, tiles, kv_heads)](
        query, key_cache, value_cache, out, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        meta.q_ends if meta.q_ends is not None else meta.cu_seqlens_q, scale * LOG2E, int(window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, D_PAD=_pow2(head_dim, MIN_DOT),
        BLOCK_SIZE=block_size, BLOCK_N=KEY_TILE, HAS_ENDS=meta.q_ends is not None, **_dot_args(query.dtype))
    return out


class DeterministicTritonBackend(AttentionBackend):
    """`invariant_attention`: the Triton path's deterministic variant (see the module docstring).
    Not capturable: the grid is sized from the step's host copies."""

    name = "triton_deterministic"
    supports = frozenset({"gqa", "mrope_positions", "sliding_window", "bidirectional_spans"})

    def forward(self, query, key_cache, value_cache, meta: PagedMetadata, scale: float | None = None,
                out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        return invariant_attention(query, key_cache, value_cache, meta, scale, out=out, window=window)

"""Paged attention in Triton: K/V read straight from the arena through the block tables.

Two kernels, both over the arena's per-layer tensors `[num_blocks, block_size, kv_heads, head_dim]`
(token-major, as `engine.arena.KVArena` holds them) and a padded `[num_seqs, max_blocks]` int32
block-table tensor; neither gathers KV into a copy nor pads anything:

- **decode** (split-KV, "flash-decoding"): one query token per sequence. A program handles one
  (sequence, KV head, KV split): the KV head's whole group of query heads at once (GQA: each K/V
  row is loaded once for the group), an online softmax over the split's tokens, and writes the
  split's partial max, sum and output (fp32). A second kernel, one program per (sequence, query
  head), combines the splits. Splitting the KV keeps a GPU busy when a batch is small and its
  contexts long.
- **prefill**: a chunk of n new tokens per sequence against its whole table (the cached length
  plus the chunk), causal with the diagonal offset by the cached length: query i of the chunk
  sees keys [0, cached + i] — or, with the step's explicit masks, [p - window + 1, q_end) for the
  token at p: a sliding window (keys before the tile's window are not read) and bidirectional
  spans (`q_ends`: a token inside an image sees the image's later tokens too). A program handles one (sequence, tile of query tokens, KV head); its
  rows are the tile's tokens times the group's query heads, so K/V are again loaded once per group.

Keys are addressed per token: block `table[p // block_size]`, slot `p % block_size`, so any block
size works (1, 16, 32, ...) and a tile of keys may span several blocks.

Launching reads only tensor shapes and host integers the caller already has (the number of
decode sequences, a bound on the chunk length) — never a tensor's value — so the decode launch can
be captured in a CUDA graph: a replay with other tables and lengths in the same buffers is right.

Under `TRITON_INTERPRET=1` (set before triton is imported) the kernels run on CPU tensors through
Triton's interpreter; that is how CI tests them. The interpreter's `tl.dot` multiplies the raw bit
patterns of bfloat16 operands (triton-lang/triton#11584, "not supported yet"), so there the dot
operands are widened to fp32 first (`DOT_F32`); compiled kernels multiply bf16/fp16 natively with
fp32 accumulation. fp32 inputs use `input_precision="ieee"` (TF32 would cost ~1e-3 of accuracy).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .backend import AttentionBackend, PagedMetadata

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs M, N, K >= 16 when compiled


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (max(1, n) - 1).bit_length())


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, part_o_ptr, part_ml_ptr,
    scale_log2, split_tokens, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    heads_total = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, seq_len)
    # a sliding window: keys before seq_len - window are not read (a split may be left empty)
    lo = tl.where(window > 0, tl.maximum(lo, seq_len - window), lo)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    head = kvh * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tb
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
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
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    # partials: o [seqs, heads, NUM_SPLITS, D_PAD], (m, l) [seqs, heads, NUM_SPLITS, 2]
    row = (seq.to(tl.int64) * heads_total + head) * NUM_SPLITS + split  # [GROUP_PAD]
    tl.store(part_o_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])
    tl.store(part_ml_ptr + row * 2, m, mask=g_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l, mask=g_ok)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < NUM_SPLITS
    row = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a sequence of no keys (a padded row): zeros
    w = tl.where(s_ok, tl.exp2(m - m_max), 0.0)
    total = tl.sum(l * w, 0)
    o = tl.load(part_o_ptr + row[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0)
    o = tl.where(total > 0, o / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, cu_q_ptr, q_ends_ptr, tile_seq_ptr, tile_idx_ptr,
    first_seq, scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, HAS_ENDS: tl.constexpr, TILE_MAP: tl.constexpr,
):
    if TILE_MAP:  # program i does the map's tile i (a static step's grid: its real tiles plus slack)
        seq = tl.load(tile_seq_ptr + tl.program_id(0))
        tile = tl.load(tile_idx_ptr + tl.program_id(0))
    else:
        seq = first_seq + tl.program_id(0)
        tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        cached = seq_len - q_len
        r = tl.arange(0, BLOCK_M)  # rows: BLOCK_Q tokens x GROUP query heads
        tok = tile * BLOCK_Q + r // GROUP
        head = kvh * GROUP + r % GROUP
        row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
        q_pos = cached + tok  # absolute position: sees keys [q_lo, q_end)
        if HAS_ENDS:  # bidirectional spans: a token inside one sees its later tokens too
            q_end = tl.load(q_ends_ptr + q_start + tok, mask=row_ok, other=0)
            hi = tl.max(q_end, 0)
        else:
            q_end = q_pos + 1
            hi = cached + tl.minimum((tile + 1) * BLOCK_Q, q_len)  # keys past the tile's last query: none
        q_lo = q_pos - window + 1  # window 0: every key from 0
        lo = tl.where(window > 0, tl.maximum(cached + tile * BLOCK_Q - window + 1, 0), 0)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_row = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + (q_row * stride_qt + head * stride_qh)[:, None] + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        table = tables_ptr + seq.to(tl.int64) * stride_tb
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < hi
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
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row none of whose keys came yet
            alpha = tl.exp2(m - m_use)
            p = tl.exp2(s - m_use[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        o = acc / l[:, None]
        tl.store(out_ptr + (q_row * stride_ot + head * stride_oh)[:, None] + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


INTERPRETING = _interpreted(_prefill_kernel)
"""Whether this module's kernels were built for Triton's interpreter (TRITON_INTERPRET=1 when it was
imported): they then run on CPU tensors, and widen dot operands to fp32 (see the docstring)."""


def interpreter_ready() -> bool:
    """Whether the kernels can run in the interpreter now: built for it, triton's own library
    (`tl.zeros`, `tl.sum`, ... are kernels too) built for it as well — TRITON_INTERPRET=1 was set
    before triton was first imported — and the variable still set (the interpreter reads it)."""
    knobs = getattr(triton, "knobs", None)
    now = knobs.runtime.interpret if knobs is not None else os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return INTERPRETING and _interpreted(tl.zeros) and bool(now)


def _dot_args(dtype: torch.dtype) -> dict:
    # fp32: full precision (TF32, the compiled default, costs ~1e-3); bf16/fp16: the default
    return {"DOT_F32": INTERPRETING, "PRECISION": "ieee" if dtype == torch.float32 else None}


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int]:
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError("the arena's keys and values must both be [num_blocks, block_size, kv_heads, head_dim]")
    if query.dim() != 3 or query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"query {tuple(query.shape)} must be [tokens, heads, {key_cache.shape[3]}]")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query and the arena's tensors must have contiguous head dimensions")
    heads, kv_heads = query.shape[1], key_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    return heads, kv_heads, heads // kv_heads


def _check_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, not {t.dtype}")


def _block_n(query: torch.Tensor, head_dim: int) -> int:
    """Keys per tile: 64 for 16-bit heads up to 128 wide; 32 for wider rows (fp32, or heads over
    128), which keeps a prefill tile's pipelined K/V in an H100's shared memory; 32 when interpreting."""
    return 32 if INTERPRETING or query.element_size() * _pow2(head_dim, MIN_DOT) > 256 else 64


def default_splits(max_tokens: int, min_split: int = 256, max_splits: int = 16) -> int:
    """KV splits of a decode step whose tables cover `max_tokens` tokens: enough programs to keep a
    GPU busy for a few long sequences, none shorter than `min_split` tokens."""
    return max(1, min(max_splits, -(-max_tokens // min_split)))


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 num_splits: int | None = None, block_n: int | None = None, window: int | None = None) -> torch.Tensor:
    """One new token per sequence: query [B, heads, d] (its keys already written into the arena),
    block_tables [B, max_blocks] int32, seq_lens [B] int32 (keys per sequence, the new one
    included) -> out [B, heads, d]. A sequence with seq_lens 0 (a padded row) gets zeros. `window`:
    the layer's sliding window (keys [seq_len - window, seq_len) only; the others are not read).

    The number of KV splits follows from the table tensor's width (`default_splits`), never from
    the lengths' values: the launch needs no host sync and is capturable."""
    heads, kv_heads, group = _check(query, key_cache, value_cache)
    _check_int32(block_tables=block_tables, seq_lens=seq_lens)
    batch, head_dim = query.shape[0], query.shape[2]
    block_size = key_cache.shape[1]
    out = torch.empty_like(query) if out is None else out
    if out.shape != query.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with a contiguous head dimension")
    if batch == 0:
        return out
    block_n = block_n or _block_n(query, head_dim)
    max_tokens = block_tables.shape[1] * block_size
    splits = num_splits or default_splits(max_tokens)
    split_tokens = -(-max(1, -(-max_tokens // splits)) // block_n) * block_n
    d_pad = _pow2(head_dim, MIN_DOT)
    part_o = torch.empty(batch, heads, splits, d_pad, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(batch, kv_heads, splits)](
        query, key_cache, value_cache, block_tables, seq_lens, part_o, part_ml,
        scale * LOG2E, split_tokens, int(window or 0),
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        NUM_SPLITS=splits, GROUP=group, GROUP_PAD=_pow2(group, MIN_DOT), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, **_dot_args(query.dtype))
    _decode_reduce_kernel[(batch, heads)](
        part_o, part_ml, out, out.stride(0), out.stride(1),
        NUM_SPLITS=splits, SPLITS_PAD=_pow2(splits), HEAD_DIM=head_dim, D_PAD=d_pad)
    return out


def prefill_tile_tokens(group: int, block_m: int | None = None) -> int:
    """Query tokens per program of the prefill kernel (a tile's rows are its tokens times the GQA
    group): what a tile map (`paged_prefill`'s `tile_map`) is built for."""
    return max(block_m or 64, _pow2(group, MIN_DOT)) // group


def paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  max_query_len: int, scale: float, out: torch.Tensor | None = None, first_seq: int = 0,
                  num_seqs: int | None = None, block_m: int | None = None, block_n: int | None = None,
                  q_ends: torch.Tensor | None = None, window: int | None = None,
                  tile_map: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Chunks of new tokens against their tables: query [T, heads, d] packed (sequence i's rows are
    [cu_seqlens_q[i], cu_seqlens_q[i+1])), seq_lens [S] int32 (cached + new tokens), block_tables
    [S, max_blocks] int32 -> out [T, heads, d] (only the rows of sequences first_seq ..
    first_seq + num_seqs - 1 are written). `max_query_len` bounds every chunk's length (a host
    integer: the plan's, or a static cap). `q_ends` [T] int32: each token's keys end there
    (bidirectional spans; default: its position + 1); `window`: the layer's sliding window.
    `tile_map` (sequence [P], tile [P], int32; built for `prefill_tile_tokens(group, block_m)`
    tokens a tile): the grid is P programs per KV head, program i doing tile i of its sequence (an
    index past the sequence's chunk: nothing) — a static step's launch sized by its bucket's tiles
    (at most T / tile + sequences), not by sequences x the longest chunk's tiles."""
    heads, kv_heads, group = _check(query, key_cache, value_cache)
    _check_int32(block_tables=block_tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q)
    if q_ends is not None:
        _check_int32(q_ends=q_ends)
    head_dim, block_size = query.shape[2], key_cache.shape[1]
    out = torch.empty_like(query) if out is None else out
    if out.shape != query.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with a contiguous head dimension")
    num_seqs = block_tables.shape[0] - first_seq if num_seqs is None else num_seqs
    if num_seqs <= 0 or max_query_len <= 0:
        return out
    block_m = block_m or 64
    block_m = max(block_m, _pow2(group, MIN_DOT))
    block_q = block_m // group
    block_n = block_n or _block_n(query, head_dim)
    if tile_map is not None:
        _check_int32(tile_seqs=tile_map[0], tile_ids=tile_map[1])
        grid = (tile_map[0].shape[0], 1, kv_heads)
    else:
        grid = (num_seqs, -(-max_query_len // block_q), kv_heads)
    tile_seqs, tile_ids = tile_map if tile_map is not None else (cu_seqlens_q, cu_seqlens_q)
    _prefill_kernel[grid](
        query, key_cache, value_cache, out, block_tables, seq_lens, cu_seqlens_q,
        q_ends if q_ends is not None else cu_seqlens_q, tile_seqs, tile_ids, first_seq, scale * LOG2E,
        int(window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, D_PAD=_pow2(head_dim, MIN_DOT),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, HAS_ENDS=q_ends is not None, TILE_MAP=tile_map is not None,
        **_dot_args(query.dtype))
    return out


class TritonBackend(AttentionBackend):
    """The paged Triton kernels: decode sequences (the step's leading one-token segments) through
    the split-KV kernel, every other sequence through the prefill kernel."""

    name = "triton"
    supports = frozenset({"gqa", "mrope_positions", "sliding_window", "bidirectional_spans"})
    capturable = True

    def tile_tokens(self, heads: int, kv_heads: int) -> int | None:
        return prefill_tile_tokens(heads // kv_heads)

    def forward(self, query, key_cache, value_cache, meta: PagedMetadata, scale: float | None = None,
                out: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        out = torch.empty_like(query) if out is None else out
        nd = meta.num_decodes
        if nd:
            paged_decode(query[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                         out=out[:nd], window=window)
        if meta.num_seqs > nd:
            paged_prefill(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                          meta.max_query_len, scale, out=out, first_seq=nd, q_ends=meta.q_ends, window=window,
                          tile_map=meta.tile_map)
        return out

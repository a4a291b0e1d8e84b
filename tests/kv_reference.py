"""The reference batched KV cache for tests: the contiguous, left-padded cache the runtime used
before the paged KV arena. Tests build one with `stack_kv` to check `LlavaAdapter.decode` and the
paged attention against transformers' own batched forward.

transformers' `DynamicLayer` concatenates the whole cache with each new token, so every decode
step copies every sequence's KV once more; with 8 sequences of a few hundred tokens that copy
costs as much as reading the weights. Here each layer's keys and values live in a buffer
[batch, kv_heads, capacity, head_dim] with room to grow: a step writes one column, and attention
reads a view of the filled part. Rows are left-padded so that all sequences end at the same
column; the attention mask hides the padding.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values), [B, heads, T, dim]

_ROUND = 64  # capacity granularity, so that buffers are reused across similar batches' growth


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` whose tensors are views of a buffer with spare columns."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.kbuf, self.vbuf, self.length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._expose()

    @property
    def capacity(self) -> int:
        return self.kbuf.shape[2]

    def _expose(self) -> None:
        self.keys = self.kbuf[:, :, : self.length]
        self.values = self.vbuf[:, :, : self.length]

    def reserve(self, length: int) -> None:
        """Makes room for `length` columns (reallocating and copying when the buffer is full)."""
        if length <= self.capacity:
            return
        cap = _rounded(max(length, self.capacity * 3 // 2))
        shape = (*self.kbuf.shape[:2], cap, self.kbuf.shape[3])
        kbuf, vbuf = self.kbuf.new_empty(shape), self.vbuf.new_empty(shape)
        kbuf[:, :, : self.length] = self.keys
        vbuf[:, :, : self.length] = self.values
        self.kbuf, self.vbuf = kbuf, vbuf
        self._expose()

    def set_length(self, length: int) -> None:
        """Declares the first `length` columns filled (after writing them into the buffers)."""
        self.length = length
        self._expose()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n, q = self.length, key_states.shape[-2]
        self.reserve(n + q)
        self.kbuf[:, :, n : n + q] = key_states
        self.vbuf[:, :, n : n + q] = value_states
        self.length = n + q
        self._expose()
        return self.keys, self.values


def _rounded(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


def stack_kv(kvs: Sequence[KV], capacity: int = 0) -> tuple[Cache, torch.Tensor]:
    """One batch cache holding each sequence's KV ([1, heads, T_b, dim] per layer) as a row,
    left-padded to the longest, with room for `capacity` columns; and the attention mask
    [B, longest] (1 = real token) that hides the padding."""
    lengths = [kv[0][0].shape[2] for kv in kvs]
    longest = max(lengths)
    cap = _rounded(max(capacity, longest + 1))
    layers = []
    for i in range(len(kvs[0])):
        k0 = kvs[0][i][0]
        shape = (len(kvs), k0.shape[1], cap, k0.shape[3])
        ks, vs = k0.new_zeros(shape), k0.new_zeros(shape)
        for b, (kv, n) in enumerate(zip(kvs, lengths)):
            ks[b, :, longest - n : longest] = kv[i][0][0]
            vs[b, :, longest - n : longest] = kv[i][1][0]
        layers.append(BufferedLayer(ks, vs, longest))
    mask = torch.zeros(len(kvs), longest, dtype=torch.long, device=kvs[0][0][0].device)
    for b, n in enumerate(lengths):
        mask[b, longest - n :] = 1
    return Cache(layers=layers), mask


def buffered_cache(buffers: KV, length: int) -> Cache:
    """A batch-1 cache over per-layer (keys, values) buffers whose first `length` columns hold KV."""
    return Cache(layers=[BufferedLayer(k, v, length) for k, v in buffers])

"""The running decode batch: every prefilled sequence advances by one token per batched forward.

Sequences of different lengths share one KV cache, left-padded to the longest, with a 2-D
attention mask hiding the padding and explicit per-sequence positions — which reproduces each
sequence's unbatched logits (tests/test_adapter.py pins it). Membership changes are recorded on
the event loop (cheap) and the cache is re-formed inside the next step, in the worker thread, so
no tensor copying ever runs on the loop.
"""

from __future__ import annotations

from typing import Protocol, Sequence as Seq

import torch
from transformers import DynamicCache

from mmserve.models.llava import LlavaAdapter

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class Member(Protocol):
    kv: KV | None  # the sequence's own KV while it is not a row of the batch cache
    kv_len: int
    last_token: int


class DecodeBatch:
    def __init__(self, adapter: LlavaAdapter):
        self.adapter = adapter
        self.members: list[Member] = []  # who takes part in the next step
        self._rows: list[Member] = []    # whose KV the batch cache holds, row by row
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.members)

    def set_members(self, members: Seq[Member]) -> None:
        """Records who takes part from the next step on (applied by `step`, off the loop)."""
        self.members = list(members)
        if not self.members:
            self._rows, self.cache, self.mask = [], None, None

    def kv_of(self, member: Member) -> KV:
        """The member's own KV, [1, heads, kv_len, dim] per layer, without padding (views)."""
        if member.kv is not None:
            return member.kv
        b = self._rows.index(member)
        start = self.mask.shape[1] - member.kv_len
        return tuple((layer.keys[b:b + 1, :, start:], layer.values[b:b + 1, :, start:]) for layer in self.cache.layers)

    def _reform(self) -> None:
        own = [self.kv_of(m) for m in self.members]
        caches = [DynamicCache(ddp_cache_data=list(kv), config=self.adapter.text_config) for kv in own]
        self.cache, self.mask = self.adapter.stack_caches(caches)
        self._rows = list(self.members)
        for m in self.members:
            m.kv = None

    def step(self) -> torch.Tensor:
        """One batched decode forward (worker thread): logits [B, vocab], one row per member."""
        if self._rows != self.members:
            self._reform()
        ones = torch.ones(len(self.members), 1, dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        positions = [m.kv_len for m in self.members]
        out = self.adapter.decode([m.last_token for m in self.members], self.cache, positions, attention_mask=self.mask)
        self.cache = out.cache
        for m in self.members:
            m.kv_len += 1
        return out.logits

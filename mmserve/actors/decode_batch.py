"""The running decode batch: every prefilled sequence advances by one token per batched forward.

Sequences of different lengths share one KV cache, left-padded to the longest, with a 2-D
attention mask hiding the padding and explicit per-sequence positions — which reproduces each
sequence's unbatched logits (tests/test_adapter.py pins it). The batch is rebuilt only when its
membership changes.
"""

from __future__ import annotations

from typing import Protocol, Sequence as Seq

import torch
from transformers import DynamicCache

from mmserve.models.llava import LlavaAdapter

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class Member(Protocol):
    kv: KV | None  # the sequence's own KV while it is outside the batch
    kv_len: int
    last_token: int


class DecodeBatch:
    def __init__(self, adapter: LlavaAdapter):
        self.adapter = adapter
        self.members: list[Member] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.members)

    def kv_of(self, member: Member) -> KV:
        """The member's own KV, [1, heads, kv_len, dim] per layer, without padding (views)."""
        if member.kv is not None:
            return member.kv
        b = self.members.index(member)
        width = self.mask.shape[1]
        return tuple((layer.keys[b:b + 1, :, width - member.kv_len:], layer.values[b:b + 1, :, width - member.kv_len:])
                     for layer in self.cache.layers)

    def set_members(self, members: Seq[Member]) -> None:
        """Re-forms the batch around `members` (some new, some already in it)."""
        if list(members) == self.members:
            return
        own = [self.kv_of(m) for m in members]
        for m, kv in zip(members, own):
            m.kv = kv
        self.members = list(members)
        if not members:
            self.cache = self.mask = None
            return
        caches = [DynamicCache(ddp_cache_data=list(kv), config=self.adapter.text_config) for kv in own]
        self.cache, self.mask = self.adapter.stack_caches(caches)
        for m in members:
            m.kv = None

    def step(self) -> torch.Tensor:
        """One batched decode forward (worker thread): logits [B, vocab] for each member's next token."""
        ones = torch.ones(len(self.members), 1, dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        positions = [m.kv_len for m in self.members]
        out = self.adapter.decode([m.last_token for m in self.members], self.cache, positions, attention_mask=self.mask)
        self.cache = out.cache
        for m in self.members:
            m.kv_len += 1
        return out.logits

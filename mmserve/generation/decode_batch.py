"""The running decode batch: every prefilled sequence advances by one token per batched forward.

Sequences of different lengths share one KV cache in preallocated buffers (written in place, see
`mmserve.models.kv_buffer`), left-padded to the longest, with a 2-D attention mask hiding the
padding and explicit per-sequence positions — which reproduces each sequence's unbatched logits
(tests/test_adapter.py pins it). Membership changes are recorded on the event loop (cheap) and
the cache is re-formed inside the next step, in the worker thread, so no tensor copying ever runs
on the loop; a sequence decoding alone keeps its own cache (no copy at all). A re-formation always allocates new buffers: views handed out by `kv_of` (for a
prefix-cache commit being copied in another thread) are never written again.
"""

from __future__ import annotations

from typing import Protocol, Sequence as Seq

import torch
from transformers.cache_utils import Cache

from mmserve.models.kv_buffer import KV, own_kv, row_kv, stack_kv
from mmserve.models.llava import LlavaAdapter

HEADROOM = 256  # columns reserved beyond the longest sequence, so most batches never regrow


class Member(Protocol):
    cache: Cache | None  # the sequence's own batch-1 cache while it is not a row of the batch cache
    kv_len: int
    last_token: int
    remaining: int  # tokens it may still generate


class DecodeBatch:
    def __init__(self, adapter: LlavaAdapter):
        self.adapter = adapter
        self.members: list[Member] = []  # who takes part in the next step
        self._rows: list[Member] = []    # whose KV the batch cache holds, row by row
        self.cache: Cache | None = None
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
        if member.cache is not None:
            return own_kv(member.cache)
        return row_kv(self.cache, self._rows.index(member), member.kv_len)

    def _reform(self) -> None:
        first = self.members[0]
        if len(self.members) == 1 and first.cache is not None:  # a lone sequence: adopt its cache
            self.cache = first.cache
            self.mask = torch.ones(1, first.kv_len, dtype=torch.long, device=self.adapter.device)
        else:
            own = [self.kv_of(m) for m in self.members]
            longest = max(m.kv_len for m in self.members)
            room = min(max(m.remaining for m in self.members), HEADROOM)
            self.cache, self.mask = stack_kv(own, capacity=longest + room)
        self._rows = list(self.members)
        for m in self.members:
            m.cache = None

    def step(self) -> torch.Tensor:
        """One batched decode forward (worker thread): logits [B, vocab], one row per member."""
        if self._rows != self.members:
            self._reform()
        ones = torch.ones(len(self.members), 1, dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        padded = len(self.members) > 1 and not bool(self.mask.all())
        positions = [m.kv_len for m in self.members]
        out = self.adapter.decode([m.last_token for m in self.members], self.cache, positions,
                                  attention_mask=self.mask if padded else None)
        for m in self.members:
            m.kv_len += 1
        return out.logits

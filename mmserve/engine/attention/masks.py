"""The masks of paged attention, as key intervals: the one place the host-side backends (`sdpa`,
`sdpa_deterministic`) and the static steps' metadata (`mixed_step`'s `q_ends`, read by the Triton
kernels) compute what a new token sees.

A new token at position p sees the keys [lo, hi) of its sequence: hi = p + 1 (causal), or the end
of the bidirectional span holding it (image tokens that see each other both ways: Gemma 3); with
a sliding window W, lo = p - W + 1, else 0 — transformers' mask AND(window, OR(causal, same
image)) as one interval per token. A step never ends inside a span (`step_spans` refuses it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def step_spans(spans: Sequence[tuple[int, int]], start: int, length: int) -> tuple[tuple[int, int], ...]:
    """The bidirectional spans [lo, hi) among `spans` that hold any of the new tokens [start,
    start+length). A span that starts among them must end among them: its later tokens' keys must
    be in the step (a chunk that ends inside a span is refused, never computed causally)."""
    end = start + length
    out = tuple((int(lo), int(hi)) for lo, hi in spans if lo < end and hi > start and hi - lo > 1)
    for lo, hi in out:
        if hi > end:
            raise ValueError(f"a step ends at position {end}, inside the bidirectional span [{lo}, {hi}): "
                             "its tokens must be computed together (the scheduler never splits one)")
    return out


def key_ends(start: int, length: int, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """[length] int64: the (exclusive) end of the keys each new token at positions [start,
    start+length) sees — its position + 1, or the end of the bidirectional span holding it (its
    later tokens too: image tokens see each other both ways)."""
    ends = np.arange(start + 1, start + length + 1, dtype=np.int64)
    for lo, hi in spans:
        a, b = max(lo, start), min(hi, start + length)
        if a < b:
            ends[a - start:b - start] = np.maximum(ends[a - start:b - start], hi)
    return ends


def key_starts(start: int, length: int, window: int | None) -> np.ndarray:
    """[length] int64: the first key each new token sees — p - window + 1 with a sliding window
    (below 0 meaning 0), else 0."""
    if not window:
        return np.zeros(length, dtype=np.int64)
    return np.arange(start, start + length, dtype=np.int64) - window + 1


def first_key(start: int, window: int | None) -> int:
    """The first key any token of a chunk starting at `start` sees (keys before it are not read)."""
    return max(0, start - window + 1) if window else 0


def step_mask(start: int, length: int, lo: int, spans: Sequence[tuple[int, int]], window: int | None,
              device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The bool mask [length, end - lo] of new tokens [start, end) over keys [lo, end): each
    token's interval (`key_starts`, `key_ends`). None when SDPA's own masks say the same: a lone
    token seeing every key from lo, or a causal chunk from position 0 (is_causal)."""
    end = start + length
    if length == 1 and not spans:
        return None  # keys [lo, start] are exactly its window
    if not spans and start == 0 and lo == 0 and not (window and window < length):
        return None
    k = torch.arange(lo, end).unsqueeze(0)
    mask = k < torch.from_numpy(key_ends(start, length, spans)).unsqueeze(1)
    if window:
        mask &= k >= torch.from_numpy(key_starts(start, length, window)).unsqueeze(1)
    return mask.to(device)

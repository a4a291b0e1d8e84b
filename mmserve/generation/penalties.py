"""Presence, frequency and repetition penalties, for a whole batch at once on the logits' device.

Definitions (applied in this order, as vLLM does):

* repetition penalty r (vLLM's extension; 1 is off): for every token that occurs in the prompt or
  the answer so far, a positive logit is divided by r and a negative one multiplied by r;
* frequency penalty f (OpenAI): ``logit[j] -= f * count[j]``, count over the answer so far;
* presence penalty p (OpenAI): ``logit[j] -= p * (count[j] > 0)``.

The rows' token ids travel to the device as one padded [R, L] tensor per kind; counts are one
`scatter_add_` for all rows, never a Python loop over the vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mmserve.generation.sampling import SamplingParams


def apply_penalties(logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                    prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> torch.Tensor:
    """`logits` [B, V] (float) with rows `rows` penalized by their `params`, `prompts` and
    `answers` (one entry per row of `rows`); a new tensor, the input is never written."""
    if not rows:
        return logits
    dev, V = logits.device, logits.shape[1]
    index = _upload(list(rows), torch.long, dev)
    x = logits.index_select(0, index)
    counts = _counts(answers, len(rows), V, dev)
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        seen = (counts > 0) | (_counts(prompts, len(rows), V, dev) > 0)
        r = _upload(rep, torch.float32, dev).unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    freq = _upload([p.frequency_penalty for p in params], torch.float32, dev).unsqueeze(1)
    pres = _upload([p.presence_penalty for p in params], torch.float32, dev).unsqueeze(1)
    x = x - freq * counts - pres * (counts > 0).float()
    return logits.index_copy(0, index, x)


def _counts(seqs: Sequence[Sequence[int]], rows: int, V: int, dev: torch.device) -> torch.Tensor:
    """[rows, V] float32: how often each token id occurs in each row's ids."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(rows, V + 1, dtype=torch.float32, device=dev)
    if width:
        padded = torch.full((rows, width), V, dtype=torch.long)  # column V catches the padding
        for i, s in enumerate(seqs):
            if len(s):
                padded[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long).clamp_(0, V)
        ids = padded.to(dev, non_blocking=True)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=dev))
    return counts[:, :V]


def _upload(values: list, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return t if dev.type == "cpu" else t.pin_memory().to(dev, non_blocking=True)

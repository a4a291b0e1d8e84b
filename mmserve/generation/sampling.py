"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 means greedy (argmax)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded per request (so a seed reproduces its output), or None for greedy."""
    if params.greedy:
        return None
    gen = torch.Generator(device="cpu")
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           banned: torch.Tensor | None = None) -> int:
    """Picks the next token id from 1-D logits. `banned` ids (e.g. EOS before min_tokens,
    the image placeholder) are never chosen."""
    logits = logits.detach().float().cpu()
    if banned is not None and banned.numel():
        logits = logits.clone()
        logits[banned] = float("-inf")
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest set whose mass reaches top_p: drop tokens whose preceding mass already does
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))

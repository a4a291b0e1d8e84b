"""Token sampling: greedy, temperature, min-p, top-k, top-p, with a per-request seeded generator; what
one request asks of its tokens (`SamplingParams`)."""

from __future__ import annotations

import math
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
    n: int = 1  # choices: the prompt is prefilled once and its blocks shared
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already in the answer
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the answer
    repetition_penalty: float = 1.0  # vLLM's: prompt and answer tokens' logits pushed toward 0 by this factor
    logprobs: bool = False
    top_logprobs: int = 0  # 0-20 alternatives per token (needs logprobs)
    grammar: str | None = None  # an llguidance grammar (response_format), validated at parse time
    # vLLM's extensions, with vLLM's meaning
    min_p: float = 0.0  # tokens less likely than min_p times the most likely one are never drawn
    ignore_eos: bool = False  # EOS never ends the answer (it is never drawn: max_tokens ends it)
    stop_token_ids: tuple[int, ...] = ()  # a drawn one ends the answer (it is part of it, as in vLLM)
    skip_special_tokens: bool = True  # special tokens' text is left out of the answer
    include_stop_str_in_output: bool = False  # the stop string that ended the answer stays in it

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


_GOLDEN = 0x9E3779B97F4A7C15


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of a request seeded with `seed`: choice 0 keeps it (so `n`=1 is
    unchanged), the others get distinct, well-mixed seeds (never seed + i, which would make choice 1
    of seed 5 equal choice 0 of seed 6)."""
    if seed is None or choice == 0:
        return seed
    return (seed ^ (choice * _GOLDEN)) % 2**63


def make_generator(params: SamplingParams, choice: int = 0) -> torch.Generator | None:
    """A CPU generator seeded per request and choice (so a seed reproduces its output), or None for
    greedy."""
    if params.greedy:
        return None
    gen = torch.Generator(device="cpu")
    if params.seed is not None:
        gen.manual_seed(choice_seed(params.seed, choice))
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
    if params.min_p > 0.0:  # below min_p times the top probability: log p_i < log p_max + log min_p
        logits = logits.masked_fill(logits < logits.max() + math.log(params.min_p), float("-inf"))
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

"""What the generator samples in a step, row by row, and how a sampled token reads to the caller.

`row_specs` turns the sequences due a token into `RowSpec`s (a choice-0 sequence whose prefill
ends also samples its other choices' first tokens from its row); `TokenPieces` gives the text and
bytes of token ids for OpenAI's logprobs objects.
"""

from __future__ import annotations

from typing import Callable

import torch

from mmserve.actors.messages import TokenLogprob
from mmserve.actors.sequence import Sequence
from mmserve.generation.step_sampling import RowSpec, Sampled


def row_specs(rows: list[tuple[int, Sequence]], banned: Callable[[Sequence], torch.Tensor],
              grammar_rows: dict[int, int]) -> tuple[list[RowSpec], list[tuple[int, int]]]:
    """The specs of `rows` ((logits row, sequence) each) and, per spec, (position in `rows`,
    choice). `grammar_rows` maps id(sequence) to its row of the step's grammar mask."""
    specs, owners = [], []
    for k, (r, seq) in enumerate(rows):
        params = seq.params
        prompt = seq.ids[:seq.prompt_len] if params.repetition_penalty != 1.0 else ()
        answer = seq.tokens if params.penalized else ()
        ban, grow = banned(seq), grammar_rows.get(id(seq))
        # a seeded choice draws from its own generator (reproducible); the others share the device's
        seeded = params.seed is not None
        specs.append(RowSpec(r, params, seq.rng if seeded else None, ban, prompt, answer, grow))
        owners.append((k, seq.choice))
        for c, (rng, _) in enumerate(seq.forks, 1):  # its other choices' first tokens: same row
            specs.append(RowSpec(r, params, rng if seeded else None, ban, prompt, answer, grow))
            owners.append((k, c))
    return specs, owners


class TokenPieces:
    """Token id → (text, bytes), cached; the bytes come from `token_bytes` (exact, also for a
    token holding part of a UTF-8 character, whose text then shows the bytes escaped)."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._bytes = token_bytes
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __call__(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        piece = self._cache.get(token_id)
        if piece is None:
            raw = self._bytes(token_id)
            piece = (raw.decode("utf-8", errors="backslashreplace"), tuple(raw))
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = piece
        return piece

    def logprob(self, sampled: Sampled) -> TokenLogprob:
        text, raw = self(sampled.token_id)
        top = tuple(_entry(self(t), lp) for t, lp in sampled.top)
        return TokenLogprob(text, sampled.logprob, raw, top)


def _entry(piece: tuple[str, tuple[int, ...]], logprob: float) -> TokenLogprob:
    return TokenLogprob(piece[0], logprob, piece[1])

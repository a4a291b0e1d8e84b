"""What the generator samples in a step, row by row, and how a sampled token reads to the caller.

`row_specs` turns the sequences due a token into `RowSpec`s (a choice-0 sequence whose prefill
ends also samples its other choices' first tokens from its row); `banned_ids` says which tokens a
sequence may not draw now; `assembler` makes a request's detokenizer; `TokenPieces` gives the
text and bytes of token ids for OpenAI's logprobs objects.
"""

from __future__ import annotations

from typing import Callable

import torch

from mmserve.actors.messages import TokenLogprob
from mmserve.actors.sequence import Sequence
from mmserve.engine.step_sampling import RowSpec, Sampled
from mmserve.generation.stops import TextAssembler
from mmserve.inputs.request import ChatRequest
from mmserve.models.adapter import Adapter


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


def banned_ids(seq: Sequence, image_token: torch.Tensor, eos: torch.Tensor, vocab_size: int,
               image_and_eos: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens `seq` may not draw now: the image placeholder always; EOS for the whole answer
    with `ignore_eos` (vLLM: EOS does not end it; banning it makes `max_tokens` end it), and EOS and
    `stop_token_ids` before `min_tokens` (as vLLM's min-tokens processor). A grammar says itself
    when the answer may end: a constrained sequence gets neither ban. `image_and_eos`: the two
    together, made once (a step asks for every sequence's bans)."""
    params = seq.params
    if seq.matcher is not None:
        return image_token
    early = len(seq.tokens) < params.min_tokens
    if not early and not params.ignore_eos:
        return image_token
    stops = [t for t in params.stop_token_ids if t < vocab_size] if early else []
    if not stops and image_and_eos is not None:
        return image_and_eos
    return torch.cat([image_token, eos, torch.tensor(stops, dtype=torch.long)] if stops else [image_token, eos])


def assembler(adapter: Adapter, request: ChatRequest) -> TextAssembler:
    """The detokenizer of one choice of `request`: its stop strings, special tokens skipped or not,
    and the template's lead removed only where the answer starts a new assistant message."""
    params = request.sampling
    decode = adapter.decode_text if params.skip_special_tokens else adapter.decode_special
    lead = adapter.answer_lead if request.template.opens_answer else ""
    return TextAssembler(decode, params.stop, lead, include_stop=params.include_stop_str_in_output)


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

    def logprob(self, sampled: Sampled, text: str | None = None) -> TokenLogprob:
        """The logprobs entry of a sampled token whose text in the answer is `text` (None: its
        own). Where the answer shows less of it than the token holds (the template's lead cut
        from the first token), the alternatives lose that same leading whitespace."""
        own, raw = self(sampled.token_id)
        if text is None or text == own:
            return TokenLogprob(own, sampled.logprob, raw, tuple(_entry(self(t), lp, t) for t, lp in sampled.top),
                                sampled.token_id)
        cut = own[: len(own) - len(text)] if own.endswith(text) and own[: len(own) - len(text)].isspace() else ""
        shown = (text, tuple(text.encode()))  # the chosen token among its alternatives reads as it does itself
        top = tuple(_entry(shown if t == sampled.token_id else _without(self(t), cut), lp, t)
                    for t, lp in sampled.top)
        return TokenLogprob(text, sampled.logprob, tuple(text.encode()), top, sampled.token_id)


def _entry(piece: tuple[str, tuple[int, ...]], logprob: float, token_id: int) -> TokenLogprob:
    return TokenLogprob(piece[0], logprob, piece[1], (), token_id)


def _without(piece: tuple[str, tuple[int, ...]], lead: str) -> tuple[str, tuple[int, ...]]:
    if not lead or not piece[0].startswith(lead):
        return piece
    text = piece[0][len(lead):]
    return text, tuple(text.encode())

"""What the generator samples in a step, row by row, and how a sampled token reads to the caller.

(The rows a step samples and the tokens a sequence may not draw are built with the step:
`engine.step_inputs`.) `assembler` makes a request's detokenizer; `TokenPieces` gives the text
and bytes of token ids for OpenAI's logprobs objects; `Lexicon` holds both tables of a model.
"""

from __future__ import annotations

from typing import Callable

from mmserve.actors.messages import TokenLogprob
from mmserve.generation.grammar import Grammars
from mmserve.engine.step_sampling import Sampled
from mmserve.generation.stops import TextAssembler
from mmserve.inputs.request import ChatRequest
from mmserve.models.adapter import Adapter


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


class Lexicon:
    """A model's compiled grammars (llguidance) and its token pieces (text and bytes, for logprobs):
    both costly to make, so made on first use — at admission of the first request that needs them
    (there a failure fails that request alone)."""

    def __init__(self, adapter: Adapter):
        self._adapter = adapter
        self._grammars: Grammars | None = None
        self.pieces: TokenPieces | None = None  # made by `want_pieces`

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            a = self._adapter
            self._grammars = Grammars(a.tokenizer, a.vocab_size, a.eos_token_ids)
        return self._grammars

    def want_pieces(self) -> TokenPieces:
        if self.pieces is None:
            self.pieces = TokenPieces(self.grammars.token_bytes)
        return self.pieces

"""A prompt whose text alone is longer than the server takes is refused before it is tokenized.

Tokenizing is the one step of intake whose cost grows with the body: 32 MiB of text (the largest
body accepted) kept a tokenizer busy for tens of seconds, stalling every request behind it, only
to be refused for its length afterwards. No tokenization is needed to know: every token of a
vocabulary covers at most `max_token_bytes` bytes of text, so a text of B bytes is at least
B / max_token_bytes tokens. A prompt whose text passes that bound for certain is refused at once
with the same error its token count would have given; any other is tokenized as before. The bound
never refuses a prompt that fits: it counts only the text the chat template prints verbatim (each
part with its outer whitespace stripped, which templates may trim), and the template and images
only add tokens.
"""

from __future__ import annotations

from mmserve.inputs.request import ChatRequest, TextPart

_CACHE_ATTR = "_mmserve_max_token_bytes"


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of text one token of `tokenizer` can stand for, special tokens
    included (an upper bound: a byte-level piece's own characters are counted in UTF-8, a
    SentencePiece `▁` as three bytes). Computed once per tokenizer."""
    cached = getattr(tokenizer, _CACHE_ATTR, None)
    if cached is None:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        cached = max((len(p.encode("utf-8")) for p in pieces if isinstance(p, str)), default=1)
        cached = max(cached, 4)  # a byte-fallback or unknown token may stand for one whole character
        setattr(tokenizer, _CACHE_ATTR, cached)
    return cached


def text_bytes(request: ChatRequest) -> int:
    """The bytes of text a chat request's messages (or a completion's text prompt) are sure to put
    in the prompt."""
    if request.prompt is not None:
        text = request.prompt.text
        return len(text.strip().encode("utf-8")) if text is not None else 0
    return sum(len(p.text.strip().encode("utf-8")) for m in request.messages for p in m.parts
               if isinstance(p, TextPart))


def fewest_tokens(request: ChatRequest, tokenizer) -> int:
    """A lower bound on the request's prompt tokens, from its text's size alone."""
    nbytes = text_bytes(request)
    return -(-nbytes // max_token_bytes(tokenizer)) if nbytes else 0

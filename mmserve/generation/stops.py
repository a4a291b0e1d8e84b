"""Incremental detokenization with stop strings, safe for streaming.

Text that might be the beginning of a stop string is held back until it is known not to be, so
a stream never shows text that the final answer cuts off.
"""

from __future__ import annotations

from typing import Callable, Sequence


class TextAssembler:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Detokenization is incremental (as in vLLM): each token decodes only a short window of recent
    ids, never the whole answer again, so a long generation costs the same per token at its end
    as at its start (this runs on the event loop, once per token per sequence)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), lead: str = ""):
        self._decode = decode
        self._lead = lead
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are final text
        self._read = 0    # ids up to here are already in `_raw`
        self._raw = ""    # everything decoded so far, lead included
        self._emitted = 0
        self.stopped = False
        self.text = ""

    def add(self, token_id: int) -> str:
        """Adds one token; returns the text that is now safe to show (maybe empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence (or nothing visible yet): wait for more
        self._raw += after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        text = self._raw
        if self._lead:
            if len(text) < len(self._lead) and self._lead.startswith(text):
                return ""  # maybe the lead, not known yet
            if text.startswith(self._lead):
                text = text[len(self._lead):]
        self.text = text
        for s in self._stop:
            idx = text.find(s, max(0, self._emitted - len(s) + 1))
            if idx != -1:
                self.stopped = True
                self.text = text[:idx]
                return self._take(idx)
        return self._take(len(text) - self._held_back(text))

    def finish(self) -> str:
        """Flushes what was held back when generation ends without a stop string."""
        if self.stopped:
            return ""
        return self._take(len(self.text))

    def _held_back(self, text: str) -> int:
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    longest = max(longest, k)
                    break
        return longest

    def _take(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self.text[self._emitted : upto] if upto <= len(self.text) else self.text[self._emitted :]
        self._emitted = upto
        return delta

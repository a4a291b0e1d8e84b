"""Incremental detokenization with stop strings, safe for streaming.

Text that might be the beginning of a stop string is held back until it is known not to be, so
a stream never shows text that the final answer cuts off.

Each token's own text — the part of the answer it contributed, as the answer shows it — is
settled once the text around it is final: the template's lead removed, a stop string (and what
follows it) cut off, a character split over several byte-level tokens given to the token that
completes it, a special token the decode skips given nothing. The texts of all of an answer's
tokens, joined, are the answer (what OpenAI's logprobs `token`s must join to).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


class TextAssembler:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Detokenization is incremental (as in vLLM): each token decodes only a short window of recent
    ids, never the whole answer again, so a long generation costs the same per token at its end
    as at its start (this runs on the event loop, once per token per sequence).

    `lead`: whitespace the chat template puts before an answer (removed once, at its start).
    `include_stop`: a stop string that ends the answer stays in it (vLLM's
    `include_stop_str_in_output`)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), lead: str = "",
                 include_stop: bool = False):
        self._decode = decode
        self._lead = lead
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are final text
        self._read = 0    # ids up to here are already in `_raw`
        self._raw = ""    # everything decoded so far, lead included
        self._emitted = 0
        self._ends: list[int] = []  # per token: the length of `_raw` once it was added
        self._payloads: list[Any] = []
        self._settled = 0  # tokens whose own text was handed out (`settled`)
        self._offset = 0   # characters of `_raw` before the answer (the lead, once known)
        self._done = False
        self.stopped = False
        self.text = ""

    def add(self, token_id: int, payload: Any = None) -> str:
        """Adds one token; returns the text that is now safe to show (maybe empty). `payload`
        comes back with the token's own text from `settled`."""
        self._ids.append(token_id)
        self._payloads.append(payload)
        self._ends.append(len(self._raw))
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence (or nothing visible yet): wait for more
        self._raw += after[len(before):]
        self._ends[-1] = len(self._raw)
        self._prefix, self._read = self._read, len(self._ids)
        text = self._raw
        if self._lead:
            if len(text) < len(self._lead) and self._lead.startswith(text):
                return ""  # maybe the lead, not known yet
            if text.startswith(self._lead):
                text = text[len(self._lead):]
                self._offset = len(self._lead)
        self.text = text
        for s in self._stop:
            idx = text.find(s, max(0, self._emitted - len(s) + 1))
            if idx != -1:
                self.stopped = True
                self.text = text[:idx + len(s)] if self._include_stop else text[:idx]
                return self._take(len(self.text))
        return self._take(len(text) - self._held_back(text))

    def finish(self) -> str:
        """Flushes what was held back when generation ends without a stop string."""
        self._done = True
        if self.stopped:
            return ""
        return self._take(len(self.text))

    def settled(self) -> list[tuple[str, Any]]:
        """(text, payload) of each token whose text in the answer is final since the last call, in
        order: every token once the answer has ended (a stop or `finish`), otherwise those whose
        text has been shown in full."""
        final = self.stopped or self._done
        out = []
        while self._settled < len(self._ids):
            i = self._settled
            end = min(max(0, self._ends[i] - self._offset), len(self.text))
            if not final and (end > self._emitted or (self._lead and self._offset == 0 and not self.text)):
                break  # its text may still be held back, or be the lead
            start = min(max(0, self._ends[i - 1] - self._offset), len(self.text)) if i else 0
            out.append((self.text[start:end], self._payloads[i]))
            self._payloads[i] = None
            self._settled += 1
        return out

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

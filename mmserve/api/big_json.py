"""`json.loads` for a body with a few very long strings (an image's data URL, a long text), in
calls short enough that the GIL changes hands between them.

json.loads is one C call that holds the GIL throughout: on a worker thread it still stops the
event loop for as long as it runs (20-100 ms for a 30 MB data URL). Here each string literal
longer than `big` is cut out of the text and replaced by a placeholder, the small rest is parsed
by json.loads, and each long string is decoded on its own by json.loads over pieces of about
`piece` characters, cut where no escape (nor a surrogate pair) is split — json.loads checks each
piece as it would the whole (escapes, control characters) — then put back in place. The answer is json.loads's, value for value; a text that is not valid JSON (or has too many
strings for the scan to pay) is handed to json.loads whole, for its own error and position.
"""

from __future__ import annotations

import json
import secrets

BIG = 64 * 1024  # a string literal longer than this is decoded on its own
PIECE = 1 << 20  # characters per piece of a long string's decoding
MAX_STRINGS = 20_000  # beyond this many string literals the scan costs more than it saves
_WS = " \t\r\n"


def loads(text: str, big: int = BIG, piece: int = PIECE):
    spans = _long_strings(text, big)
    if not spans:
        return json.loads(text)
    tag = f"mmserve-big-{secrets.token_hex(16)}-"  # fresh per parse: no client can send it
    parts, values, pos = [], {}, 0
    for n, (start, end) in enumerate(spans):
        parts.append(text[pos:start])
        parts.append(json.dumps(f"{tag}{n}"))
        values[f"{tag}{n}"] = (start, end)
        pos = end + 1
    parts.append(text[pos:])
    try:
        skeleton = json.loads("".join(parts))
        decoded = {key: _decode_string(text, start, end, piece) for key, (start, end) in values.items()}
    except ValueError:  # JSONDecodeError included: json.loads says what and where, on the whole text
        return json.loads(text)
    return _put_back(skeleton, decoded)


def _long_strings(text: str, big: int) -> list[tuple[int, int]]:
    """(opening quote, closing quote) of each string value longer than `big` (keys stay: they are
    short in any sane body), scanning quote to quote; [] when there are none, too many strings,
    or the text ends inside one (then json.loads reports it)."""
    spans, pos, count = [], 0, 0
    while (start := text.find('"', pos)) >= 0:
        count += 1
        if count > MAX_STRINGS:
            return []
        end = start + 1
        while True:
            end = text.find('"', end)
            if end < 0:
                return []
            slashes = end
            while text[slashes - 1] == "\\":
                slashes -= 1
            if (end - slashes) % 2 == 0:  # an even run of backslashes: this quote is not escaped
                break
            end += 1
        after = end + 1
        while after < len(text) and text[after] in _WS:
            after += 1
        if end - start - 1 > big and not text.startswith(":", after):
            spans.append((start, end))
        pos = end + 1
    return spans


def _decode_string(text: str, start: int, end: int, piece: int) -> str:
    """The value of the string literal text[start:end + 1] (quotes included), as json.loads gives it."""
    out, at = [], start + 1
    while at < end:
        cut = min(end, at + piece)
        # never inside an escape (\X, \uXXXX) nor between the two halves of a surrogate pair
        # (\uD83D\uDE00): no backslash in the 12 characters before the cut
        while cut < end and (slash := text.rfind("\\", max(at, cut - 12), cut)) >= 0:
            while slash > at and text[slash - 1] == "\\":
                slash -= 1
            cut = slash
        if cut <= at:  # escapes all the way back: this piece runs to the end
            cut = end
        out.append(json.loads(f'"{text[at:cut]}"'))
        at = cut
    return "".join(out)


def _put_back(value, decoded: dict[str, str]):
    """`value` with every placeholder string replaced by its decoded string (iteratively: the
    skeleton may nest as deep as json.loads allows)."""
    if isinstance(value, str):
        return decoded.get(value, value)
    stack = [value]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in list(items):
            if isinstance(item, str):
                if item in decoded:
                    node[key] = decoded[item]
            elif isinstance(item, (dict, list)):
                stack.append(item)
    return value

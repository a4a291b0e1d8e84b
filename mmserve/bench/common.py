"""Shared pieces of the benchmark: images and messages, timed requests (embedded and over HTTP),
and small statistics helpers."""

from __future__ import annotations

import base64
import io
import json
import math
import statistics
from dataclasses import dataclass
from time import perf_counter

from PIL import Image

from mmserve.models.demo import COLORS, SHAPES, render_image
from mmserve.api.openai_json import usage as usage_json

MODEL = "bench"  # the name the benchmark serves its model under
SYSTEM_A = "You are a helpful assistant. Look at the image carefully and answer the question."
SYSTEM_B = "You are a vision assistant. Keep answers short and accurate."
QUESTIONS = (
    "What color is the shape?",
    "What shape is it?",
    "What color is the background?",
    "Describe the image in a few words.",
    "Is the shape large or small?",
    "Where in the image is the shape?",
    "What else do you notice?",
    "Summarise the conversation so far.",
)


# -- images and messages ------------------------------------------------------------------

def image(i: int):
    """The i-th benchmark image; distinct indices give distinct pixels."""
    return render_image(COLORS[i % len(COLORS)], SHAPES[(i // len(COLORS)) % len(SHAPES)], seed=1000 + i)


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(text: str, img=None) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(img)}}] if img is not None else []
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def ask(i: int, question: str = QUESTIONS[0]) -> list[dict]:
    """A one-turn request about image i."""
    return [user(question, image(i))]


QWEN_IMAGE_SIZES = ((224, 224), (336, 224), (224, 336), (448, 252), (280, 420))
"""(width, height) the Qwen2-VL family's images cycle over: its token count follows an image's size
(bench-qwen: 64, 96, 96, 144 and 150 tokens), so a run exercises placeholder runs of several
lengths and grids that shift later M-RoPE positions differently."""


class Images:
    """The images of one run. Without `sizes`, image i is `image(i)` exactly (LLaVA runs: their
    figures are compared with earlier runs'); with `sizes`, it is resized to sizes[i % len(sizes)]
    (distinct indices still give distinct pixels)."""

    def __init__(self, sizes: tuple[tuple[int, int], ...] = ()):
        self.sizes = tuple(tuple(s) for s in sizes)

    def __call__(self, i: int):
        img = image(i)
        if not self.sizes:
            return img
        return img.resize(self.sizes[i % len(self.sizes)], Image.Resampling.BICUBIC)

    def ask(self, i: int, question: str = QUESTIONS[0]) -> list[dict]:
        """A one-turn request about image i."""
        return [user(question, self(i))]


# -- timed requests ----------------------------------------------------------------------

@dataclass(frozen=True)
class Timing:
    """One generation, timed from the request's start."""

    ttft: float  # to the first token
    total: float  # to the last token
    completion_tokens: int
    cached_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    deltas: tuple[str, ...] = ()

    @property
    def decode_s(self) -> float:
        return self.total - self.ttft

    @property
    def decode_tps(self) -> float:
        """Decode tokens/s: (completion_tokens - 1) / (time from first token to last token)."""
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 else math.nan


class _Clock:
    """Collects delta texts and the times of the first and last token of one stream."""

    def __init__(self):
        self.start = perf_counter()
        self.first = self.last = None
        self.deltas: list[str] = []

    def text(self, text: str, token: bool = False) -> None:
        """A delta arrived; `token`: it stands for a generated token even when its text is empty
        (the embedded API announces the first token at once, even if its text is held back)."""
        if text or token:
            self.first = self.first or perf_counter()
        if text:
            self.deltas.append(text)

    def finish(self, usage: dict, at: float | None = None) -> Timing:
        """The timing, the last token having come at `at` (default: now)."""
        last = at or perf_counter()
        first = self.first or last
        return Timing(first - self.start, last - self.start, usage["completion_tokens"],
                      usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"],
                      "".join(self.deltas), tuple(self.deltas))


def sampling(tokens: int, salt: str | None = None) -> dict:
    """Greedy decoding of exactly `tokens` tokens."""
    body = {"model": MODEL, "temperature": 0, "max_tokens": tokens, "min_tokens": tokens}
    return body if salt is None else dict(body, cache_salt=salt)


async def timed_chat(rt, messages: list[dict], tokens: int, salt: str | None = None, on_delta=None,
                     extra: dict | None = None) -> Timing:
    """One request through the embedded Runtime API, streamed; `on_delta()` is called at every delta;
    `extra` adds request parameters (e.g. a response_format)."""
    clock = _Clock()
    async with rt.chat(messages, **sampling(tokens, salt), **(extra or {})) as stream:
        async for delta in stream:
            clock.text(delta.text, token=delta.finish_reason is None)
            if on_delta is not None:
                on_delta()
            if delta.finish_reason is not None:
                return clock.finish(usage_json(delta.usage))
    raise RuntimeError("the stream ended without a finish reason")


async def timed_http(client, url: str, messages: list[dict], tokens: int, salt: str | None = None,
                     first: str = "chunk") -> Timing:
    """One streaming request over the OpenAI-compatible HTTP API (httpx on trio)."""
    body = dict(sampling(tokens, salt), messages=messages, stream=True, stream_options={"include_usage": True})
    return await timed_sse(client, url, body, first)


async def timed_sse(client, url: str, body: dict, first: str = "text") -> Timing:
    """One streamed chat completion to any OpenAI-compatible server, timed from the request.

    `first` says what marks the first token. "chunk": the first chunk, even with empty content —
    right for mmserve, which sends its first chunk once the first token exists, and comparable with
    HF `generate`'s token times (text can lag tokens: a partial UTF-8 character or a possible stop
    string is held back, for many tokens with a random-weight model). "text": the first non-empty
    content — the only mark that means the same for servers that send their role chunk at once."""
    if first not in ("chunk", "text"):
        raise ValueError(f"first must be 'chunk' or 'text', not {first!r}")
    clock, finished, usage = _Clock(), None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk["choices"]:
                clock.text(choice["delta"].get("content") or "", token=first == "chunk")
                if choice.get("finish_reason"):
                    finished = perf_counter()
            usage = chunk.get("usage") or usage
    if finished is None or usage is None:
        raise RuntimeError("the stream ended without a finish reason or usage")
    return clock.finish({"prompt_tokens_details": {"cached_tokens": 0}, **usage}, at=finished)


# -- statistics ------------------------------------------------------------------------------

def median(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def percentile(xs, q: float) -> float:
    """The q-th percentile (0..100), linear interpolation."""
    xs = sorted(xs)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def error_text(e: BaseException) -> str:
    """What failed, for a report row: each leaf of an exception group (not "Exceptions from Trio nursery")."""
    leaves = [e]
    while any(isinstance(x, BaseExceptionGroup) for x in leaves):
        leaves = [y for x in leaves for y in (x.exceptions if isinstance(x, BaseExceptionGroup) else [x])]
    return "; ".join(f"{type(x).__name__}: {x}" for x in leaves)


def row(scenario: str, metric: str, value, unit: str = "", baseline=None, ratio_=None, target: str | None = None,
        ok: bool | None = None) -> dict:
    """One line of the report's summary table."""
    return {"scenario": scenario, "metric": metric, "value": value, "unit": unit, "baseline": baseline,
            "ratio": ratio_, "target": target, "ok": ok}

"""What the scenarios share: a run's timings in brief, and a target's check that leaves a NaN
unknown rather than failed."""

from __future__ import annotations

from mmserve.bench.common import Timing


def brief(t: Timing) -> dict:
    return {"ttft_s": t.ttft, "total_s": t.total, "decode_tps": t.decode_tps, "completion_tokens": t.completion_tokens,
            "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens}


def at_most(value: float, target: float) -> bool | None:
    return None if value != value else bool(value <= target)  # NaN: unknown


def at_least(value: float, target: float) -> bool | None:
    return None if value != value else bool(value >= target)

"""Scenarios 3 to 5, the caches: multi-turn image chat (prefix cache on vs off, and vs prefilling
only the uncached suffix), the same image with a new question (encoder cache on vs off), and three
images with identical text (cache-on output must equal cache-off output)."""

from __future__ import annotations

from mmserve.bench.common import (MODEL, QUESTIONS, SYSTEM_A, SYSTEM_B, Timing, assistant, median, ratio, row,
                                  system, timed_chat, user)
from mmserve.bench.context import Bench
from mmserve.bench.scenarios.shared import at_most


# -- 3. multi-turn image chat ----------------------------------------------------------------

async def multiturn(b: Bench) -> dict:
    """A chat that resends its whole history (image included) every turn: TTFT with the prefix cache
    on vs off, and vs the bare compute of prefilling only the uncached suffix."""
    p = b.params
    per_turn: list[list[dict]] = [[] for _ in range(p.turns)]
    async with b.runtime(prefix=True) as on, b.runtime(prefix=False) as off:
        for c in range(p.conversations):
            history, img = [system(SYSTEM_A)], b.image(b.new_image())
            for k in range(p.turns):
                b.note(f"conversation {c + 1}/{p.conversations}, turn {k + 1}/{p.turns}")
                history.append(user(QUESTIONS[k % len(QUESTIONS)], img if k == 0 else None))
                hit = await timed_chat(on, history, p.turn_tokens, salt=f"mt{c}")
                miss = await timed_chat(off, history, p.turn_tokens, salt=f"mt{c}")
                ref_s, suffix = await b.suffix_prefill(history, hit.cached_tokens, p.ref_repeats)
                per_turn[k].append({"ttft_on_s": hit.ttft, "ttft_off_s": miss.ttft, "prefill_suffix_s": ref_s,
                                    "prompt_tokens": hit.prompt_tokens, "cached_tokens": hit.cached_tokens,
                                    "suffix_tokens": suffix})
                history.append(assistant(hit.text))
    turns = [_turn_summary(k + 1, runs) for k, runs in enumerate(per_turn)]
    return {"new_tokens": p.turn_tokens, "conversations": p.conversations, "turns": turns, "rows": _turn_rows(turns)}


def _turn_summary(turn: int, runs: list[dict]) -> dict:
    out = {"turn": turn, **{k: median(r[k] for r in runs) for k in runs[0]}}
    out["ratio_on_off"] = ratio(out["ttft_on_s"], out["ttft_off_s"])
    out["ratio_hit_vs_suffix_prefill"] = ratio(out["ttft_on_s"], out["prefill_suffix_s"])
    return out


def _turn_rows(turns: list[dict]) -> list[dict]:
    rows = []
    for t in turns[2:]:  # turns >= 3
        k = t["turn"]
        rows.append(row("3 multi-turn", f"turn {k}: TTFT prefix cache on / off", t["ttft_on_s"], "s", t["ttft_off_s"],
                        t["ratio_on_off"], "≤ 0.25", at_most(t["ratio_on_off"], 0.25)))
        rows.append(row("3 multi-turn", f"turn {k}: TTFT(hit) / prefill({t['suffix_tokens']:.0f}-token suffix)",
                        t["ttft_on_s"], "s", t["prefill_suffix_s"], t["ratio_hit_vs_suffix_prefill"], "≤ 1.05",
                        at_most(t["ratio_hit_vs_suffix_prefill"], 1.05)))
    return rows


# -- 4. same image, new question ---------------------------------------------------------------

def _encoder_runs(rt) -> int:
    return rt.stats()[MODEL]["encoder"]["encoder_runs"]


async def _timed_with_encoder(rt, messages, tokens: int, salt: str) -> tuple[Timing, int]:
    before = _encoder_runs(rt)
    t = await timed_chat(rt, messages, tokens, salt)
    return t, _encoder_runs(rt) - before


async def _same_image_once(rt, img, tokens: int, salt: str) -> dict:
    first = [system(SYSTEM_A), user(QUESTIONS[0], img)]
    cold, cold_runs = await _timed_with_encoder(rt, first, tokens, salt)
    same, same_runs = await _timed_with_encoder(rt, first + [assistant(cold.text), user(QUESTIONS[1])], tokens, salt)
    other, other_runs = await _timed_with_encoder(rt, [system(SYSTEM_B), user(QUESTIONS[1], img)], tokens, salt)
    return {"cold_s": cold.ttft, "same_conversation_s": same.ttft, "other_conversation_s": other.ttft,
            "same_conversation_cached_tokens": same.cached_tokens, "other_conversation_cached_tokens": other.cached_tokens,
            "encoder_runs": {"cold": cold_runs, "same_conversation": same_runs, "other_conversation": other_runs}}


async def same_image(b: Bench) -> dict:
    """The same image with a new question, in the same and in another conversation (other system
    prompt: no prefix reuse), with the encoder cache on and off, vs the cold first request."""
    p = b.params
    runs: dict[str, list[dict]] = {"encoder_cache_on": [], "encoder_cache_off": []}
    async with b.runtime() as enc_on, b.runtime(encoder=False) as enc_off:
        for r in range(p.image_repeats):
            img = b.image(b.new_image())
            for name, rt in (("encoder_cache_on", enc_on), ("encoder_cache_off", enc_off)):
                b.note(f"repeat {r + 1}/{p.image_repeats}, {name}")
                runs[name].append(await _same_image_once(rt, img, p.answer_tokens, f"si{r}"))
    summary = {name: _same_image_summary(rs) for name, rs in runs.items()}
    return {"new_tokens": p.answer_tokens, "summary": summary, "runs": runs, "rows": _same_image_rows(summary)}


def _same_image_summary(runs: list[dict]) -> dict:
    keys = ("cold_s", "same_conversation_s", "other_conversation_s")
    out = {k: median(r[k] for r in runs) for k in keys}
    out["ratio_same_conversation"] = ratio(out["same_conversation_s"], out["cold_s"])
    out["ratio_other_conversation"] = ratio(out["other_conversation_s"], out["cold_s"])
    out["encoder_runs"] = runs[-1]["encoder_runs"]
    return out


def _same_image_rows(summary: dict) -> list[dict]:
    rows = []
    for name, s in summary.items():
        target = "≤ 0.5" if name == "encoder_cache_on" else None
        label = name.replace("_", " ")
        for conv in ("same_conversation", "other_conversation"):
            r = s[f"ratio_{conv}"]
            rows.append(row("4 same image", f"{conv.replace('_', ' ')}, {label}: warm / cold TTFT", s[f"{conv}_s"],
                            "s", s["cold_s"], r, target, at_most(r, 0.5) if target else None))
    return rows


# -- 5. three images, identical text ------------------------------------------------------------

async def three_images(b: Bench) -> dict:
    """Three different images with identical text, then the same three again: cache-on output must
    equal cache-off output (random weights: no answer to check, so equality is the oracle)."""
    p = b.params
    requests = [[user(QUESTIONS[3], b.image(b.new_image()))] for _ in range(3)]
    async with b.runtime() as on, b.runtime(prefix=False, encoder=False) as off:
        first, reference = [], []
        for i, msgs in enumerate(requests):
            b.note(f"image {i + 1}/3")
            first.append(await timed_chat(on, msgs, p.turn_tokens))
            reference.append(await timed_chat(off, msgs, p.turn_tokens))
        b.note("repeat")
        again = [await timed_chat(on, msgs, p.turn_tokens) for msgs in requests]
    same = [a.deltas == r.deltas and a.completion_tokens == r.completion_tokens
            for runs in (first, again) for a, r in zip(runs, reference)]
    no_cross = all(t.cached_tokens == 0 for t in first)
    ttft = {"cache_on_first": median(t.ttft for t in first), "cache_on_repeat": median(t.ttft for t in again),
            "cache_off": median(t.ttft for t in reference)}
    rows = [row("5 three images", "cache-on output == cache-off output", all(same), "", target="true", ok=all(same)),
            row("5 three images", "no prefix hit across different images", no_cross, "",
                [t.cached_tokens for t in first], target="true", ok=no_cross),
            row("5 three images", "TTFT cache on (new image) / cache off", ttft["cache_on_first"], "s", ttft["cache_off"],
                ratio(ttft["cache_on_first"], ttft["cache_off"])),
            row("5 three images", "TTFT cache on (repeated image) / cache off", ttft["cache_on_repeat"], "s",
                ttft["cache_off"], ratio(ttft["cache_on_repeat"], ttft["cache_off"]))]
    return {"new_tokens": p.turn_tokens, "outputs_equal": same, "no_cross_image_hits": no_cross, "ttft_s": ttft,
            "cached_tokens": {"first": [t.cached_tokens for t in first], "repeat": [t.cached_tokens for t in again]},
            "texts": {"cache_on": [t.text for t in first], "cache_off": [t.text for t in reference]}, "rows": rows}

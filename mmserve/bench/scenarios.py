"""The benchmark scenarios. Each compares side by side, in the same run, and returns a dict of
measurements plus `rows` for the report's summary table. Times are seconds unless named `_ms`."""

from __future__ import annotations

from time import perf_counter

import trio

from mmserve.bench import peer as peer_lib
from mmserve.bench.common import (MODEL, QUESTIONS, SYSTEM_A, SYSTEM_B, Timing, ask, assistant, image, median,
                                  percentile, ratio, row, system, timed_chat, timed_http, user)
from mmserve.bench.context import Bench


def _brief(t: Timing) -> dict:
    return {"ttft_s": t.ttft, "total_s": t.total, "decode_tps": t.decode_tps, "completion_tokens": t.completion_tokens,
            "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens}


def _at_most(value: float, target: float) -> bool | None:
    return None if value != value else bool(value <= target)  # NaN: unknown


def _at_least(value: float, target: float) -> bool | None:
    return None if value != value else bool(value >= target)


# -- 1. single-stream decode -------------------------------------------------------------------

async def decode(b: Bench) -> dict:
    """Decode tokens/s of one stream: mmserve embedded and over HTTP vs HF `generate`, interleaved."""
    p = b.params
    msgs = ask(b.new_image())
    runs: dict[str, list[Timing]] = {"embedded": [], "http": [], "hf": []}
    async with b.runtime(prefix=False, encoder=False) as rt, b.server(prefix=False, encoder=False) as (client, url):
        for r in range(p.decode_repeats):
            b.note(f"repeat {r + 1}/{p.decode_repeats}")
            runs["embedded"].append(await timed_chat(rt, msgs, p.decode_tokens))
            runs["http"].append(await timed_http(client, url, msgs, p.decode_tokens))
            runs["hf"].append(await b.hf_generate(msgs, p.decode_tokens))
    tps = {k: median(t.decode_tps for t in v) for k, v in runs.items()}
    ttft = {k: median(t.ttft for t in v) for k, v in runs.items()}
    rows = [row("1 decode", f"decode tok/s, {k}", tps[k], "tok/s", tps["hf"], ratio(tps[k], tps["hf"]),
                "≥ 0.95", _at_least(ratio(tps[k], tps["hf"]), 0.95)) for k in ("embedded", "http")]
    rows += [row("1 decode", f"TTFT, {k}", ttft[k], "s", ttft["hf"], ratio(ttft[k], ttft["hf"]))
             for k in ("embedded", "http")]
    return {"new_tokens": p.decode_tokens, "decode_tps": tps, "ttft_s": ttft,
            "ratio_vs_hf": {k: ratio(tps[k], tps["hf"]) for k in ("embedded", "http")},
            "runs": {k: [_brief(t) for t in v] for k, v in runs.items()}, "rows": rows}


# -- 2. concurrency sweep ------------------------------------------------------------------------

async def _poll_health(client, url: str, interval: float, out: list) -> None:
    while True:
        t0 = perf_counter()
        r = await client.get(url + "/health")
        out.append((perf_counter() - t0, r.status_code))
        await trio.sleep(interval)


def _health_stats(polls: list[tuple[float, int]]) -> dict:
    lat = [p[0] * 1000 for p in polls]
    return {"polls": len(lat), "non_200": sum(p[1] != 200 for p in polls), "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "max_ms": max(lat, default=None)}


async def _idle_health(client, url: str, interval: float, seconds: float = 1.0) -> dict:
    """/health latency with nothing else running: what the busy numbers compare with."""
    polls: list[tuple[float, int]] = []
    with trio.move_on_after(seconds):
        await _poll_health(client, url, interval, polls)
    return _health_stats(polls)


async def _level(client, url: str, requests: list, tokens: int, poll: float | None, send=timed_http) -> dict:
    """All `requests` at once over HTTP, each by `send(client, url, messages, tokens)`; with `poll`,
    /health is polled every `poll` s meanwhile."""
    results: list[Timing | None] = [None] * len(requests)
    health: list[tuple[float, int]] = []

    async def one(i: int) -> None:
        results[i] = await send(client, url, requests[i], tokens)

    start = perf_counter()
    async with trio.open_nursery() as outer:
        if poll:
            outer.start_soon(_poll_health, client, url, poll, health)
        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(one, i)
        wall = perf_counter() - start
        outer.cancel_scope.cancel()
    ttfts = [t.ttft for t in results]
    out = {"concurrency": len(requests), "wall_s": wall, "agg_tps": sum(t.completion_tokens for t in results) / wall,
           "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}
    if poll:
        out["health"] = _health_stats(health)
    return out


def _hf_sequential(runs: list[Timing]) -> dict:
    """HF `generate` of the same requests one after another: aggregate tokens/s, and the TTFTs the
    requests would see if they all arrived at once and were served in order."""
    busy, ttfts = 0.0, []
    for t in runs:
        ttfts.append(busy + t.ttft)
        busy += t.total
    return {"agg_tps": sum(t.completion_tokens for t in runs) / busy,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


async def concurrency(b: Bench) -> dict:
    """N concurrent streaming HTTP requests (distinct images; caches off) vs sequential HF generate."""
    p, top = b.params, max(b.params.levels)
    requests = [ask(b.new_image()) for _ in range(top)]
    b.note(f"HF generate x{top}")
    hf_runs = [await b.hf_generate(m, p.sweep_tokens) for m in requests]
    levels = []
    async with b.server(prefix=False, encoder=False) as (client, url):
        idle = await _idle_health(client, url, p.health_interval_s)
        for n in p.levels:
            b.note(f"{n} concurrent")
            lv = await _level(client, url, requests[:n], p.sweep_tokens, p.health_interval_s if n == top else None)
            lv["hf"] = _hf_sequential(hf_runs[:n])
            lv["ratio_agg_tps"] = ratio(lv["agg_tps"], lv["hf"]["agg_tps"])
            levels.append(lv)
    return {"new_tokens": p.sweep_tokens, "levels": levels, "health_idle": idle, "health_during": top,
            "rows": _concurrency_rows(levels, idle)}


def _concurrency_rows(levels: list[dict], idle: dict) -> list[dict]:
    rows = []
    for lv in levels:
        n, hf = lv["concurrency"], lv["hf"]
        target = ("≥ 2.5", _at_least(lv["ratio_agg_tps"], 2.5)) if n == 8 else (None, None)
        rows.append(row("2 concurrency", f"aggregate tok/s @{n} vs sequential HF", lv["agg_tps"], "tok/s",
                        hf["agg_tps"], lv["ratio_agg_tps"], *target))
        rows.append(row("2 concurrency", f"TTFT p50 @{n}", lv["ttft_p50_s"], "s", hf["ttft_p50_s"],
                        ratio(lv["ttft_p50_s"], hf["ttft_p50_s"])))
        rows.append(row("2 concurrency", f"TTFT p99 @{n}", lv["ttft_p99_s"], "s", hf["ttft_p99_s"],
                        ratio(lv["ttft_p99_s"], hf["ttft_p99_s"])))
        if "health" in lv:
            h = lv["health"]
            rows.append(row("2 concurrency", f"/health p99 @{n} vs idle ({h['polls']} polls, max {h['max_ms']:.0f} ms, "
                            f"{h['non_200']} not 200)", h["p99_ms"], "ms", idle["p99_ms"], ratio(h["p99_ms"], idle["p99_ms"]),
                            "< 50 ms", bool(h["p99_ms"] < 50 and not h["non_200"])))
    return rows


# -- 3. multi-turn image chat ----------------------------------------------------------------

async def multiturn(b: Bench) -> dict:
    """A chat that resends its whole history (image included) every turn: TTFT with the prefix cache
    on vs off, and vs the bare compute of prefilling only the uncached suffix."""
    p = b.params
    per_turn: list[list[dict]] = [[] for _ in range(p.turns)]
    async with b.runtime(prefix=True) as on, b.runtime(prefix=False) as off:
        for c in range(p.conversations):
            history, img = [system(SYSTEM_A)], image(b.new_image())
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
                        t["ratio_on_off"], "≤ 0.25", _at_most(t["ratio_on_off"], 0.25)))
        rows.append(row("3 multi-turn", f"turn {k}: TTFT(hit) / prefill({t['suffix_tokens']:.0f}-token suffix)",
                        t["ttft_on_s"], "s", t["prefill_suffix_s"], t["ratio_hit_vs_suffix_prefill"], "≤ 1.15",
                        _at_most(t["ratio_hit_vs_suffix_prefill"], 1.15)))
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
            img = image(b.new_image())
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
                            "s", s["cold_s"], r, target, _at_most(r, 0.5) if target else None))
    return rows


# -- 5. three images, identical text ------------------------------------------------------------

async def three_images(b: Bench) -> dict:
    """Three different images with identical text, then the same three again: cache-on output must
    equal cache-off output (random weights: no answer to check, so equality is the oracle)."""
    p = b.params
    requests = [[user(QUESTIONS[3], image(b.new_image()))] for _ in range(3)]
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


# -- 6. peer: transformers serve ------------------------------------------------------------

PEER = "6 peer"
PEER_STEP_TIMEOUT_S = 300  # one decode request or one concurrency level of the peer


def _at_least(value: float, target: float) -> bool | None:
    return None if value != value else bool(value >= target)  # NaN: unknown


def _peer_levels(p) -> tuple[int, ...]:
    """The concurrency levels of scenario 6: scenario 2's; in the quick run only the lowest and the
    highest (1 and 8), to stay within its time budget (every level runs on both servers)."""
    return (p.levels[0], p.levels[-1]) if p.name == "quick" else p.levels


async def _timed_text(client, url: str, messages: list[dict], tokens: int) -> Timing:
    """mmserve timed like the peer: the first token is the first non-empty text (see timed_sse)."""
    return await timed_http(client, url, messages, tokens, first="text")


async def peer(b: Bench) -> dict:
    """Scenarios 1 and 2's workloads against HF `transformers serve` on the same model, side by side
    with an mmserve HTTP server (caches off) started for this scenario: the same requests, mmserve
    then the peer at every step. Ratios are mmserve / transformers serve. Not installed: skipped.
    The peer failing to start or to answer: an error row with the end of its log, after whatever was
    measured before; the peer process is always stopped."""
    reason = peer_lib.unavailable()
    if reason:
        return {"status": "skipped", "reason": reason, "rows": [row(PEER, "transformers serve", f"skipped: {reason}")]}
    p = b.params
    model = str(b.model_dir.resolve())
    peer_runs: list[tuple[int, Timing]] = []  # (tokens asked for, what came back), for the fixed-length check

    async def send(client, url: str, messages: list[dict], tokens: int) -> Timing:
        t = await peer_lib.timed_peer(client, url, messages, tokens, model=model)
        peer_runs.append((tokens, t))
        return t

    async def on_peer(coro):
        """A step of the peer, bounded in time; any failure is the peer's (a PeerError with its log)."""
        try:
            with trio.fail_after(PEER_STEP_TIMEOUT_S):
                return await coro
        except Exception as e:  # noqa: BLE001  (whatever it is, it is reported, not raised)
            raise peer_lib.PeerError(_leaf_error(e), peer_lib.log_tail(b.workdir / peer_lib.LOG)) from e

    decode_msgs = ask(b.new_image())
    levels_n = _peer_levels(p)
    requests = [ask(b.new_image()) for _ in range(max(levels_n))]
    decode_runs: dict[str, list[Timing]] = {"mmserve": [], "peer": []}
    levels: list[dict] = []
    out: dict = {"status": "ok", "peer": peer_lib.describe(b.model_dir),
                 "new_tokens": {"decode": p.decode_tokens, "sweep": p.sweep_tokens}}
    async with b.server(prefix=False, encoder=False) as (client, url):
        b.note("starting transformers serve")
        try:  # inside the server's block: a PeerError is caught before a nursery can wrap it in a group
            async with peer_lib.serve(b.model_dir, p.torch_threads, b.workdir) as peer_url:
                await on_peer(send(client, peer_url, ask(b.new_image(), QUESTIONS[1]), 2))  # warm-up
                for r in range(p.decode_repeats):
                    b.note(f"decode, repeat {r + 1}/{p.decode_repeats}")
                    decode_runs["mmserve"].append(await _timed_text(client, url, decode_msgs, p.decode_tokens))
                    decode_runs["peer"].append(await on_peer(send(client, peer_url, decode_msgs, p.decode_tokens)))
                for n in levels_n:
                    b.note(f"{n} concurrent, mmserve / transformers serve")
                    mm = await _level(client, url, requests[:n], p.sweep_tokens, None, send=_timed_text)
                    other = await on_peer(_level(client, peer_url, requests[:n], p.sweep_tokens, None, send=send))
                    levels.append({"concurrency": n, "mmserve": mm, "peer": other,
                                   "ratio_agg_tps": ratio(mm["agg_tps"], other["agg_tps"])})
        except peer_lib.PeerError as e:
            out.update(status="error", error=f"transformers serve: {e}", peer_log_tail=e.log_tail)
    out.update(_peer_decode(decode_runs), levels=levels, peer_tokens=_peer_tokens(peer_runs))
    out["rows"] = _peer_rows(out)
    return out


def _leaf_error(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


def _peer_decode(runs: dict[str, list[Timing]]) -> dict:
    if not runs["peer"]:
        return {}
    tps = {k: median(t.decode_tps for t in v) for k, v in runs.items()}
    ttft = {k: median(t.ttft for t in v) for k, v in runs.items()}
    first = {k: v[0] for k, v in runs.items()}
    return {"decode_tps": tps, "ttft_s": ttft, "runs": {k: [_brief(t) for t in v] for k, v in runs.items()},
            "prompt_tokens": {k: t.prompt_tokens for k, t in first.items()}, "texts": {k: t.text for k, t in first.items()},
            # mmserve holds back the whitespace that leads an answer; transformers serve streams it
            "same_text": first["mmserve"].text.strip() == first["peer"].text.strip()}


def _peer_tokens(runs: list[tuple[int, Timing]]) -> dict:
    short = [(asked, t.completion_tokens) for asked, t in runs if t.completion_tokens != asked]
    return {"requests": len(runs), "fixed_length": not short, "not_as_asked": short[:10]}


def _peer_rows(out: dict) -> list[dict]:
    rows = []
    if "decode_tps" in out:
        tps, ttft, prompt = out["decode_tps"], out["ttft_s"], out["prompt_tokens"]
        rows += [row(PEER, "decode tok/s, HTTP: mmserve / transformers serve", tps["mmserve"], "tok/s", tps["peer"],
                     ratio(tps["mmserve"], tps["peer"])),
                 row(PEER, "TTFT, HTTP: mmserve / transformers serve", ttft["mmserve"], "s", ttft["peer"],
                     ratio(ttft["mmserve"], ttft["peer"])),
                 row(PEER, "same prompt tokens (mmserve, transformers serve)", prompt["mmserve"] == prompt["peer"], "",
                     f"{prompt['mmserve']}, {prompt['peer']}"),
                 row(PEER, "same greedy text on the decode prompt (leading whitespace aside)", out["same_text"], "")]
    for lv in out["levels"]:
        n, mm, other = lv["concurrency"], lv["mmserve"], lv["peer"]
        target = "≥ 1" if n == 8 else None
        rows.append(row(PEER, f"aggregate tok/s @{n}: mmserve / transformers serve", mm["agg_tps"], "tok/s",
                        other["agg_tps"], lv["ratio_agg_tps"], target,
                        _at_least(lv["ratio_agg_tps"], 1) if target else None))
        for q in ("p50", "p99"):
            key = f"ttft_{q}_s"
            rows.append(row(PEER, f"TTFT {q} @{n}: mmserve / transformers serve", mm[key], "s", other[key],
                            ratio(mm[key], other[key])))
    tokens = out["peer_tokens"]
    if tokens["requests"]:
        rows.append(row(PEER, "transformers serve generated the tokens asked for (tok/s uses actual counts)",
                        tokens["fixed_length"], "", f"{tokens['requests']} requests", target="true",
                        ok=tokens["fixed_length"]))
    if out["status"] == "error":
        tail = " ⏎ ".join(out.get("peer_log_tail", "").splitlines()[-6:])[-600:]
        rows.append(row(PEER, "transformers serve failed", out["error"], "", f"log: {tail}" if tail else None,
                        ok=False))
    return rows


SCENARIOS = {
    "decode": decode,
    "concurrency": concurrency,
    "multiturn": multiturn,
    "same_image": same_image,
    "three_images": three_images,
    "peer": peer,
}

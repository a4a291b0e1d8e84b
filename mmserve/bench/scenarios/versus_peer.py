"""Scenario 6, the peer: scenarios 1 and 2's workloads against HF `transformers serve` (the `bench`
extra) on the same model, side by side with an mmserve HTTP server."""

from __future__ import annotations

import trio

from mmserve.bench import peer as peer_lib
from mmserve.bench.common import QUESTIONS, Timing, median, ratio, row, timed_http
from mmserve.bench.context import Bench
from mmserve.bench.scenarios.shared import at_least, brief
from mmserve.bench.scenarios.throughput import run_level
from mmserve.models.random_weights import is_random_weights


# -- 6. peer: transformers serve ------------------------------------------------------------

PEER = "6 peer"
PEER_STEP_TIMEOUT_S = 300  # one decode request or one concurrency level of the peer


def _peer_levels(p) -> tuple[int, ...]:
    """The concurrency levels of scenario 6: `peer_levels`, else scenario 2's. The quick run has only
    1 and 8, to stay within its time budget (every level runs on both servers, and the peer serves
    one request at a time)."""
    return p.peer_levels or p.levels


async def _timed_text(client, url: str, messages: list[dict], tokens: int) -> Timing:
    """mmserve timed like the peer: the first token is the first non-empty text (see timed_sse)."""
    return await timed_http(client, url, messages, tokens, first="text")


def _no_weights(b: Bench) -> str | None:
    if is_random_weights(b.model_dir):
        return "a random-weights checkpoint (no weights file) loads in mmserve only, not in `transformers serve`"
    return None


async def peer(b: Bench) -> dict:
    """Scenarios 1 and 2's workloads against HF `transformers serve` on the same model, side by side
    with an mmserve HTTP server (caches off) started for this scenario: the same requests, mmserve
    then the peer at every step. Ratios are mmserve / transformers serve. Not installed, or a
    family it cannot load here (Qwen2-VL): skipped.
    The peer failing to start or to answer: an error row with the end of its log, after whatever was
    measured before; the peer process is always stopped."""
    reason = peer_lib.unsupported(b.family) or _no_weights(b) or peer_lib.unavailable()
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

    decode_msgs = b.ask(b.new_image())
    levels_n = _peer_levels(p)
    requests = [b.ask(b.new_image()) for _ in range(max(levels_n))]
    decode_runs: dict[str, list[Timing]] = {"mmserve": [], "peer": []}
    levels: list[dict] = []
    out: dict = {"status": "ok", "peer": peer_lib.describe(b.model_dir),
                 "new_tokens": {"decode": p.decode_tokens, "sweep": p.sweep_tokens}}
    async with b.server(prefix=False, encoder=False) as (client, url):
        b.note("starting transformers serve")
        try:  # inside the server's block: a PeerError is caught before a nursery can wrap it in a group
            async with peer_lib.serve(b.model_dir, p.torch_threads, b.workdir) as peer_url:
                await on_peer(send(client, peer_url, b.ask(b.new_image(), QUESTIONS[1]), 2))  # warm-up
                for r in range(p.decode_repeats):
                    b.note(f"decode, repeat {r + 1}/{p.decode_repeats}")
                    decode_runs["mmserve"].append(await _timed_text(client, url, decode_msgs, p.decode_tokens))
                    decode_runs["peer"].append(await on_peer(send(client, peer_url, decode_msgs, p.decode_tokens)))
                for n in levels_n:
                    b.note(f"{n} concurrent, mmserve / transformers serve")
                    mm = await run_level(client, url, requests[:n], p.sweep_tokens, None, send=_timed_text)
                    other = await on_peer(run_level(client, peer_url, requests[:n], p.sweep_tokens, None, send=send))
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
    return {"decode_tps": tps, "ttft_s": ttft, "runs": {k: [brief(t) for t in v] for k, v in runs.items()},
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
                        at_least(lv["ratio_agg_tps"], 1) if target else None))
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

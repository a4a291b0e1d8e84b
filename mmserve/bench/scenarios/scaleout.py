"""Scenario 11, scaleout: two replicas (no shared tier) behind the real SMG gateway (`smg launch
--policy cache_aware`, the `scaleout` extra's Rust gateway) against the same two behind SMG's
round-robin, the same multi-turn image chats through each: TTFT of turns >= 2 and the prefix-cache
hit rate side by side. Cache-aware routing keeps a conversation on the replica that holds its KV
(SMG matches on message text: each turn extends the last one's); round-robin moves every turn to
the other replica, which holds only the turn before last. Target: TTFT p50 of turns >= 2 behind
SMG at most 0.7x round-robin's (issue 43).

Everything listens on 127.0.0.1; each gateway is stopped by SIGTERM, then SIGKILL (it keeps its
listener for a 5 s settle window after SIGTERM, and ignores it while a worker is unreachable)."""

from __future__ import annotations

import socket
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from mmserve.bench.common import QUESTIONS, SYSTEM_A, assistant, median, ratio, row, system, timed_http, user
from mmserve.bench.context import Bench
from mmserve.bench.processes import die_with_parent, stop
from mmserve.bench.scenarios.shared import at_most
from mmserve.bench.servers import http_server

SMG = Path(sys.executable).parent / "smg"
TARGET_TTFT_RATIO = 0.7  # cache-aware / round-robin, TTFT p50 of turns >= 2
THINK_S = 0.05
START_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def _replica(b: Bench, name: str):
    b.note(f"starting replica {name} ({b.params.http})")
    async with http_server(b.config(), b.params.http, b.workdir / name) as url:
        async with httpx.AsyncClient(timeout=None) as client:
            await timed_http(client, url, b.ask(b.new_image(), QUESTIONS[1]), 2)  # warm: first-step costs
        yield url


@asynccontextmanager
async def _gateway(b: Bench, workers: list[str], policy: str):
    """`smg launch` on loopback ports in front of `workers`, until it lists both workers' loads."""
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    b.note(f"starting SMG ({policy})")
    proc = subprocess.Popen(
        [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
         "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
         "--load-monitor-interval", "1", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            with trio.fail_after(START_TIMEOUT_S):
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"smg exited with status {proc.returncode}")
                    try:
                        loads = (await client.get(url + "/get_loads")).json().get("loads", [])
                        if set(workers) <= {x.get("worker") for x in loads}:
                            break
                    except (httpx.HTTPError, ValueError):
                        pass
                    await trio.sleep(0.2)
        yield url
    finally:
        await stop(proc, timeout_s=1.0)


async def _conversations(b: Bench, url: str, tag: str) -> list[list[dict]]:
    """`conversations` chats of `turns` turns through the gateway at `url`, each with its own image
    and cache_salt (no conversation hits another's blocks, or the other policy's): per turn, a list
    of {ttft_s, prompt_tokens, cached_tokens}."""
    p = b.params
    per_turn: list[list[dict]] = [[] for _ in range(p.turns)]
    async with httpx.AsyncClient(timeout=None) as client:
        for c in range(p.conversations):
            history, img = [system(f"{SYSTEM_A} (conversation {tag}-{c})")], b.image(b.new_image())
            for k in range(p.turns):
                b.note(f"{tag}: conversation {c + 1}/{p.conversations}, turn {k + 1}/{p.turns}")
                history.append(user(QUESTIONS[k % len(QUESTIONS)], img if k == 0 else None))
                t = await timed_http(client, url, history, p.turn_tokens, salt=f"{tag}{c}")
                per_turn[k].append({"ttft_s": t.ttft, "prompt_tokens": t.prompt_tokens,
                                    "cached_tokens": t.cached_tokens})
                history.append(assistant(t.text))
                await trio.sleep(THINK_S)
    return per_turn


def _later(per_turn: list[list[dict]]) -> list[dict]:
    return [r for turn in per_turn[1:] for r in turn]


def _hit_rate(runs: list[dict]) -> float:
    prompt = sum(r["prompt_tokens"] for r in runs)
    return sum(r["cached_tokens"] for r in runs) / prompt if prompt else float("nan")


async def scaleout(b: Bench) -> dict:
    if not SMG.exists():
        reason = f"no smg binary at {SMG} (pip install 'mmserve[scaleout]'): the scaleout scenario is skipped"
        b.note(reason)
        return {"status": "skipped", "reason": reason,
                "rows": [row("11 scaleout", "skipped", reason, "", target=None, ok=None)]}
    p = b.params
    async with _replica(b, "replica-a") as ra, _replica(b, "replica-b") as rb:
        async with _gateway(b, [ra, rb], "cache_aware") as gw:
            aware = await _conversations(b, gw, "aware")
        async with _gateway(b, [ra, rb], "round_robin") as gw:
            rr = await _conversations(b, gw, "rr")
    turns = [{"turn": k + 1, "ttft_cache_aware_s": median(r["ttft_s"] for r in aware[k]),
              "ttft_round_robin_s": median(r["ttft_s"] for r in rr[k]),
              "cached_tokens_cache_aware": median(r["cached_tokens"] for r in aware[k]),
              "cached_tokens_round_robin": median(r["cached_tokens"] for r in rr[k]),
              "prompt_tokens": median(r["prompt_tokens"] for r in aware[k])} for k in range(p.turns)]
    ttft_aware = median(r["ttft_s"] for r in _later(aware))
    ttft_rr = median(r["ttft_s"] for r in _later(rr))
    hit_aware, hit_rr = _hit_rate(_later(aware)), _hit_rate(_later(rr))
    r = ratio(ttft_aware, ttft_rr)
    rows = [row("11 scaleout", "turns >= 2 through SMG: TTFT p50 cache_aware / round_robin", ttft_aware, "s",
                ttft_rr, r, f"≤ {TARGET_TTFT_RATIO}", at_most(r, TARGET_TTFT_RATIO)),
            row("11 scaleout", "hit rate (turns >= 2): cache_aware vs round_robin", hit_aware, "", hit_rr,
                ratio(hit_aware, hit_rr))]
    return {"new_tokens": p.turn_tokens, "conversations": p.conversations, "turns": turns,
            "ttft_turns_ge2": {"cache_aware_s": ttft_aware, "round_robin_s": ttft_rr, "ratio": r},
            "hit_rate": {"cache_aware": hit_aware, "round_robin": hit_rr}, "rows": rows}

"""Scenario 7, replicas: two servers on one Redis (the shared cache tier), multi-turn image chats
whose turns alternate between them — as behind a load balancer that does not pin conversations.
TTFT of turns >= 3 with the tier vs the same two servers without it (each turn then lands on a
replica that has not seen the previous one), and the tier's hit rate (cached / prompt tokens of
turns >= 2) vs one replica serving whole conversations from its local cache."""

from __future__ import annotations

import secrets
import shutil
from contextlib import asynccontextmanager

import httpx
import trio

from mmserve.bench.common import QUESTIONS, SYSTEM_A, assistant, median, ratio, row, system, timed_http, user
from mmserve.bench.context import Bench
from mmserve.bench.scenarios.shared import at_most
from mmserve.bench.servers import http_server

THINK_S = 0.05  # between turns (a user reads the answer): the last turn's blocks reach Redis meanwhile
# turns >= 3 carry no target (retired: ≤ 0.35): two alternating replicas each miss only the last
# turn's tokens, whatever the tier does, so the ratio measures the turn's length, not the tier
TARGET_HIT_RATE_GAP = 0.05


@asynccontextmanager
async def _server(b: Bench, config, name: str):
    b.note(f"starting server {name} ({b.params.http})")
    async with http_server(config, b.params.http, b.workdir / name) as url:
        async with httpx.AsyncClient(timeout=None) as client:
            await timed_http(client, url, b.ask(b.new_image(), QUESTIONS[1]), 2)
            yield client, url


async def _conversations(b: Bench, servers: list, tag: str) -> list[list[dict]]:
    """`conversations` chats of `turns` turns, turn k on servers[k % len(servers)]: per turn, a
    list of {ttft_s, prompt_tokens, cached_tokens}."""
    p = b.params
    per_turn: list[list[dict]] = [[] for _ in range(p.turns)]
    for c in range(p.conversations):
        history, img = [system(SYSTEM_A)], b.image(b.new_image())
        for k in range(p.turns):
            b.note(f"{tag}: conversation {c + 1}/{p.conversations}, turn {k + 1}/{p.turns}")
            client, url = servers[k % len(servers)]
            history.append(user(QUESTIONS[k % len(QUESTIONS)], img if k == 0 else None))
            t = await timed_http(client, url, history, p.turn_tokens, salt=f"{tag}{c}")
            per_turn[k].append({"ttft_s": t.ttft, "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens})
            history.append(assistant(t.text))
            await trio.sleep(THINK_S)
    return per_turn


def _hit_rate(per_turn: list[list[dict]]) -> float:
    runs = [r for turn in per_turn[1:] for r in turn]
    prompt = sum(r["prompt_tokens"] for r in runs)
    return sum(r["cached_tokens"] for r in runs) / prompt if prompt else float("nan")


async def replicas(b: Bench) -> dict:
    if shutil.which("redis-server") is None:
        reason = "redis-server is not installed (apt-get install -y redis-server): the replicas scenario is skipped"
        b.note(reason)
        return {"status": "skipped", "reason": reason,
                "rows": [row("7 replicas", "skipped", reason, "", target=None, ok=None)]}
    p = b.params
    # one owner, started once, stopped on every way out (the readiness poll runs in a worker thread)
    from mmserve.bench.redis_server import RedisServer  # redis-py only where this scenario runs (not on the GPU machine)

    async with RedisServer(b.workdir / "redis") as redis:
        secret = secrets.token_hex(32)  # the replicas' shared secret: values in Redis are tagged with it
        tier, plain = b.config().replace(shared_cache={"url": redis.url, "secret": secret}), b.config()
        async with _server(b, tier, "tier-a") as ta, _server(b, tier, "tier-b") as tb, \
                _server(b, plain, "plain-a") as pa, _server(b, plain, "plain-b") as pb:
            with_tier = await _conversations(b, [ta, tb], "tier")
            without = await _conversations(b, [pa, pb], "plain")
            single = await _conversations(b, [pa], "single")
        keys = redis.client().dbsize()
    turns = []
    for k in range(p.turns):
        on, off = median(r["ttft_s"] for r in with_tier[k]), median(r["ttft_s"] for r in without[k])
        turns.append({"turn": k + 1, "ttft_tier_s": on, "ttft_no_tier_s": off, "ratio": ratio(on, off),
                      "cached_tokens_tier": median(r["cached_tokens"] for r in with_tier[k]),
                      "cached_tokens_no_tier": median(r["cached_tokens"] for r in without[k]),
                      "prompt_tokens": median(r["prompt_tokens"] for r in with_tier[k])})
    later = [t for t in turns if t["turn"] >= 3]
    ttft_on = median(r["ttft_s"] for k in range(2, p.turns) for r in with_tier[k])
    ttft_off = median(r["ttft_s"] for k in range(2, p.turns) for r in without[k])
    hit_tier, hit_single, hit_plain = _hit_rate(with_tier), _hit_rate(single), _hit_rate(without)
    gap = abs(hit_tier - hit_single)
    rows = [row("7 replicas", "turns >= 3 alternating replicas: TTFT with shared tier / without", ttft_on, "s",
                ttft_off, ratio(ttft_on, ttft_off)),
            row("7 replicas", "turn 2 (the other replica's first sight of it): TTFT with tier / without",
                turns[1]["ttft_tier_s"] if len(turns) > 1 else float("nan"), "s",
                turns[1]["ttft_no_tier_s"] if len(turns) > 1 else float("nan"),
                turns[1]["ratio"] if len(turns) > 1 else float("nan")),
            row("7 replicas", "hit rate (turns >= 2): two replicas + tier vs one replica", hit_tier, "",
                hit_single, ratio(hit_tier, hit_single), f"|diff| ≤ {TARGET_HIT_RATE_GAP}",
                at_most(gap, TARGET_HIT_RATE_GAP))]
    return {"new_tokens": p.turn_tokens, "conversations": p.conversations, "turns": turns,
            "ttft_turns_ge3": {"tier_s": ttft_on, "no_tier_s": ttft_off, "ratio": ratio(ttft_on, ttft_off),
                               "per_turn": later},
            "hit_rate": {"two_replicas_tier": hit_tier, "one_replica": hit_single, "two_replicas_no_tier": hit_plain},
            "redis_keys": keys, "rows": rows}

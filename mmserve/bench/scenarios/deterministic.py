"""Scenario 13, the deterministic mode's cost (opt-in: `--scenarios deterministic`; issue 40):
the same requests through two HTTP servers side by side, `[runtime] deterministic` off and on,
taken in turns over `det_rounds` rounds (off then on, then on then off: a load that comes and goes
falls on both alike) — single-stream decode tokens/s, and the wall time of `det_levels` concurrent
image requests. Each row is the mode's time over the default's: the median of the rounds' ratios,
each round's pair measured minutes apart at most.

Why not two `mmserve bench --deterministic` runs: run after run on this 2-core VM, the same
code's decode ratio ranged from 1.18 to 1.63 over three pairs (a 16-token decode, the machine's
load moving between the runs); a ratio of measurements taken seconds apart is what the target can
be checked on. It still moves on a shared machine (five runs of one commit: medians of 1.39 to
1.67): read several. Both servers stay up; the one not measured is idle."""

from __future__ import annotations

from mmserve.bench.common import median, ratio, row, sampling, timed_http
from mmserve.bench.context import Bench
from mmserve.bench.scenarios.shared import at_most
from mmserve.bench.scenarios.throughput import run_level

TARGET = 1.35  # the mode's time over the default's (issue 40; SGLang's deterministic mode: +34% on average)
MODES = ("default", "deterministic")


async def deterministic(b: Bench) -> dict:
    p = b.params
    single = b.ask(b.new_image())
    requests = [b.ask(b.new_image()) for _ in range(max(p.det_levels))]
    runs: dict[str, dict[str, list[float]]] = {m: {"decode_tps": [], **{f"wall_s@{n}": [] for n in p.det_levels}}
                                               for m in MODES}
    async with b.server(prefix=False, encoder=False, runtime={"deterministic": False}) as off, \
            b.server(prefix=False, encoder=False, runtime={"deterministic": True}) as on:
        servers = dict(zip(MODES, (off, on)))
        fingerprints = {m: await _fingerprint(*servers[m], single) for m in MODES}
        if fingerprints["default"] is not None or fingerprints["deterministic"] is None:
            raise RuntimeError(f"the servers do not run the modes compared: system_fingerprint {fingerprints}")
        for r in range(p.det_rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                client, url = servers[mode]
                b.note(f"round {r + 1}/{p.det_rounds}, {mode}")
                runs[mode]["decode_tps"].append((await timed_http(client, url, single, p.sweep_tokens)).decode_tps)
                for n in p.det_levels:
                    level = await run_level(client, url, requests[:n], p.sweep_tokens, None)
                    runs[mode][f"wall_s@{n}"].append(level["wall_s"])
    # the mode's time over the default's, round by round (decode: the inverse ratio of tokens/s)
    per_round = {"decode": [ratio(a, b_) for a, b_ in zip(runs["default"]["decode_tps"],
                                                         runs["deterministic"]["decode_tps"])]}
    for n in p.det_levels:
        per_round[f"@{n}"] = [ratio(b_, a) for a, b_ in zip(runs["default"][f"wall_s@{n}"],
                                                           runs["deterministic"][f"wall_s@{n}"])]
    cost = {k: median(v) for k, v in per_round.items()}
    rows = [_row("single-stream decode (HTTP)", cost["decode"], per_round["decode"])]
    rows += [_row(f"{n} concurrent image requests (HTTP)", cost[f"@{n}"], per_round[f"@{n}"]) for n in p.det_levels]
    return {"fingerprints": fingerprints, "rounds": p.det_rounds, "new_tokens": p.sweep_tokens,
            "levels": list(p.det_levels), "runs": runs, "per_round": per_round, "cost": cost, "rows": rows}


async def _fingerprint(client, url: str, messages: list[dict]) -> str | None:
    """The `system_fingerprint` a server's answer carries: the deterministic mode's, or None."""
    r = await client.post(url + "/v1/chat/completions", json=dict(sampling(2, None), messages=messages), timeout=None)
    r.raise_for_status()
    return r.json().get("system_fingerprint")


def _row(what: str, cost: float, rounds: list[float]) -> dict:
    spread = f"{min(rounds):.2f}–{max(rounds):.2f}" if len(rounds) > 1 else f"{rounds[0]:.2f}"
    return row("13 deterministic", f"deterministic / default time, {what}; median of {len(rounds)} rounds ({spread})",
               cost, "x", None, cost, f"≤ {TARGET}", at_most(cost, TARGET))

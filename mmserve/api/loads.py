"""`GET /v1/loads`: this replica's load in SGLang's load format, the one SMG (Shepherd Model Gateway)
polls from a generic HTTP worker (`/v1/loads?include=core,disagg,queues,memory`).

Without it SMG has no load for an mmserve replica (it parses `/metrics` only for the engines it
knows by name), so its KV-pressure limits (`--overload-token-usage-threshold`,
`--worker-overload-waiting-requests`, …) cannot act. The figures are those of `/metrics`
(mmserve/runtime/load.py reads both): `token_usage` is `mmserve:kv_cache_usage_perc`,
`num_running_reqs` / `num_waiting_reqs` are `mmserve:num_requests_running` / `…_waiting`.

One entry in `loads` per loaded model (SGLang has one per data-parallel rank; mmserve has none, and
a router averages `token_usage` and sums the counts over the entries, which is what a replica
serving several models should read as). Counts are JSON integers: SMG's schema is i32, and a
report whose counts are floats is refused whole (the worker then has no load at all). Where
mmserve has no such figure the field is 0 (`gen_throughput`, `utilization`,
`num_waiting_uncached_tokens`); the `include` sections beyond `core` are left out, as SGLang's
schema allows.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from importlib import metadata

from quart import Response
from quart_trio import QuartTrio

from mmserve.runtime.load import ModelLoad, model_loads
from mmserve.runtime.runtime import Runtime

LOADS_PATH = "/v1/loads"


def _version() -> str:
    try:
        return metadata.version("mmserve")
    except metadata.PackageNotFoundError:  # a source checkout that is not installed
        return "0"


def rank_load(rank: int, load: ModelLoad) -> dict:
    """One SGLang `SchedulerLoadSnapshot` (a data-parallel rank's load) for one loaded model."""
    used_tokens = load.used_blocks * load.block_size
    capacity = load.num_blocks * load.block_size
    return {
        "dp_rank": rank,
        "model": load.model,  # mmserve's own: which model this entry is (a router ignores it)
        "num_running_reqs": load.running,
        "num_waiting_reqs": load.waiting,
        "num_waiting_uncached_tokens": 0,
        "num_total_reqs": load.running + load.waiting,
        "num_used_tokens": used_tokens,
        "max_total_num_tokens": capacity,
        "token_usage": load.kv_usage,
        "gen_throughput": 0.0,
        "cache_hit_rate": load.hit_tokens / load.query_tokens if load.query_tokens else 0.0,
        "utilization": 0.0,
        "max_running_requests": load.max_running,
    }


def loads_report(rt: Runtime) -> dict:
    """SGLang's `/v1/loads` body (`WorkerLoadResponse`): per-model entries and their aggregate."""
    loads = [rank_load(i, load) for i, load in enumerate(model_loads(rt))]
    report = {"timestamp": datetime.now(timezone.utc).isoformat(), "version": _version(),
              "dp_rank_count": len(loads), "loads": loads}
    if loads:  # no model loaded yet: no aggregate, which a router must not read as an idle replica
        running = sum(x["num_running_reqs"] for x in loads)
        waiting = sum(x["num_waiting_reqs"] for x in loads)
        report["aggregate"] = {
            "total_running_reqs": running, "total_waiting_reqs": waiting, "total_reqs": running + waiting,
            "avg_token_usage": round(sum(x["token_usage"] for x in loads) / len(loads), 4),
            "avg_throughput": 0.0, "avg_utilization": 0.0}
    return report


def register_loads_route(app: QuartTrio, rt: Runtime) -> None:
    """Adds `GET /v1/loads` (under /v1/, so an API key guards it when keys are set: SMG sends its
    `--api-key` to its workers)."""

    @app.get(LOADS_PATH)
    async def loads():
        return Response(json.dumps(loads_report(rt)), status=200, mimetype="application/json")

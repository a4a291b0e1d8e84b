"""What requests leave behind: the bench process's resident memory over a run of requests once both
caches are full (issue 46: every request's handle, images included, was kept until its model was
unloaded — ~7.9 KiB a request with small caches, ~5.5 MB with 4 MB images).

The embedded runtime runs in this process, so its resident set is the one measured. Caches still
filling legitimately grow it (the KV arena's pages are touched as blocks are first written; the
encoder cache stores outputs up to its budget), so requests with fresh images are sent until both
caches have evicted, then `retention_settle` more (at least a tenth of the measured ones), and
only then is memory sampled: after every tenth of the measured requests, following a full
collection. The settling requests fill what is bounded but not yet at its bound: trio keeps the
entries of exited deadline scopes in its timer heap until they outnumber the live ones by 1,000
(a stream's every delta waits under its request deadline: ~6 entries a request, ~2 KiB), so the
first ~170 requests of a process grow it by ~0.4 MB, and never more. The growth per 1,000 requests
is the least-squares slope through those samples: one reading alone is at the mercy of the
allocator, a slope over ten is not."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache

import trio

from mmserve.bench.common import MODEL, timed_chat

MIB = 1024 * 1024


@cache
def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def resident_bytes() -> int:
    """This process's resident memory once garbage is collected. glibc keeps the pages of freed
    chunks mapped (in each thread's arena) for reuse; malloc_trim(0) hands them back first, so
    the reading is what the process holds, not what its allocator keeps in reserve."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, R²) of the least-squares line through `points` (x, y); R² 0 for a flat line."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    syy = sum((y - my) ** 2 for _, y in points)
    if not sxx:
        return 0.0, 0.0
    b = sxy / sxx
    return b, (b * sxy / syy if syy else 0.0)


def caches_full(rt) -> bool:
    """Both caches of the bench model have evicted: they hold all their budget allows."""
    m = rt.registry.require(MODEL)
    return m.encoder.stats().get("evictions", 0) > 0 and m.prefix_cache.stats()["evictions"] > 0


async def measure(b) -> dict:
    """Fresh-image requests, `retention_concurrency` at a time, through an embedded runtime with both
    caches on (the encoder cache capped at `retention_encoder_entries`): until both caches are full
    (at most `retention_fill_max` requests), then `retention_requests` more, sampled as above."""
    p = b.params
    overrides = {"encoder_cache": {"max_entries": p.retention_encoder_entries}}
    if p.retention_kv_budget_bytes:
        overrides["kv_cache"] = {"budget_bytes": p.retention_kv_budget_bytes}
    async with b.runtime(**overrides) as rt:

        async def run(count: int) -> None:
            """`count` requests, `retention_concurrency` at once; each request's messages are
            made when it starts and dropped when it ends (the bench keeps none of them)."""
            left = iter(range(count))

            async def worker() -> None:
                for _ in left:
                    await timed_chat(rt, b.ask(b.new_image()), p.retention_tokens)

            async with trio.open_nursery() as nursery:
                for _ in range(p.retention_concurrency):
                    nursery.start_soon(worker)

        filled = 0
        while not caches_full(rt) and filled < p.retention_fill_max:
            await run(p.retention_concurrency)
            filled += p.retention_concurrency
        full = caches_full(rt)
        chunk = max(1, p.retention_requests // p.retention_samples)
        await run(max(chunk, p.retention_settle))  # what requests after a fill still settle (below)
        points = [(0, resident_bytes())]
        for k in range(1, p.retention_samples + 1):
            await run(chunk)
            points.append((k * chunk, resident_bytes()))
    per_request, r2 = slope(points)
    return {"fill_requests": filled, "caches_full": full, "requests": chunk * p.retention_samples,
            "concurrency": p.retention_concurrency, "samples": [(n, rss / MIB) for n, rss in points],
            "rss_start_mib": points[0][1] / MIB, "rss_end_mib": points[-1][1] / MIB,
            "growth_per_1000_mib": per_request * 1000 / MIB, "r2": r2}

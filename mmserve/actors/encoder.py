"""Encoder actor: one encoder output per image, from the encoder-output cache or the vision tower.

It owns its model's `EncoderCache`, keyed by each item's encoder key: its `mm_hash` and the
request's `cache_salt` (`keys.encoder_cache_key`), so a tenant never hits — and never times —
another tenant's entry, here or in the shared tier, which stores under the same key. Jobs that
arrive together (within `batch_wait_ms`) are looked up together; their misses are encoded in one
batched forward, and an item missing for several requests of one tenant at once is encoded once
and shared (in-flight dedup, by encoder key: never across tenants). Entries a job uses are pinned
from look-up until the job is handed to the generator, so an insertion for another request in the
same batch can never evict them. Uncacheable items (no content key) are encoded fresh and never
stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import trio

from mmserve.actors.base import Actor
from mmserve.actors.messages import ClearCache, EncodeJob, GenerateJob, Release
from mmserve.cache.encoder_cache import EncoderCache, tensor_nbytes
from mmserve.cache.keys import encoder_cache_key, key_prefix
from mmserve.cache.shared_values import KIND_ENCODER, encoder_key
from mmserve.errors import MMServeError
from mmserve.engine.vision_step import VisionPath
from mmserve.models.adapter import Adapter, PromptInputs
from mmserve.config import EncoderCacheConfig
from mmserve.actors import compute
from mmserve.actors.faults import fault


@dataclass
class Miss:
    """One item to encode, and every (job, image index) waiting for it: all of one tenant, as the
    key (the encoder key, salt inside) says."""

    key: bytes | None
    prompt: PromptInputs  # the first waiter's: pixels are computed from it only now, for the tower
    index: int
    waiters: list[tuple[EncodeJob, int]] = field(default_factory=list)
    pixels: torch.Tensor | None = None

    @property
    def labels(self) -> list[str | None]:
        """The client request ids of the waiters (fault hooks key on them)."""
        return [j.handle.client_request_id for j, _ in self.waiters]


class Encoder(Actor):
    name = "encoder"

    def __init__(self, adapter: Adapter, generator_inbox: trio.MemorySendChannel,
                 config: EncoderCacheConfig = EncoderCacheConfig(), prefix_cache: trio.MemorySendChannel | None = None,
                 vision: VisionPath | None = None, shared=None):
        super().__init__(model=adapter.name)
        self.adapter = adapter
        self.vision = vision or VisionPath(adapter)  # the tower: static per view bucket, or eager
        self.generator_inbox = generator_inbox
        self.prefix_cache = prefix_cache
        self._registered: set[str] = set()  # in-flight requests the prefix cache holds something for
        self.config = config
        self.cache = EncoderCache(config.budget_bytes, config.max_entries or None) if config.enabled else None
        self.encoder_runs = 0
        self.items_encoded = 0
        self.shared = shared  # the model's SharedTier (Redis), when [shared_cache] is on
        self.shared_hits = 0

    async def run(self) -> None:
        while True:
            jobs = await self._gather()
            self.progressed()
            await self._serve(jobs)
            # not kept while the next batch is awaited: the last batch's requests would live on
            del jobs
            self.progressed()

    async def _gather(self) -> list[EncodeJob]:
        """The next batch: every waiting job, and, if some need the tower, those arriving within
        the batch window (up to max_batch_images images)."""
        jobs: list[EncodeJob] = []
        while not jobs:
            self._take(jobs, await self.inbox.receive())
        self._drain(jobs)
        if self.config.batch_wait_ms > 0 and self._uncached(jobs) and self._images(jobs) < self.config.max_batch_images:
            with trio.move_on_after(self.config.batch_wait_ms / 1000):
                while self._images(jobs) < self.config.max_batch_images:
                    self._take(jobs, await self.inbox.receive())
                    self._drain(jobs)
        return jobs

    def _drain(self, jobs: list[EncodeJob]) -> None:
        while self._images(jobs) < self.config.max_batch_images:
            try:
                self._take(jobs, self.inbox.receive_nowait())
            except trio.WouldBlock:
                return

    def _take(self, jobs: list[EncodeJob], msg) -> None:
        """Adds a job to the batch; a control message is handled at once."""
        if isinstance(msg, EncodeJob):
            jobs.append(msg)
            self.in_flight[msg.handle.request_id] = msg.handle  # held from receipt: not idle, not lost
        elif isinstance(msg, ClearCache):
            dropped = self.cache.clear() if self.cache is not None else []
            self.log.info("encoder_cache.cleared", entries=len(dropped), bytes=sum(n for _, n in dropped),
                          kept_pinned=len(self.cache) if self.cache is not None else 0)
            try:
                msg.reply.send_nowait(len(dropped))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        else:
            raise TypeError(f"encoder: unexpected message {msg!r}")

    def _wanted(self, job: EncodeJob) -> list[tuple[int, bytes | None]]:
        """(index, encoder key) of each image the job needs: those its cached prefix does not
        cover whole (a covered image's KV is in the hit; its encoder output is never needed). The
        key is the only one this actor looks up or stores by; None: uncacheable."""
        keys = job.prompt.mm_keys or (None,) * len(job.prompt.spans)
        salt = job.handle.request.cache_salt
        return [(i, None if key is None else encoder_cache_key(key, salt, algorithm=self.adapter.hash_algorithm))
                for i, (span, key) in enumerate(zip(job.prompt.spans, keys))
                if not job.prefix.covers(span.start, span.length)]

    def _uncached(self, jobs: list[EncodeJob]) -> bool:
        """Whether some image needs the tower (only then is waiting for company worth it)."""
        return any(key is None or self.cache is None or not self.cache.contains(key)
                   for j in jobs for _, key in self._wanted(j))

    def _images(self, jobs: list[EncodeJob]) -> int:
        return sum(len(self._wanted(j)) for j in jobs)

    async def _serve(self, jobs: list[EncodeJob]) -> None:
        for j in [j for j in jobs if not j.handle.active]:
            self.in_flight.pop(j.handle.request_id, None)
            self._settle_prefix(j)
        jobs = [j for j in jobs if j.handle.active]
        for j in jobs:
            self.in_flight[j.handle.request_id] = j.handle
            if j.prefix.registered:
                self._registered.add(j.handle.request_id)
        try:
            found: dict[tuple[int, int], torch.Tensor] = {}
            failed: dict[int, Exception] = {}  # id(job) → why one of its images could not be encoded
            misses = self._look_up(jobs, found)
            if misses and self.shared is not None:
                misses = await self._shared_look_up(misses, found)
            from_cache = set(found)  # before the misses are encoded into `found` too
            if misses:
                await self._encode(misses, found, failed)
            for j in jobs:
                if id(j) in failed:
                    self.fail_request(j.handle, failed[id(j)], "encoder")
                    self._settle_prefix(j)
                    continue
                embeds = tuple(found.get((id(j), i)) for i in range(len(j.prompt.spans)))
                if j.handle.active:
                    hits = sum(1 for i, _ in self._wanted(j) if (id(j), i) in from_cache)
                    self.generator_inbox.send_nowait(GenerateJob(j.handle, j.prompt, embeds, j.prefix, hits))
                else:
                    self._settle_prefix(j)
                self._registered.discard(j.handle.request_id)
                self.in_flight.pop(j.handle.request_id, None)  # on a crash they stay, for the supervisor
        finally:
            for j in jobs:
                self._release(j.handle.request_id)

    def _look_up(self, jobs: list[EncodeJob], found: dict) -> list[Miss]:
        misses: dict[bytes | int, Miss] = {}
        for j in jobs:
            rid = j.handle.request_id
            for i, key in self._wanted(j):
                if key is not None and key in misses:  # the same new item twice in this batch
                    # Encoded once for all its waiters: one tenant's only, as the key holds the
                    # salt. Two tenants sending one image in one batch window are two items, so
                    # neither learns from the merge (nor shares the other's failure) that the
                    # other sent it.
                    misses[key].waiters.append((j, i))
                    continue
                cached = self.cache.get(key) if (self.cache is not None and key is not None) else None
                if cached is not None:
                    self.cache.pin(key, rid)
                    found[id(j), i] = cached
                    self.log.info("encoder_cache.hit", request_id=rid, key=key_prefix(key),
                                  bytes=tensor_nbytes(cached))
                    continue
                if key is not None and self.cache is not None:
                    self.log.info("encoder_cache.miss", request_id=rid, key=key_prefix(key))
                slot = key if key is not None else len(misses) + (1 << 62)
                misses[slot] = Miss(key, j.prompt, i, [(j, i)])
        return list(misses.values())

    async def _encode(self, misses: list[Miss], found: dict, failed: dict) -> None:
        """Encodes the misses, max_batch_images per forward. An item that fails fails its waiters
        alone: pixels are made per item, and a failed batch is encoded again one item at a time."""
        misses = await self._add_pixels(misses, failed)
        n = self.config.max_batch_images
        for start in range(0, len(misses), n):
            for miss, out in await self._forward_contained(misses[start:start + n], failed):
                for j, i in miss.waiters:
                    found[id(j), i] = out
                self._store(miss, out)
                if self.shared is not None and miss.key is not None:  # written in the background
                    self.shared.put_soon(KIND_ENCODER, encoder_key(miss.key), out)

    async def _shared_look_up(self, misses: list[Miss], found: dict) -> list[Miss]:
        """The local misses asked of the shared tier (one round trip, within its deadline), each
        under its encoder key — the tenant's own, as here: what the tier holds — of the dtype and
        shape this model's encoder makes — serves the miss's waiters and is cached here under that
        same key. Returns the misses left to encode."""
        asked = [m for m in misses if m.key is not None]
        if not asked:
            return misses
        hidden = self.adapter.encoder_width
        shapes = [(m.prompt.spans[m.index].length, hidden) for m in asked]
        tensors = await self.shared.get_many(KIND_ENCODER, [encoder_key(m.key) for m in asked],
                                             self.adapter.dtype, shapes)
        self.shared.counts["encoder_queries"] += len(asked)
        served = set()
        for miss, t in zip(asked, tensors):
            if t is None:
                continue
            t = t.to(self.adapter.device)
            self.shared.counts["encoder_hits"] += 1
            self.shared_hits += 1
            for j, i in miss.waiters:
                found[id(j), i] = t
            self.log.info("encoder_cache.shared_hit", request_id=miss.waiters[0][0].handle.request_id,
                          key=key_prefix(miss.key), bytes=tensor_nbytes(t))
            self._store(miss, t)
            served.add(id(miss))
        return [m for m in misses if id(m) not in served]

    async def _add_pixels(self, misses: list[Miss], failed: dict) -> list[Miss]:
        """Each miss with its pixel tensor; the image processor runs in a worker thread, off the
        compute thread (a large image must not hold up every model step) and off the event loop."""
        results = await trio.to_thread.run_sync(self._pixels, misses, abandon_on_cancel=True)
        ready = []
        for miss, result in zip(misses, results):
            if isinstance(result, Exception):
                self._fail_miss(miss, result, failed)
            else:
                miss.pixels = result
                ready.append(miss)
        return ready

    def _pixels(self, misses: list[Miss]) -> list[torch.Tensor | Exception]:
        # torch ops here stay on this thread: a second OpenMP team would make libgomp stop
        # spin-waiting in the compute thread's team too (actors/compute.py)
        torch.set_num_threads(1)
        out: list[torch.Tensor | Exception] = []
        for m in misses:
            try:
                fault("encoder.item", *m.labels)
                out.append(m.prompt.pixels(self.adapter, m.index))
            except Exception as e:  # this item's failure, reported to its waiters alone
                out.append(e)
        return out

    async def _forward_contained(self, chunk: list[Miss], failed: dict) -> list[tuple[Miss, torch.Tensor]]:
        """(miss, output) for every item of `chunk` the tower could encode."""
        try:
            outputs = await compute.run(self._forward, chunk, abandon_on_cancel=True, owner=self.key)
        except Exception as e:
            if len(chunk) == 1:
                self._fail_miss(chunk[0], e, failed)
                return []
            self.log.warning("encoder.batch_failed", items=len(chunk), error=f"{type(e).__name__}: {e}",
                             request_ids=sorted({j.handle.request_id for m in chunk for j, _ in m.waiters}))
            done = []
            for miss in chunk:  # find the item at fault: the others are encoded again without it
                done += await self._forward_contained([miss], failed)
            return done
        self.encoder_runs += 1
        self.items_encoded += len(chunk)
        self.log.info("encoder.batch", items=len(chunk),
                      request_ids=sorted({j.handle.request_id for m in chunk for j, _ in m.waiters}))
        return list(zip(chunk, outputs))

    def _forward(self, chunk: list[Miss]) -> list[torch.Tensor]:
        fault("encoder.forward", *(label for m in chunk for label in m.labels))
        return self.vision.encode([m.pixels for m in chunk])

    @staticmethod
    def _fail_miss(miss: Miss, error: Exception, failed: dict) -> None:
        for j, _ in miss.waiters:
            failed.setdefault(id(j), error)

    def _store(self, miss: Miss, out: torch.Tensor) -> None:
        if self.cache is None or miss.key is None:
            return
        rid = miss.waiters[0][0].handle.request_id
        result = self.cache.put(miss.key, out, pin_owner=rid)
        for key, nbytes in result.evicted:
            self.log.info("encoder_cache.evict", request_id=rid, key=key_prefix(key), bytes=nbytes)
        if result.stored:
            self.log.info("encoder_cache.insert", request_id=rid, key=key_prefix(miss.key), bytes=tensor_nbytes(out))
        else:
            self.log.info("encoder_cache.not_stored", request_id=rid, key=key_prefix(miss.key),
                          bytes=tensor_nbytes(out), reason=result.reason)

    def _release(self, request_id: str) -> None:
        if self.cache is not None:
            self.cache.release_owner(request_id)

    def _settle_prefix(self, job: EncodeJob) -> None:
        """The request ends here: what the prefix cache holds for it (pins, registrations) is released."""
        self._registered.discard(job.handle.request_id)
        if job.prefix.registered and self.prefix_cache is not None:
            self.prefix_cache.send_nowait(Release(job.handle.request_id))

    def fail_in_flight(self, error: MMServeError) -> int:
        if self.prefix_cache is not None:
            for rid in self._registered:
                self.prefix_cache.send_nowait(Release(rid))
        self._registered.clear()
        owners = list(self.in_flight)
        failed = super().fail_in_flight(error)
        for rid in owners:
            self._release(rid)
        return failed

    def stats(self) -> dict:
        base = {"encoder_runs": self.encoder_runs, "items_encoded": self.items_encoded,
                **({"shared_hits": self.shared_hits} if self.shared is not None else {})}
        if self.cache is None:
            return dict(base, enabled=False)
        return dict(base, enabled=True, **self.cache.stats().__dict__)

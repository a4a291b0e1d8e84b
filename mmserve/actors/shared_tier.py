"""SharedTier actor: a model's second cache tier in Redis, shared by every replica.

It sits under both local caches: the encoder asks it for the encoder outputs its own cache misses
(and hands it fresh ones to write), the prefix-cache manager asks it for the KV blocks that follow
a local prefix hit (and hands it the blocks committed here). Keys and values are laid out in
`cache.shared_values`: the local keys (model signature and `cache_salt` inside) under a versioned
namespace, and values whose header and HMAC tag (under the secret the replicas share) make any
corrupt, truncated, foreign or forged value a miss.

Nothing anyone else writes to Redis is believed, and the client is redis-py's synchronous one in
trio worker threads: see `actors.shared_tier_io` for both.

Never slower and never down because of the tier:
- a look-up has a deadline (`lookup_deadline_ms`): a late answer is a miss;
- writes are fire-and-forget into a bounded queue (`write_queue`): a value that finds it full is
  dropped and counted; a background task drains it, `write_batch` values per pipelined round trip;
- any Redis error (absent, restarted, full, refusing) turns the tier off for `backoff_s`, logged
  once (`shared_tier.off`); a probe (opening the pool's connections, a PING on each) then turns it
  back on (`shared_tier.on`) or doubles the wait, up to `max_backoff_s`. While off, look-ups
  answer "miss" at once and writes are dropped. Requests are always answered from local compute;
- the tier connects as its model loads (`connect`, before the model is ready), not in a look-up's
  deadline; a Redis down then turns it off as above (the model loads and serves regardless).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from functools import partial
from typing import Sequence

import torch
import trio

from mmserve.actors.base import Actor
from mmserve.actors.kv_messages import FetchBlocks, SharedBlocks
from mmserve.actors.reservation_ledger import send
from mmserve.actors.shared_tier_io import (
    DELETE_REFUSED_LUA, Refused, describe, public_error, read_values, renew_and_delete, write_values)
from mmserve.actors.write_settlement import WriteSettlement
from mmserve.cache.keys import key_prefix
from mmserve.cache.shared_values import KIND_KV_BLOCK, REJECT_REASONS, MacKey, block_key
from mmserve.config import SharedCacheConfig

ON, OFF = "on", "off"
LATE_STREAK_OFF = 3  # this many late look-ups in a row count as an error (Redis is too slow)
FETCH_CHUNK_BYTES = 4 << 20  # KV blocks are read about this much per round trip (what arrived by the deadline is kept)
TIDY_PENDING_MAX = 8  # after-read rounds (TTL renewals, deletions of refused values) waiting; more are skipped


class SharedTier(Actor):
    name = "shared_tier"
    LOOKUP_THREADS = 4
    WARM_CONNECTIONS = LOOKUP_THREADS + 1  # opened at connect: as many look-ups as run at once, and the writer
    # the pool: the look-ups, the writer, the after-read round (TTL renewals and deletions), a probe
    MAX_CONNECTIONS = LOOKUP_THREADS + 3

    def __init__(self, model: str, config: SharedCacheConfig):
        super().__init__(model=model)
        self.model = model
        self.config = config
        self.state = ON
        self.off_until = 0.0
        self.backoff_s = config.backoff_s
        self.last_error: str | None = None  # in full, for logs and /debug (it can name Redis's host)
        self.public_error: str | None = None  # what /health shows: what went wrong, never where
        self.counts: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()  # refused values by reason (REJECT_REASONS)
        secret = config.secret_bytes()
        self.mac = MacKey(secret) if secret is not None else MacKey.unauthenticated()
        self._delete_refused = None  # the compare-and-delete script, registered with the client
        self._tidy_pending = 0
        self._tidy_limiter = trio.CapacityLimiter(1)
        self._client = None
        self._nursery: trio.Nursery | None = None
        self._probing = False
        self._late_streak = 0
        self._writes_settled = WriteSettlement()  # values queued vs written, failed or dropped
        self._writes_send, self._writes = trio.open_memory_channel(config.write_queue)
        self._limiter = trio.CapacityLimiter(self.LOOKUP_THREADS)

    # -- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._write_loop)
                while True:
                    msg = None
                    with trio.move_on_after(1.0):
                        msg = await self.inbox.receive()
                    self.progressed()
                    if isinstance(msg, FetchBlocks):
                        nursery.start_soon(self._fetch_blocks, msg)
                    elif msg is not None:
                        raise TypeError(f"shared tier: unexpected message {msg!r}")
        finally:
            self._nursery = None

    def client(self):
        """The Redis client (built by `connect` or on first use, in a worker thread); opens nothing."""
        if self._client is None:
            import redis

            self._client = redis.Redis.from_url(
                self.config.url, socket_timeout=self.config.socket_timeout_s,
                socket_connect_timeout=self.config.socket_timeout_s, max_connections=self.MAX_CONNECTIONS)
            self._delete_refused = self._client.register_script(DELETE_REFUSED_LUA)
        return self._client

    # -- on / off ---------------------------------------------------------------------------------

    async def connect(self) -> bool:
        """Builds the client and opens its pool now, as the model loads, not in a look-up's deadline
        (importing redis-py alone takes 35-75 ms); a Redis down or silent turns the tier off."""
        try:
            await self._open_pool()
        except Exception as e:
            self._failed(e, "connect")
        return self.state == ON

    async def _open_pool(self) -> None:
        """WARM_CONNECTIONS opened at once, a PING on each, within a connect and a reply's timeout."""
        bound, barrier, errors = 2 * self.config.socket_timeout_s, threading.Barrier(self.WARM_CONNECTIONS), []
        with trio.move_on_after(bound) as scope:
            await trio.to_thread.run_sync(self.client, abandon_on_cancel=True)
            async with trio.open_nursery() as nursery:
                for _ in range(self.WARM_CONNECTIONS):
                    nursery.start_soon(partial(trio.to_thread.run_sync, self._open_connection, barrier, bound, errors,
                                               abandon_on_cancel=True))
        barrier.abort()  # threads still waiting (given up, or another failed) give theirs back
        if errors or scope.cancelled_caught:
            raise errors[0] if errors else TimeoutError(f"connecting took longer than {bound:g} s")

    def _open_connection(self, barrier: threading.Barrier, timeout: float, errors: list) -> None:
        """(Worker thread.) Opens a pooled connection, held till all are (else the pool reuses it)."""
        pool, conn = self.client().connection_pool, None
        try:
            try:
                conn = pool.get_connection()
            except TypeError:  # redis-py < 5.3 wants a command name
                conn = pool.get_connection("PING")
            conn.send_command("PING")
            conn.read_response()  # a socket error here closes the connection
            barrier.wait(timeout)
        except threading.BrokenBarrierError:
            pass  # another connection failed (its error is reported), or the wait was given up
        except Exception as e:  # reported by _open_pool; the others stop waiting for this one
            errors.append(e)
            barrier.abort()
        finally:
            if conn is not None:
                pool.release(conn)

    def active(self) -> bool:
        """Whether the tier is on now; when its backoff has run out, a probe is started."""
        if self.state == ON:
            return True
        if not self._probing and self._nursery is not None and trio.current_time() >= self.off_until:
            self._probing = True
            self._nursery.start_soon(self._probe)
        return False

    async def _probe(self) -> None:
        """Back on if Redis answers; the pool's connections are reopened here, not in look-ups."""
        try:
            await self._open_pool()
        except Exception as e:
            self.counts["probes_failed"] += 1
            self.last_error, self.public_error = describe(e), public_error(e)
            self.backoff_s = min(self.backoff_s * 2, self.config.max_backoff_s)
            self.off_until = trio.current_time() + self.backoff_s
        else:
            self.state, self.backoff_s, self._late_streak = ON, self.config.backoff_s, 0
            self.log.info("shared_tier.on", errors=self.counts["errors"], outages=self.counts["outages"])
        finally:
            self._probing = False

    def _failed(self, error: BaseException | str, during: str) -> None:
        self.counts["errors"] += 1
        self.last_error = error if isinstance(error, str) else describe(error)
        self.public_error = error if isinstance(error, str) else public_error(error)  # a str is ours: no address in it
        if self.state == ON:  # logged once per outage; the probes that fail are only counted
            self.state = OFF
            self.counts["outages"] += 1
            self.off_until = trio.current_time() + self.backoff_s
            self.log.warning("shared_tier.off", during=during, error=self.last_error, retry_in_s=self.backoff_s)

    # -- look-ups ---------------------------------------------------------------------------------

    async def get_many(self, kind: int, redis_keys: Sequence[bytes], dtype: torch.dtype,
                       shapes: Sequence[Sequence[int]]) -> list[torch.Tensor | None]:
        """The tensors stored under `redis_keys` (None for each miss), within the look-up deadline,
        each of `dtype` and of its whole shape in `shapes` (which bounds what is read of it). Any
        error, a late answer or a tier that is off: all misses. An entry that verifies has its TTL
        renewed; one that does not is a miss, counted and deleted (both after the answer)."""
        out: list[torch.Tensor | None] = [None] * len(redis_keys)
        if not redis_keys or not self.active():
            return out
        got = await self._get_by(trio.current_time() + self.config.lookup_deadline_ms / 1000, kind,
                                 redis_keys, dtype, shapes)
        return out if got is None else got

    async def get_chain(self, kind: int, redis_keys: Sequence[bytes], dtype: torch.dtype,
                        shape: Sequence[int], chunk: int) -> list[torch.Tensor]:
        """The values of a chain of keys, as many consecutive ones from the first as are stored,
        read `chunk` at a time: what has arrived when the look-up deadline passes is kept (a
        shorter hit), not thrown away with the rest."""
        found: list[torch.Tensor] = []
        if not redis_keys or not self.active():
            return found
        deadline = trio.current_time() + self.config.lookup_deadline_ms / 1000
        for at in range(0, len(redis_keys), chunk):
            keys = redis_keys[at:at + chunk]
            got = await self._get_by(deadline, kind, keys, dtype, [shape] * len(keys))
            for t in got or ():
                if t is None:
                    return found
                found.append(t)
            if got is None:
                break
        return found

    async def _get_by(self, deadline: float, kind: int, redis_keys, dtype, shapes) -> list | None:
        """One pipelined read answered by `deadline`; None when late, failed or off."""
        with trio.move_on_at(deadline) as scope:
            try:
                out, found, refused = await trio.to_thread.run_sync(
                    self._get_decode, kind, list(redis_keys), dtype, list(shapes),
                    limiter=self._limiter, abandon_on_cancel=True)
            except Exception as e:
                self._failed(e, "lookup")
                return None
        if scope.cancelled_caught:
            self.counts["late"] += 1
            self._late_streak += 1
            if self._late_streak >= LATE_STREAK_OFF:
                ms = self.config.lookup_deadline_ms
                self._failed(f"{self._late_streak} look-ups in a row took longer than {ms:g} ms", "lookup")
            return None
        self._late_streak = 0
        if refused:
            self.counts["corrupt"] += len(refused)
            reasons = Counter(r.reason for r in refused)
            self.rejected.update(reasons)
            self.log.warning("shared_tier.bad_value", values=len(refused), kind=kind, reasons=dict(reasons))
        if found or refused:
            self._tidy_soon(found, [r for r in refused if r.reason != "version"])
        return out

    def _get_decode(self, kind: int, keys: list[bytes], dtype: torch.dtype, shapes) -> tuple[list, list, list]:
        """(Worker thread.) `shared_tier_reads.read_values` on this tier's client and secret."""
        torch.set_num_threads(1)  # see actors/compute.py: no second OpenMP team
        return read_values(self.client(), kind, keys, dtype, shapes, self.mac)

    def _tidy_soon(self, found: list[bytes], refused: list[Refused]) -> None:
        """After a look-up has answered: the TTLs of the values that verified are renewed, the
        refused values deleted (unless rewritten since). Bounded: when too many rounds wait,
        this one is skipped (a value's TTL is then not renewed; a refused value is refused again)."""
        if self._nursery is None or self._tidy_pending >= TIDY_PENDING_MAX:
            self.counts["tidy_skipped"] += 1
            return
        self._tidy_pending += 1
        self._nursery.start_soon(self._tidy, found, refused)

    async def _tidy(self, found: list[bytes], refused: list[Refused]) -> None:
        import redis.exceptions

        try:
            deleted = await trio.to_thread.run_sync(self._renew_and_delete, found, refused,
                                                    limiter=self._tidy_limiter, abandon_on_cancel=True)
            self.counts["deleted"] += deleted
        except redis.exceptions.ResponseError as e:  # e.g. an ACL without EVAL: look-ups and writes still work
            self.counts["tidy_errors"] += 1
            if self.counts["tidy_errors"] == 1:
                self.log.warning("shared_tier.tidy_refused", error=describe(e))
        except Exception as e:
            self._failed(e, "tidy")
        finally:
            self._tidy_pending -= 1

    def _renew_and_delete(self, found: list[bytes], refused: list[Refused]) -> int:
        """(Worker thread.) One pipelined round trip; how many refused values were deleted."""
        return renew_and_delete(self.client(), self._delete_refused, found, refused, self.config.ttl_s)

    async def _fetch_blocks(self, msg: FetchBlocks) -> None:
        t0, found = time.monotonic(), []
        try:
            keys = [block_key(h) for h in msg.hashes]
            block_bytes = math.prod(msg.shape) * msg.dtype.itemsize
            found = await self.get_chain(KIND_KV_BLOCK, keys, msg.dtype, msg.shape,
                                         max(1, FETCH_CHUNK_BYTES // block_bytes))
            self.counts["block_queries"] += len(keys)
            self.counts["block_hits"] += len(found)
            self.log.info("shared_tier.blocks", request_id=msg.request_id, queried=len(keys), found=len(found),
                          first_hash=key_prefix(msg.hashes[0]) if msg.hashes else None,
                          elapsed_s=round(time.monotonic() - t0, 6))
        finally:  # always answered: the manager holds the request's lookup until then
            try:
                msg.reply.send_nowait(SharedBlocks(msg.request_id, msg.epoch, tuple(found), time.monotonic() - t0))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    # -- writes -----------------------------------------------------------------------------------

    def put_soon(self, kind: int, redis_key: bytes, tensor: torch.Tensor) -> bool:
        """Queues a value to be written (fire and forget); False when it was dropped."""
        if not self.active():
            self.counts["dropped_off"] += 1
            return False
        try:
            self._writes_send.send_nowait((kind, redis_key, tensor))
        except trio.WouldBlock:
            self.counts["dropped_full"] += 1
            return False
        self._writes_settled.queued()
        return True

    def notify_after_writes(self, reply: trio.MemorySendChannel, msg) -> None:
        """Sends `msg` to `reply` once every value queued so far is written (or failed, or
        dropped), and at the latest after `finish_flush_ms`: the generator ends a response when the
        blocks it committed can be found by any replica."""
        done = self._writes_settled.all_queued_so_far()
        if done.is_set() or self._nursery is None or not self.config.finish_flush_ms:
            send(reply, msg)
            return
        self._nursery.start_soon(self._notify, reply, msg, done)

    async def _notify(self, reply: trio.MemorySendChannel, msg, done: trio.Event) -> None:
        t0 = trio.current_time()
        try:
            with trio.move_on_after(self.config.finish_flush_ms / 1000) as scope:
                await done.wait()
            self.counts["finish_flush_late" if scope.cancelled_caught else "finish_flushed"] += 1
            self.counts["finish_flush_wait_ms"] += round((trio.current_time() - t0) * 1000)
        finally:  # whatever happens to this actor, the response ends
            send(reply, msg)

    async def _write_loop(self) -> None:
        while True:
            batch = [await self._writes.receive()]
            while len(batch) < self.config.write_batch:
                try:
                    batch.append(self._writes.receive_nowait())
                except trio.WouldBlock:
                    break
            self.progressed()
            try:
                await self._write(batch)
            finally:
                self._writes_settled.settled(len(batch))

    async def _write(self, batch: list) -> None:
        if not self.active():
            self.counts["dropped_off"] += len(batch)
            return
        try:
            written, nbytes, refused = await trio.to_thread.run_sync(self._set_many, batch, abandon_on_cancel=True)
        except Exception as e:
            self.counts["write_errors"] += len(batch)
            self._failed(e, "write")
            return
        self.counts["writes"] += written
        self.counts["written_bytes"] += nbytes
        if refused:
            self.counts["refused_writes"] += refused
            self.log.warning("shared_tier.refused_write", values=refused)

    def _set_many(self, batch: list) -> tuple[int, int, int]:
        """(Worker thread.) `shared_tier_io.write_values` on this tier's client and secret."""
        torch.set_num_threads(1)
        return write_values(self.client(), batch, self.mac, self.config.ttl_s)

    @property
    def pending_writes(self) -> int:
        """Values queued or being written now."""
        return self._writes_settled.pending

    # -- reporting --------------------------------------------------------------------------------

    def stats(self) -> dict:
        c = self.counts
        return {"state": self.state, "last_error": self.last_error,
                "retry_in_s": max(0.0, round(self.off_until - trio.current_time(), 3)) if self.state == OFF else 0.0,
                "write_queue": self._writes.statistics().current_buffer_used,
                **{k: c[k] for k in ("encoder_queries", "encoder_hits", "block_queries", "block_hits", "late",
                                     "corrupt", "errors", "outages", "probes_failed", "writes", "write_errors",
                                     "written_bytes", "dropped_full", "dropped_off", "finish_flushed",
                                     "finish_flush_late", "finish_flush_wait_ms", "deleted", "refused_writes",
                                     "tidy_skipped", "tidy_errors")},
                "rejected": {reason: self.rejected[reason] for reason in REJECT_REASONS}}

    def health_details(self) -> dict:
        """For the public /health (informational: a tier that is off never makes the model
        unhealthy): whether it is on and what went wrong, never where Redis is (no host, port or
        URL; the logs and the admin's /debug/cache have the full error)."""
        s = self.stats()
        return {"state": s["state"], "last_error": self.public_error, "retry_in_s": s["retry_in_s"],
                "errors": s["errors"], "dropped_full": s["dropped_full"]}


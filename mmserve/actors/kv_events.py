"""The KV event publisher of one replica (`[kv_events]`): batches of events (`cache.kv_event_records`)
from the models' cache managers, published over ZMQ as vLLM's `ZmqEventPublisher` does — a PUB socket
sending `[topic, seq (8-byte big-endian), payload (msgpack)]`, and a ROUTER socket replaying missed
batches: a request `["", start_seq (8 bytes)]` (a DEALER sending the empty delimiter a REQ socket
would, as Dynamo's listener does; a REQ socket would take only the first reply) is answered
`["", seq, payload]` for every buffered batch from `start_seq` on, then `["", -1, b""]`.

Off the event loop's critical path: a manager hands its batch over with `publish` (never waits: a
bounded queue); one thread of this publisher owns the sockets, encodes and sends. A batch that
finds the queue full is dropped and counted (vLLM's publisher would block the scheduler instead);
since a router that missed it would trust blocks that may be gone, the next batch published starts
with `AllBlocksCleared`, and `generation` grows so that every manager forgets what it announced (a
router then learns blocks anew as they are committed or hit: misses at worst, never a gap trusted).

Where this differs from vLLM: the endpoints are always bound (a replica is the stable end; vLLM
binds only wildcard endpoints), and the first batch is `AllBlocksCleared` (a restarted replica
holds nothing, whatever a router remembers of its previous life).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import zmq

from mmserve.actors.kv_event_wire import BatchEncoder
from mmserve.cache.kv_event_records import AllCleared
from mmserve.config.kv_events import KVEventsConfig
from mmserve.logs import get_logger

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """One replica's KV event stream; `close` stops the thread and closes the sockets."""

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.log = get_logger("kv_events")
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.replay_batches)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        self._replay = None
        try:  # bound here, so a taken port is an error at start, not a silent thread's
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.replay_endpoint = None
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"[kv_events]: cannot bind {config.endpoint!r} / {config.replay_endpoint!r}: {e}") from None
        self.sources = 0  # cache managers publishing here (one per loaded model)
        self.generation = 0  # grows when a dropped batch made every announcement void
        self.published = 0  # batches sent
        self.dropped = 0  # batches dropped: the queue was full
        self.replays = 0  # replay requests answered
        self._lost = False
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self.publish([AllCleared()])  # whatever a router remembers of this replica's previous life
        self.log.info("kv_events.started", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                      topic=self.config.topic, encoding=config.encoding)

    def add_source(self) -> None:
        """A cache manager publishes here from now on (one per loaded model)."""
        self.sources += 1

    def remove_source(self) -> None:
        """A cache manager publishes no more (its model was unloaded)."""
        self.sources -= 1

    def publish(self, events: list) -> bool:
        """Hands a batch to the publisher thread without waiting; False when the queue was full (the
        batch is dropped, counted, and every announcement so far is void: see the module's doc)."""
        with self._lock:  # a drop and the next batch's AllBlocksCleared, in the order they happened
            if self._lost:
                events = [AllCleared(), *events]
            try:
                self._queue.put_nowait((time.time(), events))
            except queue.Full:
                self.dropped += 1
                if not self._lost:
                    self.generation += 1
                    self.log.warning("kv_events.dropped", queued=self._queue.qsize(), dropped=self.dropped)
                self._lost = True
                return False
            self._lost = False
            return True

    def close(self) -> None:
        """Sends what is queued (up to a second), then stops the thread and closes the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)
        self._close_sockets()
        self.log.info("kv_events.stopped", published=self.published, dropped=self.dropped, replays=self.replays)

    def stats(self) -> dict:
        return {"published": self.published, "dropped": self.dropped, "replays": self.replays,
                "queued": self._queue.qsize()}

    # -- the publisher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        encoder = BatchEncoder(self.config.encoding)
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception as e:  # one bad request never stops the stream
                    self.log.error("kv_events.replay_failed", error=f"{type(e).__name__}: {e}")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encoder.encode(ts, events)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception as e:  # never the serving path's problem: logged, the stream goes on
                self.log.error("kv_events.publish_failed", error=f"{type(e).__name__}: {e}")
                continue
            self._buffer.append((seq, payload))
            self.published += 1
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            self.log.warning("kv_events.bad_replay", frames=len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
        self.replays += 1

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

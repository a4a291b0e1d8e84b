"""The static decode step: its input buffers, its body, and on CUDA its graphs, one per bucket.

A decode step of B sequences (one new token each, no image rows) runs in the smallest bucket
(1, 2, 4, 8, ... up to the runner's `max_batch`) that holds B. Every tensor the step reads lives
in `DecodeBuffers`, allocated once: token ids, positions (M-RoPE's rows too), the slot each new
K/V goes to, block tables, sequence lengths. A step writes its values into rows [0, B) of
them and pads rows [B, bucket) (sequence length 0: the kernels read nothing for it; its K/V goes to
the arena's spare scratch slot), so a replay of the same bucket reads the same addresses with
other values — what a CUDA graph needs. `DecodeGraphs.run` replays the bucket's graph (captured on
first use) on CUDA, and runs the body eagerly elsewhere (the CPU, where tests prove the body
capturable: no host synchronisation, no input outside these buffers, the model and the arena).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from mmserve.engine.attention import PagedMetadata


def buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a decode step is padded to: powers of two, then `max_batch` itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return tuple(sizes) + (max_batch,)


def bucket_of(n: int, sizes: Sequence[int]) -> int:
    """The smallest bucket holding `n` sequences."""
    for b in sizes:
        if b >= n:
            return b
    raise ValueError(f"{n} sequences exceed the largest decode bucket ({sizes[-1]})")


class DecodeBuffers:
    """The static inputs of a decode step, `max_batch` rows each, on the model's device."""

    def __init__(self, max_batch: int, max_blocks: int, rope_rows: int, block_size: int, scratch_slot: int,
                 device: torch.device):
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.scratch_slot, self.device = scratch_slot, device
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(rope_rows, max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # host staging (pinned on CUDA), double-buffered: the copies in are asynchronous, and with
        # overlap scheduling the host fills step n+1's staging while step n's copy may still wait
        # in the stream behind step n-1. Each set's copies record an event; a fill takes the other
        # set than the last one and waits only for that set's own previous copies (step n-1's,
        # long done), never for the step in flight (nothing to wait for on the CPU)
        self._sets = [_Staging(max_batch, max_blocks, rope_rows, device) for _ in range(2)]
        self._turn = 0

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every buffer (tests check that steps read only these, at fixed addresses)."""
        return self.ids, self.positions, self.slots, self.tables, self.seq_lens, self.cu_seqlens

    def fill(self, ids: Sequence[int], tables: Sequence[Sequence[int]], starts: Sequence[int],
             positions: np.ndarray | None, bucket: int) -> None:
        """Rows [0, len(ids)) get sequence i's token `ids[i]` at position `starts[i]` (M-RoPE:
        `positions[:, i]`) with block table `tables[i]`; rows up to `bucket` are padding."""
        n, bs = len(ids), self.block_size
        if n > bucket or bucket > self.max_batch:
            raise ValueError(f"{n} sequences in a bucket of {bucket} (max {self.max_batch})")
        widest = max(len(t) for t in tables)
        if widest > self.max_blocks:
            raise ValueError(f"a block table of {widest} blocks exceeds the static width {self.max_blocks}")
        st = self._next_set()
        host_ids, host_pos = st.ids.numpy(), st.positions.numpy()
        host_slots, host_tables, host_lens = st.slots.numpy(), st.tables.numpy(), st.seq_lens.numpy()
        host_ids[:bucket] = 0
        host_ids[:n] = ids
        start = np.asarray(starts, dtype=np.int64)
        host_pos[:, :bucket] = 0
        host_pos[:, :n] = start if positions is None else positions
        host_tables[:bucket] = 0
        for i, t in enumerate(tables):
            host_tables[i, :len(t)] = t
        host_slots[:bucket] = self.scratch_slot
        host_slots[:n] = host_tables[np.arange(n), start // bs].astype(np.int64) * bs + start % bs
        host_lens[:bucket] = 0
        host_lens[:n] = start + 1
        self._copy_in(st, bucket)

    def clear(self, bucket: int) -> None:
        """Rows [0, bucket) become padding (what a capture at load runs on)."""
        st = self._next_set()
        st.ids[:bucket] = 0
        st.positions[:, :bucket] = 0
        st.slots[:bucket] = self.scratch_slot
        st.tables[:bucket] = 0
        st.seq_lens[:bucket] = 0
        self._copy_in(st, bucket)

    def _next_set(self) -> "_Staging":
        """The staging set the next fill writes (not the last one's), once its own copies are done."""
        st = self._sets[self._turn]
        self._turn ^= 1
        st.wait()
        return st

    def _copy_in(self, st: "_Staging", bucket: int) -> None:
        for buf, host in ((self.ids, st.ids), (self.slots, st.slots), (self.tables, st.tables),
                          (self.seq_lens, st.seq_lens)):
            buf[:bucket].copy_(host[:bucket], non_blocking=True)  # rows
        self.positions[:, :bucket].copy_(st.positions[:, :bucket], non_blocking=True)
        st.recorded()

    def metadata(self, bucket: int) -> PagedMetadata:
        """The step's metadata as views of the buffers (host fields: only the bucket's shape)."""
        return PagedMetadata(block_tables=self.tables[:bucket], seq_lens=self.seq_lens[:bucket],
                             cu_seqlens_q=self.cu_seqlens[:bucket + 1], slot_mapping=self.slots[:bucket],
                             num_decodes=bucket, max_query_len=0, block_size=self.block_size,
                             starts=(), lengths=(1,) * bucket, tables=())


class _Staging:
    """One set of a decode step's host staging (pinned on CUDA) and the event its copies in record."""

    def __init__(self, max_batch: int, max_blocks: int, rope_rows: int, device: torch.device):
        pin = device.type == "cuda"
        self.ids = torch.zeros(max_batch, dtype=torch.long, pin_memory=pin)
        self.positions = torch.zeros(rope_rows, max_batch, dtype=torch.long, pin_memory=pin)
        self.slots = torch.zeros(max_batch, dtype=torch.long, pin_memory=pin)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        self._pending = False

    def recorded(self) -> None:
        if self._copied is not None:
            self._copied.record()
            self._pending = True

    def wait(self) -> None:
        """Its last copies in have read it: it may be rewritten."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False


class DecodeGraphs:
    """Runs `body(bucket)` (the decode step over the buffers' first `bucket` rows, returning its
    logits); on CUDA as a graph per bucket, captured on first use and replayed after.

    A bucket whose capture fails (the driver invalidates a capture it cannot record) runs its body
    eagerly from the same buffers from then on — the same step, with its launch overhead — and is
    listed in `failed` with the error: a model whose graphs cannot all be captured still serves.
    Should the device fail the eager step too, that error is raised."""

    def __init__(self, body: Callable[[int], torch.Tensor], device: torch.device, capture: bool,
                 share_pool_with: "DecodeGraphs | None" = None):
        self.body, self.device = body, device
        self.capture = capture and device.type == "cuda"
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.failed: dict[int, str] = {}
        self._pool = None
        # another set of graphs of the same runner (never replayed at the same time): one memory pool
        self._pool_owner = share_pool_with

    @property
    def pool(self):
        """The memory pool every capture of this set (and of the set it shares with) records into."""
        if self._pool_owner is not None:
            return self._pool_owner.pool
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @pool.setter
    def pool(self, value) -> None:
        if self._pool_owner is not None:
            self._pool_owner.pool = value
        else:
            self._pool = value

    def run(self, bucket: int) -> torch.Tensor:
        if not self.capture or bucket in self.failed:
            return self.body(bucket)
        if bucket not in self.graphs and not self._try_capture(bucket):
            return self.body(bucket)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out

    def capture_all(self, buckets: Sequence[int], clear: Callable[[int], None]) -> int:
        """Captures every bucket not captured (or failed) yet, on padding-only buffers (`clear`),
        largest first so the smaller ones reuse its memory pool; the number captured (0 off CUDA)."""
        if not self.capture:
            return 0
        todo = [b for b in sorted(buckets, reverse=True) if b not in self.graphs and b not in self.failed]
        captured = 0
        for b in todo:
            clear(b)
            captured += self._try_capture(b)
        return captured

    def _try_capture(self, bucket: int) -> bool:
        stream = torch.cuda.current_stream(self.device)
        try:
            self.graphs[bucket] = self._capture(bucket)
            return True
        except RuntimeError as e:  # torch.AcceleratorError, Triton's launch errors
            # torch.cuda.graph's exit does not restore the stream when capture_end raises
            torch.cuda.set_stream(stream)
            self.failed[bucket] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.body(bucket)  # the eager step on this device still works, or its error is raised
        torch.cuda.synchronize(self.device)
        return False

    def _capture(self, bucket: int):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: lazy initialisation and autotuning stay out of the graph
            for _ in range(2):
                self.body(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work meanwhile (a shared-tier export reads blocks on the
        # event loop's thread) is not an error in this capture
        with collector_paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.body(bucket)
        return graph, out


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (then as it was).

    Why a capture needs it: a collection may run at any allocation of a Python object — the body
    of a step makes thousands — and what it frees runs its destructors right there, on the
    capturing thread. A dead `torch.cuda.CUDAGraph` (a runner that is garbage but held in a cycle:
    `DecodeGraphs.body` is its runner's bound method) destroys its graph and executable
    (`cudaGraphDestroy`, `cudaGraphExecDestroy`), which the driver forbids while the thread
    captures: "operation not permitted when stream is capturing (function reset)", the capture
    invalidated (`cudaErrorStreamCaptureInvalidated`) and "operation failed due to a previous error
    during capture". torch's `torch.cuda.graph` used to `gc.collect()` before each capture; since
    torch 2.9 it does so only under `torch.compiler.config.force_cudagraph_gc`. Whether it struck
    depended on when a collection fell due — Qwen2-VL's forward makes more Python objects than
    LLaVA's, so a collection fell inside one of its captures (always the same one of a sequence:
    the count is deterministic) and never inside LLaVA's."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

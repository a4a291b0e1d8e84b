"""What the device allows, measured in the benchmark, for the report's absolute figures.

- **Copy bandwidth**: a large device-to-device copy (`dst.copy_(src)`; on the CPU a memcpy by
  torch's threads), the median of a few, as 2 × bytes / time (each byte read once and written
  once). A decode step is bound by reading the weights once: its limit is this bandwidth over the
  bytes it reads.
- **Bytes a decode step reads**: the language model's parameters and the output head's (each
  tensor once: a tied head is the embedding table), not the input embedding table, of which a
  step gathers a few rows, nor the vision tower, which decoding never runs.
- **Prefill time per token count**: one prompt of T text tokens through a `ModelRunner` step (the
  runtime's own prefill path: the paged forward, the step's logits), on its own small KV arena,
  synchronised with the device before and after; the median of `repeats` after one warm-up (a
  Triton kernel compiles per shape).
"""

from __future__ import annotations

import statistics
import time

import torch

from mmserve.bench.stand_in import winning_tokens
from mmserve.config.sections import KVCacheConfig
from mmserve.engine.arena import Segment
from mmserve.engine.runner import ModelRunner, StepInputs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: str | torch.device, mib: int, repeats: int = 5) -> dict:
    """{bytes, seconds, bytes_per_s}: the median copy of a `mib` MiB buffer into another."""
    device = torch.device(device)
    n = max(1, mib) << 20
    src = torch.ones(n, dtype=torch.uint8, device=device)  # written: its pages exist before the timing
    dst = torch.zeros_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(max(1, repeats)):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"bytes": n, "seconds": seconds, "bytes_per_s": 2 * n / seconds, "repeats": len(times)}


def decode_weight_bytes(adapter) -> int:
    """The bytes of weights one decode step reads (see the module docstring)."""
    embedding = adapter.model.get_input_embeddings().weight
    tensors = {}
    for p in adapter.language_model.parameters():
        if p is not embedding:
            tensors[p.data_ptr()] = p.numel() * p.element_size()
    for p in adapter.model.lm_head.parameters():
        tensors[p.data_ptr()] = p.numel() * p.element_size()
    return sum(tensors.values())


class PrefillTimer:
    """A runner over `adapter` with an arena for `max_tokens` tokens, timing one-prompt prefills.
    With `graph_buckets` (token counts) the runner captures a graph per bucket where it can (CUDA),
    so a prefill of exactly a bucket's tokens replays its graph: the captured path's time."""

    def __init__(self, adapter, max_tokens: int, block_size: int = KVCacheConfig().block_size,
                 graph_buckets: tuple[int, ...] | None = None):
        elem = torch.empty((), dtype=adapter.dtype).element_size()
        block_bytes = 2 * adapter.kv_layers * block_size * adapter.kv_heads * adapter.head_dim * elem
        blocks = -(-max_tokens // block_size) + 2  # + the static path's scratch block, + one spare
        graphs = bool(graph_buckets)
        self.runner = ModelRunner(adapter, blocks * block_bytes, block_size, max_batch=1, cuda_graphs=graphs,
                                  max_tokens=max(max_tokens, *(graph_buckets or (0,))),
                                  token_buckets=tuple(graph_buckets) if graphs else None)
        self.captured = self.runner.capture() if graphs and self.runner.captures else 0
        self.adapter, self.block_size = adapter, block_size
        self.tokens = winning_tokens(adapter, adapter.vocab_size)

    def step(self, n: int) -> StepInputs:
        ids = tuple((self.tokens * (n // len(self.tokens) + 1))[:n])
        table = tuple(range(-(-n // self.block_size)))
        positions = None
        if self.adapter.mrope:  # text only: every M-RoPE row is the index
            positions = torch.arange(n, dtype=torch.long).unsqueeze(0).expand(self.runner.rope_rows, n)
        return StepInputs(ids, (Segment(table, 0, n),), positions=positions)

    def time(self, n: int, repeats: int) -> dict:
        """{tokens, ms (median), ms_all}: `repeats` prefills of n tokens after one warm-up."""
        step, device = self.step(n), self.runner.device
        self.runner.forward(step)
        _sync(device)
        times = []
        for _ in range(max(1, repeats)):
            _sync(device)
            t0 = time.perf_counter()
            self.runner.forward(step)
            _sync(device)
            times.append(1000 * (time.perf_counter() - t0))
        return {"tokens": n, "ms": statistics.median(times), "ms_all": times}

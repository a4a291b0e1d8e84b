"""The static vision step: a fixed-shape family's vision tower and projector from static buffers,
per view-count bucket; on CUDA a graph per bucket, captured at load and replayed.

An encoder call of V views (LLaVA: one an image; Gemma 3: an image and its pan-and-scan crops;
Idefics3: its tiles and global view — `models.fixed_tower`) runs in the smallest bucket (`[runtime]
graph_image_buckets`; default 1, 2, 4, ... up to `[encoder_cache] max_batch_images` on CUDA) that
holds V: the views are copied into rows [0, V) of `VisionBuffers` (pixels, and Idefics3's pixel
masks), rows [V, bucket) are padding (zero pixels, full masks: finite rows nobody reads), and the
bucket's body runs — or its graph replays (`DecodeGraphs`: warm-up on a side stream, the collector
paused, one memory pool for the tower's buckets). A call of more views than the largest bucket is
split into runs of the largest and one of the rest (`oversized_calls` counts such calls). Each
run's real rows are copied out of the graph's output at once, so a later replay never rewrites an
output the encoder cache holds; padding rows are never copied.

A view's rows depend on that view alone (a vision transformer attends within a view; no op of the
tower mixes batch rows), so padding changes no real row's arithmetic: on the CPU the static rows
equal the eager tower's exactly (`torch.equal`, tests/test_vision_graphs.py); on CUDA a GEMM may
pick another tile shape for another batch size, which can change the rounding (bf16 noise, never
the values of other rows).

`VisionPath` is what the encoder actor calls: the static step where the family has a fixed tower and
buckets are set, else the adapter's eager `encode_images`, counting why (`eager_reasons`: the
`mmserve:encoder_eager_runs` metric).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from mmserve.engine.decode_graphs import DecodeGraphs, bucket_of, buckets
from mmserve.models.fixed_tower import FixedTower, TowerViews


def image_buckets(max_views: int) -> tuple[int, ...]:
    """The default view-count buckets: 1, 2, 4, ... then `max_views` (the encoder's batch size)."""
    return buckets(max(1, max_views))


def image_buckets_for(configured: Sequence[int], device: torch.device | str, max_batch_images: int) -> tuple[int, ...]:
    """The buckets of a model's static tower: `[runtime] graph_image_buckets`, else on CUDA
    `image_buckets(max_batch_images)` (an encoder call's images; a call of Gemma 3's crops or
    Idefics3's tiles may hold more views: split), else none — off CUDA padding costs real work and
    saves no launch, so the tower stays eager unless a list asks for the static step."""
    if configured:
        return tuple(configured)
    return image_buckets(max_batch_images) if torch.device(device).type == "cuda" else ()


class VisionBuffers:
    """The static inputs of a vision step, `max_views` rows each, on the model's device."""

    def __init__(self, max_views: int, view_shape: tuple[int, int, int], masked: bool, dtype: torch.dtype,
                 device: torch.device):
        self.max_views = max_views
        self.pixels = torch.zeros(max_views, *view_shape, dtype=dtype, device=device)
        self.mask = torch.ones(max_views, *view_shape[1:], dtype=torch.bool, device=device) if masked else None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every buffer (tests check that steps read only these, at fixed addresses)."""
        return (self.pixels,) if self.mask is None else (self.pixels, self.mask)

    def fill(self, views: TowerViews, bucket: int) -> None:
        """Views [0, n) into rows [0, n); rows [n, bucket) padding."""
        n = views.pixels.shape[0]
        if n > bucket or bucket > self.max_views:
            raise ValueError(f"{n} views in a bucket of {bucket} (max {self.max_views})")
        self.pixels[:n].copy_(views.pixels)
        self.pixels[n:bucket].zero_()
        if self.mask is not None:
            self.mask[:n].copy_(views.mask)
            self.mask[n:bucket].fill_(True)  # a view with no real pixel would attend to nothing (NaN)

    def clear(self, bucket: int) -> None:
        """Every row of the bucket padding (what a capture at load runs on)."""
        self.pixels[:bucket].zero_()
        if self.mask is not None:
            self.mask[:bucket].fill_(True)

    def body_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.pixels[:bucket], None if self.mask is None else self.mask[:bucket]


class StaticVision:
    """A fixed tower run from `VisionBuffers` per bucket (see the module docstring)."""

    def __init__(self, tower: FixedTower, sizes: Sequence[int], device: torch.device, dtype: torch.dtype,
                 capture: bool):
        sizes = tuple(sorted(set(int(s) for s in sizes)))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"image buckets must be positive, not {sizes}")
        self.tower, self.buckets = tower, sizes
        self.buffers = VisionBuffers(sizes[-1], tower.view_shape, tower.masked, dtype, device)
        # its own memory pool: a replay of the runner's graphs (whose logits may wait on the device
        # for sampling) never rewrites a tower output, nor the other way round
        self.graphs = DecodeGraphs(self.body, device, capture)
        self.runs: Counter[int] = Counter()  # bucket -> static runs
        self.oversized_calls = 0  # calls of more views than the largest bucket (split)

    @property
    def captures(self) -> bool:
        return self.graphs.capture

    def body(self, bucket: int) -> torch.Tensor:
        """The tower over the buffers' first `bucket` rows -> [bucket, rows, width]: reads the
        buffers and the model's weights only (capturable)."""
        return self.tower.body(*self.buffers.body_inputs(bucket))

    @torch.inference_mode()
    def capture(self) -> int:
        """Every bucket's graph now (CUDA with graphs on; else nothing), largest first so the
        smaller ones reuse the pool; the number captured."""
        return self.graphs.capture_all(self.buckets, self.buffers.clear)

    def rows(self, views: TowerViews) -> torch.Tensor:
        """[V, rows, width]: the tower's rows of every view, a fresh tensor (never a buffer)."""
        total, largest = views.pixels.shape[0], self.buckets[-1]
        if total > largest:
            self.oversized_calls += 1
        out = None
        for start in range(0, total, largest):
            n = min(largest, total - start)
            bucket = bucket_of(n, self.buckets)
            part = TowerViews(views.pixels[start:start + n],
                              None if views.mask is None else views.mask[start:start + n])
            self.buffers.fill(part, bucket)
            got = self.graphs.run(bucket)
            self.runs[bucket] += 1
            if out is None:
                out = torch.empty((total, *got.shape[1:]), dtype=got.dtype, device=got.device)
            out[start:start + n].copy_(got[:n])  # the real rows only: padding never leaves the step
        return out


class VisionPath:
    """How the encoder runs one tower call: the static step (a fixed tower, buckets set) or the
    adapter's eager `encode_images`, with the counts the metrics export."""

    def __init__(self, adapter, image_buckets: Sequence[int] = (), cuda_graphs: bool = True):
        self.adapter = adapter
        self.static: StaticVision | None = None
        self.eager_reasons: Counter[str] = Counter()
        tower = adapter.fixed_tower() if image_buckets else None
        self._off = "static_off" if not image_buckets else "dynamic_shapes" if tower is None else None
        if tower is not None:
            self.static = StaticVision(tower, image_buckets, adapter.device, adapter.dtype, cuda_graphs)

    @property
    def captures(self) -> bool:
        """Whether the static steps run as captured CUDA graphs (`capture` then has work to do)."""
        return self.static is not None and self.static.captures

    def capture(self) -> int:
        return self.static.capture() if self.static is not None else 0

    @property
    def failed_captures(self) -> dict[int, str]:
        return dict(self.static.graphs.failed) if self.static is not None else {}

    @property
    def static_runs(self) -> Counter[int]:
        return self.static.runs if self.static is not None else Counter()

    @torch.inference_mode()
    def encode(self, items: Sequence) -> list[torch.Tensor]:
        """One encoder output per item, as `Adapter.encode_images` gives them."""
        if self.static is None:
            return self._eager(items, self._off)
        tower = self.static.tower
        views = tower.views(items)
        if tuple(views.pixels.shape[1:]) != tower.view_shape:  # a processor set to another size
            return self._eager(items, "view_shape")
        return tower.assemble(items, self.static.rows(views))

    def _eager(self, items: Sequence, reason: str) -> list[torch.Tensor]:
        self.eager_reasons[reason] += 1
        return self.adapter.encode_images(items)

"""Qwen2-VL's video processor (`Qwen2VLVideoProcessor`), step for step, without torchvision.

transformers' video processors run on torchvision, which has no build for this CPU torch (its
0.28 wheel's operators do not register), so the arithmetic is reproduced here with torch alone:
- settings: the checkpoint's `video_preprocessor_config.json`, else its `preprocessor_config.json`
  (transformers' fallback), over the class defaults;
- frame sampling (`sample_frames`): `num_frames` rounded to the temporal patch size, or `fps`
  frames per second between `min_frames` and `max_frames`, at indices arange(0, n, n / k);
- resize (`smart_resize` to multiples of patch x merge within the pixel budgets; with a
  `total_pixels` budget, each frame's share of it, as `cap_pixels_per_frame` computes it), by
  torchvision's CPU path for uint8 frames: `interpolate(uint8, bicubic, antialias=True)`;
- rescale and normalize fused as transformers' torchvision backend fuses them ((x - 255 mean) /
  (255 std), in float32), then patches grouped `temporal_patch_size` frames at a time (the last
  frame repeated to a whole group), flattened in the processor's order.

Where this differs from transformers: with neither `fps` nor `num_frames`, frames are sampled at
`[video] default_fps` (qwen-vl-utils' 2 fps) instead of every frame being kept, and fps sampling is
capped at `[video] max_frames`; a video shorter than one temporal group keeps all its frames (the
processor would sample none and fail).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mmserve.cache.keys import processor_digest
from mmserve.models.adapter import ImageSpan
from mmserve.models.video_item import Plan, VideoItem, VideoMeta, VideoSampling

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class QwenVideoSettings:
    """The video processor's settings that change a video's tokens (Qwen2VLVideoProcessor's defaults)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28  # size["shortest_edge"]
    max_pixels: int = 28 * 28 * 768  # size["longest_edge"]
    min_frames: int = 4
    max_frames: int = 768
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    processor: str = "Qwen2VLVideoProcessor"  # whose arithmetic (sampling, resize) these settings drive
    extra: dict = field(default_factory=dict, compare=False)  # other keys of the saved config

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def digest(self) -> int:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        return processor_digest({"video_processor": self.processor, **d})


def load_settings(path: Path, **overrides) -> QwenVideoSettings:
    """The checkpoint's video processor settings, read as transformers reads them."""
    saved: dict = {}
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (path / name).is_file():
            saved = json.loads((path / name).read_text())
            break
    size = dict(saved.get("size") or {})
    values = {k: saved[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "min_frames", "max_frames",
                                    "rescale_factor") if saved.get(k) is not None}
    values["min_pixels"] = saved.get("min_pixels") or size.get("shortest_edge") or QwenVideoSettings.min_pixels
    values["max_pixels"] = saved.get("max_pixels") or size.get("longest_edge") or QwenVideoSettings.max_pixels
    for k in ("image_mean", "image_std"):
        if saved.get(k) is not None:
            values[k] = tuple(float(x) for x in saved[k])
    values.update(overrides)
    return QwenVideoSettings(**values)


def sample_indices(meta: VideoMeta, sampling: VideoSampling, s: QwenVideoSettings,
                   frame_cap: int = 768) -> tuple[int, ...]:
    """`Qwen2VLVideoProcessor.sample_frames` on the video's metadata (see the module doc); the
    intake fills in `sampling.fps` when the request names no sampling."""
    total, tps = meta.total_frames, s.temporal_patch_size
    if sampling.num_frames is not None:
        num = round(sampling.num_frames / tps) * tps
        if num > total:
            raise ValueError(f"num_frames={sampling.num_frames} asks for {num} frames; the video has {total}")
    else:
        most = math.floor(min(s.max_frames, frame_cap, total) / tps) * tps
        num = min(max(total / meta.fps * sampling.fps, s.min_frames), most, total)
        num = math.floor(num / tps) * tps
    if num <= 0:  # shorter than one temporal group: every frame (patchify repeats the last)
        return tuple(range(total))
    return tuple(int(i) for i in torch.arange(0, total, total / num).int().tolist())


def resized_size(height: int, width: int, n_frames: int, sampling: VideoSampling,
                 s: QwenVideoSettings) -> tuple[int, int]:
    """(height, width) every frame is resized to (`Qwen2VLVideoProcessor.resize`)."""
    min_pixels = sampling.min_pixels if sampling.min_pixels is not None else s.min_pixels
    max_pixels = sampling.max_pixels if sampling.max_pixels is not None else s.max_pixels
    if sampling.total_pixels is not None:  # cap_pixels_per_frame with the request's total budget
        max_pixels = max(min(max_pixels, sampling.total_pixels * s.temporal_patch_size // n_frames),
                         int(min_pixels * 1.05))
    return smart_resize(height, width, factor=s.factor, min_pixels=min_pixels, max_pixels=max_pixels)


def video_grid(item: VideoItem, s: QwenVideoSettings) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of the sampled video."""
    n = len(item.indices)
    h, w = resized_size(item.meta.height, item.meta.width, n, item.sampling, s)
    return (-(-n // s.temporal_patch_size), h // s.patch_size, w // s.patch_size)


def video_patches(frames: np.ndarray, resized: tuple[int, int], s: QwenVideoSettings) -> torch.Tensor:
    """The flattened patches [t * h * w, C * temporal * patch * patch] of [T, H, W, 3] uint8 frames."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [T, C, H, W] uint8
    if tuple(video.shape[-2:]) != tuple(resized):
        video = torch.nn.functional.interpolate(video, size=resized, mode="bicubic", antialias=True,
                                                align_corners=False)
    mean = torch.tensor(s.image_mean) * (1.0 / s.rescale_factor)
    std = torch.tensor(s.image_std) * (1.0 / s.rescale_factor)
    video = (video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    tps, p, m = s.temporal_patch_size, s.patch_size, s.merge_size
    if pad := -video.shape[0] % tps:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    t, c, h, w = video.shape
    gt, gh, gw = t // tps, h // p, w // p
    patches = video.reshape(gt, tps, c, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * tps * p * p).contiguous()


def video_plan(sampling: VideoSampling, s: QwenVideoSettings, frame_cap: int) -> Plan:
    return lambda meta: sample_indices(meta, sampling, s, frame_cap)


def expand_placeholders(compact: list[int], items: list[tuple[int, int]]) -> tuple[tuple[int, ...], tuple]:
    """(input_ids, spans) of a templated prompt whose k-th image or video pad token (in prompt
    order) is repeated to items[k] = (its pad token id, its token count)."""
    pads = {token for token, _ in items}
    where = [i for i, t in enumerate(compact) if t in pads]
    if [compact[i] for i in where] != [token for token, _ in items]:
        raise ValueError(f"the prompt's image and video placeholders ({len(where)}) do not match its "
                         f"{len(items)} images and videos in order")
    ids: list[int] = []
    spans = []
    start = 0
    for i, (token, n) in zip(where, items):
        ids += compact[start:i]
        spans.append(ImageSpan(len(ids), n))
        ids += [token] * n
        start = i + 1
    return tuple(int(t) for t in ids + compact[start:]), tuple(spans)

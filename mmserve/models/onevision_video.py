"""LLaVA-OneVision's video processor (`LlavaOnevisionVideoProcessor`) and its token count, without
torchvision (see `qwen_video` for why).

- sampling: transformers' `default_sample_indices_fn` — `num_frames` frames, or `fps` frames per
  second (at least one), at indices arange(k) * n // k — capped at `[video] max_frames`;
- each frame resized to the tower's square tile (the processor's `size`), by torchvision's CPU
  path for uint8 frames (`interpolate(uint8, bicubic, antialias=True)`), then rescale and
  normalize fused as transformers' torchvision backend fuses them: [T, C, S, S] per video;
- tokens: each frame's feature map is pooled 2x (bilinear, `apply_pooling`) to ceil(side / 2)^2
  rows, and the video ends with one `image_newline` row: T * ceil(side / 2)^2 + 1, as
  `LlavaOnevisionProcessor` counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.cache.keys import processor_digest
from mmserve.models.video_item import VideoMeta, VideoSampling


@dataclass(frozen=True)
class OnevisionVideoSettings:
    tile: int  # the square side every frame is resized to
    feature_side: int  # the tower's feature map side (image_size // patch_size)
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float

    @property
    def pooled_side(self) -> int:
        return math.ceil(self.feature_side / 2)

    def tokens(self, frames: int) -> int:
        return frames * self.pooled_side ** 2 + 1

    def digest(self) -> int:
        return processor_digest({"video_processor": "LlavaOnevisionVideoProcessor", **self.__dict__})


def onevision_settings(image_processor, vision_config) -> OnevisionVideoSettings:
    """The video processor's settings as transformers reads them without a video config of its own
    (the image processor's `size`, normalisation and rescale factor)."""
    return OnevisionVideoSettings(
        tile=int(vision_config.image_size), feature_side=int(vision_config.image_size) // int(vision_config.patch_size),
        image_mean=tuple(float(x) for x in image_processor.image_mean),
        image_std=tuple(float(x) for x in image_processor.image_std),
        rescale_factor=float(image_processor.rescale_factor))


def sample_indices(meta: VideoMeta, sampling: VideoSampling, frame_cap: int) -> tuple[int, ...]:
    """`default_sample_indices_fn` on the video's metadata (the intake fills in `fps`)."""
    total = meta.total_frames
    if sampling.num_frames is not None:
        num = sampling.num_frames
        if num > total:
            raise ValueError(f"num_frames={num} exceeds the video's {total} frames")
    else:
        num = min(max(1, int(total / meta.fps * sampling.fps)), frame_cap, total)
    return tuple(int(i) for i in np.arange(num, dtype=int) * total // num)


def video_pixels(frames: np.ndarray, s: OnevisionVideoSettings) -> torch.Tensor:
    """[T, C, S, S] float32 of [T, H, W, 3] uint8 frames."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    if tuple(video.shape[-2:]) != (s.tile, s.tile):
        video = torch.nn.functional.interpolate(video, size=(s.tile, s.tile), mode="bicubic", antialias=True,
                                                align_corners=False)
    mean = torch.tensor(s.image_mean) * (1.0 / s.rescale_factor)
    std = torch.tensor(s.image_std) * (1.0 / s.rescale_factor)
    return ((video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)).contiguous()

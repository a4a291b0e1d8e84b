"""Qwen3-VL's video processor (`Qwen3VLVideoProcessor`) and processor (`Qwen3VLProcessor`), step
for step, without torchvision (see `qwen_video` for the steps Qwen2-VL shares: resize, normalize,
temporal patches).

What is Qwen3-VL's own:
- sampling: `num_frames` frames (or `fps` frames per second, at least `min_frames`, at most
  `max_frames` and the video's) at `linspace(0, n - 1, k).round()`; no rounding to whole groups;
- resize: `smart_resize` over the whole video (t x h x w within [min_pixels, max_pixels]) — a
  request's `total_pixels` lowers `max_pixels`, which is already a budget for the whole video;
- timestamps in the prompt: each temporal group of `temporal_patch_size` frames is written as
  ``<{t:.1f} seconds><|vision_start|>`` + its pads + ``<|vision_end|>``, t the mean time of its
  first and last frame (the last frame repeated to fill a group), in place of the template's
  ``<|vision_start|><|video_pad|><|vision_end|>``. So each group is an item of its own
  (`VideoGroup`: its own span, its own key, grid (1, h, w)), as the model's `get_rope_index`
  treats it too (it splits a video's grid into t grids of one group). The vision tower attends
  within one group's patches (one window per frame group) and its position embeddings repeat per
  group, so a group encoded alone equals its rows of the whole video encoded at once.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

from mmserve.models.qwen_video import QwenVideoSettings, load_settings
from mmserve.models.video_item import VideoGroup, VideoItem, VideoMeta, VideoSampling

_HALF = (0.5, 0.5, 0.5)


def load_qwen3_settings(path) -> QwenVideoSettings:
    """The checkpoint's settings over Qwen3VLVideoProcessor's defaults (patch 16, mean = std = 0.5)."""
    defaults = QwenVideoSettings(patch_size=16, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768,
                                 image_mean=_HALF, image_std=_HALF, processor="Qwen3VLVideoProcessor")
    saved = load_settings(path)
    given = {k: getattr(saved, k) for k in ("patch_size", "temporal_patch_size", "merge_size", "min_frames",
                                            "max_frames", "rescale_factor", "image_mean", "image_std",
                                            "min_pixels", "max_pixels")
             if getattr(saved, k) != getattr(QwenVideoSettings(), k)}
    return replace(defaults, **given)


def sample_indices(meta: VideoMeta, sampling: VideoSampling, s: QwenVideoSettings, frame_cap: int) -> tuple[int, ...]:
    """`Qwen3VLVideoProcessor.sample_frames` (see the module doc); the intake fills in `fps`."""
    total = meta.total_frames
    most = min(s.max_frames, frame_cap)
    if sampling.num_frames is not None:
        num = min(sampling.num_frames, total)
    else:
        num = int(total / meta.fps * sampling.fps)
        num = min(max(num, s.min_frames), most, total)
    return tuple(int(i) for i in np.linspace(0, total - 1, num).round().astype(int))


def resized_size(item: VideoItem, s: QwenVideoSettings) -> tuple[int, int]:
    sampling = item.sampling
    min_pixels = sampling.min_pixels if sampling.min_pixels is not None else s.min_pixels
    max_pixels = sampling.max_pixels if sampling.max_pixels is not None else s.max_pixels
    if sampling.total_pixels is not None:
        max_pixels = max(min(max_pixels, sampling.total_pixels), min_pixels)
    return smart_resize(len(item.indices), item.meta.height, item.meta.width, temporal_factor=s.temporal_patch_size,
                        factor=s.factor, min_pixels=min_pixels, max_pixels=max_pixels)


def groups(item: VideoItem, s: QwenVideoSettings) -> list[VideoGroup]:
    """The video's temporal groups, each with its timestamp (`Qwen3VLProcessor._calculate_timestamps`)."""
    tps = s.temporal_patch_size
    indices = list(item.indices)
    indices += [indices[-1]] * (-len(indices) % tps)
    times = [i / item.meta.fps for i in indices]
    stamps = [(times[k] + times[k + tps - 1]) / 2 for k in range(0, len(times), tps)]
    return [VideoGroup(item, g, len(stamps), t) for g, t in enumerate(stamps)]


def group_frames(group: VideoGroup, s: QwenVideoSettings) -> np.ndarray:
    """The group's frames ([temporal_patch_size, H, W, 3]; the video's last frame repeated to fill it)."""
    frames = group.video.frames()
    tps = s.temporal_patch_size
    chunk = frames[group.group * tps:(group.group + 1) * tps]
    if len(chunk) < tps:
        chunk = np.concatenate([chunk, np.repeat(frames[-1:], tps - len(chunk), axis=0)])
    return chunk


def timestamped_prompt(text: str, videos: list[list[VideoGroup]], vision_start: str, video_pad: str,
                       vision_end: str) -> str:
    """The template's text with each video's ``start + pad + end`` replaced by its groups, each after
    its timestamp (as `Qwen3VLProcessor.replace_video_token` writes them, one pad per group here)."""
    triple = vision_start + video_pad + vision_end
    pieces = text.split(triple)  # split once: a replacement holds the triple again
    if len(pieces) != len(videos) + 1:
        raise ValueError(f"the prompt has {len(pieces) - 1} video placeholders for {len(videos)} videos")
    out = [pieces[0]]
    for gs, after in zip(videos, pieces[1:]):
        out += [f"<{g.timestamp:.1f} seconds>{triple}" for g in gs] + [after]
    return "".join(out)

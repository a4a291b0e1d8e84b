"""Video content parts and their settings, as vLLM takes them in a chat request.

- `{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}` (vLLM's extension of
  OpenAI's schema), or an `http(s)` URL fetched under the remote-image rules (`[limits]
  remote_image_*`: allow-list, vetted addresses, byte cap, deadline), with `[video] max_bytes`.
- Pre-extracted frames: `{"type": "video", "video": [<image data: or http(s) URL>, ...]}` (each
  frame an image, read as image parts are); embedded callers may also pass PIL images or a
  [T, H, W, 3] uint8 array as `video`.
- Per-request settings in vLLM's `mm_processor_kwargs`: `fps` or `num_frames` (at most one),
  `min_pixels` / `max_pixels` (per frame) and `total_pixels` (the whole video), as
  qwen-vl-utils names them. Unknown keys are refused (vLLM hands them to the processor; mmserve
  knows which settings it honours, and a silently ignored setting would cache wrong expectations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.config import LimitsConfig
from mmserve.errors import BadRequest, clip
from mmserve.inputs.remote_images import check_url, is_remote_url
from mmserve.models.video_item import VideoSampling

VIDEO_FIELDS = {"mm_processor_kwargs"}
MAX_FRAME_LIST = 4096  # a frame list's length at parse time ([video] max_frames bounds it at intake)
_KWARGS = ("fps", "num_frames", "min_pixels", "max_pixels", "total_pixels")


@dataclass(frozen=True, eq=False)
class VideoPart:
    """A video as given: a `data:` or checked remote URL (`url`), a list of frames (`frames`: image
    URLs or PIL images), or, from embedded callers, a [T, H, W, 3] uint8 array (`array`)."""

    url: str | None = None
    frames: tuple = ()
    array: Any = None


def _url(value: Any, where: str, limits: LimitsConfig, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}: {what} must be a URL string", param=where)
    if is_remote_url(value):
        check_url(value, limits.remote_image_policy, where)
        return value
    if not value.startswith("data:"):
        allowed = "a data: URL or an http(s) URL" if limits.remote_images else "a data: URL"
        raise BadRequest(f"{where}: {what} must be {allowed}", param=where)
    return value


def parse_video_part(part: dict, where: str, limits: LimitsConfig) -> VideoPart:
    """A `video_url` or `video` content part, checked for shape (no I/O; decoded by the intake)."""
    if part.get("type") == "video_url":
        spec = part.get("video_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        return VideoPart(url=_url(url, where, limits, "'video_url' (an object with a 'url')"))
    video = part.get("video")
    if isinstance(video, np.ndarray):  # embedded callers
        if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3 or not video.shape[0]:
            raise BadRequest(f"{where}: a 'video' array must be [frames, height, width, 3] uint8, got "
                             f"{video.shape} {video.dtype}", param=where)
        return VideoPart(array=video)
    if isinstance(video, str):
        return VideoPart(url=_url(video, where, limits, "'video'"))
    if not isinstance(video, (list, tuple)) or not video:
        raise BadRequest(f"{where}: a 'video' part needs 'video': a non-empty list of frames (image URLs)",
                         param=where)
    if len(video) > MAX_FRAME_LIST:
        raise BadRequest(f"{where}: a frame list holds at most {MAX_FRAME_LIST} frames", param=where)
    frames = []
    for k, frame in enumerate(video):
        if isinstance(frame, dict):  # {"type": "image_url", "image_url": {"url": ...}} per frame
            spec = frame.get("image_url")
            frame = spec.get("url") if isinstance(spec, dict) else spec
        if isinstance(frame, str):
            frames.append(_url(frame, f"{where}.video[{k}]", limits, "a frame"))
        elif type(frame).__module__.startswith("PIL."):
            frames.append(frame)
        else:
            raise BadRequest(f"{where}.video[{k}]: a frame must be an image URL, got {clip(frame)}",
                             param=f"{where}.video[{k}]")
    return VideoPart(frames=tuple(frames))


def _positive(kwargs: dict, key: str, integer: bool, hi: float) -> Any:
    v = kwargs.get(key)
    if v is None:
        return None
    ok = isinstance(v, int) and not isinstance(v, bool) if integer else (
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
    if not ok or not 0 < v <= hi:
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'mm_processor_kwargs.{key}' must be {kind} above 0 and at most {hi:g}, got {clip(v)}",
                         param=f"mm_processor_kwargs.{key}")
    return float(v) if not integer else v


def video_sampling(body: dict) -> VideoSampling:
    """The request's video settings from `mm_processor_kwargs` (absent: the defaults)."""
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None:
        return VideoSampling()
    if not isinstance(kwargs, dict):
        raise BadRequest("'mm_processor_kwargs' must be an object like {\"fps\": 2}", param="mm_processor_kwargs")
    unknown = sorted(set(kwargs) - set(_KWARGS))
    if unknown:
        raise BadRequest(f"mm_processor_kwargs: {clip(unknown[0], 64)} is not a setting mmserve honours (supported: "
                         f"{', '.join(_KWARGS)})", param="mm_processor_kwargs")
    sampling = VideoSampling(
        fps=_positive(kwargs, "fps", False, 240), num_frames=_positive(kwargs, "num_frames", True, 4096),
        min_pixels=_positive(kwargs, "min_pixels", True, 2**31), max_pixels=_positive(kwargs, "max_pixels", True, 2**31),
        total_pixels=_positive(kwargs, "total_pixels", True, 2**40))
    if sampling.fps is not None and sampling.num_frames is not None:
        raise BadRequest("mm_processor_kwargs: 'fps' and 'num_frames' are mutually exclusive (as transformers' "
                         "video processors take them)", param="mm_processor_kwargs")
    if None not in (sampling.min_pixels, sampling.max_pixels) and sampling.min_pixels > sampling.max_pixels:
        raise BadRequest("mm_processor_kwargs: 'min_pixels' is above 'max_pixels'", param="mm_processor_kwargs")
    return sampling

"""A video as the adapters see it: its header's metadata, the frames sampled from it, their content
digest, and the request's sampling settings — everything its tokens depend on — with the frames
themselves loaded only when the vision tower needs them.

The frames are decoded by `mmserve.inputs.video` (PyAV). When a second question names a file the
intake has decoded before under the same settings, the item is built from what was learnt then,
and `load` decodes the file again only if the encoder cache no longer holds its output: a hit
skips both decoding and encoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VideoMeta:
    """What a video's header says, known before any frame is decoded."""

    width: int
    height: int
    total_frames: int
    fps: float  # the stream's average frame rate (a frame list's: the rate it was extracted at)

    @property
    def duration_s(self) -> float:
        return self.total_frames / self.fps


@dataclass(frozen=True)
class VideoSampling:
    """A request's video settings (vLLM's `mm_processor_kwargs`): frames per second or a frame
    count (at most one), and the pixel budgets per frame and for the whole video. None: the
    model's (and the server's) default."""

    fps: float | None = None
    num_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None

    def settings(self) -> dict:
        """The settings given, as the keys (`video_header`, `video_source_key`) carry them."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True, eq=False)
class VideoItem:
    """One video of a prompt: the frames at `indices` of a source described by `meta`."""

    meta: VideoMeta
    indices: tuple[int, ...]
    content: bytes  # keys.video_content_digest of the sampled frames
    sampling: VideoSampling
    load: Callable[[], np.ndarray]  # the sampled frames [T, H, W, 3] uint8 (decoded again if not kept)
    kind: str = "file"  # "file" or "frames" (a list of pre-extracted frames)

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled frames (transformers' `VideoMetadata.sampled_fps`)."""
        return len(self.indices) / self.meta.total_frames * self.meta.fps

    @property
    def timestamps(self) -> tuple[float, ...]:
        """Each sampled frame's time in the source, in seconds."""
        return tuple(i / self.meta.fps for i in self.indices)

    def frames(self) -> np.ndarray:
        frames = self.load()
        if frames.shape != (len(self.indices), self.meta.height, self.meta.width, 3) or frames.dtype != np.uint8:
            raise RuntimeError(f"a video's frames are {frames.shape} {frames.dtype}; its metadata says "
                               f"{(len(self.indices), self.meta.height, self.meta.width, 3)} uint8")
        return frames


# (metadata) -> the indices of the frames to keep, ascending: the family's frame sampling
Plan = Callable[[VideoMeta], tuple[int, ...]]


@dataclass(frozen=True, eq=False)
class VideoGroup:
    """One temporal group of a video (`temporal_patch_size` frames: one grid row of t) as an item
    of its own: Qwen3-VL writes each group's timestamp as text before it, so each has a span."""

    video: VideoItem
    group: int
    groups: int
    timestamp: float  # seconds (the mean of its first and last frame's times)


def is_video(item) -> bool:
    return isinstance(item, (VideoItem, VideoGroup))

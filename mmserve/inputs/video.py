"""Video files decoded with PyAV (FFmpeg), in worker threads, never on the event loop.

Every bound is checked before the work it bounds (`[video]` in config.toml):
- the bytes before the file is opened (`max_bytes`, also for fetched files);
- from the container's header, before a frame is decoded: a container format of a video (a PNG
  or JPEG sent as a video is a still image, refused), a video stream (an audio-only file is
  refused), the frame size (`max_frame_pixels`), the duration (`max_duration_s`), the frame rate
  and the frame count (counted by demuxing, which decodes nothing, when the header lacks it);
- the frames to keep — the family's sampling (`plan`) picks their indices from that metadata —
  must fit `max_frames` and `max_total_pixels` (sampled frames x frame pixels: the RGB kept);
- decoding stops after the last frame to keep, and runs under `decode_timeout_s`.
Anything FFmpeg cannot read (corrupt, truncated, empty) is a 400 `invalid_video` naming the part.

Frames are converted to RGB as transformers' PyAV video loader does (`frame.to_ndarray(format=
"rgb24")`), and the sampled frames' content key (`content_digest`) covers exactly those pixels.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np

from mmserve.cache.keys import video_content_digest
from mmserve.config.video import VideoConfig
from mmserve.errors import BadRequest, PayloadTooLarge
from mmserve.models.video_item import Plan, VideoMeta

# FFmpeg's names of the containers accepted as video; image demuxers (png_pipe, image2, ...) are not
VIDEO_CONTAINERS = frozenset({
    "mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "mpeg", "mpegts", "ogg", "flv", "asf", "h264", "hevc",
})


class InvalidVideo(BadRequest):
    """A video part that cannot be read as a video (HTTP 400, code `invalid_video`)."""

    code = "invalid_video"


@dataclass(frozen=True, eq=False)
class DecodedVideo:
    """The sampled frames of one video ([T, H, W, 3] uint8 RGB), where they came from, and their
    content digest."""

    frames: np.ndarray
    meta: VideoMeta
    indices: tuple[int, ...]
    content: bytes  # video_content_digest of `frames`


def check_size(n_bytes: int, cfg: VideoConfig, where: str) -> None:
    if n_bytes > cfg.max_bytes:
        raise PayloadTooLarge(f"{where}: video is larger than the {cfg.max_bytes} byte limit ([video] max_bytes)",
                              param=where)


def _av():
    import av  # imported on first use: a server that never sees a video never loads FFmpeg

    return av


def _invalid(where: str, what: str) -> InvalidVideo:
    return InvalidVideo(f"{where}: {what}", param=where)


def probe(container, cfg: VideoConfig, where: str, deadline: float) -> tuple[object, VideoMeta]:
    """(the video stream, its metadata) from the header (and, without a frame count there, from
    demuxing), every bound on it checked; nothing is decoded."""
    if container.format.name not in VIDEO_CONTAINERS:
        raise _invalid(where, f"data is not a video (FFmpeg reads it as {container.format.name!r}; a still image "
                              "is an image part)")
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise _invalid(where, f"the file has no video stream (streams: {', '.join(kinds)})")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    width, height = int(ctx.width or 0), int(ctx.height or 0)
    if width <= 0 or height <= 0:
        raise _invalid(where, "the video stream has no frame size")
    if width * height > cfg.max_frame_pixels:
        raise _invalid(where, f"frames are {width}x{height} = {width * height} pixels, above the "
                              f"{cfg.max_frame_pixels} pixel limit ([video] max_frame_pixels)")
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else 0.0
    if not fps > 0 or fps > 1000:
        raise _invalid(where, f"the video stream has no usable frame rate ({rate})")
    duration = container.duration / 1_000_000 if container.duration else None  # AV_TIME_BASE
    if duration is not None and duration > cfg.max_duration_s:
        raise _invalid(where, f"the video is {duration:.1f} s long, above the {cfg.max_duration_s:g} s limit "
                              "([video] max_duration_s)")
    total = int(stream.frames or 0)
    if total <= 0:
        total = _count_packets(container, stream, where, deadline)
        container.seek(0)
    if total <= 0:
        raise _invalid(where, "the video has no frames")
    meta = VideoMeta(width, height, total, fps)
    if meta.duration_s > cfg.max_duration_s:
        raise _invalid(where, f"the video is {meta.duration_s:.1f} s long, above the {cfg.max_duration_s:g} s "
                              "limit ([video] max_duration_s)")
    return stream, meta


def _count_packets(container, stream, where: str, deadline: float) -> int:
    n = 0
    for packet in container.demux(stream):
        if packet.size:
            n += 1
        if time.monotonic() > deadline:
            raise _invalid(where, "reading the video took longer than [video] decode_timeout_s")
    return n


def check_plan(indices: tuple[int, ...], meta: VideoMeta, cfg: VideoConfig, where: str) -> None:
    """The frames to keep fit the limits (before any is decoded)."""
    if not indices:
        raise _invalid(where, "no frame would be sampled from the video")
    if list(indices) != sorted(set(indices)) or indices[0] < 0 or indices[-1] >= meta.total_frames:
        raise ValueError(f"a frame plan must be ascending indices below {meta.total_frames}, got {indices}")
    if len(indices) > cfg.max_frames:
        raise BadRequest(f"{where}: {len(indices)} frames would be sampled, above this server's limit of "
                         f"{cfg.max_frames} ([video] max_frames); ask for fewer (mm_processor_kwargs num_frames "
                         "or fps)", param=where, code="invalid_video")
    total = len(indices) * meta.width * meta.height
    if total > cfg.max_total_pixels:
        raise BadRequest(f"{where}: {len(indices)} frames of {meta.width}x{meta.height} are {total} pixels, above "
                         f"this server's limit of {cfg.max_total_pixels} ([video] max_total_pixels); ask for "
                         "fewer frames", param=where, code="invalid_video")


def decode_video(data: bytes, plan: Plan, cfg: VideoConfig, where: str, algorithm: str = "xxh3_128") -> DecodedVideo:
    """The frames `plan` picks from the video file `data`, or a typed 4xx error naming `where`."""
    check_size(len(data), cfg, where)
    if not data:
        raise _invalid(where, "the video file is empty")
    av = _av()
    deadline = time.monotonic() + cfg.decode_timeout_s
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            stream, meta = probe(container, cfg, where, deadline)
            indices = plan(meta)
            check_plan(indices, meta, cfg, where)
            frames = _decode_frames(container, stream, meta, indices, where, deadline)
    except BadRequest:
        raise
    except (av.FFmpegError, EOFError, OSError, ValueError) as e:
        raise _invalid(where, f"the video could not be decoded ({type(e).__name__}: {str(e)[:200]})") from None
    return DecodedVideo(frames, meta, indices, video_content_digest(frames, algorithm))


def _decode_frames(container, stream, meta: VideoMeta, indices: tuple[int, ...], where: str,
                   deadline: float) -> np.ndarray:
    """Decodes up to the last index, keeping only the indexed frames (in presentation order)."""
    out = np.empty((len(indices), meta.height, meta.width, 3), dtype=np.uint8)
    want = {index: k for k, index in enumerate(indices)}
    last, seen = indices[-1], 0
    stream.thread_type = "AUTO"
    for frame in container.decode(stream):
        if time.monotonic() > deadline:
            raise _invalid(where, "decoding the video took longer than [video] decode_timeout_s")
        k = want.get(seen)
        if k is not None:
            if (frame.width, frame.height) != (meta.width, meta.height):
                raise _invalid(where, f"frame {seen} is {frame.width}x{frame.height}; the stream says "
                                      f"{meta.width}x{meta.height} (a size change mid-stream is not supported)")
            out[k] = frame.to_ndarray(format="rgb24")
        seen += 1
        if seen > last:
            return out
    raise _invalid(where, f"the video ends after {seen} decodable frames; its header says {meta.total_frames} "
                          "(a truncated or corrupt file)")


def frames_video(frames: list[np.ndarray], fps: float, cfg: VideoConfig, where: str,
                 algorithm: str = "xxh3_128") -> DecodedVideo:
    """A list of pre-extracted RGB frames ([H, W, 3] uint8 each, one size) as a video taken whole
    at `fps` (the rate they were extracted at)."""
    if not frames:
        raise _invalid(where, "a frame list needs at least one frame")
    sizes = {f.shape for f in frames}
    if len(sizes) != 1:
        raise _invalid(where, f"the frames of a video must all have one size, got {sorted(sizes)}")
    h, w = frames[0].shape[:2]
    meta = VideoMeta(w, h, len(frames), fps)
    indices = tuple(range(len(frames)))
    check_plan(indices, meta, cfg, where)
    stacked = np.ascontiguousarray(np.stack(frames), dtype=np.uint8)
    return DecodedVideo(stacked, meta, indices, video_content_digest(stacked, algorithm))

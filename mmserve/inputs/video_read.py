"""A request's video parts made into `VideoItem`s (in the intake's worker thread).

A video file is read under the model's frame sampling (`adapter.video_plan`) and the request's
settings (`mm_processor_kwargs`; fps defaults to `[video] default_fps`). Before decoding, the
file's bytes and those settings are hashed (`keys.video_source_key`, salted with the request's
cache_salt) and looked up in the intake's memo (`cache.video_memo`, read here from a snapshot):
on a hit nothing is decoded — the item carries what the first decode learnt, and decodes the file
again only if the encoder asks for its frames (its output was evicted). What this thread learnt
or used goes back to the intake, which owns the memo.

A frame list's frames are images, read as image parts are (`open_image`: formats, sizes), and
taken whole at `fps` (the rate they were extracted at; `[video] default_fps` when not given).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field, replace

import numpy as np

from mmserve.cache.keys import video_source_key
from mmserve.cache.video_memo import VideoIdentity
from mmserve.config import LimitsConfig
from mmserve.config.video import VideoConfig
from mmserve.errors import BadRequest, UnsupportedParameter
from mmserve.inputs.images import data_url_bytes, open_image, processor_rgb
from mmserve.inputs.video import InvalidVideo, check_size, decode_video, frames_video
from mmserve.models.video_item import VideoItem, VideoSampling

_DATA_URL = re.compile(r"^data:(?:[\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[\w.+-]+)*;base64,", re.I)


@dataclass
class VideosRead:
    """The items, by part key, and the memo entries this read learnt (new) and used (hits)."""

    items: dict = field(default_factory=dict)
    learnt: dict[bytes, VideoIdentity] = field(default_factory=dict)
    hits: list[bytes] = field(default_factory=list)


def video_bytes(url: str, cfg: VideoConfig, where: str) -> bytes:
    """The bytes of a base64 `data:` URL, size-checked before decoding."""
    m = _DATA_URL.match(url)
    if not m:
        raise InvalidVideo(f"{where}: a video URL must look like data:video/mp4;base64,<data>", param=where)
    payload = url[m.end():]
    check_size(len(payload) * 3 // 4, cfg, where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidVideo(f"{where}: video data is not valid base64", param=where) from None


def check_videos(adapter, parts: list, sampling: VideoSampling, cfg: VideoConfig) -> None:
    """Refuses video parts the model or the server does not take (before anything is read)."""
    if not parts:
        return
    if not getattr(adapter, "supports_video", False):
        raise UnsupportedParameter(f"model {adapter.name!r} does not take video input", param=parts[0][1])
    if len(parts) > cfg.max_videos_per_request:
        raise BadRequest(f"at most {cfg.max_videos_per_request} videos per request ([video] "
                         f"max_videos_per_request), got {len(parts)}", param="messages")
    if sampling.num_frames is not None and any(p.url is None for _, _, p in parts):
        raise BadRequest("mm_processor_kwargs.num_frames samples a video file; a list of frames is taken whole "
                         "(send fps: the rate its frames were extracted at)", param="mm_processor_kwargs")


def resolved(sampling: VideoSampling, cfg: VideoConfig) -> VideoSampling:
    """The settings with the server's default rate filled in when the request names no sampling."""
    if sampling.fps is None and sampling.num_frames is None:
        return replace(sampling, fps=cfg.default_fps)
    return sampling


def read_videos(adapter, parts: list, sampling: VideoSampling, cfg: VideoConfig, limits: LimitsConfig,
                fetched: dict | None, known: dict, cache_salt: str | None) -> VideosRead:
    """Each `(key, where, VideoPart)` of `parts` as a VideoItem (see the module doc)."""
    out = VideosRead()
    sampling = resolved(sampling, cfg)
    algorithm = adapter.hash_algorithm
    for key, where, part in parts:
        if part.url is not None:
            data = fetched[key] if fetched is not None and key in fetched else video_bytes(part.url, cfg, where)
            out.items[key] = _file_item(adapter, data, sampling, cfg, where, known, cache_salt, out)
            continue
        if part.array is not None:
            frames = list(part.array)
        else:
            frames = [_frame(f, limits, fetched, (key, k), f"{where}.video[{k}]") for k, f in enumerate(part.frames)]
        video = frames_video(frames, sampling.fps, cfg, where, algorithm)
        out.items[key] = VideoItem(video.meta, video.indices, video.content, sampling, _kept(video.frames), "frames")
    return out


def _kept(frames: np.ndarray):
    return lambda: frames


def _file_item(adapter, data: bytes, sampling: VideoSampling, cfg: VideoConfig, where: str, known: dict,
               cache_salt: str | None, out: VideosRead) -> VideoItem:
    check_size(len(data), cfg, where)
    algorithm = adapter.hash_algorithm
    plan = adapter.video_plan(sampling, cfg.max_frames)
    settings = {"kind": "file", "frame_cap": cfg.max_frames, **sampling.settings()}
    source = video_source_key(adapter.model_sig, adapter.video_digest, cache_salt, settings, data, algorithm=algorithm)
    identity = known.get(source)
    if identity is not None:
        out.hits.append(source)

        def load() -> np.ndarray:  # the encoder cache lost its output: the file is decoded again
            video = decode_video(data, plan, cfg, where, algorithm)
            if video.content != identity.content or video.indices != identity.indices:
                raise RuntimeError(f"{where}: decoding the video again gave other frames than the first time")
            return video.frames

        return VideoItem(identity.meta, identity.indices, identity.content, sampling, load)
    video = decode_video(data, plan, cfg, where, algorithm)
    out.learnt[source] = VideoIdentity(video.meta, video.indices, video.content)
    return VideoItem(video.meta, video.indices, video.content, sampling, _kept(video.frames))


def _frame(frame, limits: LimitsConfig, fetched: dict | None, key, where: str) -> np.ndarray:
    """One frame of a frame list as an RGB array, read as an image part is."""
    if not isinstance(frame, str):
        image = processor_rgb(frame)
    elif fetched is not None and key in fetched:
        image = open_image(fetched[key], limits, where)
    else:
        image = open_image(data_url_bytes(frame, limits, where), limits, where)
    return np.asarray(image, dtype=np.uint8)

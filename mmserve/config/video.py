"""The `[video]` section: what a video part may cost before and while it is decoded, and the
sampling a request gets when it names none (`mmserve.inputs.video`)."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.config.checks import check_int, check_number


@dataclass(frozen=True)
class VideoConfig:
    """Bounds of one video part, each checked before the work it bounds (see config.toml)."""

    max_videos_per_request: int = 2  # 0: video parts are refused
    max_bytes: int = 64 * 1024 * 1024  # the file (inline or fetched), before it is opened
    max_frames: int = 64  # frames sampled from one video (a frame list's length too)
    max_duration_s: float = 600.0  # the container's duration, from its header, before decoding
    max_frame_pixels: int = 8_294_400  # one decoded frame (3840 x 2160), from the stream header
    max_total_pixels: int = 64 * 1024 * 1024  # sampled frames x their pixels: the decoded RGB kept in memory
    decode_timeout_s: float = 30.0  # demuxing and decoding one video, wall clock
    default_fps: float = 2.0  # sampling when the request names neither fps nor num_frames (qwen-vl-utils' FPS)
    identity_memo_entries: int = 1024  # (file bytes, settings) -> decoded identity: a second question skips decoding

    def __post_init__(self) -> None:
        w = "[video]"
        check_int(w, "max_videos_per_request", self.max_videos_per_request, 0)
        check_int(w, "max_bytes", self.max_bytes, 1)
        check_int(w, "max_frames", self.max_frames, 1, 4096)
        check_number(w, "max_duration_s", self.max_duration_s, 0, lo_open=True)
        check_int(w, "max_frame_pixels", self.max_frame_pixels, 1)
        check_int(w, "max_total_pixels", self.max_total_pixels, 1)
        check_number(w, "decode_timeout_s", self.decode_timeout_s, 0, lo_open=True)
        check_number(w, "default_fps", self.default_fps, 0, 240, lo_open=True)
        check_int(w, "identity_memo_entries", self.identity_memo_entries, 0)

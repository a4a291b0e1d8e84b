"""Video parts (`inputs/video_parts.py`) and PyAV decoding (`inputs/video.py`): the shapes vLLM
accepts, the settings in mm_processor_kwargs, and every file that is not a readable video — corrupt,
truncated, empty, audio only, a still image, zero frames, too large in bytes, frames, duration or
pixels — refused with a 400 `invalid_video` (413 for bytes) naming the part, before a frame is
decoded where the header already tells. Clips are drawn and encoded here (render_video)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image

from mmserve.config import LimitsConfig, VideoConfig
from mmserve.errors import BadRequest, PayloadTooLarge
from mmserve.inputs.request import parse_chat_request
from mmserve.inputs.video import InvalidVideo, decode_video, frames_video
from mmserve.inputs.video_parts import VideoPart
from mmserve.models.demo.render_video import encode_mp4, render_clip, video_data_url
from mmserve.models.qwen_video import QwenVideoSettings, sample_indices
from mmserve.models.video_item import VideoMeta, VideoSampling
from tests.helpers import data_url

LIMITS = LimitsConfig()
WHERE = "messages[0].content (video 0)"


@pytest.fixture(scope="module")
def clip() -> bytes:
    return encode_mp4(render_clip("red", "circle", True, seed=3, frames=16), fps=8)


def every(meta: VideoMeta) -> tuple[int, ...]:
    return tuple(range(meta.total_frames))


def chat(*parts, **body):
    return parse_chat_request({"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "q"}]}],
                               **body}, LIMITS, "m")


# -- the API ----------------------------------------------------------------------------------------


def test_video_url_and_frame_lists_parse_as_vllm_sends_them(clip):
    url = video_data_url(clip)
    frame = data_url(render_clip("blue", "square", False, frames=1)[0])
    r = chat({"type": "video_url", "video_url": {"url": url}}, {"type": "video", "video": [frame, frame]},
             mm_processor_kwargs={"fps": 1.5, "max_pixels": 4096})
    parts = [p for p in r.messages[0].parts if isinstance(p, VideoPart)]
    assert parts[0].url == url and parts[1].frames == (frame, frame)
    assert r.video == VideoSampling(fps=1.5, max_pixels=4096) and r.num_images == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"fps": 2, "num_frames": 8}, "mutually exclusive"),
    ({"fps": -1}, "fps"),
    ({"num_frames": 2.5}, "num_frames"),
    ({"do_resize": False}, "not a setting"),
    ({"min_pixels": 100, "max_pixels": 10}, "above"),
])
def test_bad_mm_processor_kwargs_are_a_400_naming_them(kwargs, match):
    with pytest.raises(BadRequest, match=match) as e:
        chat(mm_processor_kwargs=kwargs)
    assert e.value.status == 400 and e.value.param.startswith("mm_processor_kwargs")


def test_remote_video_urls_follow_the_remote_image_rules_and_videos_only_in_user_messages():
    with pytest.raises(BadRequest) as e:
        chat({"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}})
    assert e.value.code == "remote_images_disabled" and e.value.param == "messages[0].content[0]"
    with pytest.raises(BadRequest, match="videos are only allowed in user messages"):
        parse_chat_request({"messages": [{"role": "system", "content": [
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]},
            {"role": "user", "content": "q"}]}, LIMITS, "m")


# -- decoding ---------------------------------------------------------------------------------------


def test_a_clip_decodes_to_the_sampled_frames_as_pyav_reads_them(clip):
    plan = lambda meta: sample_indices(meta, VideoSampling(fps=4.0), QwenVideoSettings())  # noqa: E731
    video = decode_video(clip, plan, VideoConfig(), WHERE)
    assert video.meta == VideoMeta(64, 64, 16, 8.0)
    assert video.indices == (0, 2, 4, 6, 8, 10, 12, 14)  # 2 s at 4 fps, transformers' arange
    with av.open(io.BytesIO(clip)) as c:
        every_frame = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert all(np.array_equal(video.frames[k], every_frame[i]) for k, i in enumerate(video.indices))
    red = video.frames[0].reshape(-1, 3).astype(int)
    assert ((red[:, 0] > 200) & (red[:, 1] < 60)).any()  # the red shape survived H.264
    again = decode_video(clip, plan, VideoConfig(), WHERE)
    assert again.content == video.content
    other = decode_video(clip, lambda m: (0, 1, 2, 3), VideoConfig(), WHERE)
    assert other.content != video.content


def _audio_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for _ in range(8):
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name", ["empty", "garbage", "truncated", "audio_only", "still_png", "no_frames"])
def test_files_that_are_not_readable_videos_are_invalid_video(clip, name):
    data = {"empty": b"", "garbage": b"\x00not a video" * 50, "truncated": clip[: len(clip) // 2],
            "audio_only": _audio_only(), "still_png": _png(), "no_frames": clip[:48]}[name]
    with pytest.raises(InvalidVideo) as e:
        decode_video(data, every, VideoConfig(), WHERE)
    assert e.value.status == 400 and e.value.code == "invalid_video" and e.value.param == WHERE
    assert WHERE in e.value.message


def test_bounds_are_checked_before_decoding(clip):
    with pytest.raises(PayloadTooLarge) as e:
        decode_video(clip, every, VideoConfig(max_bytes=len(clip) - 1), WHERE)
    assert e.value.status == 413 and e.value.param == WHERE

    def never(meta):
        raise AssertionError("planned a video past a header bound")

    for cfg, match in [(VideoConfig(max_frame_pixels=64 * 64 - 1), "max_frame_pixels"),
                       (VideoConfig(max_duration_s=1.5), "max_duration_s")]:
        with pytest.raises(InvalidVideo, match=match):
            decode_video(clip, never, cfg, WHERE)
    for cfg, match in [(VideoConfig(max_frames=15), "max_frames"), (VideoConfig(max_total_pixels=64 * 64 * 15),
                                                                      "max_total_pixels")]:
        with pytest.raises(BadRequest, match=match) as e:
            decode_video(clip, every, cfg, WHERE)
        assert e.value.code == "invalid_video"
    with pytest.raises(InvalidVideo, match="decode_timeout_s"):
        decode_video(clip, every, VideoConfig(decode_timeout_s=1e-9), WHERE)


def test_a_frame_list_is_taken_whole_and_frames_of_two_sizes_are_refused():
    frames = [np.asarray(f) for f in render_clip("green", "triangle", True, frames=5)]
    video = frames_video(frames, 2.0, VideoConfig(), WHERE)
    assert video.indices == (0, 1, 2, 3, 4) and video.meta == VideoMeta(64, 64, 5, 2.0)
    with pytest.raises(InvalidVideo, match="one size"):
        frames_video([frames[0], frames[1][:32]], 2.0, VideoConfig(), WHERE)

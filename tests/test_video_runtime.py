"""Video parts through the whole Runtime, beyond the family checks: a model without video refuses
them (400 naming the part) and goes on serving; the per-request video limit; a frame list sent as
image data URLs and the same frames as an embedded array are one video (one encoding); a remote
video is fetched under the remote-image rules with [video] max_bytes, and is the same video as the
file sent inline."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
import trio

from mmserve import Runtime
from mmserve.config import Config, ModelConfig
from mmserve.errors import MMServeError
from mmserve.models.demo.render_video import encode_mp4, render_clip, video_data_url
from tests.conftest import on_device
from tests.helpers import data_url
from tests.image_server import ImageServer

Q = {"type": "text", "text": "What color is the shape in the video?"}
REMOTE = {"remote_images": True, "remote_image_hosts": ("127.0.0.1",), "remote_image_allow_http": True,
          "remote_image_allow_private": True}


def ask(parts: list, **kw) -> dict:
    return dict(messages=[{"role": "user", "content": [*parts, Q]}], temperature=0, max_tokens=3, **kw)


async def refused(rt, **request) -> MMServeError:
    with pytest.raises(MMServeError) as e:
        await rt.chat_completion(**request)
    return e.value


def test_a_model_without_video_refuses_it_and_goes_on(tiny_config):
    clip = video_data_url(encode_mp4(render_clip("red", "circle", False, frames=8), fps=8))

    async def main():
        async with Runtime.open(tiny_config) as rt:
            e = await refused(rt, **ask([{"type": "video_url", "video_url": {"url": clip}}]))
            assert (e.status, e.code, e.param) == (400, "unsupported_parameter", "messages[0].content (video 0)")
            assert "does not take video" in e.message
            assert (await rt.chat_completion(**ask([]))).choices[0].text is not None

    trio.run(main)


def test_video_limits_frame_lists_and_remote_videos(tiny_qwen25_dir):
    frames = render_clip("blue", "square", True, frames=6)
    array = np.stack([np.asarray(f) for f in frames])
    config = on_device(Config(models=(ModelConfig("q", str(tiny_qwen25_dir), default=True),)))

    async def main(server: ImageServer):
        with urllib.request.urlopen(server.url("/clip.mp4")) as r:  # inline: the very bytes the server sends
            clip = r.read()
        async with Runtime.open(config.replace(limits=REMOTE, video={"max_videos_per_request": 1})) as rt:
            two = [{"type": "video", "video": [data_url(f) for f in frames]}] * 2
            e = await refused(rt, **ask(two))
            assert e.status == 400 and "at most 1 videos" in e.message
            e = await refused(rt, **ask(two[:1], mm_processor_kwargs={"num_frames": 4}))
            assert e.status == 400 and e.param == "mm_processor_kwargs"
            with pytest.raises(MMServeError, match="does not take video parts"):
                await rt.tokenize({"messages": ask(two[:1])["messages"]})
            entries = lambda: rt.stats()["q"]["encoder"]["entries"]  # noqa: E731  (distinct videos encoded)
            as_urls = await rt.chat_completion(**ask(two[:1], mm_processor_kwargs={"fps": 3}))
            as_array = await rt.chat_completion(**ask([{"type": "video", "video": array}], mm_processor_kwargs={"fps": 3}))
            assert as_urls.choices[0].text == as_array.choices[0].text and entries() == 1
            inline = await rt.chat_completion(**ask([{"type": "video_url", "video_url": {"url": video_data_url(clip)}}]))
            remote = await rt.chat_completion(**ask([{"type": "video_url", "video_url": {"url": server.url("/clip.mp4")}}]))
            assert inline.choices[0].text == remote.choices[0].text and entries() == 2  # one video: one key
        async with Runtime.open(config.replace(limits=REMOTE, video={"max_bytes": len(clip) - 1})) as rt:
            e = await refused(rt, **ask([{"type": "video_url", "video_url": {"url": server.url("/clip.mp4")}}]))
            assert e.status == 413 and e.param == "messages[0].content (video 0)"

    with ImageServer() as server:
        trio.run(main, server)


# clips the demo never trained on (scripts/train_demo_qwen_video.py draws seeds from 7_000_000 on)
HELD_OUT_CLIPS = (  # (colour, shape, background, moves, seed, size, frames, fps, mm_processor_kwargs)
    ("purple", "triangle", "gray", True, 9_500_001, (96, 64), 16, 8, {}),
    ("orange", "circle", "black", False, 9_500_002, (64, 80), 12, 6, {}),
    ("green", "square", "white", True, 9_500_003, (80, 80), 20, 10, {"fps": 4}),
    ("red", "square", "gray", False, 9_500_004, (64, 64), 16, 8, {"fps": 4}),
)


def test_demo_qwen_answers_a_held_out_clips_colour_and_motion():
    """The trained demo-qwen, through the whole Runtime (the server's decoding, sampling and video
    preprocessing), names the colour of the shape in clips it never saw and whether it moves."""
    from tests.conftest import _demo_dir

    config = on_device(Config(models=(ModelConfig("demo-qwen", _demo_dir("demo-qwen"), default=True),)))

    async def main():
        async with Runtime.open(config) as rt:
            for color, shape, background, moves, seed, size, frames, fps, kwargs in HELD_OUT_CLIPS:
                clip = video_data_url(encode_mp4(render_clip(color, shape, moves, seed=seed, frames=frames, size=size,
                                                             background=background), fps=fps))
                for question, want in (("What color is the shape in the video?", color),
                                       ("Does the shape move?", "yes" if moves else "no")):
                    done = await rt.chat_completion(
                        [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}},
                                                      {"type": "text", "text": question}]}],
                        temperature=0, max_tokens=6, **({"mm_processor_kwargs": kwargs} if kwargs else {}))
                    assert done.text.strip() == want, (color, shape, moves, seed, question, done.text)

    trio.run(main)

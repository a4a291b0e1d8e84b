"""Short synthetic clips for video tests and examples: one shape of one colour on a plain
background, still or moving across the frame (from one side of it to the other), encoded to mp4
(H.264, or MPEG-4 part 2 where FFmpeg lacks libx264) with PyAV. Deterministic for a seed; nothing
is downloaded."""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageDraw

from .render import BACKGROUND_RGB, COLOR_RGB, SHAPES

Q_VIDEO_COLOR = "What color is the shape in the video?"
Q_VIDEO_MOVES = "Does the shape move?"


def render_clip(color: str, shape: str, moves: bool, *, seed: int = 0, frames: int = 16,
                size: tuple[int, int] = (64, 64), background: str = "white") -> list[Image.Image]:
    """`frames` RGB frames of a `color` `shape`: still, or crossing the frame on a straight line."""
    if color not in COLOR_RGB or shape not in SHAPES or background not in BACKGROUND_RGB:
        raise ValueError(f"unknown colour, shape or background: {color!r}, {shape!r}, {background!r}")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0xC11F])
    width, height = size
    half = min(width, height) * float(rng.uniform(0.14, 0.22))
    lo, hi = (half + 1, half + 1), (width - half - 1, height - half - 1)  # where the centre may be
    if moves:
        # across the frame: the chord of the centre's box along a random direction through a point
        # near its middle, so the shape travels at least the box's short side (half the frame or
        # more) -- a step of several patches between the frames one temporal patch merges
        angle = float(rng.uniform(0, 2 * math.pi))
        dx, dy = math.cos(angle), math.sin(angle)
        mx, my = ((a + b) / 2 + float(rng.uniform(-0.1, 0.1)) * (b - a) for a, b in zip(lo, hi))
        reach = min(_exit(m, d, a, b) for m, d, a, b in ((mx, dx, lo[0], hi[0]), (my, dy, lo[1], hi[1])))
        back = min(_exit(m, -d, a, b) for m, d, a, b in ((mx, dx, lo[0], hi[0]), (my, dy, lo[1], hi[1])))
        x0, y0, x1, y1 = mx - back * dx, my - back * dy, mx + reach * dx, my + reach * dy
    else:
        x0, y0 = (float(rng.uniform(a, b)) for a, b in zip(lo, hi))
        x1, y1 = x0, y0
    out = []
    for t in range(frames):
        f = t / max(1, frames - 1)
        cx, cy = x0 + (x1 - x0) * f, y0 + (y1 - y0) * f
        img = Image.new("RGB", size, BACKGROUND_RGB[background])
        draw = ImageDraw.Draw(img)
        box = [cx - half, cy - half, cx + half, cy + half]
        if shape == "circle":
            draw.ellipse(box, fill=COLOR_RGB[color])
        elif shape == "square":
            draw.rectangle(box, fill=COLOR_RGB[color])
        else:
            draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=COLOR_RGB[color])
        out.append(img)
    return out


def _exit(m: float, d: float, lo: float, hi: float) -> float:
    """How far from m along d (one axis) before leaving [lo, hi]."""
    if d > 1e-9:
        return (hi - m) / d
    if d < -1e-9:
        return (lo - m) / d
    return math.inf


def encode_mp4(frames: list[Image.Image], fps: int = 8) -> bytes:
    """The frames as an mp4 file (yuv420p: even sides needed)."""
    import av

    buf = io.BytesIO()
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1  # one encoder thread: the same bytes in every process
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def video_data_url(data: bytes) -> str:
    import base64

    return "data:video/mp4;base64," + base64.b64encode(data).decode()

"""Synthetic images and question strings for the demo vision-language models.

An image is one coloured shape (circle, square or triangle) on a plain background. The seed varies
the shape's size, position, a slight rotation and a slight colour jitter, so held-out seeds give
fresh images. Rendering is deterministic: equal arguments give byte-identical images.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
BACKGROUNDS = ("white", "black", "gray")
SHAPES = ("circle", "square", "triangle")

Q_COLOR = "What color is the shape?"
Q_BACKGROUND = "What color is the background?"
Q_SHAPE = "What shape is it?"
Q_FIRST = "What color is the first shape?"
Q_SECOND = "What color is the second shape?"

#: Nominal RGB values; the renderer jitters each channel by a few units.
COLOR_RGB: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 70, 225),
    "yellow": (240, 220, 30),
    "purple": (140, 40, 185),
    "orange": (250, 140, 20),
}
BACKGROUND_RGB: dict[str, tuple[int, int, int]] = {
    "white": (250, 250, 250),
    "black": (8, 8, 8),
    "gray": (128, 128, 128),
}

IMAGE_SIZE = 64
_SUPERSAMPLE = 4  # draw at 4x and downsample: smooth edges
_SHAPE_JITTER = 12  # per-channel colour jitter (+/-)
_BACKGROUND_JITTER = 6
_MIN_SIDE, _MAX_SIDE = 36, 50  # bounding-box side of the shape, in 64-px units
_MARGIN = 3
_MAX_ROTATION_DEG = 10.0


def _jitter(rgb: tuple[int, int, int], amount: int, rng: np.random.Generator) -> tuple[int, ...]:
    noise = rng.integers(-amount, amount + 1, size=3)
    return tuple(int(v) for v in np.clip(np.asarray(rgb) + noise, 0, 255))


def _rotate(points, cx, cy, angle):
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + (x - cx) * c - (y - cy) * s, cy + (x - cx) * s + (y - cy) * c) for x, y in points]


def render_image(
    color: str, shape: str, background: str | None = None, seed: int = 0,
    size: tuple[int, int] | None = None,
) -> Image.Image:
    """Render a ``color`` ``shape`` on a plain ``background`` as a 64x64 RGB image.

    ``background=None`` picks one of :data:`BACKGROUNDS` from the seed. ``size=(width, height)``
    draws on a canvas of that size instead (the shape scales with the shorter side and may sit
    anywhere along the longer one); ``None`` keeps the 64x64 output byte for byte.
    """
    if color not in COLOR_RGB:
        raise ValueError(f"unknown color {color!r}; expected one of {COLORS}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 0x5EED])
    bg_pick = int(rng.integers(len(BACKGROUNDS)))
    if background is None:
        background = BACKGROUNDS[bg_pick]
    if background not in BACKGROUND_RGB:
        raise ValueError(f"unknown background {background!r}; expected one of {BACKGROUNDS}")

    bg_rgb = _jitter(BACKGROUND_RGB[background], _BACKGROUND_JITTER, rng)
    fg_rgb = _jitter(COLOR_RGB[color], _SHAPE_JITTER, rng)
    width, height = (IMAGE_SIZE, IMAGE_SIZE) if size is None else (int(size[0]), int(size[1]))
    if min(width, height) < 8:
        raise ValueError(f"image size {size} too small (min side 8)")
    scale = min(width, height) / IMAGE_SIZE  # exactly 1.0 at the default size: same floats
    side = float(rng.uniform(_MIN_SIDE, _MAX_SIDE)) * scale
    half = side / 2
    extent = half * (1.12 if shape == "triangle" else 1.0)  # rotated triangle reaches further
    margin = _MARGIN * scale
    cx = float(rng.uniform(margin + extent, width - margin - extent))
    cy = float(rng.uniform(margin + extent, height - margin - extent))
    angle = math.radians(float(rng.uniform(-_MAX_ROTATION_DEG, _MAX_ROTATION_DEG)))

    k = _SUPERSAMPLE
    big = Image.new("RGB", (width * k, height * k), bg_rgb)
    draw = ImageDraw.Draw(big)
    if shape == "circle":
        r = half * 0.98
        draw.ellipse([(cx - r) * k, (cy - r) * k, (cx + r) * k, (cy + r) * k], fill=fg_rgb)
    else:
        if shape == "square":
            h = half * 0.86  # same visual area ballpark as the circle; rotation stays in frame
            pts = [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
        else:  # triangle, apex up, centred on its bounding box
            top, bottom = cy - half, cy + half * 0.8
            pts = [(cx, top), (cx + half, bottom), (cx - half, bottom)]
        pts = _rotate(pts, cx, cy, angle)
        draw.polygon([(x * k, y * k) for x, y in pts], fill=fg_rgb)
    return big.resize((width, height), Image.Resampling.BOX)

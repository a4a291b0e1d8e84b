"""The pixels an image processor will materialise for an image, known before it runs.

`max_image_pixels` bounds the decoded image (checked from the header, before decoding), but the
processor can make an image far larger than it was: CLIP-style processors scale the image so its
*shortest* edge becomes `shortest_edge`, keeping the aspect ratio, and only then centre-crop. A
1 x 160,000 strip (160,000 pixels, a few hundred bytes of PNG) with `shortest_edge` 336 is resized
to 336 x 53,760,000 — 18 billion pixels, tens of GB of floats — before the crop throws nearly all
of it away. `processing_pixels` computes every intermediate size from the processor's settings,
mirroring transformers' own arithmetic, so `check_image_size` can refuse such an image with a 400
instead of the server running out of memory.

Covered: every size layout transformers' `PilBackend.resize` understands (CLIPImageProcessor and
CLIPImageProcessorPil among them: `{"shortest_edge"}`, `{"shortest_edge", "longest_edge"}`,
`{"max_height", "max_width"}`, `{"height", "width"}`), then `center_crop` and `pad`; and Qwen2-VL
style processors (`smart_resize` between min_pixels and max_pixels, then patches repeated
`temporal_patch_size` times); and Idefics3 style ones (the longest edge, then up to whole tiles,
then the tiles and the global view). Any other layout raises UnknownLayout rather than guess low;
then `check_image_size` bounds only the decoded image (and the registry warns when the model loads).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmserve.errors import UnprocessableImage
from mmserve.config import LimitsConfig

# transformers' Qwen2-VL defaults, for a processor that leaves min/max pixels unset
_QWEN_MIN_PIXELS = 56 * 56
_QWEN_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True)
class Step:
    """One image the processor holds at some point: `copies` times height x width pixels."""

    name: str
    height: int
    width: int
    copies: int = 1

    @property
    def pixels(self) -> int:
        return self.height * self.width * self.copies


class UnknownLayout(TypeError):
    """The processor's size settings are not a layout this module can bound (see `_resized_size`):
    only the decoded image and the aspect ratio are checked for it (the registry warns at load)."""


def processing_pixels(image_processor: Any, width: int, height: int) -> int:
    """The largest number of pixels `image_processor` materialises in any step for a width x height
    image, the decoded image itself included."""
    return max(step.pixels for step in processing_steps(image_processor, width, height))


def processing_steps(image_processor: Any, width: int, height: int) -> tuple[Step, ...]:
    """Every image the processor materialises for a width x height input, in order."""
    decoded = Step("decoded", height, width)
    if _is_qwen_style(image_processor):
        return (decoded, *_qwen_steps(image_processor, height, width))
    if _is_idefics3_style(image_processor):
        return (decoded, *_idefics3_steps(image_processor, height, width))
    return (decoded, *_resize_crop_pad_steps(image_processor, height, width))


def check_aspect_ratio(width: int, height: int, limits: LimitsConfig, where: str) -> None:
    """Refuses (400) an image whose longer side exceeds `max_image_aspect_ratio` times its shorter.

    Cheap, and needs only the header's size, so it runs before decoding: an extreme strip is what
    makes aspect-preserving resizes explode, and no model reads anything useful from one."""
    if width <= 0 or height <= 0:
        raise UnprocessableImage(f"{where}: image has zero size", param=where)
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_image_aspect_ratio:
        raise UnprocessableImage(
            f"{where}: image is {width}x{height}, an aspect ratio of {ratio:,.1f}:1, above this server's "
            f"limit of {limits.max_image_aspect_ratio:g}:1", param=where, code="image_too_large")


def check_image_size(image_processor: Any, width: int, height: int, limits: LimitsConfig, where: str) -> None:
    """Refuses (400 `image_too_large`) an image the processor would blow up beyond `max_image_pixels`
    in some step, or whose aspect ratio is beyond `max_image_aspect_ratio` — before it runs."""
    check_aspect_ratio(width, height, limits, where)
    try:
        steps = processing_steps(image_processor, width, height)
    except UnknownLayout:
        steps = (Step("decoded", height, width),)
    except ValueError as e:  # the processor's own refusal (Qwen2-VL: aspect ratio above 200)
        raise UnprocessableImage(f"{where}: the model's image processor cannot take this image: {e}",
                                 param=where, code="image_too_large") from None
    worst = max(steps, key=lambda s: s.pixels)
    if worst.pixels > limits.max_image_pixels:
        copies = "" if worst.copies == 1 else f", {worst.copies} copies"
        raise UnprocessableImage(
            f"{where}: a {width}x{height} image becomes {worst.pixels} pixels in the image processor's "
            f"{worst.name} step ({worst.width}x{worst.height}{copies}), above this server's limit of "
            f"{limits.max_image_pixels}", param=where, code="image_too_large")


# --- CLIP and every other PilBackend layout ----------------------------------------------------


def _resize_crop_pad_steps(ip: Any, height: int, width: int) -> list[Step]:
    """transformers' generic `_preprocess`: resize, then center_crop, then pad."""
    steps = []
    if getattr(ip, "do_resize", False):
        height, width = _resized_size(ip, _size_fields(getattr(ip, "size", None)), height, width)
        steps.append(Step("resize", height, width))
    if getattr(ip, "do_center_crop", False):
        crop = _size_fields(getattr(ip, "crop_size", None))
        if crop.get("height") and crop.get("width"):
            steps.append(Step("center crop", crop["height"], crop["width"]))
    pad = _size_fields(getattr(ip, "pad_size", None))
    if getattr(ip, "do_pad", False) and pad.get("height") and pad.get("width"):
        steps.append(Step("pad", pad["height"], pad["width"]))
    return steps


def _resized_size(ip: Any, size: dict[str, int], height: int, width: int) -> tuple[int, int]:
    """(height, width) after `resize`, by the rules (and the very float arithmetic) of
    `PilBackend.resize`, so the bound is exact rather than approximately right."""
    shortest, longest = size.get("shortest_edge"), size.get("longest_edge")
    if shortest and longest:
        return _size_with_aspect_ratio(height, width, shortest, longest)
    if shortest:
        return _shortest_edge_resize(height, width, shortest)
    if size.get("max_height") and size.get("max_width"):
        scale = min(size["max_height"] / height, size["max_width"] / width)
        return int(height * scale), int(width * scale)
    if size.get("height") and size.get("width"):
        return size["height"], size["width"]
    raise UnknownLayout(
        f"cannot bound the pixels of {type(ip).__name__} with size {size}: mmserve knows the "
        "shortest_edge / longest_edge / max_height+max_width / height+width layouts")


def _shortest_edge_resize(height: int, width: int, shortest: int) -> tuple[int, int]:
    """transformers.image_transforms.get_resize_output_image_size(default_to_square=False)."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest, int(shortest * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers.image_transforms.get_size_with_aspect_ratio."""
    raw_size = None
    lo, hi = float(min(height, width)), float(max(height, width))
    if hi / lo * size > max_size:
        raw_size = max_size * lo / hi
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    scale_from = raw_size if raw_size is not None else size
    if width < height:
        return int(scale_from * height / width), size
    return size, int(scale_from * width / height)


# --- Qwen2-VL ------------------------------------------------------------------------------------


def _is_qwen_style(ip: Any) -> bool:
    """Qwen2-VL style processors resize to a pixel budget and cut patches; they say so by having
    merge and temporal patch sizes."""
    return all(hasattr(ip, a) for a in ("patch_size", "merge_size", "temporal_patch_size"))


def _qwen_steps(ip: Any, height: int, width: int) -> list[Step]:
    """`smart_resize` to a multiple of patch_size * merge_size within [min_pixels, max_pixels],
    then the patch array, which repeats every pixel `temporal_patch_size` times."""
    if getattr(ip, "do_resize", True):
        size = _size_fields(getattr(ip, "size", None))
        min_pixels = size.get("shortest_edge") or getattr(ip, "min_pixels", None) or _QWEN_MIN_PIXELS
        max_pixels = size.get("longest_edge") or getattr(ip, "max_pixels", None) or _QWEN_MAX_PIXELS
        factor = int(ip.patch_size) * int(ip.merge_size)
        height, width = _smart_resize()(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    copies = int(ip.temporal_patch_size or 1)
    return [Step("resize", height, width), Step("patches", height, width, copies)]


@functools.cache
def _smart_resize() -> Callable[..., tuple[int, int]]:
    """transformers' own `smart_resize`, so the bound follows its arithmetic exactly. Imported late
    (transformers is slow to import); 5.x keeps it beside the PIL processor, 4.x in the module that
    5.x made depend on torchvision."""
    for module in ("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
                   "transformers.models.qwen2_vl.image_processing_qwen2_vl"):
        try:
            return importlib.import_module(module).smart_resize
        except (ImportError, AttributeError):
            continue
    raise UnknownLayout("this transformers has no Qwen2-VL smart_resize to bound the pixels with")


# --- Idefics3 ------------------------------------------------------------------------------------


def _is_idefics3_style(ip: Any) -> bool:
    """Idefics3 style processors resize to a longest edge, then up to whole tiles they cut; they say
    so by having a tile size (`max_image_size`) and `do_image_splitting`."""
    return all(hasattr(ip, a) for a in ("max_image_size", "do_image_splitting"))


def _idefics3_steps(ip: Any, height: int, width: int) -> list[Step]:
    """`resize` to the longest edge, `resize_for_vision_encoder` up to whole tiles, then the tiles
    and the global view (mmserve.models.idefics3 holds the processor's arithmetic)."""
    from mmserve.models.idefics3 import image_grid, processed_sizes

    resized, tiled = processed_sizes(ip, height, width)
    rows, cols = image_grid(ip, height, width)
    tile = int(_size_fields(ip.max_image_size)["longest_edge"])
    steps = [Step("resize", *resized)]
    if tiled is not None:
        steps.append(Step("resize to whole tiles", *tiled))
    return [*steps, Step("tiles and global view", tile, tile, rows * cols + 1)]


# --- helpers -------------------------------------------------------------------------------------


def _size_fields(size: Any) -> dict[str, int]:
    """A processor's `size` / `crop_size` / `pad_size` as a plain dict of its set fields: a dict, a
    transformers SizeDict, or a bare int (a square)."""
    if size is None:
        return {}
    if isinstance(size, int):
        return {"height": size, "width": size}
    return {k: v for k, v in dict(size).items() if v is not None}

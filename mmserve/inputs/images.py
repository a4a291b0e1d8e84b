"""Image decoding and validation (run in worker threads, never on the event loop).

Refuses what could hurt the server before paying for it: oversized payloads, formats not
allowed, decompression bombs and extreme strips — the pixel count and the aspect ratio are checked
from the header before decoding. (What the model's image processor would make of the image is
checked by `mmserve.inputs.image_budget.check_image_size`.)

Every image, decoded here or handed in as a PIL image, is then read as the families' image
processors read it (`processor_rgb`), and its content key is computed over exactly those pixels.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings

from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from mmserve.errors import PayloadTooLarge, UnprocessableImage
from mmserve.config import LimitsConfig
from mmserve.inputs.image_budget import check_aspect_ratio

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


def data_url_bytes(url: str, limits: LimitsConfig, where: str) -> bytes:
    """The bytes of a base64 `data:` URL, size-checked before and after decoding."""
    m = _DATA_URL.match(url)
    if not m or not m.group("b64"):
        raise UnprocessableImage(f"{where}: image URL must look like data:image/png;base64,<data>", param=where)
    payload = url[m.end():]
    if len(payload) * 3 // 4 > limits.max_image_bytes:
        raise PayloadTooLarge(f"{where}: image is larger than the {limits.max_image_bytes} byte limit", param=where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise UnprocessableImage(f"{where}: image data is not valid base64", param=where) from None


def open_image(data: bytes, limits: LimitsConfig, where: str) -> Image.Image:
    """Decodes image bytes into an RGB PIL image, or raises a 4xx error naming the problem."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            fmt = (img.format or "").upper()
            if fmt not in limits.image_formats:
                raise UnprocessableImage(
                    f"{where}: image format {fmt or 'unknown'} is not accepted; accepted: "
                    f"{', '.join(limits.image_formats)}", param=where)
            w, h = img.size
            if w <= 0 or h <= 0:
                raise UnprocessableImage(f"{where}: image has zero size", param=where)
            check_aspect_ratio(w, h, limits, where)
            if w * h > limits.max_image_pixels:
                raise UnprocessableImage(
                    f"{where}: image is {w}x{h} = {w * h} pixels, above the {limits.max_image_pixels} "
                    "pixel limit", param=where, code="image_too_large")
            img.load()
            return processor_rgb(img)
    except UnprocessableImage:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise UnprocessableImage(f"{where}: image is too large ({e})", param=where, code="image_too_large") from None
    except UnidentifiedImageError:
        raise UnprocessableImage(f"{where}: data is not a decodable image", param=where) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise UnprocessableImage(f"{where}: image could not be decoded ({e})", param=where) from None


_WHITE = (255, 255, 255, 255)


def processor_rgb(img: Image.Image) -> Image.Image:
    """The image as the model's image processor reads it: upright, RGB, transparency on white.

    - Colours: transformers' `image_transforms.convert_to_rgb`, which every family's processor
      applies (`do_convert_rgb = True` in each of them), step for step: an image with an alpha band
      or a `transparency` entry (a palette's or a colour key's) is composited onto opaque white;
      any other mode is converted by PIL ('P' through its palette, 'CMYK' and 'YCbCr' by PIL's
      formulas, 16- and 32-bit grey ('I;16', 'I') and float ('F') clipped to 0..255, as PIL's
      conversion does). A transparent pixel is therefore white, never the colour stored under it.
    - Orientation: an EXIF orientation tag is applied first, as transformers' `load_image` does
      when it reads an image file (a path, URL or base64 string; a processor handed a decoded
      image sees it as decoded). A request carries a file, and a photo taken sideways is upright
      in every viewer, so it is read upright here. (`load_image` then converts with a plain
      `convert("RGB")`, which drops alpha; the processors' own conversion above is followed
      instead, as a transparent logo reads in a viewer.)
    Returns `img` itself when it is already an upright RGB image.
    """
    if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
        img = ImageOps.exif_transpose(img)
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        background = Image.new("RGBA", img.size, _WHITE)
        return Image.alpha_composite(background, img.convert("RGBA")).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")

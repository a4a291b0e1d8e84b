"""Images are read as the family's image processor reads them (issue 42 item 5).

For each awkward kind of file — alpha (RGBA, LA, a palette or a colour key with transparency),
palette, 16- and 32-bit grey, CMYK, an EXIF-rotated photo — mmserve's decoding followed by the
adapter's preprocessing gives exactly the pixel values the family's own transformers processor
gives for the file; and the content key (mm_hash) is over the pixels as composited."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_utils import load_image

from mmserve.config import LimitsConfig
from mmserve.config.checks import IMAGE_FORMATS
from mmserve.inputs.images import open_image, processor_rgb
from mmserve.models.demo.build import build_untrained, checkpoint_dir
from mmserve.models.loading import load_adapter

LIMITS = LimitsConfig(image_formats=IMAGE_FORMATS)  # TIFF and GIF too: 32-bit grey, GIF transparency
W, H = 48, 36  # not square, so a rotation shows


def _rng(seed=0):
    return np.random.default_rng(seed)


def _scene(seed=0) -> np.ndarray:
    """An asymmetric colourful RGB picture [H, W, 3]: gradients, a block, noise."""
    y, x = np.mgrid[0:H, 0:W]
    rgb = np.stack([x * 255 // (W - 1), y * 255 // (H - 1), (x + y) % 256], axis=-1).astype(np.uint8)
    rgb[4:14, 6:20] = (220, 30, 40)
    rgb[20:, 30:] ^= _rng(seed).integers(0, 64, size=(H - 20, W - 30, 3), dtype=np.uint8)
    return rgb


def _alpha() -> np.ndarray:
    """Transparent on the left, half-transparent in a band, opaque on the right."""
    a = np.zeros((H, W), np.uint8)
    a[:, W // 3:] = 128
    a[:, 2 * W // 3:] = 255
    a[10:20, 5:15] = 255  # an opaque patch inside the transparent area
    return a


def _file(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _rgba(under_seed=1) -> Image.Image:
    rgba = np.dstack([_scene(), _alpha()])
    hidden = _alpha() == 0  # what lies under transparent pixels: anything
    rgba[hidden, :3] = _rng(under_seed).integers(0, 256, size=(int(hidden.sum()), 3), dtype=np.uint8)
    return Image.fromarray(rgba, "RGBA")


def _palette_transparent() -> bytes:
    p = Image.fromarray(_scene()).quantize(16)
    return _file(p, "PNG", transparency=3)


def _colour_key() -> bytes:
    rgb = _scene()
    key = tuple(int(v) for v in rgb[5, 8])  # the red block's colour becomes transparent
    return _file(Image.fromarray(rgb), "PNG", transparency=key)


def _gif_transparent() -> bytes:
    return _file(Image.fromarray(_scene()).quantize(8), "GIF", transparency=2)


def _grey16() -> bytes:
    y, x = np.mgrid[0:H, 0:W]
    return _file(Image.fromarray(((x * 1400 + y * 37) % 65536).astype(np.uint16)), "PNG")


def _grey32() -> bytes:
    y, x = np.mgrid[0:H, 0:W]
    return _file(Image.fromarray((x * 9 - y * 5).astype(np.int32), "I"), "TIFF")


def _cmyk() -> bytes:
    return _file(Image.fromarray(_scene()).convert("CMYK"), "JPEG", quality=95)


def _exif_rotated(orientation=6, fmt="JPEG") -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _file(Image.fromarray(_scene()), fmt, exif=exif)


FILES = {
    "rgba": lambda: _file(_rgba(), "PNG"),
    "la": lambda: _file(_rgba().convert("LA"), "PNG"),
    "palette_transparency": _palette_transparent,
    "palette": lambda: _file(Image.fromarray(_scene()).quantize(32), "PNG"),
    "colour_key": _colour_key,
    "gif_transparency": _gif_transparent,
    "grey16": _grey16,
    "grey32_tiff": _grey32,
    "bilevel": lambda: _file(Image.fromarray(_scene()[..., 0] > 128), "PNG"),
    "cmyk_jpeg": _cmyk,
    "webp_alpha": lambda: _file(_rgba(), "WEBP", lossless=True),
}
ROTATED = {  # EXIF orientation: transformers' load_image reads the file upright
    "exif_rotate_90": lambda: _exif_rotated(6),
    "exif_mirror_180": lambda: _exif_rotated(4),
    "exif_png_transpose": lambda: _exif_rotated(5, "PNG"),
}
MODES = {"rgba": "RGBA", "la": "LA", "palette_transparency": "P", "palette": "P", "colour_key": "RGB",
         "gif_transparency": "P", "grey16": "I;16", "grey32_tiff": "I", "bilevel": "1", "cmyk_jpeg": "CMYK",
         "webp_alpha": "RGBA"}


def test_the_files_are_what_they_claim():
    """Each case decodes (in PIL, as a processor gets it) to the awkward mode it is meant to test."""
    for name, make in FILES.items():
        img = Image.open(io.BytesIO(make()))
        assert img.mode == MODES[name], name
    assert Image.open(io.BytesIO(_palette_transparent())).info.get("transparency") is not None
    assert Image.open(io.BytesIO(_colour_key())).info.get("transparency") is not None
    for make in ROTATED.values():
        assert Image.open(io.BytesIO(make())).getexif().get(0x0112) not in (None, 1)


# -- against the families' own processors --------------------------------------------------------

FAMILIES = ["demo", "demo-qwen", "tiny-gemma3", "tiny-idefics3", "tiny-llava-onevision"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> that family's adapter, loaded once (the demo checkpoints; random-weight tiny ones)."""
    loaded = {}

    def get(name):
        if name not in loaded:
            path = checkpoint_dir(name) if name.startswith("demo") else build_untrained(
                name, tmp_path_factory.mktemp(name), seed=0, random_weights=True)
            loaded[name] = load_adapter(name, path)
        return loaded[name]

    return get


@pytest.fixture(params=FAMILIES)
def adapter(request, adapters):
    return adapters(request.param)


def _tensors(item) -> list[torch.Tensor]:
    """Every tensor of one adapter pixel item (a tensor, or a dataclass of tensors and grids)."""
    if isinstance(item, torch.Tensor):
        return [item]
    return [v for v in vars(item).values() if isinstance(v, torch.Tensor)]


def _same_pixels(adapter, ours: Image.Image, reference: Image.Image) -> bool:
    """Whether the adapter's pixel items for mmserve's image equal those the family's processor
    makes of the reference image, exactly (the adapter only calls the processor and packs its
    output; the reference image goes in as transformers reads the file, not converted by us)."""
    a, b = adapter.pixel_values([ours])[0], adapter.pixel_values([reference])[0]
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


@pytest.mark.parametrize("case", sorted(FILES))
def test_decoding_gives_the_processors_own_pixels(adapter, case):
    data = FILES[case]()
    ours = open_image(data, LIMITS, "image")
    # final: plain RGB, nothing left for the processor to convert (PIL's convert("RGB") of a
    # palette image keeps its transparency as a colour key, which the processor then composites:
    # the pixels a key was computed over would not be those the model sees)
    assert ours.mode == "RGB" and ours.info.get("transparency") is None
    raw = Image.open(io.BytesIO(data))  # the processor converts (composites) it itself
    assert _same_pixels(adapter, ours, raw)


@pytest.mark.parametrize("case", sorted(ROTATED))
def test_exif_rotated_files_are_read_upright_as_transformers_load_image_reads_them(adapter, case):
    data = ROTATED[case]()
    ours = open_image(data, LIMITS, "image")
    upright = load_image("data:image/png;base64," + base64.b64encode(data).decode())  # transformers' reader
    assert ours.size == upright.size
    assert _same_pixels(adapter, ours, upright)
    assert not _same_pixels(adapter, ours, Image.open(io.BytesIO(data)).convert("RGB"))  # the tag matters


@pytest.mark.parametrize("name", ["demo", "demo-qwen"])
def test_the_demo_processor_itself_agrees(adapters, name):
    """Beside the adapter: a fresh instance of the family's processor, loaded from the checkpoint,
    on the file as decoded, against mmserve's image through that same processor."""
    adapter = adapters(name)
    proc = type(adapter.image_processor).from_pretrained(adapter.path)
    for case, make in FILES.items():
        data = make()
        ours = proc(images=[open_image(data, LIMITS, "image")], return_tensors="pt")["pixel_values"]
        ref = proc(images=[Image.open(io.BytesIO(data))], return_tensors="pt")["pixel_values"]
        assert torch.equal(ours, ref), case


def test_alpha_is_composited_on_white_not_dropped():
    """The bug: convert("RGB") showed what lay under transparent pixels (often black)."""
    img = _rgba(under_seed=5)
    got = np.asarray(open_image(_file(img, "PNG"), LIMITS, "image"))
    transparent = _alpha() == 0
    assert (got[transparent] == 255).all()
    assert not (np.asarray(img.convert("RGB"))[transparent] == 255).all()
    opaque = _alpha() == 255
    assert (got[opaque] == _scene()[opaque]).all()


def test_embedded_pil_images_are_read_the_same_way():
    from mmserve.actors.intake import _embedded_image

    for make in (*FILES.values(), *ROTATED.values()):
        data = make()
        embedded = _embedded_image(Image.open(io.BytesIO(data)), "image")
        assert np.array_equal(np.asarray(embedded), np.asarray(open_image(data, LIMITS, "image")))
    rgb = Image.fromarray(_scene())
    assert processor_rgb(rgb) is rgb  # nothing to do: no copy


# -- the content key is over the pixels as composited ---------------------------------------------


def test_mm_hash_is_over_the_composited_pixels(adapters):
    adapter = adapters("demo")  # the key layout is the same for every family

    def key(img: Image.Image, fmt="PNG") -> bytes:
        return adapter.image_key(open_image(_file(img, fmt), LIMITS, "image"))

    transparent = _rgba(under_seed=1)
    on_white = Image.fromarray(np.asarray(Image.alpha_composite(
        Image.new("RGBA", (W, H), (255, 255, 255, 255)), transparent).convert("RGB")))
    black_under = _rgba(under_seed=1)
    arr = np.asarray(black_under).copy()
    arr[_alpha() == 0, :3] = 0
    black_under = Image.fromarray(arr, "RGBA")
    opaque_black = Image.fromarray(arr[..., :3])  # the same colours, alpha dropped: black background
    k = key(transparent)
    assert k is not None
    assert key(on_white) == k  # the same visible pixels: one key, whatever the file
    assert key(black_under) == k  # what lies under transparent pixels does not matter
    assert key(opaque_black) != k  # its black-background twin is another picture
    half = np.asarray(transparent).copy()
    half[..., 3] = np.where(half[..., 3] == 128, 127, half[..., 3])
    assert key(Image.fromarray(half, "RGBA")) != k  # another alpha, another composite


def test_a_transparent_palette_and_its_opaque_twin_have_two_keys(adapters):
    """The same palette pixels with and without a transparent index look different to the model
    (the processor composites the transparent one), so they must not share a key; the transparent
    one shares its key with the file that shows the same pixels opaquely."""
    adapter = adapters("demo")  # the key layout is the same for every family
    p = Image.fromarray(_scene()).quantize(16)
    with_t, without = _file(p, "PNG", transparency=3), _file(p, "PNG")
    k_t = adapter.image_key(open_image(with_t, LIMITS, "image"))
    k_opaque = adapter.image_key(open_image(without, LIMITS, "image"))
    assert k_t != k_opaque
    composited = processor_rgb(Image.open(io.BytesIO(with_t)))
    assert adapter.image_key(open_image(_file(composited, "PNG"), LIMITS, "image")) == k_t


# -- the example, end to end -------------------------------------------------------------


async def test_a_red_circle_on_a_transparent_background_has_a_white_background(demo_config):
    """issue 42: the demo model answered "black" (the colour under the transparent pixels); read
    as transformers' processor reads the file, the background is white — as for the same circle
    drawn on white."""
    from mmserve import Runtime
    from mmserve.models.demo import Q_BACKGROUND, Q_COLOR, render_image
    from tests.helpers import ask

    on_white = render_image("red", "circle", background="white", seed=3)
    on_black = np.asarray(render_image("red", "circle", background="black", seed=3))
    circle = np.abs(np.asarray(on_white).astype(int) - on_black).sum(-1) < 30  # where the renders agree
    alpha = np.where(circle, 255, 0).astype(np.uint8)
    transparent = Image.fromarray(np.dstack([on_black, alpha]), "RGBA")  # black under the transparency
    config = demo_config.replace(models=demo_config.models[:1], kv_cache={"prefix_caching": False})
    async with Runtime.open(config) as rt:
        async def reply(img, question):
            return (await rt.chat_completion(ask(img, question), temperature=0, max_tokens=4)).text.strip()

        assert await reply(transparent, Q_BACKGROUND) == "white"
        assert await reply(transparent, Q_COLOR) == "red"
        assert await reply(Image.fromarray(on_black), Q_BACKGROUND) == "black"  # its opaque twin
        stats = rt.registry.require("demo").encoder.stats()
    assert (stats["misses"], stats["hits"]) == (2, 1)  # the twin is another picture: another key

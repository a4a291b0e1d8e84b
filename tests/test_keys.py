"""Content keys: pinned layouts and digests, and what changes a key (DESIGN.md F1, F5)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import struct

import numpy as np
import pytest
import torch
import xxhash
from PIL import Image
from safetensors.torch import save_file

from mmserve.cache import keys as K
from mmserve.cache import signature as MS
from mmserve.cache.keys import (
    HASH_ALGORITHMS,
    UncacheableInput,
    image_identity,
    key_prefix,
    mm_hash_audio,
    mm_hash_image,
    processor_digest,
)
from mmserve.cache.signature import WeightFile, model_sig, model_sig_from_parts

SIG = 0x0102030405060708
PROC = 0x1112131415161718
RUN = {"dtype": "float32", "device_type": "cpu"}  # the runtime half of a model signature


def lp(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<I", len(data)) + data


# -- pinned layouts ----------------------------------------------------------------------------
# These literals are the contract with every other process, replica and disk tier that shares
# keys. If one of these tests fails, you changed a layout: bump its version constant and re-pin.


def test_layout_versions_and_seeds_are_pinned():
    assert (MS.MODEL_SIG_LAYOUT_VERSION, K.PROCESSOR_DIGEST_LAYOUT_VERSION, K.MM_HASH_LAYOUT_VERSION) == (2, 1, 1)
    assert K.SEED_MODEL_SIG == 0x4D4D534552560001
    assert K.SEED_PROCESSOR == 0x4D4D534552560002
    assert K.SEED_MM_HASH == 0x4D4D534552560003
    assert (K.MODALITY_IMAGE, K.MODALITY_AUDIO) == (1, 2)


def _sig_parts():
    config = {"tokenizer.json": b"T", "config.json": b'{"a":1}'}  # unsorted on purpose
    weights = [WeightFile("model.safetensors", 100, b'{"x":{}}', bytes(range(16)))]
    return config, weights


def test_model_sig_layout_bytes_are_pinned():
    config, weights = _sig_parts()
    expected = b"".join(
        [
            struct.pack("<H", 2),
            lp("demo"),
            lp("float32"),
            lp("cpu"),
            struct.pack("<I", 2),
            lp("config.json") + struct.pack("<Q", 7) + b'{"a":1}',
            lp("tokenizer.json") + struct.pack("<Q", 1) + b"T",
            struct.pack("<I", 1),
            lp("model.safetensors") + struct.pack("<QQ", 100, 8) + b'{"x":{}}',
            struct.pack("<B", 16) + bytes(range(16)),
        ]
    )
    layout = MS.model_sig_layout("demo", config, weights, **RUN)
    assert layout == expected
    assert layout.hex() == (
        "02000400000064656d6f07000000666c6f617433320300000063707502000000"
        "0b000000636f6e6669672e6a736f6e07000000000000007b2261223a317d"
        "0e000000746f6b656e697a65722e6a736f6e010000000000000054010000001100000"
        "06d6f64656c2e7361666574656e736f7273640000000000000008000000000000007b2278223a7b7d7d"
        "10000102030405060708090a0b0c0d0e0f"
    )
    assert model_sig_from_parts("demo", config, weights, **RUN) == 0xA534A385B1E4A160


def test_model_sig_separates_dtypes_and_device_types():
    config, weights = _sig_parts()
    sigs = {
        (dtype, device): model_sig_from_parts("demo", config, weights, dtype=dtype, device_type=device)
        for dtype in ("float32", "float16", "bfloat16")
        for device in ("cpu", "cuda")
    }
    assert len(set(sigs.values())) == len(sigs)
    assert sigs["float16", "cpu"] == 0x52A30931F2857A76
    assert sigs["float32", "cuda"] == 0x8E9CA8FC24B1712D
    assert sigs["float16", "cuda"] == 0x6C512BB34DE8355A


def test_model_sig_runtime_fields_are_required_and_validated():
    config, weights = _sig_parts()
    with pytest.raises(TypeError):
        model_sig_from_parts("demo", config, weights)  # no silent default to fp32/cpu
    with pytest.raises(TypeError):
        model_sig_from_parts("demo", config, weights, "float32", "cpu")  # keyword-only
    bad_runs = [
        {"dtype": "", "device_type": "cpu"},
        {"dtype": "float32", "device_type": ""},
        {"dtype": "float32", "device_type": "cuda:0"},  # the type only, never an index
        {"dtype": None, "device_type": "cpu"},
    ]
    for bad in bad_runs:
        with pytest.raises(ValueError):
            model_sig_from_parts("demo", config, weights, **bad)


def test_processor_digest_is_pinned_and_canonical():
    settings = {"size": {"shortest_edge": 32}, "image_mean": [0.5, 0.25], "do_resize": True}
    assert K.canonical_json(settings) == b'{"do_resize":true,"image_mean":[0.5,0.25],"size":{"shortest_edge":32}}'
    assert processor_digest(settings) == 0x5DC2940917A06BF4
    reordered = {"do_resize": True, "image_mean": [0.5, 0.25], "size": {"shortest_edge": 32}}
    assert processor_digest(reordered) == processor_digest(settings)


def test_image_header_and_hash_are_pinned():
    pixels = np.arange(18, dtype=np.uint8).reshape(2, 3, 3)
    header = K.image_header(SIG, PROC, "RGB", (3, 2), pixels)
    expected = b"".join(
        [
            struct.pack("<HBQQ", 1, 1, SIG, PROC),
            lp("RGB"),
            struct.pack("<II", 3, 2),
            lp("|u1"),
            struct.pack("<IIII", 3, 2, 3, 3),
        ]
    )
    assert header == expected
    assert header.hex() == (
        "010001080706050403020118171615141312110300000052474203000000020000000300"
        "00007c753103000000020000000300000003000000"
    )
    assert mm_hash_image(SIG, PROC, "RGB", (3, 2), pixels).hex() == "e973a9ee69895ced08718f86e164e100"


def test_image_header_with_a_grid_is_layout_2_and_pinned():
    """Dynamic-resolution models (Qwen2-VL) fold the processor's (t, h, w) patch grid into the
    key: version 2, the v1 fields, then three u32."""
    pixels = np.arange(18, dtype=np.uint8).reshape(2, 3, 3)
    header = K.image_header(SIG, PROC, "RGB", (3, 2), pixels, (1, 4, 6))
    v1 = K.image_header(SIG, PROC, "RGB", (3, 2), pixels)
    assert header == struct.pack("<H", 2) + v1[2:] + struct.pack("<III", 1, 4, 6)
    assert header.hex() == (
        "020001080706050403020118171615141312110300000052474203000000020000000300"
        "00007c753103000000020000000300000003000000010000000400000006000000"
    )
    assert mm_hash_image(SIG, PROC, "RGB", (3, 2), pixels, grid=(1, 4, 6)).hex() == "58e8d68cd21ec855ef79545fcd148e1f"
    assert mm_hash_image(SIG, PROC, "RGB", (3, 2), pixels, grid=(1, 6, 4)) != mm_hash_image(
        SIG, PROC, "RGB", (3, 2), pixels, grid=(1, 4, 6))
    with pytest.raises(ValueError, match="grid"):
        K.image_header(SIG, PROC, "RGB", (3, 2), pixels, (1, 0, 6))


def test_qwen2_5_vl_image_header_is_layout_2_with_the_processor_settings_and_pinned(tmp_path):
    """A Qwen2.5-VL image under the tiny-qwen2.5-vl preset's processor as a checkpoint holds it
    (saved, then loaded as the adapter loads it): layout 2; the processor digest over every
    setting — min/max pixels (as `size`), patch, merge and temporal patch size, resampling,
    normalisation; then the size, the array header, and the grid those settings give a 20x12
    image (upscaled to 48x32 to reach min_pixels: 4x6 patches)."""
    from transformers import Qwen2VLImageProcessorPil

    from mmserve.models.demo.qwen import QWEN_PRESETS, build_image_processor

    build_image_processor("tiny-qwen2.5-vl").save_pretrained(tmp_path)
    settings = Qwen2VLImageProcessorPil.from_pretrained(tmp_path).to_dict()
    assert K.canonical_json(settings) == (
        b'{"do_convert_rgb":true,"do_normalize":true,"do_rescale":true,"do_resize":true,'
        b'"image_mean":[0.48145466,0.4578275,0.40821073],"image_processor_type":"Qwen2VLImageProcessor",'
        b'"image_std":[0.26862954,0.26130258,0.27577711],"merge_size":2,"patch_size":8,"resample":3,'
        b'"rescale_factor":0.00392156862745098,"size":{"longest_edge":16384,"shortest_edge":1024},'
        b'"temporal_patch_size":2}')
    digest = processor_digest(settings)
    assert digest == 0x2AAB237EBE8D3512
    grid = QWEN_PRESETS["tiny-qwen2.5-vl"].grid(20, 12)
    assert grid == (1, 4, 6)
    pixels = np.arange(20 * 12 * 3, dtype=np.uint16).astype(np.uint8).reshape(12, 20, 3)
    header = K.image_header(SIG, digest, "RGB", (20, 12), pixels, grid)
    assert header == b"".join([struct.pack("<HBQQ", 2, 1, SIG, digest), lp("RGB"), struct.pack("<II", 20, 12),
                               lp("|u1"), struct.pack("<IIII", 3, 12, 20, 3), struct.pack("<III", *grid)])
    assert header.hex() == (
        "020001080706050403020112358dbe7e23ab2a03000000524742140000000c000000030000007c7531030000000c00000014"
        "00000003000000010000000400000006000000"
    )
    assert mm_hash_image(SIG, digest, "RGB", (20, 12), pixels, grid=grid).hex() == "7035dfe0068aa1dbbedbab294da435af"


def test_llava_onevision_image_header_is_layout_2_with_the_processor_settings_and_tiling_pinned(tmp_path):
    """A LLaVA-OneVision image under the tiny-llava-onevision preset's processor as a checkpoint
    holds it (saved, then loaded as the adapter loads it): layout 2; the processor digest over the
    image processor's settings — grid pinpoints, tile size, resampling, normalisation, padding
    (and crop, when set) — and, under "processor", the processor's own (num_image_tokens,
    vision_feature_select_strategy, vision_aspect_ratio); then the size, the array header, and as
    the grid (tokens, tile rows, tile columns): a 70x30 image takes the 32x96 pinpoint, 1x3 tiles,
    16 base rows + 4 rows of 10 unpadded columns and a newline = 60 tokens."""
    from transformers import LlavaOnevisionImageProcessorPil

    from mmserve.models.demo.onevision import build_onevision_image_processor, processor_settings
    from mmserve.models.llava_onevision import _PROCESSOR_KEYS, image_tiles, image_tokens, onevision_processor_digest

    build_onevision_image_processor("tiny-llava-onevision").save_pretrained(tmp_path)
    ip = LlavaOnevisionImageProcessorPil.from_pretrained(tmp_path)
    settings = ip.to_dict()
    own = {k: processor_settings("tiny-llava-onevision")[k] for k in _PROCESSOR_KEYS}
    assert K.canonical_json({**settings, "processor": own}) == (
        b'{"do_convert_rgb":true,"do_normalize":true,"do_pad":true,"do_rescale":true,"do_resize":true,'
        b'"image_grid_pinpoints":[[32,32],[32,64],[64,32],[64,64],[32,96],[96,32],[64,96],[96,64]],'
        b'"image_mean":[0.5,0.5,0.5],"image_processor_type":"LlavaOnevisionImageProcessor",'
        b'"image_std":[0.5,0.5,0.5],"processor":{"num_image_tokens":16,"vision_aspect_ratio":"anyres_max_4",'
        b'"vision_feature_select_strategy":"full"},"resample":3,"rescale_factor":0.00392156862745098,'
        b'"size":{"height":32,"width":32}}')
    digest = onevision_processor_digest(settings, own)
    assert digest == 0x01F9779169D969BF
    grid = (image_tokens(ip, own, 30, 70), *image_tiles(ip, 30, 70))
    assert grid == (60, 1, 3)
    pixels = np.arange(70 * 30 * 3, dtype=np.uint16).astype(np.uint8).reshape(30, 70, 3)
    header = K.image_header(SIG, digest, "RGB", (70, 30), pixels, grid)
    assert header == b"".join([struct.pack("<HBQQ", 2, 1, SIG, digest), lp("RGB"), struct.pack("<II", 70, 30),
                               lp("|u1"), struct.pack("<IIII", 3, 30, 70, 3), struct.pack("<III", *grid)])
    assert header.hex() == (
        "0200010807060504030201bf69d9699177f90103000000524742460000001e000000030000007c7531030000001e00000046"
        "000000030000003c0000000100000003000000"
    )
    assert mm_hash_image(SIG, digest, "RGB", (70, 30), pixels, grid=grid).hex() == "2d7185cd378ebf7410bf92d9f7d22f24"


def test_audio_header_and_hash_are_pinned():
    samples = np.array([0.0, 0.5, -1.0], dtype=np.float32)
    header = K.audio_header(1, 2, samples, 16000)
    assert header == struct.pack("<HBQQI", 1, 2, 1, 2, 16000) + lp("<f4") + struct.pack("<II", 1, 3)
    assert mm_hash_audio(1, 2, samples, 16000).hex() == "8a58fa4be386ed2107553a47b39725c3"


# -- encoder-output key (mm_hash + cache_salt) ---------------------------------------------------

MM = bytes(range(16))


def test_encoder_key_layout_and_digests_are_pinned():
    assert K.ENCODER_KEY_LAYOUT_VERSION == 2  # 1 was the bare mm_hash, shared by every tenant
    assert K.encoder_key_layout(MM, None) == struct.pack("<H", 2) + MM + b"\x00" + lp("")
    assert K.encoder_key_layout(MM, "tenant-a") == struct.pack("<H", 2) + MM + b"\x01" + lp("tenant-a")
    assert K.encoder_key_layout(MM, "tenant-a").hex() == (
        "0200" "000102030405060708090a0b0c0d0e0f" "01" "08000000" "74656e616e742d61")
    assert K.encoder_cache_key(MM, None).hex() == "93881db54b1ed8b5328cba6b3c1ce572"
    assert K.encoder_cache_key(MM, "tenant-a").hex() == "e4c804dca88be75639ff296c32f4f69f"
    assert K.encoder_cache_key(MM, "tenant-a") == xxhash.xxh3_128_digest(
        K.encoder_key_layout(MM, "tenant-a"), seed=K.SEED_ENCODER_KEY)
    sha = K.encoder_cache_key(MM, "tenant-a", algorithm="sha256")
    assert sha.hex() == "e23b20356524db2af69a7eb79ff26c58"
    assert sha == _sha256_key(K.SEED_ENCODER_KEY, K.encoder_key_layout(MM, "tenant-a"))


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_encoder_key_separates_tenants_and_content(algorithm):
    """No salt is a namespace of its own (distinct from every salt, the empty one included); any
    other salt, or another item, gives another key; the same (item, salt) always the same key."""
    other = bytes(range(1, 17))
    keys = [K.encoder_cache_key(m, salt, algorithm=algorithm)
            for m in (MM, other) for salt in (None, "", "a", "b", "tenant-a")]
    assert len(set(keys)) == len(keys) and all(len(k) == 16 for k in keys)
    assert MM not in keys  # never the bare mm_hash: a layout-1 entry can never be read as one
    assert K.encoder_cache_key(MM, "a", algorithm=algorithm) == K.encoder_cache_key(bytes(MM), "a", algorithm=algorithm)
    for bad in (MM[:15], bytearray(MM), None):
        with pytest.raises(ValueError):
            K.encoder_cache_key(bad, "a", algorithm=algorithm)
    with pytest.raises(TypeError):
        K.encoder_cache_key(MM, 5, algorithm=algorithm)


# -- sha256 content keys (vLLM CVE-2025-25183) ---------------------------------------------------


def _sha256_key(seed: int, *parts: bytes) -> bytes:
    """The documented sha256 construction, written out independently of the module."""
    return hashlib.sha256(struct.pack("<Q", seed) + b"".join(parts)).digest()[:16]


def test_hash_algorithms_match_the_config():
    from mmserve.config import HASH_ALGORITHMS as CONFIG_HASH_ALGORITHMS

    assert HASH_ALGORITHMS == CONFIG_HASH_ALGORITHMS == ("xxh3_128", "sha256")


def test_sha256_image_and_audio_keys_are_pinned():
    pixels = np.arange(18, dtype=np.uint8).reshape(2, 3, 3)
    key = mm_hash_image(SIG, PROC, "RGB", (3, 2), pixels, algorithm="sha256")
    assert key.hex() == "8274954e4047d522f3c2d37afc2d303d"
    assert key == _sha256_key(K.SEED_MM_HASH, K.image_header(SIG, PROC, "RGB", (3, 2), pixels), pixels.tobytes())
    samples = np.array([0.0, 0.5, -1.0], dtype=np.float32)
    audio = mm_hash_audio(1, 2, samples, 16000, algorithm="sha256")
    assert audio.hex() == "b433abe40cc2cd40ef5396e1e3fea71f"
    assert audio == _sha256_key(K.SEED_MM_HASH, K.audio_header(1, 2, samples, 16000), samples.tobytes())


def test_the_default_algorithm_is_xxh3_and_the_two_never_agree():
    pixels = _rgb()
    samples = np.sin(np.arange(64, dtype=np.float32))
    img = Image.fromarray(pixels)
    xxh3 = mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels)
    assert mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels, algorithm="xxh3_128") == xxh3
    assert mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels, algorithm="sha256") != xxh3
    assert mm_hash_audio(SIG, PROC, samples, 8000, algorithm="sha256") != mm_hash_audio(SIG, PROC, samples, 8000)
    assert image_identity(SIG, PROC, img, algorithm="sha256") != image_identity(SIG, PROC, img)
    assert image_identity(SIG, PROC, img, algorithm="xxh3_128") == image_identity(SIG, PROC, img) == xxh3


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_each_algorithm_gives_equal_keys_for_equal_inputs_only(algorithm):
    pixels = _rgb()
    base = mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels, algorithm=algorithm)
    assert len(base) == 16
    assert mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels.copy(), algorithm=algorithm) == base
    as_float = pixels.astype("<f4")
    assert mm_hash_image(SIG, PROC, "RGB", (8, 6), as_float.astype(">f4"), algorithm=algorithm) == mm_hash_image(
        SIG, PROC, "RGB", (8, 6), as_float, algorithm=algorithm
    )
    flipped = pixels.copy()
    flipped[0, 0, 0] ^= 1
    others = [
        mm_hash_image(SIG, PROC, "RGB", (8, 6), flipped, algorithm=algorithm),
        mm_hash_image(SIG + 1, PROC, "RGB", (8, 6), pixels, algorithm=algorithm),
        mm_hash_image(SIG, PROC + 1, "RGB", (8, 6), pixels, algorithm=algorithm),
        mm_hash_audio(SIG, PROC, pixels.reshape(-1), 8, algorithm=algorithm),
    ]
    assert len({base, *others}) == 1 + len(others)
    jpeg = _decode(_encode(Image.fromarray(pixels), "JPEG", quality=80))
    png = _decode(_encode(jpeg, "PNG"))
    key = image_identity(SIG, PROC, jpeg, algorithm=algorithm)
    assert key == image_identity(SIG, PROC, png, algorithm=algorithm)
    assert key == mm_hash_image(SIG, PROC, "RGB", jpeg.size, np.asarray(jpeg), algorithm=algorithm)
    assert image_identity(SIG, PROC, jpeg.convert("P"), algorithm=algorithm) is None


def test_an_unknown_algorithm_is_rejected_naming_the_allowed_ones():
    pixels = _rgb()
    calls = [
        lambda alg: mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels, algorithm=alg),
        lambda alg: mm_hash_audio(SIG, PROC, pixels.reshape(-1), 8, algorithm=alg),
        lambda alg: image_identity(SIG, PROC, Image.fromarray(pixels), algorithm=alg),
        lambda alg: image_identity(SIG, PROC, Image.fromarray(pixels).convert("P"), algorithm=alg),  # not None
        K.check_hash_algorithm,
    ]
    for call in calls:
        for bad in ("md5", "SHA256", "xxh3_64", "", None):
            with pytest.raises(ValueError, match="xxh3_128.*sha256"):
                call(bad)
    assert K.check_hash_algorithm("sha256") == "sha256"


# -- processor digest --------------------------------------------------------------------------


def test_processor_digest_changes_with_any_setting():
    base = {"crop_size": 32, "image_mean": [0.48, 0.45, 0.40], "resample": 3}
    digests = {
        processor_digest(base),
        processor_digest({**base, "crop_size": 33}),
        processor_digest({**base, "image_mean": [0.48, 0.45, 0.41]}),
        processor_digest({**base, "resample": 2}),
        processor_digest({**base, "extra": None}),
    }
    assert len(digests) == 5


def test_processor_digest_floats_as_repr_and_numpy_values():
    assert K.canonical_json({"x": 0.1, "y": 1e-7}) == b'{"x":0.1,"y":1e-07}'
    as_numpy = {"mean": np.array([0.5, 0.25]), "n": np.int64(3)}
    assert processor_digest(as_numpy) == processor_digest({"mean": [0.5, 0.25], "n": 3})


def test_processor_digest_rejects_what_has_no_canonical_form():
    with pytest.raises(ValueError):
        processor_digest({"x": float("nan")})
    with pytest.raises(TypeError):
        processor_digest({"x": object()})


# -- image keys --------------------------------------------------------------------------------


def _rgb(seed: int = 0, size=(8, 6)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)


def _decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_files_decoding_to_the_same_pixels_share_a_key():
    jpeg = _decode(_encode(Image.fromarray(_rgb()), "JPEG", quality=80))
    png = _decode(_encode(jpeg, "PNG"))
    bmp = _decode(_encode(jpeg, "BMP"))
    keys = {image_identity(SIG, PROC, img) for img in (jpeg, png, bmp)}
    assert len(keys) == 1 and None not in keys


def test_a_differing_pixel_size_mode_setting_or_model_gives_a_different_key():
    pixels = _rgb()
    base = mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels)
    flipped = pixels.copy()
    flipped[5, 7, 2] ^= 1
    reshaped = pixels.reshape(8, 6, 3)  # same bytes, other geometry
    gray = pixels[..., 0]
    variants = [
        mm_hash_image(SIG, PROC, "RGB", (8, 6), flipped),
        mm_hash_image(SIG, PROC, "RGB", (6, 8), reshaped),
        mm_hash_image(SIG, PROC + 1, "RGB", (8, 6), pixels),
        mm_hash_image(SIG + 1, PROC, "RGB", (8, 6), pixels),
        mm_hash_image(SIG, PROC, "L", (8, 6), gray),
        mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels.astype(np.float32)),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    assert all(len(k) == 16 for k in variants)
    assert mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels.copy()) == base


def test_mode_alone_changes_the_key():
    pixels = np.zeros((2, 3), dtype=np.uint8)
    assert mm_hash_image(SIG, PROC, "L", (3, 2), pixels) != mm_hash_image(SIG, PROC, "1", (3, 2), pixels)


def test_byte_order_and_memory_layout_do_not_change_the_key():
    pixels = np.linspace(0, 1, 6 * 8 * 3, dtype="<f4").reshape(6, 8, 3)
    big_endian = pixels.astype(">f4")
    fortran = np.asfortranarray(pixels)
    strided = np.repeat(pixels, 2, axis=1)[:, ::2]
    base = mm_hash_image(SIG, PROC, "RGB", (8, 6), pixels)
    for arr in (big_endian, fortran, strided):
        assert mm_hash_image(SIG, PROC, "RGB", (8, 6), arr) == base


def test_mm_hash_image_rejects_inputs_without_a_faithful_key():
    pixels = _rgb()
    with pytest.raises(UncacheableInput):
        mm_hash_image(SIG, PROC, "P", (8, 6), pixels[..., 0])  # palette not in the array
    with pytest.raises(UncacheableInput):
        mm_hash_image(SIG, PROC, "RGB", (6, 8), pixels)  # size disagrees with the array
    with pytest.raises(UncacheableInput):
        mm_hash_image(SIG, PROC, "RGB", (0, 0), np.zeros((0, 0, 3), np.uint8))
    with pytest.raises(UncacheableInput):
        mm_hash_image(SIG, PROC, "RGB", (1, 1), np.array([[[object()] * 3]], dtype=object))
    with pytest.raises(ValueError):
        mm_hash_image(-1, PROC, "RGB", (8, 6), pixels)  # a caller bug, not uncacheable input
    with pytest.raises(TypeError):
        mm_hash_image(SIG, PROC, "RGB", (8, 6), torch.zeros(6, 8, 3))
    assert issubclass(UncacheableInput, ValueError)


@pytest.mark.parametrize("mode", sorted(K.CACHEABLE_IMAGE_MODES))
def test_image_identity_of_cacheable_modes(mode):
    img = Image.fromarray(_rgb()).convert(mode)
    key = image_identity(SIG, PROC, img)
    assert key == mm_hash_image(SIG, PROC, mode, img.size, np.asarray(img))
    assert len(key) == 16


def test_image_identity_is_none_for_uncacheable_images():
    rgb = Image.fromarray(_rgb())
    palette = rgb.convert("P")
    assert image_identity(SIG, PROC, palette) is None
    assert image_identity(SIG, PROC, Image.new("I;16", (4, 4))) is None
    assert image_identity(SIG, PROC, rgb.convert("CMYK")) is None
    assert image_identity(SIG, PROC, Image.new("RGB", (0, 0))) is None
    truncated = Image.open(io.BytesIO(_encode(rgb, "PNG")[:60]))
    assert image_identity(SIG, PROC, truncated) is None
    # converting first makes it cacheable
    assert image_identity(SIG, PROC, palette.convert("RGB")) is not None


def test_image_identity_raises_for_caller_bugs():
    with pytest.raises(ValueError):
        image_identity(2**64, PROC, Image.new("RGB", (2, 2)))


# -- audio keys --------------------------------------------------------------------------------


def test_audio_key_changes_with_samples_rate_and_identity():
    samples = np.sin(np.arange(400, dtype=np.float32) / 7)
    base = mm_hash_audio(SIG, PROC, samples, 16000)
    changed = samples.copy()
    changed[123] += 1e-3
    variants = [
        mm_hash_audio(SIG, PROC, changed, 16000),
        mm_hash_audio(SIG, PROC, samples, 22050),
        mm_hash_audio(SIG + 1, PROC, samples, 16000),
        mm_hash_audio(SIG, PROC + 1, samples, 16000),
        mm_hash_audio(SIG, PROC, samples.reshape(200, 2), 16000),
    ]
    assert len({base, *variants}) == 1 + len(variants)
    assert mm_hash_audio(SIG, PROC, samples.astype(">f4"), 16000) == base
    with pytest.raises(ValueError):
        mm_hash_audio(SIG, PROC, samples, 0)


def test_image_and_audio_with_equal_bytes_never_share_a_key():
    data = np.zeros((4, 4), dtype=np.uint8)
    assert mm_hash_image(SIG, PROC, "L", (4, 4), data) != mm_hash_audio(SIG, PROC, data, 4)


# -- model signature from files ----------------------------------------------------------------


def _write_model(path, *, seed=0, hidden=8, config=None, extra=None):
    path.mkdir(parents=True)
    torch.manual_seed(seed)
    save_file({"w": torch.randn(hidden, 4), "b": torch.zeros(hidden)}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config or {"hidden_size": hidden}))
    (path / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    (path / "chat_template.jinja").write_text("{{ messages }}")
    for name, text in (extra or {}).items():
        (path / name).write_text(text)
    return path


def test_model_sig_same_checkpoint_anywhere_gives_the_same_sig(tmp_path):
    a = _write_model(tmp_path / "a")
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    (b / "README.md").write_text("not part of the model")
    assert model_sig("demo", a, **RUN) == model_sig("demo", b, **RUN)
    assert 0 <= model_sig("demo", a, **RUN) < 2**64


def test_model_sig_from_files_covers_dtype_and_device_type(tmp_path):
    path = _write_model(tmp_path / "m")
    sigs = {
        model_sig("demo", path, dtype="float32", device_type="cpu"),
        model_sig("demo", path, dtype="float16", device_type="cpu"),
        model_sig("demo", path, dtype="float32", device_type="cuda"),
        model_sig("demo", path, dtype="float16", device_type="cuda"),
    }
    assert len(sigs) == 4
    with pytest.raises(TypeError):
        model_sig("demo", path)  # dtype and device_type have no default


def test_model_sig_differs_for_any_other_checkpoint_under_the_same_name(tmp_path):
    base = model_sig("demo", _write_model(tmp_path / "base"), **RUN)
    others = [
        model_sig("other", _write_model(tmp_path / "name"), **RUN),
        model_sig("demo", _write_model(tmp_path / "finetune", seed=1), **RUN),  # same shapes, same hidden size
        model_sig("demo", _write_model(tmp_path / "config", config={"hidden_size": 8, "x": 1}), **RUN),
        model_sig("demo", _write_model(tmp_path / "tok", extra={"tokenizer_config.json": "{}"}), **RUN),
        model_sig("demo", _write_model(tmp_path / "proc", extra={"preprocessor_config.json": "{}"}), **RUN),
    ]
    assert len({base, *others}) == 1 + len(others)


def test_model_sig_without_weight_content_still_sees_headers_and_sizes(tmp_path):
    a = model_sig("demo", _write_model(tmp_path / "a"), **RUN, hash_weights=False)
    finetune = model_sig("demo", _write_model(tmp_path / "b", seed=1), **RUN, hash_weights=False)
    wider = model_sig("demo", _write_model(tmp_path / "c", hidden=16), **RUN, hash_weights=False)
    assert a == finetune  # the documented blind spot of hash_weights=False
    assert a != wider


def test_model_sig_covers_bin_weights(tmp_path):
    path = _write_model(tmp_path / "m")
    base = model_sig("demo", path, **RUN)
    (path / "pytorch_model.bin").write_bytes(b"\x00" * 32)
    with_bin = model_sig("demo", path, **RUN)
    (path / "pytorch_model.bin").write_bytes(b"\x01" + b"\x00" * 31)
    assert len({base, with_bin, model_sig("demo", path, **RUN)}) == 3


def test_model_sig_rejects_missing_or_corrupt_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError):
        model_sig("demo", tmp_path / "missing", **RUN)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        model_sig("demo", tmp_path / "empty", **RUN)
    path = _write_model(tmp_path / "corrupt")
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(ValueError):
        model_sig("demo", path, **RUN)


def test_read_safetensors_header(tmp_path):
    path = _write_model(tmp_path / "m") / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert MS.read_safetensors_header(path) == raw[8 : 8 + length]
    assert json.loads(MS.read_safetensors_header(path))["w"]["shape"] == [8, 4]


def test_key_prefix():
    assert key_prefix(bytes(range(16))) == "000102030405"
    assert key_prefix(0xA534A385B1E4A160) == "a534a385b1e4"
    assert key_prefix(1) == "000000000000"

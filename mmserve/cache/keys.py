"""Content keys: the processor digest and the multimodal item hash, and the byte-layout and hash
primitives every key uses (the model signature is in `model_sig`).

Every key is xxhash with a fixed seed over an explicit, versioned, little-endian byte layout, so a
key means the same thing in every process and on every machine (no Python `hash()`, no per-process
randomness). Each layout has a version constant; changing a layout means bumping its version, and
tests pin the exact bytes and digests of every layout.

The tenant-controlled 128-bit content keys (mm_hash here, block hashes in `block_hash`) take an
`algorithm`: "xxh3_128" (the default) or "sha256" (`[prefix_cache] hash`). xxh3 with a public seed
lets a tenant craft two inputs with one key (vLLM CVE-2025-25183); SHA-256 does not. Under
"sha256" a key is SHA-256 over the same byte layout, truncated to the same 16 bytes, with the seed's
role played by a domain-separation prefix: the seed as 8 little-endian bytes, prepended. The two
algorithms therefore never share a key space. `model_sig` and `processor_digest` stay xxh3_64: their
inputs come from the operator's model directory, not from tenants.

Identity lives in the key (DESIGN.md F1, F5): an `mm_hash` folds in the model signature and the
processor settings, so two models, or one model under two processor settings, never share an entry.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Mapping

import numpy as np
import xxhash

PROCESSOR_DIGEST_LAYOUT_VERSION = 1
MM_HASH_LAYOUT_VERSION = 1
MM_HASH_GRID_LAYOUT_VERSION = 2  # v1 + the processor's (t, h, w) patch grid (dynamic-resolution models)
# The encoder-output cache's key (local cache and shared tier). Version 1 was the bare mm_hash,
# one entry for every tenant; version 2 folds in the request's cache_salt (`encoder_cache_key`).
ENCODER_KEY_LAYOUT_VERSION = 2

MODALITY_IMAGE = 1
MODALITY_AUDIO = 2
MODALITY_VIDEO = 3
VIDEO_LAYOUT_VERSION = 1  # a video's content digest, mm_hash header and source key (`video_header`)

# Fixed seeds, one per kind of key ("MMSERV" + a kind number). Never change them: keys are shared
# across processes and machines.
SEED_MODEL_SIG = 0x4D4D_5345_5256_0001
SEED_PROCESSOR = 0x4D4D_5345_5256_0002
SEED_MM_HASH = 0x4D4D_5345_5256_0003
SEED_BLOCK_HASH = 0x4D4D_5345_5256_0004
SEED_WEIGHT_CONTENT = 0x4D4D_5345_5256_0005
SEED_ENCODER_KEY = 0x4D4D_5345_5256_0008  # 6 and 7 are the shared tier's (cache/shared_values.py)
SEED_VIDEO_CONTENT = 0x4D4D_5345_5256_0009  # a video's sampled frames
SEED_VIDEO_SOURCE = 0x4D4D_5345_5256_000A  # a video file's bytes and the settings it is read under

# Hash algorithms of the tenant-controlled content keys. Kept equal to
# mmserve.config.HASH_ALGORITHMS (cache/ does not import config; a test checks they agree).
HASH_XXH3_128 = "xxh3_128"
HASH_SHA256 = "sha256"
HASH_ALGORITHMS = (HASH_XXH3_128, HASH_SHA256)
CONTENT_KEY_BYTES = 16

# Image modes whose pixel array alone says what the image looks like. 'P'/'PA' need their palette,
# 'I;16'-style and exotic modes are left to the caller to convert first: uncacheable until then.
CACHEABLE_IMAGE_MODES = frozenset({"1", "L", "LA", "RGB", "RGBA"})
# Sample dtypes hashed by value: bool, signed and unsigned ints, floats.
_HASHABLE_DTYPE_KINDS = frozenset("biuf")



class UncacheableInput(ValueError):
    """The input has no faithful content identity: encode it fresh and never store it."""


# -- little-endian packing ----------------------------------------------------------------------


def _pack(fmt: str, value: int, what: str) -> bytes:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    try:
        return struct.pack(fmt, int(value))
    except struct.error:
        raise ValueError(f"{what}={value} does not fit the key layout ({fmt})") from None


def u8(value: int, what: str = "value") -> bytes:
    return _pack("<B", value, what)


def u16(value: int, what: str = "value") -> bytes:
    return _pack("<H", value, what)


def u32(value: int, what: str = "value") -> bytes:
    return _pack("<I", value, what)


def u64(value: int, what: str = "value") -> bytes:
    return _pack("<Q", value, what)


def lp_bytes(data: bytes) -> bytes:
    """Length-prefixed bytes: u32 length, then the bytes."""
    return u32(len(data), "length") + bytes(data)


def lp_str(text: str, encoding: str = "utf-8") -> bytes:
    """Length-prefixed string (u32 byte length, then the encoded text)."""
    return lp_bytes(text.encode(encoding))


def key_prefix(key: bytes | int) -> str:
    """A short hex prefix of a key (12 hex digits) for logs; ints are read as 64-bit keys."""
    if isinstance(key, int):
        return f"{key:016x}"[:12]
    return bytes(key[:6]).hex()


# -- content-key hashing (xxh3_128 | sha256) ----------------------------------------------------


def check_hash_algorithm(algorithm: str) -> str:
    """`algorithm` itself if it is one of HASH_ALGORITHMS; ValueError naming the allowed ones if not."""
    if not isinstance(algorithm, str) or algorithm not in HASH_ALGORITHMS:
        raise ValueError(f"hash algorithm must be one of {list(HASH_ALGORITHMS)}, got {algorithm!r}")
    return algorithm


class _Sha256Key:
    """Streaming SHA-256 with a domain prefix (the seed, u64 LE), digest truncated to 16 bytes."""

    __slots__ = ("_h",)

    def __init__(self, seed: int):
        self._h = hashlib.sha256(u64(seed, "seed"))

    def update(self, data) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()[:CONTENT_KEY_BYTES]


def content_hasher(seed: int, algorithm: str = HASH_XXH3_128):
    """A streaming hasher (`update`, `digest` → 16 bytes) for one kind of content key."""
    if check_hash_algorithm(algorithm) == HASH_XXH3_128:
        return xxhash.xxh3_128(seed=seed)
    return _Sha256Key(seed)


def content_key(data: bytes, seed: int, algorithm: str = HASH_XXH3_128) -> bytes:
    """The 16-byte key of `data` under `algorithm`: xxh3_128(data, seed), or
    sha256(u64 LE seed | data) truncated to 16 bytes."""
    if check_hash_algorithm(algorithm) == HASH_XXH3_128:
        return xxhash.xxh3_128_digest(data, seed=seed)
    h = hashlib.sha256(u64(seed, "seed"))
    h.update(data)
    return h.digest()[:CONTENT_KEY_BYTES]


# -- processor digest ---------------------------------------------------------------------------


def canonical_json(settings: Mapping) -> bytes:
    """Sorted keys, no whitespace, ASCII, floats as repr; NaN/inf and non-JSON values rejected."""
    text = json.dumps(
        settings, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False, default=_json_default
    )
    return text.encode("ascii")


def _json_default(value):
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"processor setting of type {type(value).__name__} has no canonical JSON form")


def processor_digest(settings: Mapping) -> int:
    """Stable 64-bit digest of the image processor's settings: u16 version | canonical JSON."""
    layout = u16(PROCESSOR_DIGEST_LAYOUT_VERSION) + canonical_json(settings)
    return xxhash.xxh3_64_intdigest(layout, seed=SEED_PROCESSOR)


# -- multimodal item hash -----------------------------------------------------------------------


def _hashable_array(values, what: str) -> np.ndarray:
    """A C-contiguous little-endian view (or copy) of `values`, the bytes the key covers."""
    if not isinstance(values, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(values).__name__}")
    if values.dtype.kind not in _HASHABLE_DTYPE_KINDS:
        raise UncacheableInput(f"{what} dtype {values.dtype} has no stable byte form")
    return np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))


def _array_header(arr: np.ndarray) -> bytes:
    shape = b"".join(u32(n, "dimension") for n in arr.shape)
    return lp_str(arr.dtype.str, "ascii") + u32(arr.ndim) + shape


def _mm_digest(header: bytes, arr: np.ndarray, algorithm: str) -> bytes:
    hasher = content_hasher(SEED_MM_HASH, algorithm)
    hasher.update(header)
    hasher.update(arr)
    return hasher.digest()


def image_header(
    model_sig: int, processor_digest: int, mode: str, size: tuple[int, int], pixels: np.ndarray,
    grid: tuple[int, int, int] | None = None,
) -> bytes:
    """The header an image's mm_hash covers before its pixel bytes.

    Layout version 1 (no grid):
    u16 version | u8 modality=1 | u64 model_sig | u64 processor digest | mode (u32 len + ascii)
    | u32 width | u32 height | dtype str (u32 len + ascii, e.g. '|u1') | u32 ndim | u32 per dim
    Layout version 2 (a dynamic-resolution model's image, e.g. Qwen2-VL): version 1's fields with
    version = 2, then u32 grid_t | u32 grid_h | u32 grid_w. The grid follows from the size and
    the processor settings already in the key; it is folded in so the key says outright how many
    tokens the image makes and where the text after it sits (M-RoPE), whatever the arithmetic.
    """
    width, height = size
    if mode not in CACHEABLE_IMAGE_MODES:
        raise UncacheableInput(f"image mode {mode!r} is not cacheable (convert to RGB/RGBA/L first)")
    if width <= 0 or height <= 0:
        raise UncacheableInput(f"empty image {width}x{height}")
    if pixels.ndim not in (2, 3) or pixels.shape[:2] != (height, width):
        raise UncacheableInput(f"pixel array shape {pixels.shape} does not match image size {width}x{height}")
    if grid is not None and (len(grid) != 3 or min(grid) < 1):
        raise ValueError(f"an image grid is three positive patch counts (t, h, w), got {grid!r}")
    version = MM_HASH_LAYOUT_VERSION if grid is None else MM_HASH_GRID_LAYOUT_VERSION
    return b"".join(
        [
            _mm_prefix(MODALITY_IMAGE, model_sig, processor_digest, version),
            lp_str(mode, "ascii"),
            u32(width, "width"),
            u32(height, "height"),
            _array_header(pixels),
            b"" if grid is None else b"".join(u32(n, "grid") for n in grid),
        ]
    )


def _mm_prefix(modality: int, model_sig: int, processor_digest: int, version: int = MM_HASH_LAYOUT_VERSION) -> bytes:
    version = u16(version)
    return version + u8(modality) + u64(model_sig, "model_sig") + u64(processor_digest, "processor_digest")


def mm_hash_image(
    model_sig: int,
    processor_digest: int,
    mode: str,
    size: tuple[int, int],
    pixels: np.ndarray,
    *,
    algorithm: str = HASH_XXH3_128,
    grid: tuple[int, int, int] | None = None,
) -> bytes:
    """16-byte content key of a decoded image: `algorithm` over `image_header` + pixel bytes.

    `pixels` is the decoded array as the processor will see it (e.g. `np.asarray(pil_image)`,
    shape [height, width(, channels)]); byte order is normalised to little-endian, so equal values
    give equal keys on every machine. Raises UncacheableInput when no faithful key exists.
    """
    check_hash_algorithm(algorithm)
    arr = _hashable_array(pixels, "pixels")
    return _mm_digest(image_header(model_sig, processor_digest, mode, size, arr, grid), arr, algorithm)


def audio_header(model_sig: int, processor_digest: int, samples: np.ndarray, sample_rate: int) -> bytes:
    """The header an audio item's mm_hash covers before its PCM bytes (layout version 1).

    u16 version | u8 modality=2 | u64 model_sig | u64 processor digest | u32 sample rate
    | dtype str (u32 len + ascii) | u32 ndim | u32 per dim
    """
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    if samples.ndim not in (1, 2):
        raise UncacheableInput(f"PCM samples must be [n] or [n, channels], got shape {samples.shape}")
    prefix = _mm_prefix(MODALITY_AUDIO, model_sig, processor_digest)
    return prefix + u32(sample_rate, "sample_rate") + _array_header(samples)


def mm_hash_audio(
    model_sig: int,
    processor_digest: int,
    samples: np.ndarray,
    sample_rate: int,
    *,
    algorithm: str = HASH_XXH3_128,
) -> bytes:
    """16-byte content key of decoded PCM audio: `algorithm` over `audio_header` + sample bytes."""
    check_hash_algorithm(algorithm)
    arr = _hashable_array(samples, "samples")
    return _mm_digest(audio_header(model_sig, processor_digest, arr, sample_rate), arr, algorithm)


# -- video ------------------------------------------------------------------------------------------


def video_content_digest(frames: np.ndarray, algorithm: str = HASH_XXH3_128) -> bytes:
    """16 bytes over a video's sampled frames as decoded (RGB, before any resize):
    u16 version | u8 modality=3 | u32 frames | u32 height | u32 width | u32 channels | the frames' bytes."""
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4:
        raise UncacheableInput(f"video frames must be a [T, H, W, C] uint8 array, got {getattr(frames, 'shape', frames)!r}")
    header = u16(VIDEO_LAYOUT_VERSION) + u8(MODALITY_VIDEO) + b"".join(u32(n, "dimension") for n in frames.shape)
    hasher = content_hasher(SEED_VIDEO_CONTENT, algorithm)
    hasher.update(header)
    hasher.update(np.ascontiguousarray(frames))
    return hasher.digest()


def video_header(model_sig: int, processor_digest: int, content: bytes, *, settings: Mapping,
                 indices: tuple[int, ...], source_fps: float, total_frames: int, size: tuple[int, int],
                 resized: tuple[int, int], grid: tuple[int, int, int]) -> bytes:
    """Everything a video's mm_hash covers (layout version 1):
    u16 version | u8 modality=3 | u64 model_sig | u64 video processor digest | content digest (16)
    | settings (u32 len + canonical JSON: the request's fps / num_frames / pixel budgets as resolved)
    | f64 LE source fps | u32 source frames | u32 width | u32 height | u32 resized height
    | u32 resized width | u32 grid_t | u32 grid_h | u32 grid_w | u32 sampled frames | u32 per index.
    The sampled indices (with the source fps: the frames' timestamps), the resize result and the
    grid (with the temporal patch size in the processor digest: how frames are grouped) are in the
    key outright, so the same file sampled two ways never shares an entry."""
    if type(content) is not bytes or len(content) != CONTENT_KEY_BYTES:
        raise ValueError(f"a video's content digest is {CONTENT_KEY_BYTES} bytes, got {content!r}")
    if not indices or len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"a video needs sampled frames and a (t, h, w) grid, got {indices!r}, {grid!r}")
    return b"".join([
        _mm_prefix(MODALITY_VIDEO, model_sig, processor_digest, VIDEO_LAYOUT_VERSION), content,
        lp_bytes(canonical_json(settings)), struct.pack("<d", float(source_fps)), u32(total_frames, "frames"),
        u32(size[0], "width"), u32(size[1], "height"), u32(resized[0], "height"), u32(resized[1], "width"),
        *(u32(n, "grid") for n in grid), u32(len(indices), "frames"), *(u32(i, "frame index") for i in indices),
    ])


def mm_hash_video(model_sig: int, processor_digest: int, content: bytes, *, algorithm: str = HASH_XXH3_128,
                  **fields) -> bytes:
    """16-byte content key of a sampled video under one model: `algorithm` over `video_header`."""
    return content_key(video_header(model_sig, processor_digest, content, **fields), SEED_MM_HASH, algorithm)


def video_source_key(model_sig: int, processor_digest: int, cache_salt: str | None, settings: Mapping,
                     data: bytes, *, algorithm: str = HASH_XXH3_128) -> bytes:
    """16 bytes naming a video file read under one model's sampling settings, for one tenant:
    u16 version | u64 model_sig | u64 video processor digest | u8 has_salt | salt (u32 len + utf-8)
    | settings (u32 len + canonical JSON) | the file's bytes. What the intake's memo of decoded
    identities is keyed by, so a second question about a file skips decoding it."""
    salt = "" if cache_salt is None else cache_salt
    hasher = content_hasher(SEED_VIDEO_SOURCE, algorithm)
    hasher.update(u16(VIDEO_LAYOUT_VERSION) + u64(model_sig, "model_sig") + u64(processor_digest, "processor_digest")
                  + u8(int(cache_salt is not None)) + lp_str(salt) + lp_bytes(canonical_json(settings)))
    hasher.update(data)
    return hasher.digest()


# -- encoder-output key ---------------------------------------------------------------------------


def encoder_key_layout(mm_hash: bytes, cache_salt: str | None) -> bytes:
    """The bytes an encoder output's key covers (layout version 2):
    u16 version | mm_hash (16 bytes) | u8 has_salt | salt (u32 len + utf-8; empty when None).

    `has_salt` keeps "no salt" a namespace of its own, distinct from every salt (the empty one
    included), as the block hashes' root does (`block_hash.root_layout`)."""
    if type(mm_hash) is not bytes or len(mm_hash) != CONTENT_KEY_BYTES:
        raise ValueError(f"an encoder key wraps a {CONTENT_KEY_BYTES}-byte mm_hash, got {mm_hash!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    salt = "" if cache_salt is None else cache_salt
    return u16(ENCODER_KEY_LAYOUT_VERSION) + mm_hash + u8(int(cache_salt is not None)) + lp_str(salt)


def encoder_cache_key(mm_hash: bytes, cache_salt: str | None, *, algorithm: str = HASH_XXH3_128) -> bytes:
    """The 16-byte key of an item's encoder output for one tenant: `algorithm` over
    `encoder_key_layout`. The local encoder cache and the shared tier both store under it, so a
    request with another `cache_salt` (or none) never finds, and never times, another tenant's entry.

    The salt stays out of the mm_hash itself: the mm_hash names the content and also feeds the
    block hashes' extra keys, whose chain already starts from a salted root; salting it again would
    change every block hash of unsalted requests and buy nothing."""
    return content_key(encoder_key_layout(mm_hash, cache_salt), SEED_ENCODER_KEY, algorithm)


def image_identity(
    model_sig: int, processor_digest: int, pil_image, *, algorithm: str = HASH_XXH3_128,
    grid: tuple[int, int, int] | None = None,
) -> bytes | None:
    """The mm_hash of a PIL image, or None when it has no faithful identity.

    None means "encode it fresh and never store the result": an uncacheable mode ('P' needs its
    palette, 'I;16', 'CMYK', ...), an empty image, or pixel data that fails to load or disagrees
    with the image's size. Hash the image exactly as the processor will receive it (after any
    EXIF transpose or mode conversion the pipeline applies).
    """
    check_hash_algorithm(algorithm)  # caller bugs raise, never None
    _mm_prefix(MODALITY_IMAGE, model_sig, processor_digest)
    if pil_image.mode not in CACHEABLE_IMAGE_MODES:
        return None
    try:
        pixels = np.asarray(pil_image)
    except (OSError, ValueError, SyntaxError):  # truncated or corrupt image data
        return None
    try:
        return mm_hash_image(
            model_sig, processor_digest, pil_image.mode, pil_image.size, pixels, algorithm=algorithm, grid=grid
        )
    except UncacheableInput:
        return None

"""Content keys: the model signature, the processor digest and the multimodal item hash.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import xxhash

MODEL_SIG_LAYOUT_VERSION = 2
PROCESSOR_DIGEST_LAYOUT_VERSION = 1
MM_HASH_LAYOUT_VERSION = 1

MODALITY_IMAGE = 1
MODALITY_AUDIO = 2

# Fixed seeds, one per kind of key ("MMSERV" + a kind number). Never change them: keys are shared
# across processes and machines.
SEED_MODEL_SIG = 0x4D4D_5345_5256_0001
SEED_PROCESSOR = 0x4D4D_5345_5256_0002
SEED_MM_HASH = 0x4D4D_5345_5256_0003
SEED_BLOCK_HASH = 0x4D4D_5345_5256_0004
SEED_WEIGHT_CONTENT = 0x4D4D_5345_5256_0005

# Hash algorithms of the tenant-controlled content keys. Kept equal to
# mmserve.runtime.config.HASH_ALGORITHMS (cache/ does not import config; a test checks they agree).
HASH_XXH3_128 = "xxh3_128"
HASH_SHA256 = "sha256"
HASH_ALGORITHMS = (HASH_XXH3_128, HASH_SHA256)
CONTENT_KEY_BYTES = 16

# Image modes whose pixel array alone says what the image looks like. 'P'/'PA' need their palette,
# 'I;16'-style and exotic modes are left to the caller to convert first: uncacheable until then.
CACHEABLE_IMAGE_MODES = frozenset({"1", "L", "LA", "RGB", "RGBA"})
# Sample dtypes hashed by value: bool, signed and unsigned ints, floats.
_HASHABLE_DTYPE_KINDS = frozenset("biuf")

CONFIG_FILE_NAMES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
    }
)
CONFIG_FILE_PREFIXES = ("tokenizer", "chat_template")
CHAT_TEMPLATE_DIR = "additional_chat_templates"
WEIGHT_SUFFIXES = (".safetensors", ".bin")

_READ_CHUNK = 8 << 20
_MAX_SAFETENSORS_HEADER = 100 << 20


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


# -- model signature ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFile:
    """What the signature knows of one weight file.

    `header` is the safetensors JSON header (empty for .bin); `content_digest` is the xxh3_128 of
    the whole file (empty when the weights were not read).
    """

    name: str
    size: int
    header: bytes = b""
    content_digest: bytes = b""


def model_sig_layout(
    name: str,
    config_files: Mapping[str, bytes],
    weight_files: Sequence[WeightFile],
    *,
    dtype: str,
    device_type: str,
) -> bytes:
    """The bytes `model_sig` hashes (layout version 2).

    u16 version | name (u32 len + utf-8) | dtype (u32 len + utf-8, e.g. 'float32')
    | device type (u32 len + utf-8, e.g. 'cpu', 'cuda'; the type only, never an index)
    | u32 #config files | per file, sorted by name: name (u32 len + utf-8), content (u64 len + bytes)
    | u32 #weight files | per file, sorted by name: name (u32 len + utf-8), u64 size,
                          header (u64 len + bytes), content digest (u8 len + bytes)

    dtype and device type are in the signature because the same checkpoint run in fp16 and in fp32
    (or on cpu and on cuda) produces different encoder outputs and KV: one cache must never mix them.
    """
    if not name:
        raise ValueError("model name must be non-empty")
    if not isinstance(dtype, str) or not dtype:
        raise ValueError(f"dtype must be a non-empty string such as 'float32', got {dtype!r}")
    if not isinstance(device_type, str) or not device_type or ":" in device_type:
        raise ValueError(f"device_type must be a device type such as 'cpu' or 'cuda' (no index), got {device_type!r}")
    names = [w.name for w in weight_files]
    if len(set(names)) != len(names):
        raise ValueError("duplicate weight file names")
    parts = [
        u16(MODEL_SIG_LAYOUT_VERSION),
        lp_str(name),
        lp_str(dtype),
        lp_str(device_type),
        u32(len(config_files), "config file count"),
    ]
    for file_name in sorted(config_files):
        content = bytes(config_files[file_name])
        parts += [lp_str(file_name), u64(len(content)), content]
    parts.append(u32(len(weight_files), "weight file count"))
    for w in sorted(weight_files, key=lambda w: w.name):
        parts += [lp_str(w.name), u64(w.size, "weight size"), u64(len(w.header)), w.header]
        parts += [u8(len(w.content_digest), "digest length"), w.content_digest]
    return b"".join(parts)


def model_sig_from_parts(
    name: str,
    config_files: Mapping[str, bytes],
    weight_files: Sequence[WeightFile],
    *,
    dtype: str,
    device_type: str,
) -> int:
    """The 64-bit model signature from already-read parts (the pure half of `model_sig`)."""
    layout = model_sig_layout(name, config_files, weight_files, dtype=dtype, device_type=device_type)
    return xxhash.xxh3_64_intdigest(layout, seed=SEED_MODEL_SIG)


def model_sig(
    name: str, model_dir: str | Path, *, dtype: str, device_type: str, hash_weights: bool = True
) -> int:
    """The 64-bit signature of model `name` stored in `model_dir`, run in `dtype` on `device_type`.

    Covers the stable name, the runtime dtype ('float32', 'float16', ...) and device type ('cpu',
    'cuda'; not the index: every GPU of one type computes the same values), every
    config/processor/tokenizer/chat-template file and every weight file (name, size, safetensors
    header and, by default, a digest of the full content: two fine-tunes of one architecture have
    identical headers and sizes, so only the content tells them apart). `hash_weights=False` skips
    reading the weights: cheaper, but then a checkpoint whose weights changed in place with the
    same shapes keeps its signature.

    dtype and device_type have no defaults on purpose: a default would let a caller running fp16
    on cuda silently compute the fp32/cpu signature, the very mix-up they are in the key to prevent.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model {name!r}: {root} is not a directory")
    weights = [read_weight_file(root, p, hash_content=hash_weights) for p in _weight_paths(root)]
    if not weights:
        raise FileNotFoundError(f"model {name!r}: no *.safetensors or *.bin weight files in {root}")
    return model_sig_from_parts(name, read_config_files(root), weights, dtype=dtype, device_type=device_type)


def read_config_files(model_dir: str | Path) -> dict[str, bytes]:
    """The config, processor, tokenizer and chat-template files of a model dir: name → content."""
    root = Path(model_dir)
    files = {p.name: p for p in root.iterdir() if p.is_file() and _is_config_name(p.name)}
    extra = root / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        files.update({f"{CHAT_TEMPLATE_DIR}/{p.name}": p for p in extra.iterdir() if p.is_file()})
    return {file_name: path.read_bytes() for file_name, path in files.items()}


def _is_config_name(file_name: str) -> bool:
    return file_name in CONFIG_FILE_NAMES or file_name.startswith(CONFIG_FILE_PREFIXES)


def _weight_paths(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def read_weight_file(root: Path, path: Path, *, hash_content: bool = True) -> WeightFile:
    """Size, safetensors header and (optionally) content digest of one weight file."""
    size = path.stat().st_size
    header = read_safetensors_header(path) if path.name.endswith(".safetensors") else b""
    digest = file_digest(path) if hash_content else b""
    return WeightFile(path.relative_to(root).as_posix(), size, header, digest)


def read_safetensors_header(path: str | Path) -> bytes:
    """The JSON header of a safetensors file (its first 8 bytes are the LE u64 header length)."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw_len)
        if length > _MAX_SAFETENSORS_HEADER:
            raise ValueError(f"{path}: corrupt safetensors header length {length}")
        header = f.read(length)
    if len(header) != length or not header.lstrip().startswith(b"{"):
        raise ValueError(f"{path}: corrupt safetensors header")
    return header


def file_digest(path: str | Path) -> bytes:
    """xxh3_128 (fixed seed) of a whole file, read in chunks."""
    hasher = xxhash.xxh3_128(seed=SEED_WEIGHT_CONTENT)
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.digest()


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
    model_sig: int, processor_digest: int, mode: str, size: tuple[int, int], pixels: np.ndarray
) -> bytes:
    """The header an image's mm_hash covers before its pixel bytes (layout version 1).

    u16 version | u8 modality=1 | u64 model_sig | u64 processor digest | mode (u32 len + ascii)
    | u32 width | u32 height | dtype str (u32 len + ascii, e.g. '|u1') | u32 ndim | u32 per dim
    """
    width, height = size
    if mode not in CACHEABLE_IMAGE_MODES:
        raise UncacheableInput(f"image mode {mode!r} is not cacheable (convert to RGB/RGBA/L first)")
    if width <= 0 or height <= 0:
        raise UncacheableInput(f"empty image {width}x{height}")
    if pixels.ndim not in (2, 3) or pixels.shape[:2] != (height, width):
        raise UncacheableInput(f"pixel array shape {pixels.shape} does not match image size {width}x{height}")
    return b"".join(
        [
            _mm_prefix(MODALITY_IMAGE, model_sig, processor_digest),
            lp_str(mode, "ascii"),
            u32(width, "width"),
            u32(height, "height"),
            _array_header(pixels),
        ]
    )


def _mm_prefix(modality: int, model_sig: int, processor_digest: int) -> bytes:
    version = u16(MM_HASH_LAYOUT_VERSION)
    return version + u8(modality) + u64(model_sig, "model_sig") + u64(processor_digest, "processor_digest")


def mm_hash_image(
    model_sig: int,
    processor_digest: int,
    mode: str,
    size: tuple[int, int],
    pixels: np.ndarray,
    *,
    algorithm: str = HASH_XXH3_128,
) -> bytes:
    """16-byte content key of a decoded image: `algorithm` over `image_header` + pixel bytes.

    `pixels` is the decoded array as the processor will see it (e.g. `np.asarray(pil_image)`,
    shape [height, width(, channels)]); byte order is normalised to little-endian, so equal values
    give equal keys on every machine. Raises UncacheableInput when no faithful key exists.
    """
    check_hash_algorithm(algorithm)
    arr = _hashable_array(pixels, "pixels")
    return _mm_digest(image_header(model_sig, processor_digest, mode, size, arr), arr, algorithm)


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


def image_identity(
    model_sig: int, processor_digest: int, pil_image, *, algorithm: str = HASH_XXH3_128
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
            model_sig, processor_digest, pil_image.mode, pil_image.size, pixels, algorithm=algorithm
        )
    except UncacheableInput:
        return None

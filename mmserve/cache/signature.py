"""The model signature (DESIGN.md "Keys"): a 64-bit digest over the model's stable name, its runtime
dtype and device type, every config/processor/tokenizer/chat-template file and every weight file,
so a changed checkpoint under the same name never shares cache entries."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import xxhash

from mmserve.cache.keys import SEED_MODEL_SIG, SEED_WEIGHT_CONTENT, lp_str, u16, u32, u64, u8

MODEL_SIG_LAYOUT_VERSION = 2
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

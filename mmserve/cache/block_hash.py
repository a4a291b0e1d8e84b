"""Prefix-cache block hashes (DESIGN.md "Keys", failure F2).

The prompt is cut into full blocks of `block_size` tokens. Each block's hash chains from the
previous one (the first from a root over `model_sig` and the request's `cache_salt`) and covers
the block's token ids plus exactly one extra key: the multimodal items whose placeholder ranges
overlap the block. All image placeholders share one token id, so without the extra key a block of
image B's placeholders would match a cached block of image A's.

Each item in the extra key is (mm_hash, offset into the item, start within the block, item length),
in placeholder order. The offset tells the k-th block of an image from its (k+1)-th; position order
and the start within the block tell "A then B" from "B then A" inside one block (a multiset of
(mm_hash, offset) pairs would not: both images have offset 0 there).

`algorithm` ("xxh3_128" by default, or "sha256": `[prefix_cache] hash`, see `keys`) picks the hash
over these same layouts; under "sha256" a hash is SHA-256 of the seed (u64 LE) then the layout,
truncated to 16 bytes. The root and every block of one chain must use one algorithm: a chain's
algorithm is the one its root was made with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from mmserve.cache.keys import (
    CONTENT_KEY_BYTES,
    HASH_XXH3_128,
    SEED_BLOCK_HASH,
    check_hash_algorithm,
    content_key,
    lp_str,
    u8,
    u16,
    u32,
    u64,
)

BLOCK_HASH_LAYOUT_VERSION = 1
HASH_BYTES = CONTENT_KEY_BYTES


@dataclass(frozen=True)
class MMPlaceholder:
    """One multimodal item: its 16-byte mm_hash and its placeholder run [start, start+length)."""

    mm_hash: bytes
    start: int
    length: int

    def __post_init__(self):
        if not isinstance(self.mm_hash, bytes) or len(self.mm_hash) != HASH_BYTES:
            raise ValueError(f"mm_hash must be {HASH_BYTES} bytes")
        if self.start < 0 or self.length <= 0:
            raise ValueError(f"placeholder [{self.start}, +{self.length}) must have start >= 0 and length > 0")

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class ExtraKey:
    """What a block records about one overlapping item."""

    mm_hash: bytes
    offset: int  # how far into the item the block starts: max(block_start - item.start, 0)
    start_in_block: int  # where the item's run starts in the block: max(item.start - block_start, 0)
    length: int  # the item's total placeholder count


def root_layout(model_sig: int, cache_salt: str | None) -> bytes:
    """u16 version | u64 model_sig | u8 has_salt | salt (u32 len + utf-8; empty when None)."""
    salt = "" if cache_salt is None else cache_salt
    has_salt = u8(int(cache_salt is not None))
    return u16(BLOCK_HASH_LAYOUT_VERSION) + u64(model_sig, "model_sig") + has_salt + lp_str(salt)


def root_hash(model_sig: int, cache_salt: str | None, *, algorithm: str = HASH_XXH3_128) -> bytes:
    """The 16-byte hash block 0 chains from: a different model or salt shares no block."""
    return content_key(root_layout(model_sig, cache_salt), SEED_BLOCK_HASH, algorithm)


def block_layout(prev: bytes, token_ids: Sequence[int], extra: Sequence[ExtraKey]) -> bytes:
    """prev (16 bytes) | u32 #tokens | u32 per token | u32 #items
    | per item: mm_hash (16 bytes), u32 offset, u32 start in block, u32 length."""
    return _layout(prev, _token_array(token_ids), extra)


def _layout(prev: bytes, tokens: np.ndarray, extra: Sequence[ExtraKey]) -> bytes:
    """`block_layout` of tokens already checked and converted by `_token_array` (a chain checks
    its tokens once, not once per block)."""
    if len(prev) != HASH_BYTES:
        raise ValueError(f"previous hash must be {HASH_BYTES} bytes")
    parts = [bytes(prev), u32(len(tokens)), tokens.tobytes(), u32(len(extra))]
    for e in extra:
        parts += [e.mm_hash, u32(e.offset, "offset"), u32(e.start_in_block, "start"), u32(e.length, "length")]
    return b"".join(parts)


def hash_block(
    prev: bytes, token_ids: Sequence[int], extra: Sequence[ExtraKey], *, algorithm: str = HASH_XXH3_128
) -> bytes:
    """The 16-byte hash of one block chained from `prev`."""
    return content_key(block_layout(prev, token_ids, extra), SEED_BLOCK_HASH, algorithm)


def block_extra_keys(items: Sequence[MMPlaceholder], block_start: int, block_end: int) -> tuple[ExtraKey, ...]:
    """The extra key of block [block_start, block_end): every overlapping item, in position order."""
    return tuple(
        ExtraKey(it.mm_hash, max(block_start - it.start, 0), max(it.start - block_start, 0), it.length)
        for it in sorted(items, key=lambda it: it.start)
        if it.start < block_end and it.end > block_start
    )


def block_hashes(
    root: bytes,
    token_ids: Sequence[int],
    mm_items: Sequence[MMPlaceholder],
    block_size: int,
    *,
    algorithm: str = HASH_XXH3_128,
) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block gets none).

    Raises ValueError when a placeholder runs past the tokens or two placeholders overlap, or
    `algorithm` is unknown; items may come in any order. Pass the algorithm `root` was made with.
    """
    check_hash_algorithm(algorithm)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = _token_array(token_ids)
    items = validate_placeholders(mm_items, len(tokens))
    hashes, prev = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        prev = content_key(_layout(prev, tokens[start:end], block_extra_keys(items, start, end)), SEED_BLOCK_HASH,
                           algorithm)
        hashes.append(prev)
    return hashes


def validate_placeholders(mm_items: Sequence[MMPlaceholder], num_tokens: int) -> list[MMPlaceholder]:
    """The items sorted by start; ValueError if one runs past `num_tokens` or two overlap."""
    for it in mm_items:
        if not isinstance(it, MMPlaceholder):
            raise TypeError(f"expected MMPlaceholder, got {type(it).__name__}")
    items = sorted(mm_items, key=lambda it: it.start)
    for it in items:
        if it.end > num_tokens:
            raise ValueError(f"placeholder [{it.start}, {it.end}) runs past the {num_tokens} tokens")
    for a, b in zip(items, items[1:]):
        if b.start < a.end:
            raise ValueError(f"placeholders [{a.start}, {a.end}) and [{b.start}, {b.end}) overlap")
    return items


def _token_array(token_ids: Sequence[int]) -> np.ndarray:
    """Token ids as little-endian u32; ValueError for non-integers or ids outside [0, 2**32)."""
    arr = np.asarray(token_ids)
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be a flat sequence of ints, got dtype {arr.dtype} shape {arr.shape}")
    if int(arr.min()) < 0 or int(arr.max()) >= 2**32:
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False)


@dataclass(frozen=True)
class BlockChain:
    """How one request's blocks are keyed: the root over `model_sig` and its `cache_salt`, its
    images' placeholders, and where keying stops — at the first block that reaches an uncacheable
    image (no content key): content that cannot be identified is never keyed. Extends a chain of
    block hashes as the request's tokens grow (its answer's blocks chain on from its prompt's)."""

    root: bytes
    items: tuple[MMPlaceholder, ...]
    block_size: int
    limit_blocks: int
    algorithm: str = "xxh3_128"

    @classmethod
    def of(cls, model_sig: int, cache_salt: str | None, num_tokens: int, spans: Sequence[Any],
           mm_keys: Sequence[bytes | None], block_size: int, *, algorithm: str = "xxh3_128") -> "BlockChain":
        """`spans` are objects with `.start` and `.length`, one per image, with content keys `mm_keys`."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        limit = None
        items = []
        for span, key in sorted(zip(spans, mm_keys or (None,) * len(spans)), key=lambda p: p[0].start):
            if key is None:
                limit = span.start // block_size
                break
            items.append(MMPlaceholder(key, span.start, span.length))
        validate_placeholders(items, max([num_tokens, *(it.end for it in items)]))
        root = root_hash(model_sig, cache_salt, algorithm=algorithm)
        return cls(root, tuple(items), block_size, limit if limit is not None else 1 << 62, algorithm)

    def extend(self, known: Sequence[bytes], token_ids: Sequence[int]) -> list[bytes]:
        """`known` (the hashes of the first blocks) extended over every further full block of
        `token_ids`, up to the limit."""
        out = list(known)
        tokens = _token_array(token_ids)
        full = min(len(tokens) // self.block_size, self.limit_blocks)
        prev = out[-1] if out else self.root
        for i in range(len(out), full):
            start, end = i * self.block_size, (i + 1) * self.block_size
            layout = _layout(prev, tokens[start:end], block_extra_keys(self.items, start, end))
            prev = content_key(layout, SEED_BLOCK_HASH, self.algorithm)
            out.append(prev)
        return out


def prompt_block_hashes(model_sig: int, cache_salt: str | None, token_ids: Sequence[int], spans: Sequence[Any],
                        mm_keys: Sequence[bytes | None], block_size: int, *, algorithm: str = "xxh3_128") -> list[bytes]:
    """Chained hashes of the full blocks of a prompt (and, later, of its answer) whose images sit at
    `spans` (objects with `.start` and `.length`) with content keys `mm_keys`. Blocks from the first
    one that reaches an uncacheable image (no content key) on are never keyed: their content
    cannot be identified."""
    chain = BlockChain.of(model_sig, cache_salt, len(token_ids), spans, mm_keys, block_size, algorithm=algorithm)
    return chain.extend((), token_ids)

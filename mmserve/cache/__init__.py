"""Pure, synchronous cache data structures: content keys, block hashes, the encoder-output cache.

No trio, no logging, no I/O beyond reading model files for the model signature. Callers (the
actors) log what these functions return. May import only the bottom layer (config, errors, logs).
"""

from mmserve.cache.block_hash import (
    BLOCK_HASH_LAYOUT_VERSION,
    ExtraKey,
    MMPlaceholder,
    block_extra_keys,
    block_hashes,
    hash_block,
    root_hash,
    validate_placeholders,
)
from mmserve.cache.encoder_cache import (
    ALREADY_PRESENT,
    NO_ROOM,
    STORED,
    TOO_LARGE,
    EncoderCache,
    EncoderCacheStats,
    EntryInfo,
    PutResult,
    tensor_nbytes,
)
from mmserve.cache.keys import (
    CACHEABLE_IMAGE_MODES,
    ENCODER_KEY_LAYOUT_VERSION,
    HASH_ALGORITHMS,
    MM_HASH_LAYOUT_VERSION,
    PROCESSOR_DIGEST_LAYOUT_VERSION,
    UncacheableInput,
    check_hash_algorithm,
    encoder_cache_key,
    image_identity,
    key_prefix,
    mm_hash_audio,
    mm_hash_image,
    processor_digest,
)
from mmserve.cache.block_arena import ArenaFull, ArenaStats, BlockArena
from mmserve.cache.signature import MODEL_SIG_LAYOUT_VERSION, WeightFile, model_sig, model_sig_from_parts

__all__ = [
    "ALREADY_PRESENT",
    "BLOCK_HASH_LAYOUT_VERSION",
    "CACHEABLE_IMAGE_MODES",
    "ENCODER_KEY_LAYOUT_VERSION",
    "HASH_ALGORITHMS",
    "MM_HASH_LAYOUT_VERSION",
    "MODEL_SIG_LAYOUT_VERSION",
    "NO_ROOM",
    "PROCESSOR_DIGEST_LAYOUT_VERSION",
    "STORED",
    "TOO_LARGE",
    "EncoderCache",
    "EncoderCacheStats",
    "EntryInfo",
    "ExtraKey",
    "MMPlaceholder",
    "PutResult",
    "UncacheableInput",
    "WeightFile",
    "block_extra_keys",
    "block_hashes",
    "check_hash_algorithm",
    "encoder_cache_key",
    "hash_block",
    "image_identity",
    "key_prefix",
    "mm_hash_audio",
    "mm_hash_image",
    "model_sig",
    "model_sig_from_parts",
    "processor_digest",
    "root_hash",
    "tensor_nbytes",
    "validate_placeholders",
    "BlockArena",
    "ArenaFull",
    "ArenaStats",
]

"""Attention backends over the paged KV arena: the interface and step metadata (`backend`), the
masks as key intervals (`masks`), the SDPA backend (`sdpa`) and its batch-invariant variant
(`deterministic`), `select`; the Triton kernels in `triton_paged` (imported only when chosen:
triton is optional on the CPU).
Part of the engine (`mmserve.engine`); `engine.paged_forward` calls into it."""

from .backend import (FEATURES, NAMES, AttentionBackend, AttentionBackendUnavailable, ModelFeatures,
                      PagedMetadata, UnsupportedAttentionFeature, write_kv)
from .sdpa import SdpaBackend
from .selection import check_attention, select

__all__ = ["FEATURES", "NAMES", "AttentionBackend", "AttentionBackendUnavailable", "ModelFeatures",
           "PagedMetadata", "SdpaBackend", "UnsupportedAttentionFeature", "check_attention", "select", "write_kv"]

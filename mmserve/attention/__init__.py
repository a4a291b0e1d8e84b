"""Attention backends over the paged KV arena: the interface, the SDPA reference, `select`; the
Triton kernels in `triton_paged` (imported only when chosen: triton is optional on the CPU).
Imports only torch, numpy, triton and the bottom layer: `models.paged` will call into it."""

from .backend import (FEATURES, NAMES, AttentionBackend, AttentionBackendUnavailable, ModelFeatures,
                      PagedMetadata, SdpaBackend, UnsupportedAttentionFeature, write_kv)
from .selection import select

__all__ = ["FEATURES", "NAMES", "AttentionBackend", "AttentionBackendUnavailable", "ModelFeatures",
           "PagedMetadata", "SdpaBackend", "UnsupportedAttentionFeature", "select", "write_kv"]

"""The attention-backend interface over the paged KV arena and its step metadata (`selection.select`
picks a backend by name; `sdpa.py`, `deterministic.py` and `triton_paged.py` implement it).

A backend computes one layer's attention for one step of the ragged batch: the step's new tokens
(`query` [T, heads, head_dim], packed sequence after sequence) against each sequence's keys in
the arena (`key_cache`/`value_cache` [num_blocks, block_size, kv_heads, head_dim], the layer's
tensors of `engine.arena.KVArena`, the step's own K/V already written: `write_kv`), as described
by `PagedMetadata`. Positions (rotary, M-RoPE's three rows) are applied before attention, so every
backend serves M-RoPE models; what a backend must implement itself — GQA, a sliding window,
bidirectional spans (e.g. image tokens that see each other), logit soft-capping — it declares in
`supports`, and `check` refuses a model that needs anything else, naming it.

Masks are explicit: a layer's sliding window is an argument of `forward` (the token at position p
sees keys k with p - k < window; keys before the window are not read), bidirectional spans are
part of the step (`PagedMetadata.spans`, and per new token the end of the keys it sees,
`q_ends`: past its own position inside a span). A token's keys are therefore one interval
[p - window + 1, key_end): transformers' Gemma 3 mask AND(window, OR(causal, same image)).

Backends: `sdpa` (`sdpa.py`) — torch's `scaled_dot_product_attention` per prefill chunk and over
the decode tokens, keys read in place where a sequence's blocks are consecutive ids, gathered
otherwise: the CPU's serving path and the reference the others are tested against;
`sdpa_deterministic` (`deterministic.py`) — its batch-invariant variant, on the same layout and
masks; `triton` (`triton_paged.py`) — a split-KV decode kernel and a prefill kernel reading K/V
through the block tables, no gather; on CUDA, or on the CPU only under Triton's interpreter
(tests). A backend's host-side layout of a step (what each query reads) is built once per step
and kept with its metadata (`PagedMetadata.layouts`), read by every layer.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import numpy as np
import torch

from mmserve.errors import CheckpointError

from .masks import key_ends, step_spans

FEATURES = ("gqa", "mrope_positions", "sliding_window", "bidirectional_spans", "softcap")
"""Everything a model may need of its attention beyond plain causal softmax attention."""

NAMES = ("auto", "sdpa", "triton")
"""The values of `[runtime] attention_backend`."""


class UnsupportedAttentionFeature(CheckpointError):
    """The model needs an attention feature the chosen backend does not implement."""

    code = "attention_feature_unsupported"


class AttentionBackendUnavailable(CheckpointError):
    """The chosen attention backend cannot run here (unknown name, wrong device, triton missing)."""

    code = "attention_backend_unavailable"


@dataclass(frozen=True)
class ModelFeatures:
    """What a model's language model needs of attention (`FEATURES`); `from_config` reads it."""

    gqa: bool = False
    mrope_positions: bool = False
    sliding_window: bool = False
    bidirectional_spans: bool = False
    softcap: bool = False

    @property
    def needed(self) -> tuple[str, ...]:
        return tuple(f for f in FEATURES if getattr(self, f))

    @classmethod
    def from_config(cls, config) -> "ModelFeatures":
        """From a transformers text config (a full VLM config's `text_config` is used if present).
        Bidirectional spans are recognised by model type (Gemma 3 and PaliGemma let image tokens
        see each other); the others by their config fields."""
        text = getattr(config, "text_config", None) or config
        model_type = f"{getattr(config, 'model_type', '')} {getattr(text, 'model_type', '')}"
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        layer_types = getattr(text, "layer_types", None)
        if layer_types is not None:
            window = any(t == "sliding_attention" for t in layer_types)
        else:
            window = bool(getattr(text, "sliding_window", None)) and getattr(text, "use_sliding_window", True)
        softcap = any(getattr(text, f, None) for f in ("attn_logit_softcapping", "attention_logit_softcapping"))
        return cls(gqa=bool(heads and kv_heads and heads != kv_heads),
                   mrope_positions=isinstance(rope, dict) and "mrope_section" in rope,
                   sliding_window=window,
                   bidirectional_spans=any(t in model_type for t in ("gemma3", "paligemma")),
                   softcap=bool(softcap))


@dataclass(frozen=True, eq=False)
class PagedMetadata:
    """One step's description, as flat tensors on the device (read by every layer) plus the host
    integers a launch needs. Sequence i has `lengths[i]` new tokens (query rows
    [cu_seqlens_q[i], cu_seqlens_q[i+1])) at positions [starts[i], seq_lens[i]); its block
    table is row i of `block_tables` (padded with block 0 past its last block; never read there).

    The first `num_decodes` sequences have one new token each (the decode batch); the rest may
    have any number (a sequence of one token after them is simply treated as a chunk)."""

    block_tables: torch.Tensor   # int32 [S, max_blocks]
    seq_lens: torch.Tensor       # int32 [S]: cached + new tokens
    cu_seqlens_q: torch.Tensor   # int32 [S + 1]
    slot_mapping: torch.Tensor   # int64 [T]: the arena slot each new token's K/V goes to
    num_decodes: int
    max_query_len: int
    block_size: int
    starts: tuple[int, ...]      # host copies, for backends that loop per sequence (empty for a
    lengths: tuple[int, ...]     # static decode step, whose values live only on the device)
    tables: tuple[tuple[int, ...], ...]
    q_ends: torch.Tensor | None = None  # int32 [T]: each new token's keys end (exclusive) here, past
    # its own position inside a bidirectional span (`key_ends`); None: every token is causal
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()  # host: per sequence, its bidirectional
    # spans [lo, hi) that hold new tokens (empty: none)
    tile_map: tuple[torch.Tensor, torch.Tensor] | None = None  # int32 [P] each: the prefill
    # programs' (sequence, tile) — a static step's, built for `AttentionBackend.tile_tokens`; None:
    # the backend's own grid over every prefill sequence
    layouts: dict = field(default_factory=dict, repr=False)  # a host-side backend's layouts of this
    # step (what each query reads, per window), built once and read by every layer (`SdpaBackend.layout`)

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @classmethod
    def build(cls, segments: Sequence, block_size: int, device: torch.device | str = "cpu",
              max_blocks: int | None = None, spans: Sequence[Sequence[tuple[int, int]]] | None = None,
              num_blocks: int | None = None) -> "PagedMetadata":
        """From segments (anything with `block_table`, `start`, `length`: `engine.arena.Segment`).
        `max_blocks` pads the table tensor to a fixed width (a static buffer's); default: the
        longest table the step uses. `spans`: per segment, the sequence's bidirectional spans
        ([lo, hi) absolute positions whose tokens see each other: `key_ends`), or None.
        `num_blocks`: the arena's, to refuse a block id outside it and two new tokens in one slot
        (`KVArena.metadata` passes it)."""
        if not segments:
            raise ValueError("a paged step needs at least one segment")
        starts = tuple(int(s.start) for s in segments)
        lengths = tuple(int(s.length) for s in segments)
        if min(lengths) < 1 or min(starts) < 0:
            raise ValueError("every segment needs a start >= 0 and at least one new token")
        used = [-(-(st + n) // block_size) for st, n in zip(starts, lengths)]
        tables = tuple(tuple(s.block_table[:u]) for s, u in zip(segments, used))  # ids checked below
        if any(len(t) < u for t, u in zip(tables, used)):
            raise ValueError("a block table is too short for its segment's tokens")
        width = max(used) if max_blocks is None else max_blocks
        if width < max(used):
            raise ValueError(f"max_blocks={width} cannot hold a table of {max(used)} blocks")
        # every table in one conversion (one per table costs ~3 us each), then scattered into the padding
        sizes = np.asarray(used)
        padded = np.zeros((len(tables), width), dtype=np.int32)
        padded[np.arange(width) < sizes[:, None]] = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32,
                                                                count=int(sizes.sum()))
        # per new token (vectorised: a loop over sequences costs ~5 us each): its sequence and position
        counts = np.asarray(lengths)
        seq = np.repeat(np.arange(len(lengths)), counts)
        pos = np.arange(int(counts.sum())) + np.repeat(np.asarray(starts) - (np.cumsum(counts) - counts), counts)
        slots = padded[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
        if num_blocks is not None:
            if padded.min() < 0 or padded.max() >= num_blocks:  # the zero padding is a valid id
                bad = sorted(set(padded[(padded < 0) | (padded >= num_blocks)].tolist()))
                raise ValueError(f"block ids {bad[:4]} are outside the arena (0..{num_blocks - 1})")
            if len(np.unique(slots)) != len(slots):
                raise ValueError("two new tokens of the step map to the same arena slot")
        decodes = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
        prefill = lengths[decodes:]
        as_tensor = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt).to(device)  # noqa: E731
        own = [step_spans(sp, st, n) for sp, st, n in zip(spans or [()] * len(lengths), starts, lengths)]
        q_ends = None
        if any(own):
            q_ends = as_tensor(np.concatenate([key_ends(st, n, sp) for st, n, sp in zip(starts, lengths, own)]),
                               torch.int32)
        return cls(block_tables=torch.from_numpy(padded).to(device),
                   seq_lens=as_tensor([st + n for st, n in zip(starts, lengths)], torch.int32),
                   cu_seqlens_q=as_tensor(np.concatenate([[0], np.cumsum(lengths)]), torch.int32),
                   slot_mapping=torch.from_numpy(slots).to(device),
                   num_decodes=decodes, max_query_len=max(prefill, default=0), block_size=block_size,
                   starts=starts, lengths=lengths, tables=tables, q_ends=q_ends,
                   spans=tuple(own) if any(own) else ())


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes the step's new K/V ([T, kv_heads, head_dim] each) into their arena slots."""
    n = key_cache.shape[0] * key_cache.shape[1]
    key_cache.view(n, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(n, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


class AttentionBackend(ABC):
    """Paged attention over the arena for one layer and one step (see the module docstring)."""

    name: ClassVar[str]
    supports: ClassVar[frozenset[str]]
    capturable: ClassVar[bool] = False
    """Whether a decode step's launch reads only tensors and shapes, never host copies of the
    step's values (`PagedMetadata.starts`/`tables`): it can then run from static buffers, as a
    CUDA graph."""
    """The `FEATURES` this backend implements ("mrope_positions" always: positions are applied
    before attention)."""

    def prepare(self, meta: PagedMetadata, heads: int, kv_heads: int) -> None:
        """The host-side work of a step that can be done before it runs (a step prepared while the
        one before it runs: `ModelRunner.prepare`): nothing for a backend whose launch reads only
        the metadata's tensors."""

    def tile_tokens(self, heads: int, kv_heads: int) -> int | None:
        """Query tokens per program of this backend's chunk attention, for a static step's tile map
        (`PagedMetadata.tile_map`); None: the backend takes no map."""
        return None

    def check(self, features: ModelFeatures) -> None:
        """Refuses (`UnsupportedAttentionFeature`, naming each missing feature) a model that needs
        something this backend does not implement."""
        missing = [f for f in features.needed if f not in self.supports]
        if missing:
            raise UnsupportedAttentionFeature(
                f"the {self.name!r} attention backend does not support {', '.join(missing)}, which this model "
                f"needs (it supports: {', '.join(sorted(self.supports)) or 'plain causal attention only'})")

    @abstractmethod
    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: PagedMetadata, scale: float | None = None, out: torch.Tensor | None = None,
                window: int | None = None) -> torch.Tensor:
        """query [T, heads, head_dim] (the step's new tokens, positions applied), the layer's
        key/value arena tensors [num_blocks, block_size, kv_heads, head_dim] holding every key the
        step reads (its own included) -> [T, heads, head_dim] in query's dtype (written into `out`
        when given). `scale` defaults to 1/sqrt(head_dim). The masks are explicit: `window` (the
        layer's sliding window: the token at p sees keys k with p - k < window, and no key before
        is read) and `meta.q_ends` / `meta.spans` (bidirectional spans); a backend that does not
        implement one must raise when given it (`refuse`), never ignore it."""

    def refuse(self, meta: PagedMetadata, window: int | None) -> None:
        """Raises UnsupportedAttentionFeature when a step asks for a mask this backend lacks."""
        asked = (["sliding_window"] if window else []) + (["bidirectional_spans"] if meta.spans else [])
        missing = [f for f in asked if f not in self.supports]
        if missing:
            raise UnsupportedAttentionFeature(f"the {self.name!r} attention backend was given a step with "
                                              f"{', '.join(missing)}, which it does not implement")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

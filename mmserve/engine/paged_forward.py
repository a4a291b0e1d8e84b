"""The language model's forward over the paged KV arena, with transformers' own model classes.

The attention function registered here as ``"mmserve_paged"`` becomes the language model's
attention implementation (`use_paged_attention`, once per loaded model: no twin of the model, no
copied config). A paged step passes two things down the model's forward: the step itself in
``kwargs[KWARG]`` (a `BackendStep`: the arena, an attention backend and the step's
`PagedMetadata`), and `STEP_MASK` as its ``attention_mask``. `STEP_MASK` is a 4-D tensor, which
transformers' mask helpers return as they find it ("already prepared"): no T x T mask is built, and
nothing in the mask code reads the step's positions (its packed-sequence detection would cost a
host sync a step). The metadata defines the masking; the attention function knows the mask is the
step's by identity.

Any other call of the model — HF's own `generate`, the references the tests and the bench compare
against — gets transformers' SDPA attention and SDPA masks, unchanged: the registered function
hands every call without `STEP_MASK` to `sdpa_attention_forward`, and `sdpa_mask` is registered
as its mask function.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mmserve.engine.attention import AttentionBackend, PagedMetadata, SdpaBackend, UnsupportedAttentionFeature, write_kv

ATTN_IMPLEMENTATION = "mmserve_paged"
"""The name the paged attention function is registered under (`AttentionInterface`)."""

KWARG = "mmserve_paged"
"""The model-forward keyword that carries the step down to the attention function."""

STEP_MASK = torch.empty(0, 0, 0, 0, dtype=torch.bool)
"""The `attention_mask` of a paged step (see the module docstring); never read as a mask."""


class BackendStep:
    """A step through an attention backend: per layer, the new K/V written at `meta.slot_mapping`
    (one `index_copy_` each), then `backend.forward` over the arena. Every tensor it reads is one
    of `meta`'s or the arena's, so a step whose `meta` lives in static buffers is capturable.
    `attend`: query [1, heads, T, d], key/value [1, kv_heads, T, d] (rotary applied) -> [1, T,
    heads, d]; `window`: the layer's sliding window (None: every key); the bidirectional spans
    are the step's own (in `meta`)."""

    def __init__(self, arena, backend: AttentionBackend, meta: PagedMetadata):
        self.arena, self.backend, self.meta = arena, backend, meta

    def attend(self, layer, query, key, value, scaling, window=None):
        self.backend.refuse(self.meta, window)  # a mask the backend lacks is an error, never dropped
        kc, vc = self.arena.keys[layer], self.arena.values[layer]
        write_kv(kc, vc, key[0].transpose(0, 1), value[0].transpose(0, 1), self.meta.slot_mapping)
        q = query[0].transpose(0, 1)
        if q.stride(2) != 1:
            q = q.contiguous()
        return self.backend.forward(q, kc, vc, self.meta, scale=scaling, window=window).unsqueeze(0)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function: a paged step's attention (`STEP_MASK` and the step in
    ``kwargs[KWARG]``), or transformers' SDPA attention for any other call."""
    if attention_mask is not STEP_MASK:
        kwargs.pop(KWARG, None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    step: BackendStep | None = kwargs.get(KWARG)
    if step is None:
        raise RuntimeError(f"a paged step needs {KWARG}=<its step> in the forward's keyword arguments")
    if kwargs.get("softcap") or (dropout and module.training):
        # load refuses such a model (`check_attention`); a layer asking anyway is an error, never ignored
        raise UnsupportedAttentionFeature("paged attention implements no logit soft-capping and no dropout")
    # the layer's own sliding window (transformers passes it per layer: Gemma 3, Mistral, Qwen2)
    return step.attend(module.layer_idx, query, key, value, scaling, window=kwargs.get("sliding_window")), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def use_paged_attention(adapter) -> None:
    """Makes the paged attention the adapter's language model's implementation (see the module
    docstring: calls that are not paged steps keep transformers' SDPA)."""
    config = adapter.language_model.config
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        config._attn_implementation = ATTN_IMPLEMENTATION


def forward_step(adapter, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, step: BackendStep,
                 rows: torch.Tensor, lm_kwargs: dict | None = None) -> torch.Tensor:
    """The language model over one paged step: `inputs_embeds` [1, T, H], `position_ids` [1, T] (or
    [R, 1, T] for M-RoPE) -> float logits of the new tokens `rows` indexes [len(rows), vocab].
    `use_paged_attention(adapter)` first."""
    out = adapter.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids,
                                  attention_mask=STEP_MASK, use_cache=False, **(lm_kwargs or {}), **{KWARG: step})
    return adapter.model.lm_head(out.last_hidden_state[0].index_select(0, rows)).float()


def step_positions(position_ids: torch.Tensor, positions: torch.Tensor | None, device) -> torch.Tensor:
    """The forward's position ids: `positions` [R, T] (M-RoPE rows) as [R, 1, T], else the step's
    own [1, T]."""
    return position_ids if positions is None else positions.to(device).unsqueeze(1)



def eager_rows(meta: PagedMetadata, device) -> tuple[torch.Tensor, torch.Tensor]:
    """An eager step's position ids [1, T] (each new token's absolute position) and each sequence's
    last new token's index in T [S], from its metadata."""
    positions = torch.from_numpy(np.concatenate([np.arange(s, s + n) for s, n in zip(meta.starts, meta.lengths)]))
    return positions.unsqueeze(0).to(device), (meta.cu_seqlens_q[1:] - 1).long()


@torch.inference_mode()
def forward_paged(adapter, inputs_embeds: torch.Tensor, segments: Sequence, arena,
                  positions: torch.Tensor | None = None, extra_rows: torch.Tensor | None = None,
                  lm_kwargs: dict | None = None, spans=None, backend: AttentionBackend | None = None) -> torch.Tensor:
    """One ragged step of `adapter`'s language model over a paged KV arena through `backend`
    (default: the sdpa backend, the CPU's serving path), for tests and tools (serving steps go
    through `engine.runner.ModelRunner`): `inputs_embeds` [1, T, H] concatenates every segment's
    new tokens; `positions` [3, T] gives M-RoPE positions. Returns float logits [len(segments),
    vocab] of each segment's last token, then those of the new tokens `extra_rows` indexes (in T),
    if any. `spans`: per segment, its sequence's bidirectional spans (`PromptInputs.bidirectional`)."""
    meta = arena.metadata(segments, spans)
    if inputs_embeds.shape[:2] != (1, meta.num_tokens):
        raise ValueError(f"inputs_embeds {tuple(inputs_embeds.shape)} does not hold the segments' "
                         f"{meta.num_tokens} new tokens as [1, T, hidden]")
    use_paged_attention(adapter)
    position_ids, last = eager_rows(meta, adapter.device)
    rows = last if extra_rows is None else torch.cat([last, extra_rows.to(adapter.device)])
    step = BackendStep(arena, backend if backend is not None else SdpaBackend(), meta)
    return forward_step(adapter, inputs_embeds.to(adapter.device, adapter.dtype),
                        step_positions(position_ids, positions, adapter.device), step, rows, lm_kwargs)

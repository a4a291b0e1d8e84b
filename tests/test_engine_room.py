"""The engine room's one SDPA backend (issue 38 item 3): `attention_backend = "sdpa"` runs
`SdpaBackend` through the same `BackendStep` as every backend, its layout of a step built once
(ahead, by `ModelRunner.prepare`) and read by every layer; the deterministic variant sees exactly
the keys the sdpa backend's masks let each token see."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mmserve.engine.arena import KVArena, Segment
from mmserve.engine.attention import PagedMetadata, SdpaBackend
from mmserve.engine.attention.deterministic import DeterministicSdpaBackend
from mmserve.engine.attention.masks import first_key, step_mask
from mmserve.engine.paged_forward import forward_paged
from mmserve.engine.runner import ModelRunner, StepInputs, attention_heads
from mmserve.models.llava import LlavaAdapter

BS = 4


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return LlavaAdapter("tiny", tiny_model_dir)


def test_the_sdpa_setting_runs_the_sdpa_backend_with_the_layout_prepared_ahead(adapter):
    runner = ModelRunner(adapter, 1 << 20, BS, backend="sdpa")
    assert type(runner.backend) is SdpaBackend and runner.buffers is None  # no static path: every step eager
    prompt = [5, 9, 14, 3, 7, 11, 2, 8, 6, 12, 4]
    table = tuple(range(3, 3 + 4))  # consecutive blocks: read in place
    first = StepInputs(ids=tuple(prompt), segments=(Segment(table, 0, len(prompt)),))
    meta = runner.prepare(first)
    assert isinstance(meta, PagedMetadata) and len(meta.layouts) == 1  # the window-less layout, built ahead
    logits = runner.forward(first, prepared=meta)
    assert len(meta.layouts) == 1  # every layer read the prepared layout: none was built in the step
    assert runner.eager_reasons == {"backend_not_capturable": 1}
    # a decode step through the same runner equals the tests' paged step over a fresh arena
    token = int(logits[0].argmax())
    decode = StepInputs(ids=(token,), segments=(Segment(table, len(prompt), 1),))
    ahead = runner.prepare(decode)
    heads, kv_heads = attention_heads(adapter.text_config)
    lay = runner.backend.layout(ahead, None, heads // kv_heads, kv_heads)
    assert [row for row, _ in lay.decode_views] == [0] and lay.decode_rows is None  # read in place
    step_logits = runner.forward(decode, prepared=ahead)
    assert len(ahead.layouts) == 1
    arena = KVArena.allocate(adapter.kv_layers, 16, BS, adapter.kv_heads, adapter.head_dim)
    embed = adapter.model.get_input_embeddings()
    forward_paged(adapter, embed(torch.tensor([prompt])), [Segment(table, 0, len(prompt))], arena)
    again = forward_paged(adapter, embed(torch.tensor([[token]])), [Segment(table, len(prompt), 1)], arena)
    assert torch.equal(step_logits, again)


def _visible(meta: PagedMetadata, i: int, window: int | None) -> np.ndarray:
    """[length, end] bool: the keys the sdpa backend's mask lets each new token of sequence i see."""
    start, n = meta.starts[i], meta.lengths[i]
    lo = first_key(start, window)
    spans = meta.spans[i] if meta.spans else ()
    mask = step_mask(start, n, lo, spans, window)
    full = np.zeros((n, start + n), dtype=bool)
    if mask is None:  # SDPA's own masks: causal from lo (a lone token sees every key from lo)
        q = np.arange(start, start + n)[:, None]
        k = np.arange(lo, start + n)[None, :]
        full[:, lo:] = k <= q
    else:
        full[:, lo:] = mask.numpy()
    return full


@pytest.mark.parametrize("window", [None, 5, 16])
def test_the_deterministic_variant_sees_the_keys_the_sdpa_masks_give(window):
    """For random steps (decode tokens, chunks after a prefix, bidirectional spans), every real row
    of every deterministic call sees exactly the keys the sdpa backend's mask gives its token."""
    rng = random.Random(window or 0)
    group, kv_heads = 2, 2
    for _ in range(20):
        segments, spans = [], []
        for _ in range(rng.randint(1, 4)):
            start, n = rng.randint(0, 40), rng.choice([1, 1, rng.randint(2, 30)])
            table = tuple(rng.sample(range(64), -(-(start + n) // 16)))
            segments.append(Segment(table, start, n))
            lo = rng.randint(start, start + n - 1)
            spans.append(((lo, rng.randint(lo + 1, start + n)),) if n > 2 and rng.random() < 0.5 else ())
        segments.sort(key=lambda s: s.length != 1)
        meta = PagedMetadata.build(segments, 16, spans=spans)
        offsets = np.concatenate([[0], np.cumsum(meta.lengths)])
        for call in DeterministicSdpaBackend().layout(meta, window, group, kv_heads):
            mask = call.mask[:call.seqs].view(call.seqs, call.rows, call.width).numpy()  # KV head 0's batch
            token = call.token.view(call.seqs, call.rows).numpy()
            real = call.real.view(call.seqs, call.rows).numpy()
            keys = call.rows_read.view(kv_heads, call.seqs, call.width)[0].numpy() // kv_heads  # slots
            for j in range(call.seqs):
                i = int(np.searchsorted(offsets, token[j, 0], side="right") - 1)
                want = _visible(meta, i, window)
                table, start, n = meta.tables[i], meta.starts[i], meta.lengths[i]
                slot_of = {table[p // 16] * 16 + p % 16: p for p in range(start + n)}
                for r in np.flatnonzero(real[j]):
                    seen = {slot_of[int(s)] for s in keys[j][mask[j, r]]}
                    assert seen == set(np.flatnonzero(want[token[j, r] - offsets[i]]).tolist())

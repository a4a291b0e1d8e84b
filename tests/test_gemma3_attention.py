"""Explicit masks in the paged attention (issue 31): per-layer sliding windows and bidirectional
spans (Gemma 3's images), for every backend — the `sdpa` backend (the CPU's serving path), its deterministic variant and the
Triton kernels (through Triton's interpreter here, compiled on a GPU) — against transformers'
eager Gemma 3 attention over the masks transformers itself builds (`create_masks_for_vision_model`
from `token_type_ids`: OR(causal, same image), AND window for sliding layers).

A sequence is computed as the serving path computes it: prefill chunks that never split a span
(one may start inside one: a prefix hit), then decode tokens, each step against the keys earlier
steps wrote into a NaN-filled arena through a scattered block table, beside another sequence in
the same ragged step; every row must equal the dense eager attention over the whole sequence.
Keys outside a decode token's window are poisoned (NaN) and must not be read.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py sets it)

from transformers import Gemma3TextConfig  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import (  # noqa: E402
    create_masks_for_vision_model, eager_attention_forward, get_block_sequence_ids_for_mask)

from mmserve.engine.arena import KVArena, Segment  # noqa: E402
from mmserve.engine.attention import PagedMetadata, SdpaBackend, UnsupportedAttentionFeature, select  # noqa: E402
from mmserve.engine.attention.masks import key_ends, step_spans  # noqa: E402
from mmserve.engine.paged_forward import BackendStep  # noqa: E402

HEADS, KV_HEADS, D, BS = 4, 2, 16, 4
SCALE = 0.25


def hf_eager(q, k, v, length: int, spans, window: int | None) -> torch.Tensor:
    """transformers' eager Gemma 3 attention over its own masks for a sequence of `length` tokens
    whose image soft tokens are `spans`: q [L, H, d], k/v [L, KVH, d] -> [L, H, d]."""
    types = torch.zeros(1, length, dtype=torch.long)
    for lo, hi in spans:
        types[0, lo:hi] = 1
    config = Gemma3TextConfig(sliding_window=window or 4096, layer_types=["sliding_attention", "full_attention"],
                              num_hidden_layers=2, hidden_size=8, head_dim=D, num_attention_heads=HEADS,
                              num_key_value_heads=KV_HEADS)
    config._attn_implementation = "eager"
    masks = create_masks_for_vision_model(config, torch.zeros(1, length, 8), None, None,
                                          torch.arange(length).unsqueeze(0), get_block_sequence_ids_for_mask(types))
    mask = masks["sliding_attention" if window else "full_attention"]
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, training=False, head_dim=D)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scaling=SCALE)
    return out[0]


def chunks_of(length: int, prompt: int, spans, cuts) -> list[tuple[int, int]]:
    """(start, length) steps: the prompt cut at `cuts` (moved out of spans as the scheduler does;
    the first chunk may start inside a span: a prefix hit), then one decode step per token."""
    steps, at = [], 0
    for c in sorted(set(cuts)) + [prompt]:
        for lo, hi in spans:
            if lo < c < hi:
                c = hi
        if c > at:
            steps.append((at, c - at))
            at = c
    return steps + [(p, 1) for p in range(prompt, length)]


class Sequence:
    def __init__(self, rng, length, prompt, spans, cuts, table):
        self.q = torch.randn(length, HEADS, D, generator=rng)
        self.k = torch.randn(length, KV_HEADS, D, generator=rng)
        self.v = torch.randn(length, KV_HEADS, D, generator=rng)
        self.spans, self.table, self.steps = spans, table, chunks_of(length, prompt, spans, cuts)


def run(backend: str, seqs, window: int | None, hit: int = 0) -> list[torch.Tensor]:
    """Every sequence's outputs, step by step, all sequences' i-th steps in one ragged step. `hit`:
    sequence 0's first `hit` tokens' K/V are written directly (a prefix cache hit), not computed."""
    arena = KVArena.allocate(1, 64, BS, KV_HEADS, D, device=DEVICE)
    for t in (*arena.keys, *arena.values):
        t.fill_(float("nan"))
    outs = [torch.full_like(s.q, float("nan")) for s in seqs]
    for si, s in enumerate(seqs):  # a hit: the cached prefix's K/V are in its blocks
        n = hit if si == 0 else 0
        if n:
            slots = torch.tensor([s.table[p // BS] * BS + p % BS for p in range(n)])
            arena.flat(0)[0][slots] = s.k[:n].to(DEVICE)
            arena.flat(0)[1][slots] = s.v[:n].to(DEVICE)
            s.steps = [(max(st, n), st + ln - max(st, n)) for st, ln in s.steps if st + ln > n]
    for i in range(max(len(s.steps) for s in seqs)):
        live = [(s, o, s.steps[i]) for s, o in zip(seqs, outs) if i < len(s.steps)]
        # decode steps first, as the runner orders them
        live.sort(key=lambda x: x[2][1] != 1)
        segments = [Segment(s.table, st, n) for s, _, (st, n) in live]
        spans = [s.spans for s, _, _ in live]
        q = torch.cat([s.q[st:st + n] for s, _, (st, n) in live]).to(DEVICE)
        k = torch.cat([s.k[st:st + n] for s, _, (st, n) in live]).to(DEVICE)
        v = torch.cat([s.v[st:st + n] for s, _, (st, n) in live]).to(DEVICE)
        step = BackendStep(arena, backend_named(backend), arena.metadata(segments, spans))
        o = step.attend(0, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], SCALE,
                        window=window)[0].cpu()
        at = 0
        for s, out, (st, n) in live:
            out[st:st + n] = o[at:at + n]
            at += n
    return outs


def workload(seed: int):
    """Two sequences: one longer than the window, with three images (one cut across by the chunk
    plan, one adjacent to a chunk boundary, one larger than the window), one short text-only."""
    rng = torch.Generator().manual_seed(seed)
    ids = list(range(64))
    random.Random(seed).shuffle(ids)
    a = Sequence(rng, 70, 62, ((3, 12), (20, 45), (47, 51)), cuts=(8, 20, 30, 46), table=tuple(ids[:18]))
    b = Sequence(rng, 9, 6, (), cuts=(2,), table=tuple(ids[18:21]))
    return [a, b]


BACKENDS = ["sdpa", "sdpa_deterministic", "triton"]


def backend_named(name: str):
    if name == "sdpa_deterministic":
        return select("sdpa", DEVICE, deterministic=True)
    return select(name, DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 16, 7])
def test_every_backend_equals_transformers_eager_gemma3_attention(backend, window):
    seqs = workload(1)
    outs = run(backend, seqs, window)
    for s, out in zip(seqs, outs):
        ref = hf_eager(s.q, s.k, s.v, len(s.q), s.spans, window)
        torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefix_hit_inside_an_image_is_exact(backend):
    """The cached part of an image was computed with the whole image present: a step that starts
    inside the image (its rest, then the text) gives what the whole prefill gives."""
    seqs = workload(2)
    outs = run(backend, seqs, 16, hit=30)  # 30: inside the span [20, 45)
    ref = hf_eager(seqs[0].q, seqs[0].k, seqs[0].v, 70, seqs[0].spans, 16)
    torch.testing.assert_close(outs[0][30:], ref[30:], atol=3e-5, rtol=3e-5)


def test_the_masks_ignore_nothing():
    """A chunk that would end inside a span is refused, never computed causally; without spans
    the mask is plain causal; a backend lacking a mask refuses a step that carries it."""
    with pytest.raises(ValueError, match="inside the bidirectional span"):
        step_spans(((3, 12),), 0, 8)
    assert key_ends(5, 4, ()).tolist() == [6, 7, 8, 9]
    assert key_ends(5, 6, ((4, 8),)).tolist() == [8, 8, 8, 9, 10, 11]
    arena = KVArena.allocate(1, 8, BS, KV_HEADS, D)
    with pytest.raises(ValueError, match="inside the bidirectional span"):
        arena.metadata([Segment((0, 1, 2), 0, 8)], [((3, 12),)])

    class Causal(SdpaBackend):
        supports = frozenset({"gqa", "mrope_positions"})

    meta = PagedMetadata.build([Segment((0, 1, 2), 0, 10)], BS, spans=[((3, 9),)])
    step = BackendStep(arena, Causal(), meta)
    q = torch.randn(1, HEADS, 10, D)
    kv = torch.randn(1, KV_HEADS, 10, D)
    with pytest.raises(UnsupportedAttentionFeature, match="bidirectional_spans"):
        step.attend(0, q, kv, kv, SCALE)
    meta = PagedMetadata.build([Segment((0, 1, 2), 0, 10)], BS)
    with pytest.raises(UnsupportedAttentionFeature, match="sliding_window"):
        BackendStep(arena, Causal(), meta).attend(0, q, kv, kv, SCALE, window=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_reads_only_the_window(backend):
    """Decode in a sliding layer: every key before the window is NaN, and the output is still the
    reference's (a kernel that read a NaN key, even masked, would give NaN); the sdpa layout counts the
    slots it reads: the window, not the sequence."""
    window, length = 8, 40
    rng = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(length, HEADS, D, generator=rng), torch.randn(length, KV_HEADS, D, generator=rng), \
        torch.randn(length, KV_HEADS, D, generator=rng)
    arena = KVArena.allocate(1, 16, BS, KV_HEADS, D, device=DEVICE)
    table = (5, 0, 9, 2, 7, 11, 3, 14, 1, 6)
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(length)])
    arena.flat(0)[0][slots] = k.to(DEVICE)
    arena.flat(0)[1][slots] = v.to(DEVICE)
    arena.flat(0)[0][slots[:length - window]] = float("nan")  # outside the last token's window
    arena.flat(0)[1][slots[:length - window]] = float("nan")
    seg = Segment(table, length - 1, 1)
    args = (q[-1:].transpose(0, 1)[None].to(DEVICE), k[-1:].transpose(0, 1)[None].to(DEVICE),
            v[-1:].transpose(0, 1)[None].to(DEVICE), SCALE)
    step = BackendStep(arena, backend_named(backend), arena.metadata([seg]))
    out = step.attend(0, *args, window=window)[0].cpu()
    ref = hf_eager(q, k, v, length, (), window)[-1:]
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)
    if backend == "sdpa":
        assert step.backend.layout(step.meta, window, HEADS // KV_HEADS, KV_HEADS).reads == window
        step.attend(0, *args)  # a global layer reads every key (NaN here)
        assert step.backend.layout(step.meta, None, HEADS // KV_HEADS, KV_HEADS).reads == length


def test_the_scheduler_never_splits_a_bidirectional_span():
    """A chunk ends before an image or after it; one that starts at or inside an image takes its
    rest whole (past the budget only as the step's first prefill chunk); a grant cut short is cut
    back out of the image."""
    from mmserve.generation.scheduler import fit_chunk, plan_step, prefill_chunk

    class Seq:
        def __init__(self, kv_len, order=0, target=60, spans=((10, 30),)):
            self.kv_len, self.order, self.target_len, self.bidirectional = kv_len, order, target, spans
            self.admitted, self.request_id, self.table_len = False, order, 0

    assert prefill_chunk(Seq(0), 15, alone=True) == 10  # ends before the image
    assert prefill_chunk(Seq(0), 35, alone=True) == 35  # the image whole, then text
    assert prefill_chunk(Seq(10), 15, alone=True) == 20  # larger than the budget: a chunk of its own
    assert prefill_chunk(Seq(10), 15, alone=False) == 0  # ... only as the step's first
    assert prefill_chunk(Seq(22), 4, alone=True) == 8  # a hit ended inside it: its rest, whole
    assert fit_chunk(Seq(0), 25) == 10 and fit_chunk(Seq(12), 10) == 0 and fit_chunk(Seq(12), 18) == 18
    older, younger = Seq(0, order=0, spans=()), Seq(10, order=1)
    older.target_len = 5
    plan = plan_step([], [older, younger, Seq(0, order=2, spans=())], 4, 12, 8)
    # the image waits for a step of its own, and nobody younger overtakes it
    assert [(p.seq.order, p.tokens) for p in plan] == [(0, 5)]
    plan = plan_step([], [younger, Seq(0, order=2, spans=())], 4, 12, 8)
    assert [(p.seq.order, p.tokens) for p in plan] == [(1, 20)]

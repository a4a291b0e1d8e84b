"""Deterministic mode's operations (issue 40): each is batch-invariant by test, on this machine's
torch — a query's attention is bit-identical whatever the step around it (other sequences, its
chunk's start and length, decode or prefill, a sliding window, a bidirectional span), a linear
layer's row whatever the other rows, an activation's and a rotary embedding's row whatever the
row count — and the default kernels are not (the negative controls: what the mode fixes is real).
The end-to-end guarantee over every family is tests/test_deterministic_oracle.py's."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mmserve.engine.arena import Segment
from mmserve.engine.attention import PagedMetadata, SdpaBackend, select
from mmserve.engine.attention.backend import AttentionBackendUnavailable
from mmserve.engine.attention.masks import key_ends
from mmserve.engine.attention.deterministic import DeterministicSdpaBackend
from mmserve.models.batch_invariant import ROW_CHUNK, call_rows, fingerprint, invariant_linear, pack, pointwise

BS = 16


class Arena:
    """A NaN-filled arena holding one sequence of `length` tokens of random K/V per test."""

    def __init__(self, kv_heads=2, head_dim=16, blocks=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.k = torch.full((blocks, BS, kv_heads, head_dim), float("nan"))
        self.v = torch.full((blocks, BS, kv_heads, head_dim), float("nan"))
        self.free = list(range(blocks))
        random.Random(seed).shuffle(self.free)
        self.g = g

    def sequence(self, length):
        table = tuple(self.free.pop() for _ in range(-(-length // BS)))
        for p in range(length):
            b, s = table[p // BS], p % BS
            self.k[b, s] = torch.randn(self.k.shape[2:], generator=self.g)
            self.v[b, s] = torch.randn(self.v.shape[2:], generator=self.g)
        return table


def attend(backend, arena, seqs, queries, window=None, spans=None):
    """seqs: (table, start, length) per sequence; queries: [T, heads, d] for all new tokens."""
    meta = PagedMetadata.build([Segment(t, s, n) for t, s, n in seqs], BS, spans=spans)
    return backend.forward(queries, arena.k, arena.v, meta, window=window)


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("group", [1, 4])
def test_a_querys_attention_is_the_same_whatever_the_step_around_it(window, group):
    """One sequence of 70 tokens: every token's output is computed as a decode token, inside
    chunks that start and end anywhere, beside other sequences: all bit-identical; and equal to
    SDPA's within float error."""
    arena = Arena()
    heads, d = 2 * group, 16
    table = arena.sequence(70)
    others = [arena.sequence(n) for n in (9, 33, 50)]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(70, heads, d, generator=g)
    det = DeterministicSdpaBackend()
    whole = attend(det, arena, [(table, 0, 70)], q, window)
    ref = attend(SdpaBackend(), arena, [(table, 0, 70)], q, window)
    assert torch.allclose(whole, ref, atol=1e-5), float((whole - ref).abs().max())
    rng = random.Random(2)
    for trial in range(12):
        cut = sorted(rng.sample(range(1, 70), 3))
        start, end = cut[0], cut[1]
        seqs, qs = [], []
        for t in rng.sample(others, rng.randint(0, 3)):  # other sequences: a decode token or a chunk
            n = rng.choice([1, 5])
            seqs.append((t, 9 - n, n))
            qs.append(torch.randn(n, heads, d, generator=g))
        at = sum(x.shape[0] for x in qs)
        seqs.append((table, start, end - start))
        qs.append(q[start:end])
        out = attend(det, arena, seqs, torch.cat(qs), window)
        assert torch.equal(out[at:at + end - start], whole[start:end]), (trial, start, end)
        # the same tokens one at a time, as decode tokens beside the others
        p = rng.randrange(1, 70)
        out = attend(det, arena, seqs[:-1] + [(table, p, 1)], torch.cat(qs[:-1] + [q[p:p + 1]]), window)
        assert torch.equal(out[at], whole[p]), (trial, p)


def test_bidirectional_spans_are_the_same_chunked_or_not():
    arena = Arena(seed=3)
    table = arena.sequence(60)
    spans = [((10, 26), (40, 44))]
    q = torch.randn(60, 4, 16, generator=torch.Generator().manual_seed(4))
    det = DeterministicSdpaBackend()
    whole = attend(det, arena, [(table, 0, 60)], q, spans=spans)
    ref = attend(SdpaBackend(), arena, [(table, 0, 60)], q, spans=spans)
    assert torch.allclose(whole, ref, atol=1e-5)
    for start, end in [(0, 26), (26, 60), (5, 30), (30, 44), (44, 45)]:
        out = attend(det, arena, [(table, start, end - start)], q[start:end], spans=spans)
        assert torch.equal(out, whole[start:end]), (start, end)
    assert key_ends(0, 60, spans[0])[12] == 26


@pytest.mark.parametrize("window", [None, 20])
def test_keys_read_in_place_give_the_bits_of_gathered_ones(window):
    """A sequence alone whose blocks are consecutive ids is read in place (a strided view of the
    arena, NaN past its end in its last block); the same keys in scattered blocks are gathered:
    every token decode or chunked, the same bits."""
    arena = Arena(seed=7)
    scattered = arena.sequence(75)
    first = next(c for c in range(64) if not set(range(c, c + 5)) & set(scattered))
    consecutive = tuple(range(first, first + 5))
    for b, c in zip(scattered, consecutive):
        arena.k[c], arena.v[c] = arena.k[b], arena.v[b]
    arena.k[first + 4, 75 % BS:] = arena.v[first + 4, 75 % BS:] = float("nan")
    q = torch.randn(75, 2, 16, generator=torch.Generator().manual_seed(8))
    det = DeterministicSdpaBackend()
    whole = attend(det, arena, [(scattered, 0, 75)], q, window)
    assert not whole.isnan().any()
    assert det._build(PagedMetadata.build([Segment(consecutive, 74, 1)], BS), window, 1, 2, "cpu")[0].base is not None
    for start, end in [(74, 75), (60, 61), (31, 32), (0, 75), (50, 75), (17, 40)]:
        for table in (consecutive, scattered):
            out = attend(det, arena, [(table, start, end - start)], q[start:end], window)
            assert torch.equal(out, whole[start:end]), (table, start, end)


def test_sdpa_itself_varies_with_the_chunking():
    """The negative control: the default sdpa path gives some token other bits in another chunk."""
    arena = Arena(seed=5)
    table = arena.sequence(300)
    q = torch.randn(300, 2, 16, generator=torch.Generator().manual_seed(6))
    sdpa = SdpaBackend()
    whole = attend(sdpa, arena, [(table, 0, 300)], q)
    diffs = 0
    for start in (1, 100, 200, 299):
        diffs += not torch.equal(attend(sdpa, arena, [(table, start, 300 - start)], q[start:]), whole[start:])
    assert diffs > 0


def test_linear_rows_do_not_follow_the_row_count_and_mkl_s_do():
    g = torch.Generator().manual_seed(7)
    for k, n in [(64, 128), (128, 344), (512, 1408)]:
        w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(k, generator=g)
        packed = pack(w)
        want = invariant_linear(x[None], packed, b)[0]
        assert torch.allclose(want, F.linear(x, w, b), atol=1e-4)
        assert torch.equal(invariant_linear(x[None], w, b)[0], want)  # packed or not: the same bits
        mkl = set()
        for m in (1, 2, 3, 5, 8, 17, 64, 300, 530):  # 300, 530: calls of ROW_CHUNK rows and a bucketed rest
            rows = torch.randn(m, k, generator=g)
            for p in {0, m - 1, m // 2}:
                rows[p] = x
                assert torch.equal(invariant_linear(rows, packed, b)[p], want), (k, n, m, p)
                mkl.add(F.linear(rows, w, b)[p].numpy().tobytes())
        assert len(mkl) > 1  # the default varies (GEMV, tail and main kernels)


def test_onednn_sees_a_bounded_set_of_row_counts(monkeypatch):
    """oneDNN keeps memory for every row count it has run (an output-sized buffer, for good): the
    mode's linear layers give it at most 47 counts, whatever the lengths of the prefill chunks."""
    real, seen = torch.ops.mkldnn._linear_pointwise, set()

    def spy(rows, *args):
        seen.add(rows.shape[0])
        return real(rows, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(24, 16, generator=g)
    packed, x = pack(w), torch.randn(2100, 16, generator=g)
    want = invariant_linear(x[:2], packed)[0]
    for m in range(1, 2100, 7):
        out = invariant_linear(x[:m], packed)
        assert out.shape == (m, 24) and torch.equal(out[0], want)
    assert len(seen) <= 47 and max(seen) == ROW_CHUNK and min(seen) == 2
    assert {call_rows(m) for m in range(1, 17)} == set(range(2, 17))  # a decode batch: its own count
    assert all(m <= call_rows(m) <= m * 1.125 for m in range(17, ROW_CHUNK + 1))


@pytest.mark.parametrize("fn", [F.silu, lambda x: F.gelu(x, approximate="tanh"), torch.cos, torch.exp, torch.exp2])
def test_pointwise_rows_do_not_follow_the_row_count(fn):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(344, generator=g)
    want = pointwise(fn, x[None])[0]
    for m in (1, 2, 3, 16, 97, 300):
        rows = torch.randn(m, 344, generator=g)
        rows[m - 1] = x
        assert torch.equal(pointwise(fn, rows)[m - 1], want), m


def test_silu_itself_varies_with_the_row_count():
    x = torch.randn(344, generator=torch.Generator().manual_seed(9))
    rows = torch.randn(16, 344)
    rows[0] = x
    assert not torch.equal(F.silu(x[None])[0], F.silu(rows)[0])


def test_selection_and_fingerprint():
    assert isinstance(select("auto", "cpu", deterministic=True), DeterministicSdpaBackend)
    assert isinstance(select("sdpa", "cpu", deterministic=True), DeterministicSdpaBackend)
    assert isinstance(select("sdpa", "cpu"), SdpaBackend)
    with pytest.raises(AttentionBackendUnavailable, match="unknown"):
        select("flash", "cpu", deterministic=True)  # "triton": tests/test_deterministic_triton.py
    assert fingerprint(False) is None
    assert fingerprint(True) == "mmserve-det2:batch+prefix_cache+chunking+preemption"


def test_the_mode_is_installed_only_when_asked(tiny_model_dir):
    """The default runner leaves the model's layers and encoder as they are; the deterministic one
    swaps every linear layer, and encodes an image alone whatever its batch."""
    from mmserve.engine.runner import ModelRunner
    from mmserve.models.batch_invariant import DeterministicModeUnavailable, check_available
    from mmserve.models.demo import render_image
    from mmserve.models.llava import LlavaAdapter

    plain = LlavaAdapter("tiny", tiny_model_dir)
    runner = ModelRunner(plain, 1 << 20, 16)
    assert runner.backend.name == "sdpa" and not runner.deterministic
    assert not any("forward" in vars(m) for m in plain.model.modules() if isinstance(m, torch.nn.Linear))
    adapter = LlavaAdapter("tiny", tiny_model_dir)
    runner = ModelRunner(adapter, 1 << 20, 16, deterministic=True)
    assert runner.backend.name == "sdpa_deterministic"
    assert all("forward" in vars(m) for m in adapter.model.modules() if isinstance(m, torch.nn.Linear))
    pixels = adapter.pixel_values([render_image(c, "circle", seed=1) for c in ("red", "blue", "green")])
    assert torch.equal(adapter.encode_images(pixels)[1], adapter.encode_images(pixels[1:2])[0])
    with pytest.raises(DeterministicModeUnavailable, match="CPU only"):
        check_available("cuda")

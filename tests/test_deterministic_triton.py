"""The Triton kernels' deterministic variant (mmserve.engine.attention.triton_deterministic; issue 40),
through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported):
a query's attention is bit-identical as a decode token and inside prefill chunks of any start and
length beside other sequences, with sliding windows and bidirectional spans; the default Triton
kernels are not (the negative control). End to end, a family served on the triton backend in the
mode answers with the same logprobs with the caches on (chunked, batched) as alone with them off."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported, if nothing imported it yet
from mmserve.engine.attention import SdpaBackend, select  # noqa: E402
from mmserve.engine.attention import triton_paged  # noqa: E402
from mmserve.engine.attention.backend import AttentionBackendUnavailable  # noqa: E402
from mmserve.engine.attention.triton_deterministic import DeterministicTritonBackend  # noqa: E402
from tests.test_deterministic import Arena, attend  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_paged.INTERPRETING, reason="the variant runs under the interpreter only")


def trials(rng: random.Random, arena: Arena, q: torch.Tensor, others, count: int):
    """`count` steps that hold some of the 70-token sequence's tokens — a chunk of random start and
    length, or one decode token — beside 0-2 other sequences (a decode token or a chunk each):
    (seqs, queries, offset of the sequence's rows, its positions)."""
    heads, d = q.shape[1:]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for trial in range(count):
        if trial % 2:
            start = rng.randrange(70)
            end = start + 1
        else:
            start, end = sorted(rng.sample(range(71), 2))
        seqs, qs = [], []
        for table, length in rng.sample(others, rng.randint(0, 2)):
            n = rng.choice([1, 5])
            seqs.append((table, length - n, n))
            qs.append(torch.randn(n, heads, d, generator=g))
        at = sum(x.shape[0] for x in qs)
        yield seqs + [(arena.table, start, end - start)], torch.cat(qs + [q[start:end]]), at, (start, end)


def setup(group: int, seed: int):
    arena = Arena(kv_heads=2, head_dim=16, seed=seed)
    arena.table = arena.sequence(70)
    others = [(arena.sequence(n), n) for n in (9, 33, 50)]
    q = torch.randn(70, 2 * group, 16, generator=torch.Generator().manual_seed(seed + 1))
    return arena, others, q


@pytest.mark.parametrize("window,group", [(None, 1), (None, 3), (5, 3), (40, 1)])
def test_a_querys_attention_is_the_same_decode_or_chunked_beside_anything(window, group):
    arena, others, q = setup(group, seed=10 + group)
    det = select("triton", "cpu", deterministic=True)
    assert isinstance(det, DeterministicTritonBackend)
    whole = attend(det, arena, [(arena.table, 0, 70)], q, window)
    ref = attend(SdpaBackend(), arena, [(arena.table, 0, 70)], q, window)
    assert torch.allclose(whole, ref, atol=1e-5), float((whole - ref).abs().max())
    for seqs, queries, at, (start, end) in trials(random.Random(window or 0), arena, q, others, 6):
        out = attend(det, arena, seqs, queries, window)
        assert torch.equal(out[at:at + end - start], whole[start:end]), (seqs, start, end)


def test_bidirectional_spans_are_the_same_chunked_or_not():
    arena, _, q = setup(2, seed=20)
    spans = [((10, 26), (40, 44))]
    det = DeterministicTritonBackend()
    whole = attend(det, arena, [(arena.table, 0, 70)], q, spans=spans)
    ref = attend(SdpaBackend(), arena, [(arena.table, 0, 70)], q, spans=spans)
    assert torch.allclose(whole, ref, atol=1e-5)
    for window in (None, 20):
        if window:
            whole = attend(det, arena, [(arena.table, 0, 70)], q, window, spans=spans)
        for start, end in [(0, 26), (26, 60), (5, 30), (30, 44), (44, 45), (60, 61), (69, 70)]:
            out = attend(det, arena, [(arena.table, start, end - start)], q[start:end], window, spans=spans)
            assert torch.equal(out, whole[start:end]), (window, start, end)


def test_the_default_triton_kernels_vary_with_the_step():
    """The negative control: the same trials through the default kernels give some token other
    bits with a sliding window (the decode kernel tiles a window's keys from seq_len - window, the
    prefill kernel from its tile's first token); causal, a decode token past 256 keys does (its
    keys in two splits, combined by a second kernel) where the whole sequence's prefill does not."""
    default = select("triton", "cpu")
    assert isinstance(default, triton_paged.TritonBackend)
    diffs = 0
    for window in (5, 40):
        arena, others, q = setup(1, seed=11)
        whole = attend(default, arena, [(arena.table, 0, 70)], q, window)
        for seqs, queries, at, (start, end) in trials(random.Random(window or 0), arena, q, others, 6):
            out = attend(default, arena, seqs, queries, window)
            diffs += not torch.equal(out[at:at + end - start], whole[start:end])
    assert diffs > 0
    arena = Arena(kv_heads=1, head_dim=16, seed=12)
    table = arena.sequence(300)
    q = torch.randn(300, 1, 16, generator=torch.Generator().manual_seed(13))
    decoded = [(p, attend(default, arena, [(table, p, 1)], q[p:p + 1])[0]) for p in (270, 299)]
    for backend, differs in ((default, True), (DeterministicTritonBackend(), False)):
        whole = attend(backend, arena, [(table, 0, 300)], q)
        if backend is not default:
            decoded = [(p, attend(backend, arena, [(table, p, 1)], q[p:p + 1])[0]) for p in (270, 299)]
        assert any(not torch.equal(o, whole[p]) for p, o in decoded) is differs


def test_selection(monkeypatch):
    assert isinstance(select("triton", "cpu", deterministic=True), DeterministicTritonBackend)
    with pytest.raises(AttentionBackendUnavailable, match="CPU only"):
        select("triton", "cuda", deterministic=True)
    monkeypatch.setattr(triton_paged, "INTERPRETING", False)  # kernels built for the compiler, on the CPU
    with pytest.raises(AttentionBackendUnavailable, match="runs on CUDA"):
        select("triton", "cpu", deterministic=True)


def test_a_family_on_the_triton_backend_is_bit_identical_cached_batched_chunked(tmp_path_factory):
    """End to end (LLaVA, random tiny weights), the strict oracle on the triton backend: the
    requests at once with the caches on (prefix hits, 24-token chunks, a tiny arena) against each
    alone with the caches off, every logprob `==`."""
    from mmserve.models.demo import Q_COLOR, Q_FIRST, Q_SHAPE, build_untrained
    from tests.deterministic_oracle import Family, Oracle, Request

    path = build_untrained("tiny", tmp_path_factory.mktemp("tiny"), seed=0)
    oracle = Oracle(Family("tiny", str(path), (None,) * 4), backend="triton")
    requests = [Request((((0, 1), Q_COLOR), ((2,), Q_SHAPE)), 3), Request((((1,), Q_COLOR),), 2, n=2),
                Request((((0, 1), Q_FIRST),), 2), Request((((0, 2), Q_FIRST),), 2)]  # the last: a hit inside image 0
    with oracle.runtimes(requests) as (on, off, want):
        assert oracle.loaded(on).generator.runner.backend.name == "triton_deterministic"
        assert oracle.differences(on, want, requests) == []
        assert on.stats()["tiny"]["prefix_cache"]["hit_blocks"] > 0
        assert oracle.hit_ends_inside_an_image(on, requests)

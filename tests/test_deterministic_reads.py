"""Deterministic attention's reads (issue 40): a sequence whose blocks are consecutive ids has its
keys read in place (a `bmm` per sequence over a strided view of the arena), the other sequences of
its call have theirs gathered (one copy, one `bmm`). The bits must not follow the reads: a
query's output is the same read in place or gathered, beside any other sequences, whatever their
lengths (a call's sequences then read keys over widths of their own), decode token or in a chunk."""

from __future__ import annotations

import random

import pytest
import torch

from mmserve.engine.arena import Segment
from mmserve.engine.attention import PagedMetadata
from mmserve.engine.attention import deterministic
from mmserve.engine.attention.deterministic import DeterministicSdpaBackend

BS = 16
KV_HEADS, D = 2, 16
LENGTHS = (75, 40, 130, 17, 300)


class Twins:
    """Sequences of random K/V, each held twice in one NaN-filled arena: in consecutive blocks and
    in scattered ones (the same values), NaN past every sequence's end in its last block."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        n_blocks = 2 * sum(-(-n // BS) for n in LENGTHS) + 8
        self.k = torch.full((n_blocks, BS, KV_HEADS, D), float("nan"))
        self.v = torch.full((n_blocks, BS, KV_HEADS, D), float("nan"))
        free = list(range(n_blocks))
        self.consecutive, self.scattered = [], []
        for n in LENGTHS:
            nb = -(-n // BS)
            self.consecutive.append(tuple(free[:nb]))
            del free[:nb]
        rng = random.Random(seed)
        rng.shuffle(free)
        for n, run in zip(LENGTHS, self.consecutive):  # no neighbours consecutive ids: reads of 2+ blocks gathered
            table = [free.pop()]
            while len(table) < len(run):
                table.append(next(b for b in reversed(free) if b != table[-1] + 1))
                free.remove(table[-1])
            self.scattered.append(tuple(table))
            for p in range(n):
                k, v = torch.randn(KV_HEADS, D, generator=g), torch.randn(KV_HEADS, D, generator=g)
                for t in (run, table):
                    self.k[t[p // BS], p % BS], self.v[t[p // BS], p % BS] = k, v


def attend(backend, twins, steps, queries, window, scattered=()):
    """steps: (sequence index, start, length); `scattered`: the sequences read from their
    scattered copy. The call layout is returned with the output."""
    segments = [Segment((twins.scattered if i in scattered else twins.consecutive)[i], start, n)
                for i, start, n in steps]
    meta = PagedMetadata.build(segments, BS)
    group = queries.shape[1] // KV_HEADS
    out = backend.forward(queries, twins.k, twins.v, meta, window=window)
    return out, backend.layout(meta, window, group, KV_HEADS)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("group", [1, 4])
def test_sequences_read_in_place_give_the_bits_of_gathered_ones(window, group):
    """Decode steps of 1 to 5 sequences of different lengths (one call: the same padded rows),
    and steps of chunks: every sequence's keys read in place when all of them are consecutive, all
    gathered when one is scattered; every token's output bit-identical to that token computed in
    its own sequence's whole prefill, with the sequence's keys gathered."""
    twins = Twins(seed=group)
    det = DeterministicSdpaBackend()
    g = torch.Generator().manual_seed(10 + group)
    heads = KV_HEADS * group
    q = [torch.randn(n, heads, D, generator=g) for n in LENGTHS]
    whole = [attend(det, twins, [(i, 0, n)], q[i], window, scattered={i})[0] for i, n in enumerate(LENGTHS)]
    assert not any(w.isnan().any() for w in whole)
    rng = random.Random(group)
    in_place = mixed = 0
    for trial in range(24):
        seqs = rng.sample(range(len(LENGTHS)), rng.randint(1, len(LENGTHS)))
        chunked = trial % 4 == 3
        steps = []
        for i in seqs:
            if chunked:
                start = rng.randrange(LENGTHS[i])
                steps.append((i, start, rng.randint(1, LENGTHS[i] - start)))
            else:  # a decode token anywhere in the sequence (its keys: those before it and its own)
                steps.append((i, rng.randrange(LENGTHS[i]), 1))
        scattered = set(rng.sample(seqs, 1)) if trial % 2 else set()
        queries = torch.cat([q[i][s:s + n] for i, s, n in steps])
        out, calls = attend(det, twins, steps, queries, window, scattered)
        at = 0
        for i, s, n in steps:
            assert torch.equal(out[at:at + n], whole[i][s:s + n]), (trial, i, s, n, scattered)
            at += n
        for call in calls:
            assert len(call.gathered) <= len(scattered)  # consecutive blocks: always read in place
            if call.seqs > 1:
                in_place += call.seqs > len(call.gathered)
                mixed += 0 < len(call.gathered) < call.seqs
    assert in_place >= 4 and mixed >= 2  # several sequences a call read in place, and beside gathered ones


def test_a_call_s_sequences_read_in_place_over_widths_of_their_own():
    """Decode tokens of sequences of 17 and 300 tokens share a call 320 keys wide: the short
    one's keys are read in place over its own 32 (never past its blocks), the rest masked."""
    twins = Twins(seed=3)
    det = DeterministicSdpaBackend()
    steps = [(3, 16, 1), (4, 299, 1)]
    q = torch.randn(2, KV_HEADS, D, generator=torch.Generator().manual_seed(4))
    out, calls = attend(det, twins, steps, q, None)
    (call,) = calls
    assert call.width == 320 and call.bases == ((twins.consecutive[3][0] * BS, 32), (twins.consecutive[4][0] * BS, 304))
    for scattered in ({3}, {4}, {3, 4}):  # the other one read in place beside a gathered one, or both gathered
        gathered, (call,) = attend(det, twins, steps, q, None, scattered)
        assert call.gathered == tuple(sorted(j for j, (i, _, _) in enumerate(steps) if i in scattered))
        assert torch.equal(out, gathered) and not out.isnan().any()


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("group", [1, 4])
def test_a_long_chunk_in_tiles_gives_the_bits_of_the_whole_chunk(monkeypatch, window, group):
    """A chunk longer than `TILE_TOKENS` is computed in tiles of queries, each over the keys up to
    its own end; with a bidirectional span across two tiles (its tokens see keys of the next tile,
    written by the same step) and beside decode tokens, every output is bit-identical to the chunk
    computed untiled, read in place or gathered."""
    twins = Twins(seed=7 + group)
    det = DeterministicSdpaBackend()
    g = torch.Generator().manual_seed(20 + group)
    heads = KV_HEADS * group
    steps = [(4, 100, 150), (0, 74, 1), (2, 129, 1)]  # the chunk: positions 100..249 of the 300-token sequence
    spans = [((140, 200),), (), ()]  # across the tiles [100, 164) and [164, 228)
    q = torch.randn(sum(n for _, _, n in steps), heads, D, generator=g)

    def run(scattered):
        segments = [Segment((twins.scattered if i in scattered else twins.consecutive)[i], start, n)
                    for i, start, n in steps]
        meta = PagedMetadata.build(segments, BS, spans=spans)
        return det.forward(q, twins.k, twins.v, meta, window=window), det.layout(meta, window, group, KV_HEADS)

    tiled, layout = run(())
    assert deterministic.TILE_TOKENS == 64
    # the chunk's three tiles (64, 64, 22 queries), each over the keys up to its own end padded to
    # 64 (without a window all three 256 wide, the span reaching 200: the first two in one call;
    # with one, each from its own first key: three widths); the decode tokens
    assert sorted(call.seqs for call in layout) == ([1, 2, 2] if window is None else [1, 1, 1, 2])
    assert not tiled.isnan().any()
    assert torch.equal(tiled, run({4})[0])  # its keys gathered
    monkeypatch.setattr(deterministic, "TILE_TOKENS", 10_000)
    untiled, layout = run(())
    assert len(layout) == 2  # the chunk in one call, the two decode tokens in another
    assert torch.equal(tiled, untiled)

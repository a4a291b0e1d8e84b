"""Paged attention (mmserve.engine.arena + LlavaAdapter.forward_paged) reproduces the contiguous
prefill/decode path: one-shot and chunked prefill, decode, a mixed ragged step, prefix hits.

The arena is filled with NaN before use, so a read of any slot no step has written poisons the
logits; blocks are handed out in a shuffled order, so nothing relies on a sequence's blocks being
adjacent. Block size 4 keeps many blocks per sequence.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest
import torch

from mmserve.models.demo import Q_COLOR, Q_FIRST, Q_SHAPE, render_image
from tests.kv_reference import stack_kv
from mmserve.engine.arena import KVArena, Segment
from mmserve.engine.attention import SdpaBackend
from mmserve.engine.paged_forward import ATTN_IMPLEMENTATION, forward_paged
from mmserve.models.llava import LlavaAdapter

BLOCK = 4
TOL = 1e-4


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return LlavaAdapter("tiny", tiny_model_dir)


class Blocks:
    """A NaN-filled arena and its blocks in shuffled order (the bookkeeping is the test's)."""

    def __init__(self, adapter, num_blocks=96, seed=0):
        self.arena = KVArena.allocate(adapter.kv_layers, num_blocks, BLOCK, adapter.kv_heads, adapter.head_dim,
                                      adapter.dtype, adapter.device)
        for t in (*self.arena.keys, *self.arena.values):
            t.fill_(float("nan"))
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n_tokens, have=()):
        """`have` extended with fresh blocks up to n_tokens slots."""
        need = -(-n_tokens // BLOCK) - len(have)
        fresh = [self.free.pop() for _ in range(max(need, 0))]
        return tuple(have) + tuple(fresh)


def prompt_embeds(adapter, question=Q_COLOR, colour="red", shape="circle"):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    prompt = adapter.preprocess(msgs, [render_image(colour, shape, seed=0)])
    feats = adapter.encode_images(prompt.pixel_values)
    return adapter.embed(prompt.input_ids, [(s.start, f) for s, f in zip(prompt.spans, feats)])


def close(a, b):
    return float((a - b).abs().max())


def reference_greedy(adapter, embeds, steps):
    """(logits of the prompt's last token and after each decode step, greedy ids) on the
    contiguous path."""
    out = adapter.prefill(embeds)
    logits, ids, pos = [out.logits[0]], [], embeds.shape[1]
    for _ in range(steps):
        ids.append(int(out.logits[0].argmax()))
        out = adapter.decode([ids[-1]], out.cache, [pos])
        logits.append(out.logits[0])
        pos += 1
    return logits, ids


def token_embeds(adapter, ids):
    with torch.inference_mode():
        return adapter.model.get_input_embeddings()(torch.tensor([ids]))


def test_one_shot_prefill_matches_prefill(adapter):
    embeds = prompt_embeds(adapter)
    blocks = Blocks(adapter)
    seg = Segment(blocks.take(embeds.shape[1]), 0, embeds.shape[1])
    logits = forward_paged(adapter, embeds, [seg], blocks.arena)
    ref = adapter.prefill(embeds)
    assert logits.shape == (1, adapter.vocab_size) and logits.dtype == torch.float32
    assert close(logits[0], ref.logits[0]) < TOL
    # the arena holds the very KV of the contiguous cache
    for layer, cl in enumerate(ref.cache.layers):
        k, v = blocks.arena.read(layer, seg.block_table, seg.end)
        assert close(k, cl.keys[0]) < 1e-5 and close(v, cl.values[0]) < 1e-5
    # no twin: the language model itself runs the paged attention, and any call that is not a
    # paged step (HF's generate, the references) still gets transformers' SDPA, exactly
    assert adapter.model.model.language_model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert not hasattr(adapter, "_paged_lm")
    assert torch.equal(adapter.prefill(embeds).logits, ref.logits)


def test_chunked_prefill_then_decode_matches(adapter):
    embeds = prompt_embeds(adapter)
    n = embeds.shape[1]
    ref_logits, ref_ids = reference_greedy(adapter, embeds, 5)
    blocks = Blocks(adapter, seed=1)
    table, start = (), 0
    for end in (7, 18, n):  # chunk ends off block boundaries on purpose
        table = blocks.take(end, table)
        logits = forward_paged(adapter, embeds[:, start:end], [Segment(table, start, end - start)], blocks.arena)
        start = end
    assert close(logits[0], ref_logits[0]) < TOL
    ids = []
    for step in range(5):
        ids.append(int(logits[0].argmax()))
        table = blocks.take(start + 1, table)
        logits = forward_paged(adapter, token_embeds(adapter, [ids[-1]]), [Segment(table, start, 1)], blocks.arena)
        start += 1
        assert close(logits[0], ref_logits[step + 1]) < TOL, step
    assert ids == ref_ids


def test_mixed_step_matches_each_sequence_alone(adapter):
    a = prompt_embeds(adapter, Q_COLOR)
    b = prompt_embeds(adapter, Q_FIRST, colour="blue", shape="square")
    c = prompt_embeds(adapter, Q_FIRST)  # same image as A: they share the prompt up to the question
    na, nb, nc = a.shape[1], b.shape[1], c.shape[1]
    common = next(i for i in range(min(na, nc)) if not torch.equal(a[0, i], c[0, i]))
    shared = common // BLOCK * BLOCK
    assert shared >= 2 * BLOCK
    blocks = Blocks(adapter, seed=2)

    d = prompt_embeds(adapter, Q_SHAPE, colour="green", shape="triangle")[:, :-3]  # decodes too, shorter than A
    nd = d.shape[1]
    assert nd != na
    # earlier step: A and D prefilled, B's first chunk (three prefill segments in one forward)
    b_cut = 13
    ta, td, tb = blocks.take(na), blocks.take(nd), blocks.take(b_cut)
    first = forward_paged(adapter, torch.cat([a, d, b[:, :b_cut]], dim=1),
                                  [Segment(ta, 0, na), Segment(td, 0, nd), Segment(tb, 0, b_cut)], blocks.arena)

    # the mixed step: A and D decode a token, B prefills its next chunk, C prefills after the
    # prefix it shares with A
    tok_a, tok_d = int(first[0].argmax()), int(first[1].argmax())
    ta, td = blocks.take(na + 1, ta), blocks.take(nd + 1, td)
    tb = blocks.take(nb - 5, tb)
    tc = blocks.take(nc, ta[: shared // BLOCK])
    segs = [Segment(ta, na, 1), Segment(tb, b_cut, nb - 5 - b_cut), Segment(tc, shared, nc - shared),
            Segment(td, nd, 1)]
    embeds = torch.cat([token_embeds(adapter, [tok_a]), b[:, b_cut : nb - 5], c[:, shared:],
                        token_embeds(adapter, [tok_d])], dim=1)
    logits = forward_paged(adapter, embeds, segs, blocks.arena)
    assert logits.shape == (4, adapter.vocab_size)

    ref_a, ids_a = reference_greedy(adapter, a, 1)
    ref_d, ids_d = reference_greedy(adapter, d, 1)
    assert [tok_a, tok_d] == ids_a + ids_d
    assert close(logits[0], ref_a[1]) < TOL
    assert close(logits[1], adapter.prefill(b[:, : nb - 5]).logits[0]) < TOL
    assert close(logits[2], adapter.prefill(c).logits[0]) < TOL
    assert close(logits[3], ref_d[1]) < TOL


def test_decode_reads_consecutive_tables_in_place_and_gathers_the_rest(adapter):
    """On the CPU a decode token whose table is one run of consecutive blocks reads its keys in
    place (one attention call over a view of the arena); the others are gathered into one padded
    call. One step with both kinds and a prefill chunk gives each sequence's own logits."""
    a = prompt_embeds(adapter, Q_COLOR)
    d = prompt_embeds(adapter, Q_SHAPE, colour="green", shape="triangle")
    b = prompt_embeds(adapter, Q_FIRST, colour="blue", shape="square")
    na, nd, nb = a.shape[1], d.shape[1], b.shape[1]
    blocks = Blocks(adapter, num_blocks=128, seed=5)
    start = 64  # blocks from here on are laid out by hand, in order; the shuffled ones stay below
    blocks.free = [i for i in blocks.free if i < start]
    ta = tuple(range(start, start + -(-(na + 1) // BLOCK)))  # consecutive, room for its decode token
    td = blocks.take(nd + 1)  # shuffled
    first = forward_paged(adapter, torch.cat([a, d], dim=1), [Segment(ta, 0, na), Segment(td, 0, nd)], blocks.arena)
    tok_a, tok_d = int(first[0].argmax()), int(first[1].argmax())
    tb = tuple(range(start + 40, start + 40 + -(-nb // BLOCK)))
    segs = [Segment(ta, na, 1), Segment(tb, 0, nb), Segment(td, nd, 1)]
    batch = SdpaBackend().layout(blocks.arena.metadata(segs))  # what each query reads
    assert [row for row, _ in batch.decode_views] == [0]  # A's token is row 0 of the step
    assert batch.decode_views[0][1] == slice(start * BLOCK, start * BLOCK + na + 1)
    assert batch.decode_rows.tolist() == [nb + 1]  # D's token, after A's and B's chunk
    assert isinstance(batch.prefill[0][2], slice)  # B's chunk reads its keys in place too
    logits = forward_paged(adapter, torch.cat([token_embeds(adapter, [tok_a]), b, token_embeds(adapter, [tok_d])],
                                             dim=1), segs, blocks.arena)
    ref_a, ids_a = reference_greedy(adapter, a, 1)
    ref_d, ids_d = reference_greedy(adapter, d, 1)
    assert [tok_a, tok_d] == ids_a + ids_d
    assert close(logits[0], ref_a[1]) < TOL
    assert close(logits[1], adapter.prefill(b).logits[0]) < TOL
    assert close(logits[2], ref_d[1]) < TOL


def test_prefix_hit_reuses_blocks_without_copying(adapter):
    a = prompt_embeds(adapter, Q_COLOR)
    c = prompt_embeds(adapter, Q_FIRST)
    na, nc = a.shape[1], c.shape[1]
    common = next(i for i in range(min(na, nc)) if not torch.equal(a[0, i], c[0, i]))
    blocks = Blocks(adapter, seed=3)
    ta = blocks.take(na)
    forward_paged(adapter, a, [Segment(ta, 0, na)], blocks.arena)
    ref = adapter.prefill(c).logits[0]

    # hit on the full blocks of the common prefix: the table starts with A's block ids
    shared = common // BLOCK * BLOCK
    tc = blocks.take(nc, ta[: shared // BLOCK])
    before = [t.clone() for t in (*blocks.arena.keys, *blocks.arena.values)]
    ptrs = [t.data_ptr() for t in (*blocks.arena.keys, *blocks.arena.values)]
    logits = forward_paged(adapter, c[:, shared:], [Segment(tc, shared, nc - shared)], blocks.arena)
    assert close(logits[0], ref) < TOL
    own = set(tc[shared // BLOCK :])
    untouched = [i for i in range(blocks.arena.num_blocks) if i not in own]
    for old, new, ptr in zip(before, (*blocks.arena.keys, *blocks.arena.values), ptrs):
        assert new.data_ptr() == ptr  # same storage: nothing reallocated
        # only C's fresh blocks were written (never-written slots stay NaN, hence equal_nan)
        assert torch.allclose(old[untouched], new[untouched], rtol=0, atol=0, equal_nan=True)

    # a hit that ends mid-block: the partial block is copied (copy-on-write) before C appends to it
    if common % BLOCK:
        full = common // BLOCK
        cow = blocks.free.pop()
        blocks.arena.copy_block(ta[full], cow)
        tc2 = blocks.take(nc, ta[:full] + (cow,))
        logits = forward_paged(adapter, c[:, common:], [Segment(tc2, common, nc - common)], blocks.arena)
        assert close(logits[0], ref) < TOL


def test_bad_segments_are_refused(adapter):
    blocks = Blocks(adapter, num_blocks=8)
    with pytest.raises(ValueError):
        Segment((0,), 0, 0)
    with pytest.raises(ValueError):  # table too short
        blocks.arena.metadata([Segment((0, 1), 0, 9)])
    with pytest.raises(ValueError):  # block outside the arena
        blocks.arena.metadata([Segment((0, 8), 0, 6)])
    with pytest.raises(ValueError):  # two new tokens, one slot
        blocks.arena.metadata([Segment((0,), 0, 2), Segment((0,), 1, 1)])
    arena = blocks.arena
    assert arena.block_bytes * arena.num_blocks == arena.nbytes
    assert arena.block_bytes == 2 * adapter.kv_layers * BLOCK * adapter.kv_heads * adapter.head_dim * 4


def _timed(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def test_measure_paged_decode_against_contiguous_decode(adapter):
    """Measured, not asserted: one decode step of 16 sequences of ~300 tokens, paged (gather
    into contiguous tensors per layer) against `decode` over a stacked contiguous cache."""
    batch, reps = 16, 15
    gen = torch.Generator().manual_seed(0)
    lengths = [290 + int(torch.randint(0, 21, (1,), generator=gen)) for _ in range(batch)]
    prompts = [torch.randint(3, adapter.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    blocks = Blocks(adapter, num_blocks=batch * (320 + reps + 8) // BLOCK + 8, seed=4)
    tables = [blocks.take(n + reps + 2) for n in lengths]
    embeds = torch.cat([token_embeds(adapter, p) for p in prompts], dim=1)
    forward_paged(adapter, embeds, [Segment(t, 0, n) for t, n in zip(tables, lengths)], blocks.arena)

    caches = [adapter.prefill(token_embeds(adapter, p)).cache for p in prompts]
    cache, mask = stack_kv([tuple((l.keys, l.values) for l in c.layers) for c in caches], capacity=330 + reps)
    tok = [5] * batch
    state = {"pos": list(lengths), "mask": mask}

    def contiguous_step():
        m = torch.cat([state["mask"], state["mask"].new_ones(batch, 1)], dim=1)
        adapter.decode(tok, cache, state["pos"], attention_mask=m)
        state["mask"], state["pos"] = m, [p + 1 for p in state["pos"]]

    pstate = {"start": list(lengths)}
    one = token_embeds(adapter, tok)

    def paged_step():
        segs = [Segment(t, s, 1) for t, s in zip(tables, pstate["start"])]
        forward_paged(adapter, one, segs, blocks.arena)
        pstate["start"] = [s + 1 for s in pstate["start"]]

    def plan_only():  # the step's metadata and the sdpa backend's layout of it alone
        SdpaBackend().layout(blocks.arena.metadata([Segment(t, s, 1) for t, s in zip(tables, pstate["start"])]))

    slots = SdpaBackend().layout(blocks.arena.metadata([Segment(t, s, 1) for t, s in zip(tables, lengths)])).decode_slots.view(-1)

    def gather_only():  # the paged step's KV gathers alone (all layers, K and V)
        for layer in range(blocks.arena.layers):
            k, v = blocks.arena.flat(layer)
            k.index_select(0, slots)
            v.index_select(0, slots)

    paged_step(), contiguous_step()  # warm-up
    t_contig = _timed(contiguous_step, reps - 2)
    t_paged = _timed(paged_step, reps - 2)
    t_plan = _timed(plan_only, reps)
    t_gather = _timed(gather_only, reps)
    kv_bytes = sum(lengths) * 2 * adapter.kv_layers * adapter.kv_heads * adapter.head_dim * 4
    ms = lambda t: f"{t[0] * 1e3:.2f}/{t[1] * 1e3:.2f}"  # noqa: E731
    print(f"\n[paged-vs-contiguous] tiny model, {batch} seqs of {min(lengths)}-{max(lengths)} tokens, block {BLOCK}, "
          f"ms min/median: decode step contiguous {ms(t_contig)}, paged {ms(t_paged)} "
          f"(of which metadata {ms(t_plan)}, KV gathers {ms(t_gather)} for {kv_bytes / 2**20:.1f} MiB)")

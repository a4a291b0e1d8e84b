"""Batched on-device sampling (`sample_batch`) against the per-row `sample`, row by row."""

import math
import time
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.overrides import TorchFunctionMode

from mmserve.generation.sampler import (ALL_BANNED, NOTHING_LEFT, SamplingError, sample_batch,
                                        sample_batch_ids)
from mmserve.generation.sampling import SamplingParams, make_generator, sample

GREEDY = SamplingParams(temperature=0.0)


def per_row(logits, params, generators, banned=None):
    """Today's path: each row on its own through `sample`."""
    return [sample(logits[b], params[b], generators[b], None if banned is None else banned[b])
            for b in range(len(params))]


def seeded_pair(params):
    """Two independent but identically seeded generator lists (None for greedy rows)."""
    return [make_generator(p) for p in params], [make_generator(p) for p in params]


# -- the torch fact the exactness of seeded rows rests on ---------------------------------------

@pytest.mark.parametrize("V", [3, 360, 40000])
def test_multinomial_of_one_is_the_exponential_race(V):
    """`torch.multinomial(p, 1, generator=g)` == argmax(p / q), q = empty_like(p).exponential_(1, g),
    drawing the same numbers from g (so the generator ends in the same state). If a torch upgrade
    changes this, seeded rows of `sample_batch` stop matching `sample` — this test says why."""
    for seed in range(6):
        p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3, -1)
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        a = int(torch.multinomial(p, 1, generator=g1))
        q = torch.empty(2, V)[1].exponential_(1.0, generator=g2)  # a row of a batch buffer
        assert a == int(torch.argmax(p / q))
        assert torch.equal(g1.get_state(), g2.get_state())


# -- greedy ---------------------------------------------------------------------------------------

@st.composite
def greedy_cases(draw):
    B, V = draw(st.integers(1, 6)), draw(st.integers(1, 40))
    coarse = draw(st.booleans())  # integer logits: many ties, argmax must pick the first
    values = st.integers(-3, 3).map(float) if coarse else st.floats(-1e4, 1e4, width=32)
    logits = torch.tensor(draw(st.lists(st.lists(values, min_size=V, max_size=V), min_size=B,
                                        max_size=B)), dtype=torch.float32)
    banned = []
    for b in range(B):
        ids = draw(st.lists(st.integers(-V, V - 1), max_size=V))
        if len({i % V for i in ids}) == V:  # everything banned: tested separately (it raises)
            ids = ids[:-1] if len({i % V for i in ids[:-1]}) < V else []
        banned.append(torch.tensor(ids, dtype=torch.long) if ids or draw(st.booleans()) else None)
    return logits, banned


@settings(max_examples=60, deadline=None)
@given(case=greedy_cases(), as_mask=st.booleans())
def test_greedy_rows_equal_sample(case, as_mask):
    logits, banned = case
    B, V = logits.shape
    expected = per_row(logits, [GREEDY] * B, [None] * B, banned)
    spec = banned
    if as_mask:
        spec = torch.zeros(B, V, dtype=torch.bool)
        for b, ids in enumerate(banned):
            if ids is not None:
                spec[b, ids] = True
    before = logits.clone()
    assert sample_batch(logits, [GREEDY] * B, [None] * B, spec) == expected
    assert torch.equal(logits, before)  # the caller's logits are never written


def test_greedy_on_half_precision_logits_equals_sample():
    logits = (torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)) * 5).bfloat16()
    banned = [torch.tensor([int(logits[0].float().argmax())]), None, torch.tensor([1, 2]), None]
    assert sample_batch(logits, [GREEDY] * 4, [None] * 4, banned) == \
        per_row(logits, [GREEDY] * 4, [None] * 4, banned)


# -- seeded rows: the same token sequence as `sample` ---------------------------------------------

@st.composite
def seeded_cases(draw):
    B, V = draw(st.integers(1, 5)), draw(st.integers(2, 60))
    coarse = draw(st.booleans())  # ties in logits and probabilities (top-k threshold, top-p sort)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(B, V, generator=gen) * draw(st.sampled_from([0.5, 3.0, 10.0]))
    if coarse:
        logits = logits.round()
    params = [SamplingParams(temperature=draw(st.sampled_from([0.0, 0.3, 1.0, 1.7])),
                             top_k=draw(st.integers(0, V + 2)),
                             top_p=draw(st.sampled_from([1.0, 0.95, 0.9, 0.5, 0.2, 0.0001])),
                             seed=draw(st.integers(0, 2**31)))
              for _ in range(B)]
    banned = [torch.tensor(draw(st.lists(st.integers(0, V - 1), max_size=V // 2)), dtype=torch.long)
              for _ in range(B)]
    return logits, params, banned


@settings(max_examples=50, deadline=None)
@given(case=seeded_cases())
def test_seeded_rows_repeat_sample_exactly_over_steps(case):
    logits, params, banned = case
    ours, theirs = seeded_pair(params)
    for step in range(4):
        step_logits = logits.roll(step, dims=1)  # a different distribution each step
        assert sample_batch(step_logits, params, ours, banned) == \
            per_row(step_logits, params, theirs, banned)
    for a, b in zip(ours, theirs):
        if a is not None:
            assert torch.equal(a.get_state(), b.get_state())


def test_seeded_rows_match_at_a_large_vocabulary():
    """V >= 32768: torch splits a 1-D sum across threads (not a row's sum in a batch); the top-p
    renormalisation of seeded rows is done per row so they stay exact."""
    V = 40000
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 2
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11),
              SamplingParams(temperature=1.0, top_k=500, top_p=0.95, seed=12),
              SamplingParams(temperature=1.2, seed=13)]
    ours, theirs = seeded_pair(params)
    assert sample_batch(logits, params, ours) == per_row(logits, params, theirs)


class RaceInputs(TorchFunctionMode):
    """Captures the probabilities the seeded rows' race divides by its noise (`probs.div_(noise)`,
    the only in-place division of two same-shaped tensors in `sample_batch`)."""

    def __init__(self):
        super().__init__()
        self.probs = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "div_" and isinstance(args[1], torch.Tensor) \
                and args[1].shape == args[0].shape and args[0].dim() == 2:
            self.probs = args[0].clone()
        return func(*args, **(kwargs or {}))


def multinomial_inputs(logits, params, generators, banned):
    """What `sample` hands to torch.multinomial, row by row."""
    seen = []
    real = torch.multinomial

    def recording(probs, *args, **kwargs):
        seen.append(probs.clone())
        return real(probs, *args, **kwargs)

    with mock.patch.object(torch, "multinomial", recording):
        per_row(logits, params, generators, banned)
    return seen


def assert_same_race_inputs(logits, params, banned=None):
    """The seeded rows' probabilities are bit-identical to `sample`'s (a tie-free token check
    would miss a last-bit difference: it changes the token only near a tie)."""
    ours, theirs = seeded_pair(params)
    banned = banned if banned is not None else [None] * len(params)
    theirs_probs = multinomial_inputs(logits, params, theirs, banned)
    with RaceInputs() as race:
        sample_batch_ids(logits, params, ours, banned)
    random = [b for b, p in enumerate(params) if not p.greedy]
    by_row = dict(zip(random, theirs_probs))
    block_order = sorted(random, key=lambda b: params[b].top_p < 1.0)  # no-top-p rows first
    assert race.probs is not None and race.probs.shape[0] == len(block_order)
    for got, b in zip(race.probs, block_order):
        assert torch.equal(got, by_row[b]), f"row {b}"


@settings(max_examples=40, deadline=None)
@given(case=seeded_cases())
def test_seeded_rows_race_on_bit_identical_probabilities(case):
    logits, params, banned = case
    if any(not p.greedy for p in params):
        assert_same_race_inputs(logits, params, banned)


def test_seeded_rows_race_on_bit_identical_probabilities_at_a_large_vocabulary():
    logits = torch.randn(4, 40000, generator=torch.Generator().manual_seed(2)) * 2
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), GREEDY,
              SamplingParams(temperature=1.1, top_k=300, top_p=0.97, seed=2),
              SamplingParams(temperature=1.0, seed=3)]
    assert_same_race_inputs(logits, params)


def test_a_seed_reproduces_its_tokens():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1)).expand(2, 500)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7)] * 2
    runs = []
    for _ in range(2):
        gens = [make_generator(p) for p in params]
        runs.append([sample_batch(logits, params, gens) for _ in range(10)])
    assert runs[0] == runs[1]
    assert [r[0] for r in runs[0]] == [r[1] for r in runs[0]]  # same seed in two rows: same draws


# -- mixed batches --------------------------------------------------------------------------------

def test_mixed_batch_matches_per_row_where_deterministic():
    V = 2000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=g) * 2
    logits[4, 17] = 60.0  # sharply peaked
    params = [
        GREEDY,
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_k=5, seed=2),
        SamplingParams(temperature=1.0, top_p=0.8),          # unseeded
        SamplingParams(temperature=1.0, top_p=0.95),         # unseeded, peaked
        SamplingParams(temperature=1.3, top_k=1),            # unseeded, top_k=1: greedy
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=3),
        GREEDY,
    ]
    banned = [torch.tensor([int(logits[0].argmax())]), None, torch.tensor([0, 1]), None,
              None, torch.tensor([int(logits[5].argmax())]), None, torch.tensor([-1])]
    ours, theirs = seeded_pair(params)
    ours = [gen if p.seed is not None else None for gen, p in zip(ours, params)]
    top5_of_2 = set(torch.topk(logits[2].index_fill(0, torch.tensor([0, 1]), -math.inf), 5).indices.tolist())
    for step in range(20):
        got = sample_batch(logits, params, ours, banned)
        want = per_row(logits, params, theirs, banned)
        for b in (0, 1, 2, 6, 7):
            assert got[b] == want[b], (step, b)
        assert got[4] == 17
        assert got[5] == want[5]  # top_k=1 is the argmax of the (banned) row
        assert got[2] in top5_of_2


def test_unseeded_rows_follow_the_distribution():
    """2000 unseeded rows of one 4-token distribution in one call: loose frequency check."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    B = 2000
    logits = probs.log().expand(B, 4).contiguous()
    params = [SamplingParams(temperature=1.0)] * B
    counts = torch.bincount(torch.tensor(sample_batch(logits, params, [None] * B)), minlength=4)
    assert torch.allclose(counts / B, probs, atol=0.05)
    # top_p=0.75 keeps {0, 1} (preceding masses 0 and 0.5), renormalised to 0.625 / 0.375
    params = [SamplingParams(temperature=1.0, top_p=0.75)] * B
    counts = torch.bincount(torch.tensor(sample_batch(logits, params, [None] * B)), minlength=4)
    assert counts[2:].sum() == 0 and abs(counts[0] / B - 0.625) < 0.05
    # top_k=3 with temperature 0.5 (probs squared, renormalised over the first three)
    params = [SamplingParams(temperature=0.5, top_k=3)] * B
    counts = torch.bincount(torch.tensor(sample_batch(logits, params, [None] * B)), minlength=4)
    sq = probs[:3] ** 2 / (probs[:3] ** 2).sum()
    assert counts[3] == 0 and torch.allclose(counts[:3] / B, sq, atol=0.05)


# -- rows that cannot be sampled ------------------------------------------------------------------

def test_rows_with_nothing_to_sample_are_named():
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(0))
    logits[3, 2] = logits[5, 0] = math.nan
    params = [GREEDY, SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, seed=2), SamplingParams(temperature=1.0, top_p=0.0),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2)]
    gens = [make_generator(p) if p.seed is not None else None for p in params]
    every = torch.arange(6)
    banned = [every, None, every, None, None, None, None]
    bad = {0, 2, 3, 4, 5}
    with pytest.raises(SamplingError) as err:
        sample_batch(logits, params, gens, banned)
    assert isinstance(err.value, ValueError)
    assert set(err.value.rows) == bad
    assert "row 0: every token is banned" in str(err.value) and "row 3:" in str(err.value)
    assert "row 1" not in str(err.value) and "row 6" not in str(err.value)
    out = sample_batch(logits, params, gens, banned, on_error="return")
    assert all(isinstance(out[b], int) and 0 <= out[b] < 6 for b in (1, 6))
    assert all(isinstance(out[b], ValueError) and f"row {b}" in str(out[b]) for b in bad)
    codes = sample_batch_ids(logits, params, gens, banned).tolist()
    assert codes[0] == codes[2] == ALL_BANNED
    assert codes[3] == codes[4] == codes[5] == NOTHING_LEFT


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="batch, vocab"):
        sample_batch(torch.zeros(4), [GREEDY], [None])
    with pytest.raises(ValueError, match="2 rows"):
        sample_batch(logits, [GREEDY], [None])
    with pytest.raises(ValueError, match="banned mask"):
        sample_batch(logits, [GREEDY] * 2, [None] * 2, torch.zeros(2, 3, dtype=torch.bool))
    assert sample_batch(torch.zeros(0, 4), [], []) == []


# -- one device→host transfer per call ------------------------------------------------------------

HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__len__",
              "numpy", "cpu", "nonzero", "masked_select", "unique", "__repr__", "__format__",
              "argwhere", "any", "all", "equal", "allclose"}


class TransferCounter(TorchFunctionMode):
    """Records every tensor function that reads values back to the host (or could on a device)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            self.reads.append(name)
        elif name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values())):
            self.reads.append("to(cpu)")
        elif name in ("__getitem__", "__setitem__") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.reads.append(name + "[bool]")  # boolean indexing: a data-dependent shape
        return func(*args, **kwargs)


def test_one_host_transfer_per_call():
    B, V = 12, 3000
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0))
    params = [GREEDY, SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=50, seed=2),
              SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.1, top_k=20, top_p=0.8, seed=3)] * 2
    gens = [make_generator(p) if p.seed is not None else None for p in params]
    banned = [torch.tensor([0, 5]), None] * 6
    mask = torch.zeros(B, V, dtype=torch.bool)
    mask[:, 7] = True
    for spec in (banned, mask, None):
        with TransferCounter() as counter:
            out = sample_batch(logits, params, gens, spec)
        assert counter.reads == ["tolist"], counter.reads
        assert len(out) == B
    with TransferCounter() as counter:
        sample_batch_ids(logits, params, gens, banned)
    assert counter.reads == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_never_synchronises_and_stays_close_to_cpu():
    B, V = 16, 32000
    logits_cpu = torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * 3
    logits = logits_cpu.cuda().half()
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0, seed=4)] * 4
    gens = [make_generator(p) if p.seed is not None else None for p in params]
    banned = [torch.tensor([0, 5]), None] * 8
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = sample_batch_ids(logits, params, gens, banned)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = ids.tolist()
    assert out[0::4] == per_row(logits, params, [None] * B, banned)[0::4]  # greedy: exact
    assert all(0 <= t < V for t in out)
    again = sample_batch(logits, params, [make_generator(p) if p.seed is not None else None
                                          for p in params], banned)
    assert again[1::4] == out[1::4] and again[3::4] == out[3::4]  # seeded: reproducible


# -- timing (printed, not asserted) ---------------------------------------------------------------

def test_timing_batch_vs_per_row():
    B, V = 32, 32000
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * 3
    banned = [torch.tensor([2, 31999])] * B
    cases = {
        "greedy": [GREEDY] * B,
        "T=0.8 top_p=0.95 seeded": [SamplingParams(temperature=0.8, top_p=0.95, seed=b) for b in range(B)],
        "T=0.8 top_p=0.95 unseeded": [SamplingParams(temperature=0.8, top_p=0.95)] * B,
        "T=1 top_k=50 unseeded": [SamplingParams(temperature=1.0, top_k=50)] * B,
    }
    def best_ms(fn, reps=2):  # the best of a few: the cores are shared
        best = math.inf
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    threads = torch.get_num_threads()
    lines = []
    for name, params in cases.items():
        seeded = [make_generator(p) if p.seed is not None else None for p in params]
        loop_gens = [make_generator(p) for p in params]
        loop = best_ms(lambda: per_row(logits, params, loop_gens, banned))
        batch = best_ms(lambda: sample_batch(logits, params, seeded, banned))
        torch.set_num_threads(1)
        try:
            batch1 = best_ms(lambda: sample_batch(logits, params, seeded, banned))
        finally:
            torch.set_num_threads(threads)
        lines.append(f"{name:27s} per-row {loop:6.1f} ms   batch {batch:6.1f} ms "
                     f"({threads} threads), {batch1:6.1f} ms (1 thread)")
    print(f"\nsampling B={B} V={V} on CPU\n" + "\n".join(lines))

"""Overlap scheduling (`[runtime] overlap`, `actors.step_overlap`): step n+1 is planned, its blocks
drawn and its inputs, attention metadata and sampling plan built while step n runs on the compute
thread; its new tokens are gathered from step n's samples on the device, whose host copy is
unpacked on the event loop; and the answers are the same as with serial steps — greedy, seeded,
stop strings, n > 1, grammar, logprobs — also under preemption and cancellation."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import trio
from torch.utils._python_dispatch import TorchDispatchMode

from mmserve import Runtime
from mmserve.actors import step_executor as executor_module
from mmserve.bench.stand_in import StandInForward
from mmserve.errors import MMServeError
from mmserve.engine.decode_graphs import DecodeBuffers
from mmserve.generation.sampling import SamplingParams, make_generator
from mmserve.engine.step_sampling import (DeviceSample, RowSpec, Sampled, plan_sampling, sample_on_device,
                                              sample_rows)
from mmserve.engine.attention import PagedMetadata
from mmserve.models.demo import Q_COLOR, Q_SHAPE, render_image
from tests.helpers import ask, assert_nothing_held

SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"colour": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["colour", "count"]}}}


def question(i: int):
    colours, shapes = ["red", "blue", "green", "yellow"], ["circle", "square", "triangle"]
    return ask(render_image(colours[i % 4], shapes[i % 3], background="white", seed=300 + i),
               Q_COLOR if i % 2 else Q_SHAPE)


REQUESTS = [
    dict(temperature=0, max_tokens=24, min_tokens=24),
    dict(temperature=0, max_tokens=30),  # ends at its own EOS (or its length)
    dict(temperature=0.9, seed=7, max_tokens=20, min_tokens=20),
    dict(temperature=0.9, seed=11, top_p=0.9, max_tokens=18, n=2),
    dict(temperature=0, max_tokens=40, stop=["e"]),  # a stop string, found in the text
    dict(temperature=0, max_tokens=16, min_tokens=16, logprobs=True, top_logprobs=3),
    dict(temperature=0, max_tokens=30, response_format=SCHEMA),
    dict(temperature=0.7, seed=3, max_tokens=22, min_tokens=22, n=3, logprobs=True, top_logprobs=2),
]


def summary(c) -> list:
    return [(ch.text, ch.finish_reason, ch.logprobs) for ch in c.choices] + [c.usage]


def exact(answers: list) -> list:
    """`answers` with every logprob value left out (the tokens, texts and ids kept)."""
    return [a if isinstance(a, str) or a is None else [x if not isinstance(x, tuple) else (x[0], x[1], _tokens(x[2])) for x in a]
            for a in answers]


def _tokens(logprobs) -> tuple | None:
    return None if logprobs is None else tuple((e.token, e.token_id, e.bytes, _tokens(e.top)) for e in logprobs)


def logprob_values(answers: list) -> list[float]:
    def values(logprobs):
        for e in logprobs or ():
            yield e.logprob
            yield from values(e.top)
    return [v for a in answers if isinstance(a, list) for x in a if isinstance(x, tuple) for v in values(x[2])]


async def answers(config, overlap: bool, cancel: int | None = None) -> tuple[list, int]:
    """Every request of REQUESTS at once (each on its own image); `cancel`: that one leaves after
    its third token. Returns (each answer's summary, the generator's preemptions)."""
    out: list = [None] * len(REQUESTS)
    async with Runtime.open(config.replace(runtime={"overlap": overlap})) as rt:
        async def one(i: int) -> None:
            if i == cancel:
                async with rt.chat(question(i), temperature=0, max_tokens=60, min_tokens=60) as stream:
                    for _ in range(3):
                        await stream.__anext__()
                return
            try:
                out[i] = summary(await rt.chat_completion(question(i), **REQUESTS[i]))
            except MMServeError as e:
                out[i] = repr(e)

        async with trio.open_nursery() as nursery:
            for i in range(len(REQUESTS)):
                nursery.start_soon(one, i)
        await assert_nothing_held(rt)
        generator = rt.registry.require("demo").generator
        return out, generator.preemptions


async def test_answers_are_the_same_with_overlap_on_and_off(demo_config):
    config = demo_config.replace(kv_cache={"prefix_caching": False})
    serial, _ = await answers(config, overlap=False)
    overlapped, _ = await answers(config, overlap=True)
    # batches form as requests arrive (prefill chunks beside other rows): a logprob may differ in
    # the last bits of a float, as between two serial runs; every token, text and finish is the same
    assert exact(overlapped) == exact(serial)
    assert logprob_values(overlapped) == pytest.approx(logprob_values(serial), abs=1e-4)
    assert all(not isinstance(a, str) for a in serial), serial  # every request answered


async def test_answers_are_the_same_with_overlap_under_preemption_and_cancellation(demo_config):
    # 20 blocks of 8 tokens: the eight requests preempt each other; request 4 leaves early
    config = demo_config.replace(kv_cache={"block_size": 8, "budget_bytes": 20 * 16384})
    serial, preempted = await answers(config, overlap=False, cancel=4)
    overlapped, preempted_too = await answers(config, overlap=True, cancel=4)
    assert preempted and preempted_too
    assert exact(overlapped) == exact(serial)
    assert logprob_values(overlapped) == pytest.approx(logprob_values(serial), abs=1e-4)


async def steps_and_host_work(config, overlap: bool, duration_s: float = 0.06) -> tuple[list, list]:
    """Three greedy streams with the forward a stand-in of `duration_s`; returns the stand-in's calls
    and, per step planned ahead (overlap) or serially, (start, end, index of the step it was built
    behind, or None) of the host work that prepared it."""
    marks: list[tuple[float, float, int | None]] = []
    async with Runtime.open(config.replace(runtime={"overlap": overlap})) as rt:
        loaded = rt.registry.require("demo")
        gen = loaded.generator
        step, ahead, plan = gen.executor.step, gen.overlap._ahead, gen._plan
        index: dict[int, int] = {}  # id(step's plan) -> its call of the stand-in (one forward a step)

        kept = []  # every step's plan, so no id is reused

        def counted_step(views, *rest):
            kept.append(views)
            index[id(views)] = len(stand_in.calls)
            return step(views, *rest)

        def timed_ahead(nursery, flight, *rest):
            t0 = time.perf_counter()
            launched = ahead(nursery, flight, *rest)
            if launched is not None:
                kept.append(flight.views)
                marks.append((t0, time.perf_counter(), id(flight.views)))
            return launched

        def timed_plan():
            t0 = time.perf_counter()
            planned = plan()
            marks.append((t0, time.perf_counter(), None))
            return planned

        gen.executor.step, gen.overlap._ahead, gen._plan = counted_step, timed_ahead, timed_plan
        with StandInForward(loaded.adapter, duration_s) as stand_in:
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(lambda i=i: rt.chat_completion(question(i), temperature=0, max_tokens=8,
                                                                      min_tokens=8))
        calls = list(stand_in.calls)
    return calls, [(t0, t1, index.get(k) if k is not None else None) for t0, t1, k in marks]


async def test_step_n_plus_one_is_prepared_while_step_n_runs(demo_config):
    config = demo_config.replace(kv_cache={"prefix_caching": False})
    calls, ahead = await steps_and_host_work(config, overlap=True)
    built = [(t0, t1, k) for t0, t1, k in ahead if k is not None]
    assert len(built) >= 5, ahead  # the decode steps, one after another
    for t0, t1, k in built:
        running = calls[k]  # the step it was queued behind
        # planned, drawn and frozen before that step's forward ended; the step itself ran after it
        assert t1 < running.end, (t0, t1, running)
        assert calls[k + 1].start >= running.end
    # serially, every plan is made between two forwards, never during one
    calls, plans = await steps_and_host_work(config, overlap=False)
    assert plans and not any(c.start < t0 < c.end or c.start < t1 < c.end for t0, t1, _ in plans for c in calls)


async def test_step_launched_ahead_is_built_off_the_compute_thread_and_gathers_its_tokens_on_the_device(demo_config):
    """A step launched ahead is built whole on the event loop (its inputs, its attention metadata,
    its sampling plan); its new tokens reach the forward as placeholders plus a device-side gather
    from the very tensor step n sampled into; the samples are unpacked on the event loop, never on
    the compute thread."""
    config = demo_config.replace(kv_cache={"prefix_caching": False}, runtime={"overlap": True})
    builds: list[tuple[str, bool, object, object]] = []  # (thread, carries, prepared, sampling)
    forwards: list[tuple[object, object]] = []  # (step's carry, the DeviceSample it made)
    unpacked_on: set[str] = set()
    async with Runtime.open(config) as rt:
        gen = rt.registry.require("demo").generator
        build, forward, unpack = gen.builder.build, gen.runner.forward, DeviceSample.unpack
        on_device = executor_module.sample_on_device

        def recorded_build(plan):
            b = build(plan)
            builds.append((threading.current_thread().name, bool(b.carry_at), b.prepared, b.sampling))
            return b

        def recorded_forward(step, *rest):
            forwards.append((step.carry, step.ids))
            return forward(step, *rest)

        def recorded_sample(*args):  # on the compute thread, in step order
            sample = on_device(*args)
            forwards.append(("sampled", sample.ids))
            return sample

        def recorded_unpack(sample):
            unpacked_on.add(threading.current_thread().name)
            return unpack(sample)

        gen.builder.build, gen.runner.forward = recorded_build, recorded_forward
        DeviceSample.unpack, executor_module.sample_on_device = recorded_unpack, recorded_sample
        try:
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(lambda i=i: rt.chat_completion(question(i), temperature=0, max_tokens=10,
                                                                      min_tokens=10))
        finally:
            DeviceSample.unpack, executor_module.sample_on_device = unpack, on_device
    ahead = [b for b in builds if b[1]]
    assert len(ahead) >= 5, builds
    for thread, _, prepared, sampling in ahead:
        assert not thread.startswith("mmserve-compute")  # built on the event loop
        assert isinstance(prepared, PagedMetadata) and sampling is not None and sampling.plan.specs
    assert unpacked_on and not any(t.startswith("mmserve-compute") for t in unpacked_on)
    # each carried token is what the step before sampled, taken from its device tensor
    carried = 0
    for k, (carry, ids) in enumerate(forwards):
        if carry is None or carry == "sampled":
            continue
        at, tokens = carry
        assert all(ids[i] == 0 for i in at.tolist())  # placeholders: the host never had the token
        before = next(s for c, s in reversed(forwards[:k]) if c == "sampled")
        assert set(tokens.tolist()) <= set(before.tolist())
        carried += 1
    assert carried >= 5


def test_samples_reach_the_host_through_the_same_path_on_the_cpu():
    """`sample_on_device` leaves the ids on the device and starts their host copy; on the CPU there
    is nothing to wait for (no event), and the results are `sample_rows`' own."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = SamplingParams(temperature=0)
    specs = [RowSpec(0, greedy, None), RowSpec(2, SamplingParams(temperature=0, logprobs=True, top_logprobs=2), None),
             RowSpec(1, greedy, None, banned=torch.tensor([int(logits[1].argmax())]))]
    sample = sample_on_device(logits, plan_sampling(specs))
    assert sample.ready is None and sample.done()
    assert sample.ids.tolist() == [int(logits[0].argmax()), int(logits[2].argmax()), int(logits[1].topk(2).indices[1])]
    assert sample.unpack()[0] == sample_rows(logits, specs)


def test_decode_staging_is_double_buffered():
    """Step n+1's fill writes the other staging set than step n's, so the host never rewrites what
    a copy still in flight reads; the device buffers hold the last fill."""
    buf = DecodeBuffers(4, 3, 1, 8, 99, torch.device("cpu"))
    buf.fill([5, 6], [[1], [2]], [0, 3], None, 2)
    first = buf._sets[0]
    buf.fill([7, 8], [[1, 4], [2]], [9, 4], None, 2)
    assert first.ids[:2].tolist() == [5, 6] and buf._sets[1].ids[:2].tolist() == [7, 8]
    assert buf.ids[:2].tolist() == [7, 8] and buf.seq_lens[:2].tolist() == [10, 5]
    buf.fill([1, 2], [[3], [3]], [1, 2], None, 2)
    assert first.ids[:2].tolist() == [1, 2] and buf._sets[1].ids[:2].tolist() == [7, 8]


class _SyncGuard(TorchDispatchMode):
    """Records every op that waits for the device's values on the host (or whose output shape
    follows them). Uploads of host data (a step's parameters) are allowed: they are no sync."""

    SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "_unique",
             "_unique2", "unique_dim", "unique_consecutive", "argwhere", "masked_scatter"}

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.SYNCS:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def test_sampling_on_the_device_never_waits_for_the_host():
    """Every sampling feature — bans, penalties, a grammar mask, temperature, top-p/k, min-p, seeds,
    logprobs and top logprobs — runs on the logits' device without a host sync; the one transfer
    is started (`DeviceSample`), not awaited."""
    torch.manual_seed(1)
    logits = torch.randn(4, 64)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=5, logprobs=True, top_logprobs=3)
    penalized = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    specs = [RowSpec(0, SamplingParams(temperature=0), None, banned=torch.tensor([3, 7])),
             RowSpec(1, seeded, make_generator(seeded)),
             RowSpec(2, penalized, None, prompt=(1, 2, 3), answer=(4, 4, 5)),
             RowSpec(3, SamplingParams(temperature=0.7, top_p=0.5), None, grammar_row=0)]
    allowed = torch.zeros(1, 64, dtype=torch.bool)
    allowed[0, 10:20] = True
    plan = plan_sampling(specs)  # the host side: before the step
    with _SyncGuard() as guard:
        sample = sample_on_device(logits, plan, allowed)
    assert not guard.syncs, guard.syncs
    sampled = sample.unpack()[0]
    assert all(isinstance(s, Sampled) for s in sampled), sampled
    assert sampled[0].token_id not in (3, 7) and 10 <= sampled[3].token_id < 20
    assert sampled[1].logprob is not None and len(sampled[1].top) == 3

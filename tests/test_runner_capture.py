"""The decode step of `generation.runner.ModelRunner` is capturable as a CUDA graph — proven on
the CPU. Its body runs under `CaptureGuard`, a TorchDispatchMode that records every op and fails
the test on any host synchronisation (`aten._local_scalar_dense`: `.item()`, `.tolist()`, `bool()`
of a tensor; `nonzero` and every op whose output shape depends on tensor values; tensors made from
Python data, which on CUDA are host->device copies; copies between devices) and on any tensor the
body reads that is not one of the static buffers, the model's weights and buffers, or the arena
(or made by the body itself). The body runs the real Triton kernels, through Triton's interpreter
on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).

Batch compositions of one bucket reuse the same buffers at the same addresses, the static path's
logits equal the eager path's, and both equal the SDPA reference: a replay with other values in
the same buffers computes the right step. The same tests run unchanged on a GPU machine, where the
runner also captures and replays the graphs (`test_cuda_graph_replay_matches_eager`)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mmserve.attention import select
from mmserve.generation.decode_graphs import DecodeGraphs, bucket_of, buckets
from mmserve.generation.runner import ModelRunner, StepInputs
from mmserve.models.loading import load_adapter
from mmserve.models.paged import Segment

triton_paged = pytest.importorskip("mmserve.attention.triton_paged")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton_paged.interpreter_ready():
    pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1 before triton is imported",
                allow_module_level=True)

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique, aten._unique2,
           aten.unique_dim, aten.unique_consecutive, aten.repeat_interleave, aten.equal, aten.is_nonzero,
           aten.item, aten.lift_fresh, aten.lift_fresh_copy, aten.masked_scatter, aten.argwhere}
"""Op packets that synchronise with the host or whose output shape follows tensor values."""


class CaptureGuard(TorchDispatchMode):
    """Records what a capturable region must not do (see the module docstring)."""

    def __init__(self, static: list[torch.Tensor]):
        super().__init__()
        self.allowed = {t.untyped_storage().data_ptr() for t in static}
        self.made: set[int] = set()
        self.violations: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if func.overloadpacket in SYNCING:
            self.violations.append(f"{func}: synchronises with the host")
        if func.overloadpacket is aten.index and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_flatten(args[1:])[0]):
            self.violations.append(f"{func}: a boolean index (output shape follows the values)")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func.overloadpacket in (aten._to_copy, aten.copy_, aten.to) and len({t.device for t in tensors}) > 1:
            self.violations.append(f"{func}: a copy between devices")
        for t in tensors:
            if t.dim() == 0:  # a Python number wrapped for the op; tensors from data are caught above
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.made and ptr not in self.allowed:
                self.violations.append(f"{func}: reads a tensor {tuple(t.shape)} {t.dtype} that is not static")
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        return out


FAMILIES = {"llava": "tiny_model_dir", "qwen2_vl": "tiny_qwen_dir"}  # 1-D positions; M-RoPE's 3 rows


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def adapter(request):
    path = request.getfixturevalue(FAMILIES[request.param])
    return load_adapter(f"capture-{request.param}", path, device=DEVICE)


def runner_for(adapter, backend: str, max_batch: int = 8) -> ModelRunner:
    return ModelRunner(adapter, 1 << 21, 4, backend, max_batch=max_batch)


def static_tensors(runner: ModelRunner) -> list[torch.Tensor]:
    lm = runner.adapter.model
    return [*runner.buffers.tensors(), *runner.kv.keys, *runner.kv.values, *lm.parameters(), *lm.buffers()]


class Conversations:
    """Sequences prefilled into a runner's arena (eager path), scattered over its blocks, then
    stepped one token at a time; their block tables grow from a shuffled free list."""

    def __init__(self, runner: ModelRunner, lengths: list[int], seed: int):
        self.runner, self.rng = runner, random.Random(seed)  # the tokens: the same for any arena
        bs = runner.block_size
        self.free = list(range(runner.kv.num_blocks))
        random.Random(seed + 1).shuffle(self.free)
        self.tables, self.lens, self.last = [], [], []
        vocab = runner.adapter.vocab_size
        for n in lengths:
            table = [self.free.pop() for _ in range(-(-(n + 40) // bs))]
            ids = tuple(self.rng.randrange(3, vocab) for _ in range(n))
            runner.forward(StepInputs(ids, (Segment(tuple(table), 0, n),), positions=self.positions(0, n)))
            self.tables.append(table)
            self.lens.append(n)
            self.last.append(ids[-1])

    def positions(self, start: int, end: int) -> torch.Tensor | None:
        if self.runner.rope_rows == 1:
            return None
        return torch.arange(start, end).expand(self.runner.rope_rows, -1)  # text-only: every row alike

    def step(self, which: list[int]) -> StepInputs:
        """The next decode step of sequences `which` (each feeds its previous token back)."""
        segs = tuple(Segment(tuple(self.tables[i]), self.lens[i], 1) for i in which)
        pos = None if self.runner.rope_rows == 1 else torch.cat([self.positions(self.lens[i], self.lens[i] + 1)
                                                                for i in which], dim=1)
        return StepInputs(tuple(self.last[i] for i in which), segs, positions=pos)

    def advance(self, which: list[int], logits: torch.Tensor) -> None:
        for i, row in zip(which, logits.argmax(-1).tolist()):
            self.lens[i] += 1
            self.last[i] = row


def test_the_guard_catches_what_capture_forbids():
    """The guard is not vacuous: a sync, a data-dependent shape, a tensor from Python data and a
    non-static input are each reported."""
    static = torch.arange(6.0)
    for bad in (lambda: static.sum().item(), lambda: static.nonzero(), lambda: static + torch.tensor([1.0]),
                lambda: static[static > 2], lambda: bool(static.max() > 1)):
        guard = CaptureGuard([static])
        with guard:
            bad()
        assert guard.violations, bad
    outside = torch.ones(6)
    guard = CaptureGuard([static])
    with guard:
        static.add(outside)
    assert any("not static" in v for v in guard.violations)
    guard = CaptureGuard([static])
    with guard:
        (static * 2).softmax(0).exp()
    assert not guard.violations


def test_buckets():
    assert buckets(1) == (1,) and buckets(8) == (1, 2, 4, 8) and buckets(12) == (1, 2, 4, 8, 12)
    assert [bucket_of(n, buckets(12)) for n in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]
    with pytest.raises(ValueError):
        bucket_of(13, buckets(12))


def test_decode_body_is_capturable(adapter):
    """Under the guard: no host sync, no input outside the static buffers, the same buffers at the
    same addresses for every composition of a bucket, and M-RoPE's rows in the position buffer."""
    runner = runner_for(adapter, "triton")
    assert runner.backend.capturable and runner.buffers is not None
    assert runner.buffers.positions.shape[0] == (3 if adapter.mrope else 1)
    convs = Conversations(runner, [5, 23, 9, 40, 17], seed=1)
    addresses = [t.data_ptr() for t in runner.buffers.tensors()]
    for which in ([0, 1, 2], [3, 4, 0, 1], [4, 2, 3], [1], [2, 0]):  # buckets 4, 4, 4, 1, 2
        step = convs.step(which)
        bucket = bucket_of(len(which), runner.buckets)
        runner.buffers.fill(step.ids, [s.block_table for s in step.segments], [s.start for s in step.segments],
                            None if step.positions is None else step.positions.numpy(), bucket)
        guard = CaptureGuard(static_tensors(runner))
        with torch.inference_mode(), guard:  # the body a capture records (run() would replay it on CUDA)
            logits = runner.graphs.body(bucket)
        assert not guard.violations, "\n".join(sorted(set(guard.violations)))
        assert guard.ops > 50 and logits.shape == (bucket, adapter.vocab_size)
        assert [t.data_ptr() for t in runner.buffers.tensors()] == addresses
        convs.advance(which, logits[:len(which)])


def test_static_decode_equals_eager_and_sdpa(adapter):
    """The same conversations stepped three ways — static buffers (triton), eager (triton), eager
    (sdpa) — give the same logits: a step that reuses the buffers with other values is right,
    padding rows included (they write only the spare scratch block)."""
    runs = {"static": runner_for(adapter, "triton"), "eager": runner_for(adapter, "triton", max_batch=1),
            "sdpa": runner_for(adapter, "sdpa")}
    runs["eager"].buffers = None  # this one takes the eager path for every step
    lengths = [7, 30, 12, 3, 21, 16]
    convs = {k: Conversations(r, lengths, seed=2) for k, r in runs.items()}
    rng = random.Random(3)
    for _ in range(6):
        which = sorted(rng.sample(range(len(lengths)), rng.randint(1, len(lengths))))
        out = {k: runs[k].forward(convs[k].step(which)) for k in runs}
        torch.testing.assert_close(out["static"], out["eager"], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out["static"], out["sdpa"], atol=2e-4, rtol=1e-4)
        for k in runs:
            convs[k].advance(which, out["static"])
    assert runs["static"].static_steps == 6 and runs["eager"].static_steps == 0


def test_steps_with_prefill_or_images_run_eagerly(adapter):
    runner = runner_for(adapter, "triton")
    convs = Conversations(runner, [6, 9], seed=4)
    before = runner.static_steps
    step = convs.step([0, 1])
    mixed = StepInputs(step.ids + (5, 6), step.segments + (Segment((40, 41, 42), 0, 2),),
                       positions=None if step.positions is None else torch.cat([step.positions, convs.positions(0, 2)], 1))
    assert runner.forward(mixed).shape == (3, adapter.vocab_size)
    assert runner.static_steps == before


def test_padding_rows_write_only_the_spare_block(adapter):
    """What a capture at load runs on — every row padding — reads nothing and writes only the
    spare scratch block: the blocks the manager hands out are untouched."""
    runner = runner_for(adapter, "triton")
    for t in (*runner.kv.keys, *runner.kv.values):
        t.zero_()  # torch.empty may hold NaN, which no comparison calls equal
    Conversations(runner, [9, 14], seed=6)
    before = [t.clone() for t in (*runner.kv.keys, *runner.kv.values)]
    with torch.inference_mode():
        # as at load: every bucket captured on padding rows (warm-ups included; nothing off CUDA)
        assert runner.capture() == (len(runner.buckets) if DEVICE == "cuda" else 0), runner.graphs.failed
        for bucket in runner.buckets:
            runner.buffers.clear(bucket)
            assert torch.isfinite(runner.graphs.run(bucket)).all()
    usable = runner.kv.num_blocks
    for old, new in zip(before, (*runner.kv.keys, *runner.kv.values)):
        assert torch.equal(old[:usable], new[:usable])


def test_sdpa_backend_has_no_static_path(adapter):
    runner = runner_for(adapter, "sdpa")
    assert runner.buffers is None and runner.graphs is None and runner.kv.scratch_slot is None


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager(adapter):
    runner = runner_for(adapter, "triton")
    eager = runner_for(adapter, "triton")
    eager.buffers = None
    convs, ref = Conversations(runner, [8, 19, 33], seed=5), Conversations(eager, [8, 19, 33], seed=5)
    for which in ([0, 1, 2], [0, 2], [1, 2, 0]):
        got, want = runner.forward(convs.step(which)), eager.forward(ref.step(which))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        convs.advance(which, got)
        ref.advance(which, got)
    assert set(runner.graphs.graphs) == {2, 4}


async def test_runtime_serves_through_the_triton_backend_as_through_sdpa(three_model_config):
    """End to end through the generator: the demo models (LLaVA and Qwen2-VL's M-RoPE) answer the
    same greedy tokens with `attention_backend = "triton"` (prefill kernel with images; decode from
    the static buffers) as with "sdpa", for concurrent requests that share a prefix."""
    import trio

    from mmserve import Runtime
    from tests.helpers import colour_question

    config = three_model_config.replace(models=tuple(m for m in three_model_config.models if m.name != "demo-wide"))
    answers = {}
    for backend in ("sdpa", "triton"):
        got = {}
        async with Runtime.open(config.replace(runtime={"attention_backend": backend})) as rt:
            async def ask(model, colour):
                c = await rt.chat_completion(colour_question(colour), model=model, max_tokens=6, temperature=0,
                                             ignore_eos=True)
                got[model, colour] = c.choices[0].text
            async with trio.open_nursery() as n:
                for model in ("demo", "demo-qwen"):
                    for colour in ("red", "blue", "green"):
                        n.start_soon(ask, model, colour)
            runner = rt.registry.require("demo").generator.runner
            assert runner.backend.name == backend
            if backend == "triton":
                assert runner.static_steps > 0
        answers[backend] = got
    assert answers["triton"] == answers["sdpa"] and all(answers["sdpa"].values())


def test_a_bucket_whose_capture_fails_decodes_eagerly(monkeypatch):
    """The bookkeeping of a failed capture (the driver refusing one, as a Qwen2-VL bucket did on an
    H100 and an H200): that bucket runs its body eagerly from then on, is never retried, and the
    others replay; the stream a failed capture leaves current is restored. The CUDA calls are
    stand-ins here: the GPU run exercises the real ones."""
    calls, current = [], ["main"]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def body(bucket):
        calls.append(bucket)
        return torch.full((bucket, 3), float(bucket))

    graphs = DecodeGraphs(body, torch.device("cuda", 0), capture=True)

    class Replayable:
        def replay(self):
            calls.append("replay")

    def capture(bucket):
        if bucket == 2:
            current[0] = "capture-stream"  # what torch.cuda.graph leaves when capture_end raises
            raise torch.AcceleratorError("CUDA error: operation failed due to a previous error during capture")
        return Replayable(), body(bucket)

    monkeypatch.setattr(graphs, "_capture", capture)
    assert graphs.capture_all((1, 2, 4), clear=lambda b: None) == 2
    assert set(graphs.graphs) == {1, 4} and list(graphs.failed) == [2] and current[0] == "main"
    assert "previous error during capture" in graphs.failed[2]
    calls.clear()
    assert graphs.run(2).shape == (2, 3) and graphs.run(4).shape == (4, 3) and graphs.run(2)[0, 0] == 2
    assert calls == [2, "replay", 2]  # the failed bucket eagerly, each time; no second capture of it


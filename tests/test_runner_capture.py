"""Every static step of `engine.runner.ModelRunner` — decode steps per batch bucket, mixed
steps (prefill chunks, image rows, decode tokens beside them) per token bucket — is capturable as
a CUDA graph: proven on the CPU. Its body runs under `CaptureGuard`, a TorchDispatchMode that records every op and fails
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

from mmserve.engine import decode_graphs
from mmserve.engine.arena import Segment
from mmserve.engine.attention import select
from mmserve.engine.decode_graphs import DecodeGraphs, bucket_of, buckets
from mmserve.engine.mixed_step import token_buckets
from mmserve.engine.runner import ModelRunner, StepInputs
from mmserve.models.loading import load_adapter

triton_paged = pytest.importorskip("mmserve.engine.attention.triton_paged")
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


TOKEN_BUCKETS = (4, 8, 16)  # few and small: the kernels run in the interpreter


def runner_for(adapter, backend: str, max_batch: int = 8) -> ModelRunner:
    return ModelRunner(adapter, 1 << 21, 4, backend, max_batch=max_batch, token_buckets=TOKEN_BUCKETS)


def static_tensors(runner: ModelRunner) -> list[torch.Tensor]:
    lm = runner.adapter.model
    return [*runner.buffers.tensors(), *runner.mixed.tensors(), *runner.kv.keys, *runner.kv.values,
            *lm.parameters(), *lm.buffers()]


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
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048) and token_buckets(40) == (16, 32, 40)
    assert token_buckets(8) == (8,)
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


def test_steps_with_prefill_run_from_the_mixed_buffers(adapter):
    runner = runner_for(adapter, "triton")
    convs = Conversations(runner, [6, 9], seed=4)
    before = runner.static_steps, runner.mixed_steps
    step = convs.step([0, 1])
    mixed = StepInputs(step.ids + (5, 6), step.segments + (Segment((40, 41, 42), 0, 2),),
                       positions=None if step.positions is None else torch.cat([step.positions, convs.positions(0, 2)], 1))
    assert runner.forward(mixed).shape == (3, adapter.vocab_size)
    assert (runner.static_steps, runner.mixed_steps) == (before[0], before[1] + 1)


def test_padding_rows_write_only_the_spare_block(adapter):
    """What a capture at load runs on — every row padding — reads nothing and writes only the
    spare scratch block: the blocks the manager hands out are untouched."""
    runner = runner_for(adapter, "triton")
    for t in (*runner.kv.keys, *runner.kv.values):
        t.zero_()  # torch.empty may hold NaN, which no comparison calls equal
    Conversations(runner, [9, 14], seed=6)
    before = [t.clone() for t in (*runner.kv.keys, *runner.kv.values)]
    with torch.inference_mode():
        # as at load: every bucket captured on padding rows (warm-ups included; nothing off CUDA).
        # The conversations' own steps may have captured a bucket already, on first use (seen on
        # an H200: 6 of 7 left to capture), so count what is captured, not what this call adds.
        captured = runner.capture()
        if DEVICE == "cuda":
            assert not runner.failed_captures, runner.failed_captures
            assert set(runner.graphs.graphs) == set(runner.buckets)
            assert set(runner.mixed_graphs.graphs) == set(runner.token_buckets)
        else:
            assert captured == 0
        for bucket in runner.buckets:
            runner.buffers.clear(bucket)
            assert torch.isfinite(runner.graphs.run(bucket)).all()
        for bucket in runner.token_buckets:  # no sequence at all: its logits rows are junk, never used
            runner.mixed.clear(bucket)
            assert runner.mixed_graphs.run(bucket).shape == (runner.mixed.seqs(bucket), adapter.vocab_size)
    usable = runner.kv.num_blocks
    for old, new in zip(before, (*runner.kv.keys, *runner.kv.values)):
        assert torch.equal(old[:usable], new[:usable])


def test_sdpa_backend_has_no_static_path(adapter):
    runner = runner_for(adapter, "sdpa")
    assert runner.buffers is None and runner.graphs is None and runner.kv.scratch_slot is None
    assert runner.mixed is None and runner.mixed_graphs is None and runner.failed_captures == {}


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



def test_a_capture_runs_with_the_collector_paused(monkeypatch):
    """Issue 38 item 4: Python's garbage collector never runs inside a capture. A collection there
    destroys dead graphs (a runner that is garbage in a cycle), which the driver forbids while the
    thread captures ("operation not permitted when stream is capturing (function reset)") and
    answers by invalidating the capture ("operation failed due to a previous error during
    capture": Qwen2-VL's buckets on the H200). The warm-ups run with it on, and it is on again
    after (also after a capture that raised). The CUDA calls are stand-ins; the GPU run (and
    `scripts/gpu_capture_probe.py`) exercises the real ones."""
    import contextlib
    import gc

    class Stand:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stand)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Stand)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stand())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    seen, fail = [], [False]

    def body(bucket):
        seen.append(gc.isenabled())
        if fail[0] and not gc.isenabled():
            raise RuntimeError("capture failed")
        return torch.zeros(bucket, 2)

    assert gc.isenabled()
    graphs = DecodeGraphs(body, torch.device("cuda", 0), capture=True)
    graph, out = graphs._capture(2)
    assert seen == [True, True, False] and gc.isenabled() and out.shape == (2, 2)
    fail[0] = True
    with pytest.raises(RuntimeError):
        graphs._capture(4)
    assert gc.isenabled()
    shared = DecodeGraphs(body, torch.device("cuda", 0), capture=True, share_pool_with=graphs)
    assert shared.pool == graphs.pool == "pool"
    gc.disable()
    try:  # a caller that had it off keeps it off
        with decode_graphs.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


# -- mixed steps: prefill chunks, image rows and decode tokens, per token bucket -------------------

MIXED_FAMILIES = {"llava": "tiny_model_dir", "qwen2_vl": "tiny_qwen_dir", "qwen3_vl": "tiny_qwen3_dir",
                  "gemma3": "tiny_gemma3_dir"}
"""1-D positions; M-RoPE's 3 rows; DeepStack's levels; sliding windows and bidirectional spans."""


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    from mmserve.models.demo import build_untrained

    return build_untrained("tiny-qwen3-vl", tmp_path_factory.mktemp("tiny-qwen3-vl"), seed=0, random_weights=True)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    from mmserve.models.demo import build_untrained

    return build_untrained("tiny-gemma3", tmp_path_factory.mktemp("tiny-gemma3") / "tiny-gemma3", seed=0,
                           random_weights=True)


@pytest.fixture(scope="module", params=sorted(MIXED_FAMILIES))
def mixed_adapter(request):
    path = request.getfixturevalue(MIXED_FAMILIES[request.param])
    return load_adapter(f"capture-mixed-{request.param}", path, device=DEVICE)


def mixed_step(convs: Conversations, decodes: list[int], chunk: int, table: tuple[int, ...], seed: int,
               start: int = 0) -> StepInputs:
    """Decode tokens of conversations `decodes`, then a prefill chunk of `chunk` new tokens of
    another sequence at [start, start + chunk) over `table`, holding an image of up to 6 rows
    (encoder-width random rows; M-RoPE: 2-D positions over it; Gemma 3: a bidirectional span)."""
    runner = convs.runner
    adapter, rng = runner.adapter, random.Random(seed)
    step = convs.step(decodes) if decodes else StepInputs((), ())
    ids = tuple(rng.randrange(3, adapter.vocab_size) for _ in range(chunk))
    image = min(6, chunk - 1)
    lo = rng.randrange(0, chunk - image + 1)  # the image's rows among the chunk's
    width = adapter.encoder_width or int(adapter.text_config.hidden_size)
    rows = torch.randn(image, width, generator=torch.Generator().manual_seed(seed)).to(DEVICE, adapter.dtype)
    offset = len(step.ids)
    positions = None
    if runner.rope_rows > 1:
        own = torch.arange(start, start + chunk).expand(runner.rope_rows, -1).clone()
        own[1, lo:lo + image] = start + lo + torch.arange(image) // 2  # an image's rows and columns
        own[2, lo:lo + image] = start + lo + torch.arange(image) % 2
        positions = torch.cat([step.positions, own], 1) if decodes else own
    spans = None
    if "gemma3" in adapter.config.model_type:
        spans = tuple(() for _ in decodes) + (((start + lo, start + lo + image),),)
    return StepInputs(step.ids + ids, step.segments + (Segment(table, start, chunk),),
                      pieces=((offset + lo, rows),) if image else (), positions=positions, spans=spans)


def fresh_table(convs: Conversations, tokens: int) -> tuple[int, ...]:
    return tuple(convs.free.pop() for _ in range(-(-tokens // convs.runner.block_size)))


def test_mixed_step_capturable_in_every_bucket(mixed_adapter):
    """For every token bucket, a mixed step — decode tokens beside a prefill chunk with an image
    (M-RoPE positions, DeepStack levels, a bidirectional span, sliding-window layers, as the family
    has them) — runs its body under the guard: no host sync, no data-dependent shape, nothing read
    outside the static buffers, the weights and the arena; the buffers keep their addresses; and
    the logits equal the eager path's for the same step (the chunk's keys rewritten identically)."""
    runner = runner_for(mixed_adapter, "triton", max_batch=4)
    assert runner.token_buckets == TOKEN_BUCKETS and runner.mixed.seqs(4) == 4 and runner.mixed.seqs(16) == 4
    assert runner.mixed.programs(16) == -(-16 // runner.mixed.tile_tokens) + 4  # the launch: the tile map's length
    # the third is longer than Gemma 3's sliding window (32): its decode tokens' windows cut keys
    convs = Conversations(runner, [5, 3, 36], seed=11)
    addresses = [t.data_ptr() for t in runner.mixed.tensors()]
    if runner.mixed.deepstack is not None:
        assert runner.mixed.deepstack.shape[0] == mixed_adapter.deepstack_levels
    for bucket, decodes, chunk in ((4, [1], 3), (8, [0, 2], 5), (16, [0, 1, 2], 11)):
        table = fresh_table(convs, chunk)
        step = mixed_step(convs, decodes, chunk, table, seed=bucket)
        assert bucket_of(len(step.ids), runner.token_buckets) == bucket
        want = runner._eager(step, "reference")  # writes the chunk's keys; the static step rewrites them
        embeds, lm_kwargs = mixed_adapter.step_inputs(step.ids, step.pieces)
        runner.mixed.fill(step.segments, embeds[0], None if step.positions is None else step.positions.numpy(),
                          step.spans, bucket)
        if lm_kwargs.get("deepstack_visual_embeds"):
            runner.mixed.fill_deepstack(step.pieces, lm_kwargs["deepstack_visual_embeds"])
        guard = CaptureGuard(static_tensors(runner))
        with torch.inference_mode(), guard:  # the body a capture records (run() replays it on CUDA)
            logits = runner.mixed_graphs.body(bucket)
        assert not guard.violations, "\n".join(sorted(set(guard.violations)))
        assert guard.ops > 50 and logits.shape == (4, mixed_adapter.vocab_size)
        assert [t.data_ptr() for t in runner.mixed.tensors()] == addresses
        torch.testing.assert_close(logits[:len(step.segments)], want, atol=2e-5, rtol=1e-5)
        convs.advance(decodes, want[:len(decodes)])


def test_static_mixed_steps_equal_eager_steps(mixed_adapter):
    """Two runners step the same sequences — one through the static buffers (`forward`: every
    step here fits a token bucket), one eagerly — through prefill chunks with images (a prefix-hit
    chunk that starts mid-sequence among them), decode tokens beside them, and pure decode steps:
    the same logits at every step, the same keys in the arena, so replays with other values in the
    same buffers are right."""
    runs = {"static": runner_for(mixed_adapter, "triton", max_batch=4),
            "eager": runner_for(mixed_adapter, "triton", max_batch=4)}
    runs["eager"].buffers = None  # every step eagerly
    for r in runs.values():
        for t in (*r.kv.keys, *r.kv.values):
            t.zero_()  # the blocks no step writes: equal too
    convs = {k: Conversations(r, [6, 4], seed=21) for k, r in runs.items()}
    plan = [([0, 1], 8, 0), ([1], 5, 8), ([0, 1], 3, 13)]  # decodes, chunk, start
    tables = [fresh_table(convs["static"], 16)]
    for k in runs:
        convs[k].free = [b for b in convs[k].free if b not in {b for t in tables for b in t}]
    for i, (decodes, chunk, start) in enumerate(plan):
        table = tables[0]
        out = {k: runs[k].forward(mixed_step(convs[k], decodes, chunk, table, seed=30 + i, start=start))
               for k in runs}
        torch.testing.assert_close(out["static"], out["eager"], atol=2e-5, rtol=1e-5)
        for k in runs:
            convs[k].advance(decodes, out["static"][:len(decodes)])
    assert runs["static"].mixed_steps == len(plan) + 2 and runs["eager"].mixed_steps == 0
    for a, b in zip(runs["static"].kv.keys, runs["eager"].kv.keys):
        n = runs["static"].kv.num_blocks
        torch.testing.assert_close(a[:n], b[:n], atol=2e-5, rtol=1e-5)


def test_steps_past_the_largest_bucket_run_eagerly_and_are_counted(mixed_adapter):
    runner = runner_for(mixed_adapter, "triton", max_batch=2)
    convs = Conversations(runner, [3, 5], seed=41)  # two prefills from the mixed buffers
    assert runner.mixed_steps == 2 and not runner.eager_reasons
    big = mixed_step(convs, [0], 16, fresh_table(convs, 16), seed=42)  # 17 tokens > 16
    assert runner.forward(big).shape == (2, mixed_adapter.vocab_size)
    three = mixed_step(convs, [0, 1], 2, fresh_table(convs, 2), seed=43)  # 3 sequences > max_batch
    runner.forward(three)
    wants = StepInputs(three.ids, three.segments, three.pieces, three.positions, torch.tensor([3]), three.spans)
    assert runner.forward(wants).shape == (4, mixed_adapter.vocab_size)
    assert runner.eager_reasons == {"too_many_tokens": 1, "too_many_sequences": 1, "prompt_logprobs": 1}
    assert runner.mixed_steps == 2


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_of_mixed_steps_matches_eager(mixed_adapter):
    runner, eager = runner_for(mixed_adapter, "triton", max_batch=4), runner_for(mixed_adapter, "triton", max_batch=4)
    eager.buffers = None
    with torch.inference_mode():
        assert runner.capture() == len(runner.buckets) + len(runner.token_buckets), runner.failed_captures
    convs, ref = Conversations(runner, [8, 19], seed=51), Conversations(eager, [8, 19], seed=51)
    table = fresh_table(convs, 32)
    ref.free = [b for b in ref.free if b not in table]
    for i, (decodes, chunk) in enumerate((([0, 1], 12), ([1], 5))):
        start = 0 if i == 0 else 12
        got = runner.forward(mixed_step(convs, decodes, chunk, table, seed=60 + i, start=start))
        want = eager.forward(mixed_step(ref, decodes, chunk, table, seed=60 + i, start=start))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        convs.advance(decodes, got[:len(decodes)])
        ref.advance(decodes, got[:len(decodes)])
    assert set(runner.mixed_graphs.graphs) == set(TOKEN_BUCKETS)

"""The vision towers of fixed-shape families (LLaVA's CLIP, Gemma 3's SigLIP, Idefics3's SigLIP
tiles) run from static buffers per view-count bucket (`engine.vision_step`; issue 38 item 1):
proven capturable on the CPU under `CaptureGuard` (tests/test_runner_capture.py: no host sync, no
data-dependent shape, nothing read outside the static buffers and the weights), with buffers at
fixed addresses, outputs equal to the eager tower's (`torch.equal` on the CPU: a view's rows depend on
that view alone, so padding changes no real row's arithmetic — poisoned padding proves it), calls past
the largest bucket split, and the runtime's answers the same with the static tower as without. The
same tests run on a GPU, where the buckets are also captured as CUDA graphs and replayed."""

from __future__ import annotations

import pytest
import torch

from mmserve.config import Config, ModelConfig
from mmserve.config.sections import RuntimeConfig
from mmserve.engine.vision_step import StaticVision, VisionPath, image_buckets, image_buckets_for
from mmserve.models.fixed_tower import TowerViews
from mmserve.models.idefics3 import Idefics3Pixels
from mmserve.models.loading import load_adapter
from tests.conftest import on_device
from tests.test_runner_capture import DEVICE, CaptureGuard

FAMILIES = ("gemma3", "idefics3", "llava")
PRESETS = {"llava": "tiny", "gemma3": "tiny-gemma3", "idefics3": "tiny-idefics3"}
BUCKETS = (1, 2, 4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from mmserve.models.demo import build_untrained

    return {family: build_untrained(preset, tmp_path_factory.mktemp(preset) / preset, seed=0, random_weights=True)
            for family, preset in PRESETS.items()}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, checkpoints):
    return request.param, load_adapter(f"vision-{request.param}", checkpoints[request.param], device=DEVICE)


def items_of(adapter, family: str, n: int, seed: int) -> list:
    """`n` pixel items of the family: random pixels (Gemma 3: the second item with two crops;
    Idefics3: 2 tiles and a global view each; for an even `seed` the global views' pixel masks are
    padded on the right, as a wide image's — the eager tower then builds its attention mask, else
    it skips it, which the static body never does)."""
    g = torch.Generator().manual_seed(seed)
    c, h, w = adapter.fixed_tower().view_shape
    if family == "llava":
        return list(torch.randn(n, c, h, w, generator=g))
    if family == "gemma3":
        return [torch.randn(3 if i == 1 else 1, c, h, w, generator=g) for i in range(n)]
    out = []
    for _ in range(n):
        views = torch.randn(3, c, h, w, generator=g)
        mask = torch.ones(3, h, w, dtype=torch.bool)
        if seed % 2 == 0:
            mask[2, :, w // 2:] = False
            views[2, :, :, w // 2:] = 0
        out.append(Idefics3Pixels(views, mask, (1, 2)))
    return out


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise on the CPU; on CUDA within fp32 noise (cuBLAS and cuDNN may pick another kernel for
    another batch size: another summation order, never another view's values)."""
    if DEVICE == "cpu":
        assert got.shape == want.shape and torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def static_tensors(static: StaticVision, adapter) -> list[torch.Tensor]:
    return [*static.buffers.tensors(), *adapter.model.parameters(), *adapter.model.buffers()]


def test_vision_step_capturable_in_every_bucket(family):
    """For every bucket, the tower's body over the static buffers — real views in the first rows,
    padding after — runs under the guard: no host sync, no data-dependent shape, nothing read
    outside the buffers and the weights; the buffers keep their addresses for every view count,
    and the real rows equal the same body run on those views alone, unpadded."""
    name, adapter = family
    static = StaticVision(adapter.fixed_tower(), (1, 2, 4, 8), adapter.device, adapter.dtype, capture=False)
    addresses = [t.data_ptr() for t in static.buffers.tensors()]
    for bucket, n in ((1, 1), (2, 2), (4, 3), (8, 5)):
        views = TowerViews(torch.randn(n, *static.tower.view_shape, generator=torch.Generator().manual_seed(n)))
        h = static.tower.view_shape[1]
        if static.tower.masked:
            mask = torch.ones(n, *static.tower.view_shape[1:], dtype=torch.bool)
            mask[0, h // 2:] = False  # the first view padded at the bottom
            views = TowerViews(views.pixels, mask)
        static.buffers.fill(views, bucket)
        guard = CaptureGuard(static_tensors(static, adapter))
        with torch.inference_mode(), guard:  # the body a capture records (run() replays it on CUDA)
            rows = static.body(bucket)
        assert not guard.violations, "\n".join(sorted(set(guard.violations)))
        assert guard.ops > 30 and rows.shape[0] == bucket
        assert [t.data_ptr() for t in static.buffers.tensors()] == addresses
        with torch.inference_mode():
            want = static.tower.body(views.pixels.to(adapter.device, adapter.dtype),
                                     None if views.mask is None else views.mask.to(adapter.device))
        assert_same(rows[:n], want)


def test_padding_rows_never_reach_real_rows(family):
    """Rows past the call's views hold whatever the last call or a poisoning left there (NaN here):
    the real rows are bitwise the same, and finite — no op of the tower mixes views."""
    name, adapter = family
    static = StaticVision(adapter.fixed_tower(), BUCKETS, adapter.device, adapter.dtype, capture=False)
    views = static.tower.views(items_of(adapter, name, 1, seed=2))
    bucket = 4
    static.buffers.fill(TowerViews(views.pixels[:1], None if views.mask is None else views.mask[:1]), bucket)
    with torch.inference_mode():
        clean = static.body(bucket)[:1].clone()
        static.buffers.pixels[1:bucket] = float("nan")
        if static.buffers.mask is not None:
            static.buffers.mask[1:bucket] = False  # every patch padding: its attention is all -inf
        poisoned = static.body(bucket)
    assert torch.equal(poisoned[:1], clean) and torch.isfinite(clean).all()


def test_static_outputs_equal_eager_outputs(family):
    """Encoder calls of 1 to 5 items through the static path (buckets 1, 2, 4: calls of more views
    split into runs of 4 and the rest) give the eager tower's outputs (transformers' own
    `get_image_features`; bitwise on the CPU), fresh tensors (never a view of a buffer a later call
    rewrites), counted per bucket."""
    name, adapter = family
    path = VisionPath(adapter, BUCKETS, cuda_graphs=DEVICE == "cuda")
    assert path.static is not None
    outputs = []
    for n in range(1, 6):
        items = items_of(adapter, name, n, seed=n)
        got, want = path.encode(items), adapter.encode_images(items)
        assert len(got) == len(want) == n
        for g, w in zip(got, want):
            assert_same(g, w)
        outputs.append((got, [g.clone() for g in got]))
    for got, then in outputs:  # later calls replayed the same buffers: earlier outputs unchanged
        assert all(torch.equal(g, t) for g, t in zip(got, then))
    views_per_call = [path.static.tower.views(items_of(adapter, name, n, seed=n)).pixels.shape[0] for n in range(1, 6)]
    assert path.static.oversized_calls == sum(v > 4 for v in views_per_call)
    assert sum(path.static_runs.values()) == sum(-(-v // 4) for v in views_per_call)
    assert set(path.static_runs) <= set(BUCKETS) and not path.eager_reasons


def test_without_buckets_the_tower_stays_eager(family):
    name, adapter = family
    off = VisionPath(adapter)  # no buckets: the default off CUDA
    items = items_of(adapter, name, 2, seed=9)
    assert off.static is None and not off.captures and off.capture() == 0
    assert all(torch.equal(a, b) for a, b in zip(off.encode(items), adapter.encode_images(items)))
    assert off.eager_reasons == {"static_off": 1} and not off.static_runs


def test_views_of_another_size_take_the_eager_tower(checkpoints):
    """A processor set to another resolution than the tower's: the static path hands the call to the
    eager tower (which refuses it, as it always did), counted as `view_shape`."""
    adapter = load_adapter("vision-llava-size", checkpoints["llava"], device=DEVICE)
    path = VisionPath(adapter, BUCKETS)
    c, h, w = path.static.tower.view_shape
    with pytest.raises(ValueError, match="size"):
        path.encode([torch.randn(c, 2 * h, 2 * w)])
    assert path.eager_reasons == {"view_shape": 1} and not path.static_runs


def test_a_family_whose_views_change_shape_stays_eager(tiny_qwen_dir):
    """Qwen2-VL's native-resolution patches: no fixed tower, so buckets or not its tower is eager."""
    from PIL import Image

    qwen = load_adapter("vision-qwen", tiny_qwen_dir, device=DEVICE)
    dynamic = VisionPath(qwen, BUCKETS)
    assert qwen.fixed_tower() is None and dynamic.static is None and not dynamic.captures
    item = qwen.pixel_values([Image.new("RGB", (40, 30), "red")])
    assert torch.equal(dynamic.encode(item)[0], qwen.encode_images(item)[0])
    assert dynamic.eager_reasons == {"dynamic_shapes": 1}


def test_image_buckets_config():
    assert image_buckets(8) == (1, 2, 4, 8) and image_buckets(6) == (1, 2, 4, 6) and image_buckets(1) == (1,)
    assert image_buckets_for((), "cuda:0", 8) == (1, 2, 4, 8) and image_buckets_for((), "cpu", 8) == ()
    assert image_buckets_for((3, 1), "cpu", 8) == (3, 1)
    assert RuntimeConfig(graph_image_buckets=[4, 1, 4]).graph_image_buckets == (1, 4)
    for bad in ([0], 4, [2, True], [1.5]):
        with pytest.raises(ValueError, match="graph_image_buckets"):
            RuntimeConfig(graph_image_buckets=bad)
    with pytest.raises(ValueError, match="positive"):
        StaticVision(None, (), torch.device("cpu"), torch.float32, capture=False)


async def test_runtime_answers_the_same_with_the_static_tower(checkpoints):
    """Each fixed-shape family's model answers the same greedy tokens to concurrent image requests
    (one to three images a request: encoder calls of several views, split past the largest bucket)
    with `graph_image_buckets = [1, 2]` as with the eager tower, and /metrics says which path ran."""
    import trio
    from prometheus_client.parser import text_string_to_metric_families

    from mmserve import Runtime
    from mmserve.models.demo import render_image
    from tests.helpers import image_part

    def question(i: int) -> list[dict]:
        colours = ("red", "blue", "green")[:1 + i % 3]
        images = [render_image(c, "circle", seed=i, size=(48 + 8 * i, 40)) for c in colours]
        return [{"role": "user", "content": [*map(image_part, images), {"type": "text", "text": "colour?"}]}]

    for name, path in sorted(checkpoints.items()):
        answers, samples = {}, {}
        for buckets in ((), (1, 2)):
            config = on_device(Config(models=(ModelConfig(name, str(path), default=True),))).replace(
                runtime={"graph_image_buckets": list(buckets)}, encoder_cache={"batch_wait_ms": 50.0})
            got = {}
            async with Runtime.open(config) as rt:
                async def ask(i):
                    c = await rt.chat_completion(question(i), model=name, max_tokens=5, temperature=0,
                                                 ignore_eos=True)
                    got[i] = c.choices[0].text
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(ask, i)
                text = rt.metrics.render().decode()
            answers[buckets] = got
            samples[buckets] = {(s.name, tuple(sorted(s.labels.items()))): s.value
                                for f in text_string_to_metric_families(text) for s in f.samples
                                if s.name.startswith("mmserve:encoder_") and s.labels.get("model_name") == name}
        assert answers[()] == answers[(1, 2)] and len(answers[()]) == 4, name
        eager = {k[1]: v for k, v in samples[()].items() if k[0] == "mmserve:encoder_eager_runs_total"}
        static = {k[1]: v for k, v in samples[(1, 2)].items() if k[0] == "mmserve:encoder_static_runs_total"}
        if DEVICE == "cpu":
            assert eager and all(dict(labels)["reason"] == "static_off" for labels in eager), name
        assert static and sum(static.values()) > 0, name
        assert not any(k[0] == "mmserve:encoder_eager_runs_total" for k in samples[(1, 2)]), name
        split = sum(v for k, v in samples[(1, 2)].items() if k[0] == "mmserve:encoder_split_calls_total")
        assert split >= 1, name  # the three images of request 2 (Idefics3: their tiles) in a call: more than 2 views


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_of_the_tower_matches_eager(family):
    name, adapter = family
    path = VisionPath(adapter, BUCKETS, cuda_graphs=True)
    assert path.captures and path.capture() == len(BUCKETS), path.failed_captures
    for n in (1, 3, 5):
        items = items_of(adapter, name, n, seed=40 + n)
        for g, w in zip(path.encode(items), adapter.encode_images(items)):
            assert_same(g, w)
    assert set(path.static.graphs.graphs) == set(BUCKETS)

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two pytest-xdist workers share the two cores of the machine the suite is sized for: each test
# process, and every server it starts, gets one torch thread unless it asks for more (tests about
# thread counts do), or their OpenMP teams oversubscribe the cores and timed tests starve. Set before
# torch is imported: its default count comes from it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# Triton's interpreter is chosen when triton is first imported (transformers' model classes import
# torch._dynamo, which imports triton), so it is chosen here, before anything else: without a GPU,
# tests/test_triton_attention.py runs the paged Triton kernels on CPU tensors through it. Nothing
# else uses triton; subprocesses inherit the variable harmlessly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mmserve.logs import configure_logging
from mmserve.models.demo import build_untrained, checkpoint_dir
from mmserve.config import Config, ModelConfig

configure_logging("json", "info")

DEVICE = os.environ.get("MMSERVE_TEST_DEVICE", "cpu")
"""The device the runtime fixtures serve on (`MMSERVE_TEST_DEVICE=cuda` on a GPU machine; CI: cpu)."""


# The suite's KV arenas are a fixed size (the default before "auto"): answers and preemptions must
# not depend on the memory this machine has free, and a process holding many runtimes must not
# reserve half the machine for each (fork, for redis-server or a CLI, then fails with ENOMEM).
TEST_KV_BUDGET_BYTES = 256 << 20


def on_device(config: Config) -> Config:
    config = config.replace(kv_cache={"budget_bytes": TEST_KV_BUDGET_BYTES})
    return config if DEVICE == "cpu" else config.replace(runtime={"device": DEVICE})


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight tiny LLaVA checkpoint (for plumbing tests that do not need answers)."""
    return build_untrained("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory):
    """A random-weight tiny Qwen2-VL checkpoint (M-RoPE, dynamic image sizes)."""
    from mmserve.models.demo.qwen import build_untrained_qwen

    return build_untrained_qwen("tiny-qwen", tmp_path_factory.mktemp("tiny-qwen"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen25_dir(tmp_path_factory):
    """A random-weights tiny Qwen2.5-VL directory, as `mmserve make-model --random-weights --preset
    tiny-qwen2.5-vl` writes it (window attention in the vision tower, M-RoPE, dynamic image sizes;
    the output rows of tokens that are not text, EOS and the image pad among them, zeroed)."""
    return build_untrained("tiny-qwen2.5-vl", tmp_path_factory.mktemp("tiny-qwen2.5-vl"), seed=0, random_weights=True)


@pytest.fixture(scope="session")
def tiny_config(tiny_model_dir) -> Config:
    return on_device(Config(models=(ModelConfig("tiny", str(tiny_model_dir), default=True),)))


def _demo_dir(name: str) -> str:
    """The committed checkpoint, or (to try a retrained one before committing it) the directory
    `$MMSERVE_TEST_DEMO_ROOT/<name>`."""
    root = os.environ.get("MMSERVE_TEST_DEMO_ROOT")
    return str(Path(root) / name) if root else str(checkpoint_dir(name))


@pytest.fixture(scope="session")
def demo_config() -> Config:
    """Both trained demo models, `demo` the default."""
    return on_device(Config(models=(
        ModelConfig("demo", _demo_dir("demo"), default=True),
        ModelConfig("demo-wide", _demo_dir("demo-wide")),
    )))


@pytest.fixture(scope="session")
def three_model_config(demo_config) -> Config:
    """`demo`, `demo-wide` and the Qwen2-VL `demo-qwen` (dynamic image sizes, M-RoPE)."""
    return demo_config.replace(models=(*demo_config.models, ModelConfig("demo-qwen", _demo_dir("demo-qwen"))))


@pytest.fixture(scope="session")
def demo_server(demo_config):
    from tests.helpers import ServerThread

    with ServerThread(demo_config) as server:
        yield server


@pytest.fixture(autouse=True, scope="session")
def _gc_freeze_only_where_asked():
    """A model load with `[runtime] gc_freeze` (the default) walks the whole heap once before
    freezing it: ~0.3 s in this process, and the suite opens hundreds of runtimes (the suite took
    563 s with it, against ~350 s). So loads here skip that step; tests/test_gc_heap.py asks for the
    real one (its `gc_freeze` fixture) and checks what it does."""
    from mmserve.runtime import gc_heap

    real = gc_heap.settle
    gc_heap.settle = lambda: {}
    yield real
    gc_heap.settle = real

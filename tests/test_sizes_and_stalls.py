"""A real checkpoint works with the defaults (issue 44): the dtype and the KV arena are sized from
the checkpoint and the machine ("auto"), a prompt the arena cannot hold is refused before its
images are encoded, a slow forward is not taken for a hung one, and every load is logged."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import structlog
import torch

from mmserve import Runtime
from mmserve.config import Config, ModelConfig
from mmserve.errors import BadRequest
from mmserve.models.demo import render_image
from mmserve.runtime.sizing import CPU_AUTO_MAX_BYTES, checkpoint_dtype, choose_dtype, kv_budget
from tests.conftest import on_device
from tests.helpers import ask


def _checkpoint(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("config, own", [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),
    ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"),
    ({"dtype": "int8"}, None),
    ({}, None),
])
def test_the_checkpoint_names_its_dtype(tmp_path, config, own):
    assert checkpoint_dtype(_checkpoint(tmp_path, **config)) == own


def test_auto_dtype_is_the_checkpoints_where_the_cpu_runs_it(tmp_path):
    assert choose_dtype("auto", _checkpoint(tmp_path, dtype="bfloat16"), "cpu").value == "bfloat16"
    # float16 matmuls are emulated on most CPUs: float32 instead, and the reason says so
    half = choose_dtype("auto", _checkpoint(tmp_path, dtype="float16"), "cpu")
    assert half.value == "float32" and "float16" in half.why
    assert choose_dtype("auto", _checkpoint(tmp_path), "cpu").value == "float32"
    assert choose_dtype("float16", _checkpoint(tmp_path, dtype="bfloat16"), "cpu").value == "float16"


def test_auto_budget_is_a_fraction_of_what_is_left_capped_at_full_contexts():
    config = Config().replace(kv_cache={"memory_fraction": 0.25}, generator={"max_running_requests": 4})
    block = 1 << 20  # 1 MiB per 16-token block
    small = kv_budget(config, "cpu", block, context_tokens=1024, left=512 << 20)
    assert small.value == 128 << 20 and "memory_fraction = 0.25" in small.why
    # 4 sequences of 1024 tokens need 256 blocks: more would only ever hold cached prefixes
    capped = kv_budget(config, "cpu", block, context_tokens=1024, left=64 << 30)
    assert capped.value == 4 * 64 * block and "max_running_requests" in capped.why
    assert kv_budget(config, "cpu", block, 1024, left=0).value == block  # at least one block
    # on the CPU at most CPU_AUTO_MAX_BYTES (RAM is shared with the host); a GPU's fraction is its own
    roomy = config.replace(generator={"max_running_requests": 4096})
    ram = kv_budget(roomy, "cpu", block, context_tokens=1024, left=64 << 30)
    assert ram.value == CPU_AUTO_MAX_BYTES and "on the CPU" in ram.why
    fixed = config.replace(kv_cache={"budget_bytes": 12345})
    assert kv_budget(fixed, "cpu", block, 1024, left=64 << 30).value == 12345


async def test_the_implied_default_loads_at_start_and_the_load_says_what_it_chose(tiny_model_dir):
    # one [[models]] table without `default = true`: the default all the same, loaded at start
    config = on_device(Config(models=(ModelConfig("tiny", str(tiny_model_dir)),))).replace(
        kv_cache={"budget_bytes": "auto"})  # the defaults (the suite fixes its arenas' size)
    assert config.runtime.dtype == "auto" and config.kv_cache.budget_bytes == "auto"
    with structlog.testing.capture_logs() as logs:
        async with Runtime.open(config) as rt:
            assert "tiny" in rt.registry.loaded
            kv = rt.registry.loaded["tiny"].generator.runner.kv
    events = [e["event"] for e in logs]
    assert events.index("registry.model_loading") < events.index("registry.model_loaded") \
        < events.index("runtime.started")
    loaded = next(e for e in logs if e["event"] == "registry.model_loaded")
    assert loaded["dtype"] == "float32" and loaded["dtype_from"].startswith("auto")  # the checkpoint's own
    assert loaded["kv_tokens"] == kv.num_blocks * kv.block_size and loaded["kv_budget_from"].startswith("auto")


async def test_a_prompt_longer_than_the_arena_is_refused_before_its_image_is_encoded(tiny_config):
    # 2 blocks of 8 tokens: the one-image prompt (29 tokens) cannot be held
    config = tiny_config.replace(kv_cache={"budget_bytes": 1, "block_size": 8})
    async with Runtime.open(config) as rt:
        tokens = rt.registry.loaded["tiny"].generator.runner.kv.num_blocks * 8
        with pytest.raises(BadRequest) as refused:
            await rt.chat_completion(ask(render_image("red", "circle", seed=1)), max_tokens=4)
        assert rt.registry.loaded["tiny"].encoder.stats()["items_encoded"] == 0
    message = refused.value.message
    assert f"holds {tokens} tokens" in message and "[kv_cache] budget_bytes" in message
    assert "the prompt needs 30 tokens" in message and refused.value.code == "context_length_exceeded"


async def test_a_slow_forward_is_not_a_stalled_one(tiny_config):
    # every layer of the model (vision tower and decoder) takes 0.3 s: each forward lasts over
    # the 0.55 s stall limit, but a layer starts every 0.3 s — slow, not hung (0.25 s is left for
    # what runs between two layers' starts: a step's end and the next one's start, on a busy machine)
    config = tiny_config.replace(supervisor={"stall_timeout_s": 0.55, "restart_backoff_s": 0.05})
    async with Runtime.open(config) as rt:
        model = rt.registry.loaded["tiny"].adapter.model
        layers = [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]
        assert rt.registry.loaded["tiny"].adapter.kv_layers * 0.3 > 0.55  # the decoder's forward
        hooks = [layer.register_forward_pre_hook(lambda *_: time.sleep(0.3)) for layer in layers]
        try:
            answer = await rt.chat_completion(ask(render_image("red", "circle", seed=1)), max_tokens=2)
        finally:
            for h in hooks:
                h.remove()
        assert answer.usage.completion_tokens == 2
        assert not any(s.restarts for s in rt.supervisor.states.values())


@pytest.mark.slow
async def test_a_real_shape_checkpoint_answers_an_image_request_with_the_defaults(tmp_path):
    """SmolVLM-2B's shape (random weights, drawn at load) with nothing configured but the model: it
    loads in its own bfloat16, its arena is sized from the memory left, and one image request (1,427
    prompt tokens: 17 tiles through a 400M vision tower, then a 1.7B prefill) is answered on a
    2-core CPU — minutes, each layer well inside the 30 s stall limit."""
    from mmserve.models.demo import build_untrained

    path = build_untrained("smolvlm-2b", tmp_path / "smolvlm-2b", seed=0, random_weights=True)
    config = Config(models=(ModelConfig("smolvlm", str(path)),))  # every other key its default
    async with Runtime.open(config) as rt:
        loaded = rt.registry.loaded["smolvlm"]
        assert loaded.adapter.dtype == torch.bfloat16
        kv = loaded.generator.runner.kv
        assert kv.num_blocks * kv.block_size > 1429  # the one-image prompt fits the auto-sized arena
        answer = await rt.chat_completion(ask(render_image("red", "circle", seed=1)), max_tokens=1)
    assert answer.usage.completion_tokens == 1 and answer.usage.prompt_tokens > 1000
    assert not any(s.restarts for s in rt.supervisor.states.values())


def _available_gib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2**20


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/meminfo").exists() or _available_gib() < 17,
                    reason="a 7B checkpoint in bfloat16 needs ~16 GiB of free memory")
async def test_a_7b_checkpoint_answers_an_image_request_with_the_defaults(tmp_path, capsys):
    """Qwen2.5-VL-7B's shape (random weights, drawn at load: 8.3B parameters, 15.5 GiB in bfloat16)
    with nothing configured but the model, on a 2-core CPU: it loads in bfloat16, its arena is sized
    from what memory is left, and one image request is answered (minutes: every layer's heartbeat
    keeps the 30 s stall limit from taking slow for dead)."""
    from mmserve.models.demo import build_untrained

    path = build_untrained("qwen2.5-vl-7b", tmp_path / "qwen2.5-vl-7b", seed=0, random_weights=True)
    config = Config(models=(ModelConfig("q7", str(path)),))  # every other key its default
    t0 = time.monotonic()
    async with Runtime.open(config) as rt:
        loaded_s = time.monotonic() - t0
        loaded = rt.registry.loaded["q7"]
        assert loaded.adapter.dtype == torch.bfloat16
        kv = loaded.generator.runner.kv
        t1 = time.monotonic()
        photo = render_image("red", "circle", seed=1, size=(448, 448))  # 256 image tokens
        answer = await rt.chat_completion(ask(photo), max_tokens=2)
        answered_s = time.monotonic() - t1
    with capsys.disabled():
        print(f"\nqwen2.5-vl-7b shape, defaults: loaded in {loaded_s:.0f} s, arena {kv.num_blocks * kv.block_size} "
              f"tokens; {answer.usage.prompt_tokens} prompt tokens answered in {answered_s:.0f} s")
    assert answer.usage.completion_tokens == 2 and answer.usage.prompt_tokens > 256
    assert not any(s.restarts for s in rt.supervisor.states.values())

"""`mmserve bench --device / --dtype / --random-weights`: the options reach mmserve's runtime config
(embedded and the server's TOML), the baselines load the same weights on the same device and dtype,
and the report says where it ran. On the CPU: CUDA itself is for the GPU session."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from mmserve.bench import PARAMS, run_bench
from mmserve.bench.baselines import SuffixPrefill, hf_baseline, release_device_memory, sync
from mmserve.bench.context import Bench
from mmserve.bench.model import MARKER, default_model_dir, ensure_model, uses_random_weights
from mmserve.bench.params import CPU_KV_BUDGET_MIB, CUDA_KV_BUDGET_MIB
from mmserve.bench.servers import bench_config, config_toml
from mmserve.cli import build_parser, device_options, main as cli
from mmserve.config import load_config
from mmserve.models.demo.build import PRESETS
from mmserve.models.random_weights import is_random_weights
from mmserve.runtime import runtime as runtime_module


def test_cli_parses_the_gpu_run():
    args = build_parser().parse_args(["bench", "--device", "cuda", "--dtype", "bfloat16", "--preset", "llava-7b"])
    assert (args.device, args.dtype, args.preset, args.random_weights) == ("cuda", "bfloat16", "llava-7b", False)
    args = build_parser().parse_args(["bench", "--random-weights", "--kv-budget-mib", "512"])
    assert args.random_weights and args.kv_budget_mib == 512 and (args.device, args.dtype) == (None, None)
    opts = device_options(args)
    assert opts == {"device": "cpu", "dtype": "float32", "random_weights": True, "kv_budget_mib": 512}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--dtype", "float64"])


def test_the_gpu_parameter_set():
    from mmserve.bench.params import PARAMS

    gpu = PARAMS["gpu"]
    assert (gpu.preset, gpu.device, gpu.dtype, gpu.levels, gpu.batched_levels) == (
        "llava-7b", "cuda", "bfloat16", (1, 8, 32), (8, 32))
    args = build_parser().parse_args(["bench", "--params", "gpu", "--dtype", "float16"])
    if torch.cuda.is_available():
        assert device_options(args, gpu)["device"] == "cuda" and device_options(args, gpu)["dtype"] == "float16"
    else:
        with pytest.raises(ValueError, match="no CUDA device"):
            device_options(args, gpu)


@pytest.mark.parametrize("name", [n for n, p in PARAMS.items() if p.preset in PRESETS])
def test_the_retention_arena_holds_its_requests_in_flight(name):
    """The retention run's arena holds `retention_concurrency` one-image requests at once: the GPU
    set's 256 MiB held less than one of llava-7b's (0.5 MiB a token) and its first request was
    refused on the H200 (2026-11-28)."""
    p = PARAMS[name]
    preset = PRESETS[p.preset]
    head_dim = preset.text_hidden // preset.text_heads
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[p.dtype]
    per_token = 2 * preset.text_layers * preset.text_kv_heads * head_dim * item  # K and V, every layer
    request = preset.num_image_tokens + 64 + p.retention_tokens  # the image, the chat template and question
    budget = p.retention_kv_budget_bytes or p.kv_budget_bytes()
    assert budget >= p.retention_concurrency * request * per_token, (name, budget // per_token)


def test_cli_refuses_bad_devices(tmp_path, capsys):
    out = str(tmp_path / "b")
    assert cli(["bench", "--params", "test", "--device", "gpu", "--out", out]) == 2
    assert "[runtime] device" in capsys.readouterr().err
    assert cli(["bench", "--params", "test", "--random-weights", "--model-dir", out, "--out", out]) == 2
    if not torch.cuda.is_available():
        assert cli(["bench", "--params", "test", "--device", "cuda", "--out", out]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_device_and_dtype_reach_the_runtime_config_and_the_server_toml(tmp_path):
    config = bench_config(tmp_path, threads=4, prefix=True, encoder=False, device="cuda", dtype="bfloat16",
                          kv_budget_bytes=8 << 30)
    assert (config.runtime.device, config.runtime.dtype, config.runtime.torch_threads) == ("cuda", "bfloat16", 4)
    assert config.kv_cache.budget_bytes == 8 << 30 and config.kv_cache.prefix_caching
    toml = config_toml(config)
    assert 'device = "cuda"' in toml and 'dtype = "bfloat16"' in toml
    (tmp_path / "c.toml").write_text(toml)
    assert load_config(tmp_path / "c.toml") == config
    default = bench_config(tmp_path, threads=2)
    assert (default.runtime.device, default.runtime.dtype) == ("cpu", "float32")
    assert default.kv_cache.budget_bytes == load_config(None).kv_cache.budget_bytes


def test_bench_params_plumb_into_its_configs(tmp_path):
    model = ensure_model(tmp_path / "m", "tiny", random_weights=True)
    params = replace(PARAMS["test"], device="cuda:1", dtype="float16")
    config = Bench(params, model, tmp_path, note=lambda _: None).config(prefix=False)
    assert (config.runtime.device, config.runtime.dtype) == ("cuda:1", "float16")
    assert config.kv_cache.budget_bytes == CUDA_KV_BUDGET_MIB << 20 and not config.kv_cache.prefix_caching
    assert PARAMS["test"].kv_budget_bytes() == CPU_KV_BUDGET_MIB << 20  # fixed: runs compare
    assert replace(params, kv_budget_mib=100).kv_budget_bytes() == 100 << 20


def test_random_weights_bench_model(tmp_path):
    assert uses_random_weights("llava-7b") and uses_random_weights("qwen2-vl-7b") and not uses_random_weights("bench")
    assert default_model_dir(tmp_path, "bench", True).name == "bench-random-model"
    assert default_model_dir(tmp_path, "llava-7b").name == "llava-7b-random-model"
    assert default_model_dir(tmp_path, "bench").name == "bench-model"
    path = ensure_model(tmp_path / "m", "tiny", random_weights=True)
    assert is_random_weights(path) and not list(path.glob("*.safetensors"))
    stamp = (path / MARKER).stat().st_mtime_ns
    assert ensure_model(tmp_path / "m", "tiny", random_weights=True) == path  # reused
    assert (path / MARKER).stat().st_mtime_ns == stamp
    big = ensure_model(tmp_path / "7b", "llava-7b")  # written in well under a second: no 7B model is built
    assert is_random_weights(big) and json.loads((big / MARKER).read_text())["random_weights"] is True


def test_baselines_load_the_same_weights_on_the_device_and_dtype(tmp_path):
    path = ensure_model(tmp_path / "m", "tiny", random_weights=True)
    hf = hf_baseline(path, "cpu", "bfloat16")
    ref = SuffixPrefill(path, "cpu", "bfloat16")
    assert hf.model.dtype == ref.adapter.model.dtype == torch.bfloat16 and hf.device == torch.device("cpu")
    assert all(torch.equal(a, b) for a, b in zip(hf.model.state_dict().values(), ref.adapter.model.state_dict().values()))
    shared = hf_baseline(path, "cpu", "bfloat16", model=ref.adapter.model)
    assert shared.model is ref.adapter.model
    messages = [{"role": "user", "content": "What color is the shape?"}]
    assert hf.generate(messages, 3).completion_tokens == 3
    sync("cpu")
    release_device_memory("cpu")  # no-ops on the CPU


def test_cuda_settings_only_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    runtime_module.configure_device("cpu")
    assert calls == []
    runtime_module.configure_device("cuda:0")
    assert calls == [False]


def test_report_records_device_and_dtype(tmp_path):
    params = replace(PARAMS["test"], scenarios=("decode",), dtype="bfloat16", random_weights=True)
    report = run_bench(tmp_path, params, progress=False)
    meta = json.loads((tmp_path / "report.json").read_text())["meta"]
    assert report["scenarios"]["decode"]["status"] == "ok"
    assert (meta["device"], meta["dtype"], meta["cuda"], meta["random_weights"]) == ("cpu", "bfloat16", None, True)
    assert meta["device_name"] and meta["torch"] == torch.__version__
    assert meta["params"]["device"] == "cpu" and meta["model_dir"].endswith("tiny-random-model")
    md = (tmp_path / "report.md").read_text()
    assert "Device `cpu`" in md and "dtype bfloat16" in md and "random weights" in md


def test_gpu_busy_is_the_union_of_kernel_intervals_over_their_span():
    from mmserve.bench.gpu_busy import busy_summary, union_length

    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4  # overlaps counted once
    assert union_length([(0, 10), (2, 3)]) == 10 and union_length([]) == 0
    s = busy_summary([(0, 2), (1, 3), (5, 6), (8, 10)], steps=2)
    assert s["busy"] == 6 / 10 and s["kernels"] == 4 and s["kernels_per_step"] == 2
    assert busy_summary([], 3)["busy"] is None

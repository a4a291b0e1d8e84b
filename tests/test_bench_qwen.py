"""`mmserve bench` on the Qwen2-VL family: the whole run on tiny-qwen with the `test` parameters,
its HF baselines (a hand-padded batch generates what each request generates alone) and the
suffix-prefill reference (M-RoPE positions), and images that vary in size for Qwen only."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from mmserve.bench import PARAMS, run_bench
from mmserve.bench import peer as peer_lib
from mmserve.bench.baselines import HFBaseline, QwenHFBaseline, SuffixPrefill, hf_baseline, left_pad
from mmserve.bench.common import QUESTIONS, QWEN_IMAGE_SIZES, Images, assistant, image, system, user
from mmserve.bench.context import Bench
from mmserve.bench.model import MARKER, ensure_model
from mmserve.bench.params import ALL_SCENARIOS
from mmserve.cli import build_parser

NO_PEER = tuple(s for s in ALL_SCENARIOS if s != "peer")


@pytest.mark.slow  # every scenario runs on tiny-gemma3 in the fast suite (test_bench_families)
def test_bench_runs_every_scenario_on_tiny_qwen(tmp_path, monkeypatch):
    monkeypatch.setattr(peer_lib, "unavailable", lambda: "not installed (test)")
    params = replace(PARAMS["test"], preset="tiny-qwen", scenarios=NO_PEER)
    start = time.perf_counter()
    report = run_bench(tmp_path, params, progress=False)
    assert time.perf_counter() - start < 30

    assert json.loads((tmp_path / "tiny-qwen-model" / MARKER).read_text())["preset"] == "tiny-qwen"
    data = json.loads((tmp_path / "report.json").read_text())
    meta = data["meta"]
    assert (meta["family"], meta["model_type"], meta["preset"]) == ("Qwen2-VL", "qwen2_vl", "tiny-qwen")
    assert [tuple(s) for s in meta["image_sizes"]] == list(QWEN_IMAGE_SIZES)
    tokens = meta["tokens_per_image"]
    assert list(tokens) == [f"{w}x{h}" for w, h in QWEN_IMAGE_SIZES] and len(set(tokens.values())) > 1
    sc = data["scenarios"]
    assert {name: r["status"] for name, r in sc.items()} == {n: "ok" for n in NO_PEER}

    assert all(r["completion_tokens"] == params.decode_tokens for runs in sc["decode"]["runs"].values() for r in runs)
    assert sc["concurrency"]["levels"][-1]["hf_batched"]["agg_tps"] > 0
    turns = sc["multiturn"]["turns"]
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] > 0 for t in turns[1:])
    assert all(t["prefill_suffix_s"] > 0 for t in turns)
    assert all(sc["three_images"]["outputs_equal"]) and sc["three_images"]["no_cross_image_hits"]
    rows = {(r["scenario"], r["metric"].split(":")[0]) for r in data["summary"]}
    for expected in [("1 decode", "decode tok/s, embedded"), ("2 concurrency", "TTFT p99 / TTFT p50 @2"),
                     ("3 multi-turn", "turn 3"), ("4 same image", "same conversation, encoder cache on"),
                     ("5 three images", "cache-on output == cache-off output")]:
        assert expected in rows, expected
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# mmserve benchmark (test): Qwen2-VL, preset `tiny-qwen`")
    assert "tokens per image over the sizes used" in md and f"224x224 → {tokens['224x224']}" in md
    assert report["paths"]["png"] == str(tmp_path / "report.png")


async def test_peer_is_skipped_for_qwen(tmp_path, monkeypatch):
    from mmserve.bench.scenarios import peer

    monkeypatch.setattr(peer_lib, "unavailable", lambda: None)  # as if installed: the family decides
    bench = Bench(PARAMS["test"], ensure_model(tmp_path / "m", "tiny-qwen"), tmp_path, note=lambda _: None)
    result = await peer(bench)
    assert result["status"] == "skipped" and "torchvision" in result["reason"]


def test_images_vary_for_qwen_only(tmp_path):
    llava = Bench(PARAMS["test"], tmp_path / "no-model", tmp_path, note=lambda _: None)
    assert llava.family == "llava" and llava.images.sizes == ()
    assert all(llava.image(i).tobytes() == image(i).tobytes() and llava.image(i).size == (64, 64) for i in range(3))
    qwen = Images(QWEN_IMAGE_SIZES)
    assert [qwen(i).size for i in range(6)] == [*QWEN_IMAGE_SIZES, QWEN_IMAGE_SIZES[0]]
    assert qwen(0).tobytes() != qwen(5).tobytes()  # same size, different image


@pytest.fixture(scope="module")
def qwen_hf(tiny_qwen_dir):
    hf = hf_baseline(tiny_qwen_dir)
    assert isinstance(hf, QwenHFBaseline)
    return hf


def _requests() -> list[list[dict]]:
    imgs = Images(QWEN_IMAGE_SIZES)
    out = [imgs.ask(i, QUESTIONS[i % 4]) for i in range(4)]  # 4 sizes: 4 prompt lengths
    out.append([system("You are a precise assistant. Answer in one word."), user(QUESTIONS[1], imgs(4))])
    return out


def test_qwen_batched_generate_equals_unbatched(qwen_hf):
    """Left padding shifts neither the M-RoPE positions (computed with the attention mask) nor the
    images (each row's patches by its grid): every row generates what it generates alone."""
    tokens, requests = 8, _requests()
    rows = [qwen_hf._inputs(m) for m in requests]
    batch = left_pad(rows, qwen_hf.tokenizer.pad_token_id)
    lengths = [r["input_ids"].shape[1] for r in rows]
    assert len(set(lengths)) > 2 and batch["input_ids"].shape == (len(rows), max(lengths))
    assert batch["image_grid_thw"].shape == (len(rows), 3)

    def greedy(inputs) -> list[list[int]]:
        with torch.inference_mode():
            out = qwen_hf.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return out[:, inputs["input_ids"].shape[1]:].tolist()

    alone = [greedy(r)[0] for r in rows]
    assert greedy(batch) == alone
    timing = qwen_hf.generate_batch(requests, 3)  # the timed path checks rows and steps itself
    assert timing.completion_tokens == 3 and 0 < timing.ttft <= timing.total


def test_qwen_suffix_prefill_uses_mrope_positions(tiny_qwen_dir, qwen_hf):
    """The suffix prefill on top of a prefix cache reproduces the model's own last logits for hits
    before, inside and after the image; index positions would not (the image shifts them)."""
    imgs = Images(QWEN_IMAGE_SIZES)
    conv = [system("sys"), user(QUESTIONS[0], imgs(3)), assistant("a red circle"), user(QUESTIONS[1])]
    inputs = qwen_hf._inputs(conv)
    with torch.inference_mode():
        own = qwen_hf.model(**inputs).logits[0, -1].float()
    n = inputs["input_ids"].shape[1]
    ref = SuffixPrefill(tiny_qwen_dir)
    for hit in (0, 5, 30, n - 4):
        assert torch.allclose(ref.suffix_logits(conv, hit)[0], own, atol=1e-4), hit
    seconds, suffix = ref.time(conv, 30, repeats=1)
    assert suffix == n - 30 and seconds > 0

    full, positions, _ = ref._prompt(conv)
    flat = ref.prefill(full, None, 0, torch.arange(n).expand(3, -1)).logits[0]
    assert not torch.allclose(flat, own, atol=1e-4)


def test_llava_keeps_its_baselines(tiny_model_dir):
    assert type(hf_baseline(tiny_model_dir)) is HFBaseline
    ref = SuffixPrefill(tiny_model_dir)
    assert ref._prompt([user(QUESTIONS[0], image(0))])[1] is None  # 1-D positions: the adapter's prefill


def test_cli_bench_params_and_preset():
    args = build_parser().parse_args(["bench", "--params", "quick", "--preset", "bench-qwen"])
    assert (args.params, args.preset, args.quick) == ("quick", "bench-qwen", False)
    args = build_parser().parse_args(["bench", "--quick"])
    assert (args.params, args.preset, args.quick) == (None, None, True)


def test_cli_bench_rejects_an_unknown_preset(tmp_path, capsys):
    from mmserve.cli import main

    assert main(["bench", "--params", "test", "--preset", "nope", "--out", str(tmp_path / "o")]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err and not (tmp_path / "o").exists()

"""`mmserve bench` on LLaVA-OneVision, Idefics3 and Gemma 3 (issue 30 item 6): the whole run on
each tiny preset with the `test` parameters; the HF baseline's `generate` inputs, built from
mmserve's own tokens and pixel items, equal the family's transformers processor's tensors and a
left-padded batch generates what each request generates alone; the suffix-prefill reference
(`Adapter.prefill`) reproduces the model's own logits; images vary in size where the token count
follows it; the real-shape presets are accepted and built as random-weights directories."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import tests.test_gemma3 as gemma3_test
import tests.test_idefics3 as idefics3_test
import tests.test_llava_onevision as onevision_test
from mmserve.bench import PARAMS, run_bench
from mmserve.bench import peer as peer_lib
from mmserve.bench.baselines import AdapterHFBaseline, SuffixPrefill, hf_baseline, hf_prompt, left_pad
from mmserve.bench.common import QUESTIONS, QWEN_IMAGE_SIZES, Images, assistant, image, system, user
from mmserve.bench.model import MARKER, RANDOM_ONLY, default_model_dir, ensure_model
from mmserve.bench.params import ALL_SCENARIOS
from mmserve.cli import build_parser, main
from mmserve.models.random_weights import WEIGHT_SUFFIXES, read_marker

# preset -> (family name, model_type, whether its image sizes vary)
FAMILIES = {"tiny-llava-onevision": ("LLaVA-OneVision", "llava_onevision", True),
            "tiny-idefics3": ("Idefics3/SmolVLM", "idefics3", True),
            "tiny-gemma3": ("Gemma 3", "gemma3", False)}
REAL = ("llava-onevision-7b", "smolvlm-2b", "gemma3-4b")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-families")
    return {p: ensure_model(default_model_dir(root, p), p) for p in FAMILIES}


@pytest.fixture(scope="module")
def baselines(model_dirs):
    return {p: hf_baseline(d) for p, d in model_dirs.items()}


# every scenario on each family with `-m slow` (~9-14 s each); the fast suite runs every scenario
# on the default preset (tests/test_bench.py) and each family's own bench checks below
@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.slow)
                                    for p in FAMILIES])
def test_bench_runs_every_scenario(preset, model_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(peer_lib, "unavailable", lambda: "not installed (test)")
    params = replace(PARAMS["test"], preset=preset)
    run_bench(tmp_path, params, model_dir=model_dirs[preset], progress=False)

    data = json.loads((tmp_path / "report.json").read_text())
    meta, sc = data["meta"], data["scenarios"]
    name, kind, varied = FAMILIES[preset]
    assert (meta["family"], meta["model_type"], meta["preset"]) == (name, kind, preset)
    assert {n: r["status"] for n, r in sc.items()} == {**{n: "ok" for n in ALL_SCENARIOS}, "peer": "skipped"}
    if kind == "llava_onevision":  # the family decides before the installation does
        assert "torchvision" in sc["peer"]["reason"]
    if varied:
        assert [tuple(s) for s in meta["image_sizes"]] == list(QWEN_IMAGE_SIZES)
        assert len(set(meta["tokens_per_image"].values())) > 1
    else:
        assert "image_sizes" not in meta
    assert all(r["completion_tokens"] == params.decode_tokens for runs in sc["decode"]["runs"].values() for r in runs)
    turns = sc["multiturn"]["turns"]
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] > 0 for t in turns[1:])
    assert all(t["prefill_suffix_s"] > 0 for t in turns)
    assert all(sc["three_images"]["outputs_equal"]) and sc["three_images"]["no_cross_image_hits"]
    assert (tmp_path / "report.md").read_text().startswith(f"# mmserve benchmark (test): {name}, preset `{preset}`")


def test_the_families_images_vary_where_their_token_count_follows_the_size(model_dirs, baselines, tmp_path):
    from mmserve.bench.context import Bench
    from mmserve.bench.model import tokens_per_image

    imgs = Images(QWEN_IMAGE_SIZES)
    for preset, (_, _, varied) in FAMILIES.items():
        bench = Bench(PARAMS["test"], model_dirs[preset], tmp_path, note=lambda _: None)
        assert bench.images.sizes == (QWEN_IMAGE_SIZES if varied else ())
        if varied:  # the counts the report gives are the spans the runtime puts in a prompt
            a = baselines[preset].adapter
            spans = {f"{imgs(i).width}x{imgs(i).height}": a.tokenize(*hf_prompt(imgs.ask(i))).spans[0].length
                     for i in range(len(QWEN_IMAGE_SIZES))}
            assert tokens_per_image(model_dirs[preset], imgs, len(QWEN_IMAGE_SIZES)) == spans
    assert Bench(PARAMS["test"], model_dirs["tiny-gemma3"], tmp_path).image(0).tobytes() == image(0).tobytes()


def _processor_inputs(preset: str, hf: AdapterHFBaseline, n: int) -> tuple[dict, list, list]:
    """(the family test's transformers-processor inputs, its images, its chat) for n images."""
    if preset == "tiny-llava-onevision":
        return onevision_test.hf_inputs(hf.adapter, n), onevision_test.images_of(n), onevision_test.hf_chat(n)
    if preset == "tiny-idefics3":
        return idefics3_test.hf_inputs(hf.adapter.path, n), idefics3_test.images_of(n), idefics3_test.hf_chat(n)
    return dict(gemma3_test.hf_inputs(hf.adapter, n)), gemma3_test.images_of(n), gemma3_test.chat(n)


@pytest.mark.parametrize("preset", FAMILIES)
def test_generate_inputs_are_the_processors_tensors(preset, baselines):
    hf = baselines[preset]
    assert isinstance(hf, AdapterHFBaseline)
    a = hf.adapter
    for n in (1, 3):
        want, images, chat = _processor_inputs(preset, hf, n)
        got = a.generate_inputs(a.tokenize(chat, images), a.pixel_values(images))
        assert set(got) == set(want) - {"batch_num_images"}  # None: every image tiled, as the processor's all-1s
        for key, value in want.items():
            if key != "batch_num_images":
                assert got[key].shape == value.shape and torch.equal(got[key].to(value.dtype), value), (n, key)


def _requests() -> list[list[dict]]:
    imgs = Images(QWEN_IMAGE_SIZES)
    out = [imgs.ask(i, QUESTIONS[i % 4]) for i in range(3)]  # 3 sizes: 3 prompt lengths (not for Gemma 3)
    out.append([system("You are a precise assistant. Answer in one word."), user(QUESTIONS[1], imgs(4))])
    out.append([user("No image this time.")])
    return out


@pytest.mark.parametrize("preset", FAMILIES)
def test_batched_generate_equals_unbatched_and_streams_text(preset, baselines):
    """Left padding (token types too) and the images' tensors concatenated in row order, padded
    to the widest (OneVision's tiles, Idefics3's views): every row generates what it generates
    alone; the silenced model's every token is visible text."""
    hf, tokens, requests = baselines[preset], 6, _requests()
    rows = [hf._inputs(m) for m in requests]
    batch = left_pad(rows, hf.adapter.tokenizer.pad_token_id)
    assert len({r["input_ids"].shape[1] for r in rows}) > 2

    def greedy(inputs) -> list[list[int]]:
        with torch.inference_mode():
            out = hf.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return out[:, inputs["input_ids"].shape[1]:].tolist()

    alone = [greedy(r)[0] for r in rows]
    assert greedy(batch) == alone
    assert all(hf.adapter.decode_text([t]).strip() for row in alone for t in row)
    timing = hf.generate_batch(requests[:2], 3)
    assert timing.completion_tokens == 3 and 0 < timing.ttft <= timing.total


@pytest.mark.parametrize("preset", FAMILIES)
def test_suffix_prefill_reproduces_the_models_own_logits(preset, model_dirs, baselines):
    """`Adapter.prefill` over a prefix cache of `hit` tokens, then the suffix: the model's own last
    logits, for hits before, inside (not Gemma 3's bidirectional image: see `suffix_logits`) and
    after the image."""
    hf = baselines[preset]
    imgs = Images(QWEN_IMAGE_SIZES)
    conv = [system("sys"), user(QUESTIONS[0], imgs(1)), assistant("a red circle"), user(QUESTIONS[1])]
    inputs = hf._inputs(conv)
    with torch.inference_mode():
        own = hf.model(**inputs).logits[0, -1].float()
    ref = SuffixPrefill(model_dirs[preset], adapter=hf.adapter)
    prompt = hf.adapter.tokenize(*hf_prompt(conv))
    span = prompt.spans[0]
    n = inputs["input_ids"].shape[1]
    hits = [0, 3, span.start + span.length + 2, n - 4]
    if preset != "tiny-gemma3":
        hits.append(span.start + span.length // 2)
    for hit in hits:
        assert torch.allclose(ref.suffix_logits(conv, hit)[0], own, atol=1e-4), hit
    seconds, suffix = ref.time(conv, hits[2], repeats=1)
    assert suffix == n - hits[2] and seconds > 0


def test_real_shape_presets_are_accepted_and_built_as_random_weights(tmp_path):
    assert set(REAL) <= RANDOM_ONLY
    for preset in REAL:
        path = default_model_dir(tmp_path, preset)
        assert path.name == f"{preset}-random-model"
        ensure_model(path, preset)
        assert read_marker(path)["preset"] == preset and json.loads((path / MARKER).read_text())["random_weights"]
        assert not [p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)]
        assert build_parser().parse_args(["bench", "--params", "gpu", "--preset", preset]).preset == preset


def test_the_cli_lists_the_new_presets(tmp_path, capsys):
    assert main(["bench", "--params", "test", "--preset", "nope", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    for preset in (*FAMILIES, *REAL):
        assert preset in err
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    preset_help = next(a.help for a in bench._actions if "--preset" in a.option_strings)
    for preset in (*FAMILIES, *REAL):
        assert preset in preset_help

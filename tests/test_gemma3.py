"""Gemma 3 (`Gemma3ForConditionalGeneration`, issue 31): the tiny-gemma3 preset as `mmserve
make-model --random-weights` writes it loads with transformers' own classes (no torchvision), its
prompts are `Gemma3Processor`'s token for token (pan-and-scan too), and mmserve's greedy tokens equal
`generate`'s in fp32 — through the whole runtime, caches on, first time and on cache hits, with a
token budget that puts chunk boundaries next to images — over prompts longer than the 32-token
window with 1 to 3 images (16 bidirectional tokens each)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Gemma3ImageProcessorPil, Gemma3Processor

from mmserve.cli import main as cli
from mmserve.config import Config, ModelConfig
from mmserve.engine.arena import KVArena, Segment
from mmserve.engine.attention import ModelFeatures, SdpaBackend
from mmserve.engine.paged_forward import forward_paged
from mmserve.models.demo import render_image
from mmserve.models.demo.gemma3 import GEMMA3_PRESETS, build_gemma3_config, build_gemma3_tokenizer
from mmserve.models.gemma3 import Gemma3Adapter, soft_runs
from mmserve.models.loading import check_checkpoint, load_adapter
from mmserve.models.random_weights import MARKER, read_marker
from tests.conftest import on_device
from tests.family_parity import MARGIN_ABS, FamilyParity

PROMPTS = {1: [(64, 64)], 2: [(32, 48), (80, 40)], 3: [(64, 64), (40, 90), (50, 50)]}
PARITY = FamilyParity("tiny-gemma3", PROMPTS, new_tokens=10, question="What color is the shape? Describe the image.",
                      shapes=("circle", "square", "triangle"), seed=60)
images_of, chat = PARITY.images_of, PARITY.hf_chat


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("g3") / "tiny-gemma3"
    assert cli(["make-model", "--preset", "tiny-gemma3", "--out", str(out), "--random-weights", "--seed", "0"]) == 0
    return out


@pytest.fixture(scope="module")
def adapter(gemma3_dir):
    a = load_adapter("tiny-gemma3", gemma3_dir)
    assert isinstance(a, Gemma3Adapter)
    return a


def hf_inputs(adapter, n: int, images=None):
    proc = Gemma3Processor(image_processor=adapter.image_processor, tokenizer=adapter.tokenizer,
                           image_seq_length=adapter.tokens_per_image, chat_template=adapter.tokenizer.chat_template)
    images = images_of(n) if images is None else images
    return proc(text=[adapter.render_prompt(chat(n))], images=images or None, return_tensors="pt")


def test_the_preset_writes_a_gemma3_transformers_reloads(gemma3_dir, adapter):
    config = json.loads((gemma3_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3" and config["architectures"] == ["Gemma3ForConditionalGeneration"]
    text = config["text_config"]
    assert text["sliding_window"] == 32 and set(text["layer_types"]) == {"sliding_attention", "full_attention"}
    assert read_marker(gemma3_dir)["preset"] == "tiny-gemma3" and MARKER in {p.name for p in gemma3_dir.iterdir()}
    assert Gemma3ImageProcessorPil.from_pretrained(gemma3_dir).to_dict() == adapter.image_processor.to_dict()
    assert check_checkpoint("g", gemma3_dir) == "gemma3"
    features = ModelFeatures.from_config(adapter.config)
    assert features.needed == ("gqa", "sliding_window", "bidirectional_spans")
    SdpaBackend().check(features)  # served: the sdpa path implements both masks
    # the random projector is drawn, not transformers' zero init: images differ
    assert float(adapter.model.model.multi_modal_projector.mm_input_projection_weight.abs().sum()) > 0


def test_the_4b_preset_has_gemma3_4b_shapes():
    p = GEMMA3_PRESETS["gemma3-4b"]
    config = build_gemma3_config(p, build_gemma3_tokenizer())
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
            text.head_dim, text.sliding_window) == (2560, 34, 8, 4, 256, 1024)
    assert text.layer_types.count("full_attention") == 5 and text.layer_types[5] == "full_attention"
    assert config.mm_tokens_per_image == 256 and config.vision_config.image_size == 896


@pytest.mark.parametrize("n", [0, 1, 3])
def test_prompts_are_the_processors_and_images_are_bidirectional_runs(adapter, n):
    hf = hf_inputs(adapter, n)
    prompt = adapter.tokenize(chat(n), images_of(n))
    assert list(prompt.input_ids) == hf["input_ids"][0].tolist()
    types = hf["token_type_ids"][0].tolist()
    assert prompt.bidirectional == soft_runs(types, 1) and len(prompt.bidirectional) == n
    assert [(s.start, s.start + s.length) for s in prompt.spans] == list(prompt.bidirectional)
    if n:
        assert torch.equal(torch.cat(adapter.pixel_values(images_of(n))), hf["pixel_values"])


def test_pan_and_scan_prompts_and_rows_are_the_processors(gemma3_dir, tmp_path):
    """With pan-and-scan, a wide image is its original view and crops, each a run of soft tokens
    (each bidirectional alone, as transformers groups them); the image's span covers them all,
    its rows holding the markers' embeddings between the runs; logits equal the model's own."""
    import shutil

    d = tmp_path / "pas"
    shutil.copytree(gemma3_dir, d)
    settings = json.loads((d / "preprocessor_config.json").read_text())
    settings.update(do_pan_and_scan=True, pan_and_scan_min_crop_size=32)
    (d / "preprocessor_config.json").write_text(json.dumps(settings))
    a = load_adapter("pas", d)
    imgs = [render_image("red", "circle", seed=1).resize((96, 32)), render_image("blue", "square", seed=2)]
    assert [a.crops(i) for i in imgs] == [3, 0]
    proc = Gemma3Processor(image_processor=a.image_processor, tokenizer=a.tokenizer, image_seq_length=16,
                           chat_template=a.tokenizer.chat_template)
    hf = proc(text=[a.render_prompt(chat(2))], images=imgs, return_tensors="pt", do_pan_and_scan=True,
              pan_and_scan_min_crop_size=32)
    prompt = a.tokenize(chat(2), imgs)
    assert list(prompt.input_ids) == hf["input_ids"][0].tolist()
    assert prompt.bidirectional == soft_runs(hf["token_type_ids"][0].tolist(), 1) and len(prompt.bidirectional) == 5
    rows = a.encode_images(a.pixel_values(imgs))
    assert [r.shape[0] for r in rows] == [s.length for s in prompt.spans]
    logits = _paged_prefill(a, prompt, rows, chunk=20)
    with torch.inference_mode():
        ref = a.model(**hf).logits[0, -1]
    assert float((logits[0] - ref).abs().max()) < MARGIN_ABS


def _paged_prefill(adapter, prompt, rows, chunk: int):
    """The prompt through the paged path in chunks of about `chunk` tokens, never splitting an
    image (as the scheduler cuts them) -> the last token's logits."""
    from mmserve.generation.scheduler import prefill_chunk

    embeds = adapter.embed(prompt.input_ids, [(s.start, e) for s, e in zip(prompt.spans, rows)])
    n = len(prompt.input_ids)
    arena = KVArena.for_model(adapter, 1 << 22, 4)
    table = tuple(range(-(-n // 4)))

    class Seq:
        kv_len, target_len, bidirectional = 0, n, prompt.bidirectional

    seq = Seq()
    while seq.kv_len < n:
        s = seq.kv_len
        e = s + prefill_chunk(seq, chunk, alone=True)
        logits = forward_paged(adapter, embeds[:, s:e], [Segment(table, s, e - s)], arena, spans=[prompt.bidirectional])
        seq.kv_len = e
    return logits


@pytest.mark.parametrize("n", [0, 2, 3])
def test_first_step_logits_equal_transformers(adapter, n):
    imgs = images_of(n)
    hf = hf_inputs(adapter, n)
    prompt = adapter.tokenize(chat(n), imgs)
    rows = adapter.encode_images(adapter.pixel_values(imgs)) if imgs else []
    logits = _paged_prefill(adapter, prompt, rows, chunk=13)
    PARITY.assert_first_step_logits(adapter, hf, prompt, logits[0], n)


async def test_greedy_tokens_through_the_runtime_equal_generate(adapter, gemma3_dir):
    """Each prompt (past the 32-token window: 1-3 images of 16 tokens) twice through the runtime,
    caches on (the second time prefix and encoder hits), in prefill chunks of at most 20 tokens
    (so chunk boundaries fall next to images, and each image is a chunk of its own), all prompts
    at once; token for token equal to `generate`, each top-2 margin within 1e-4 of its own."""
    hf = {n: hf_inputs(adapter, n) for n in PROMPTS}
    assert all(inputs["input_ids"].shape[1] > 32 for inputs in hf.values())
    expected = {n: PARITY.generate(adapter, inputs) for n, inputs in hf.items()}
    config = on_device(Config(models=(ModelConfig("g3", str(gemma3_dir), default=True),))).replace(
        kv_cache={"block_size": 4}, generator={"max_batched_tokens": 20})
    await PARITY.assert_runtime_equals_generate(adapter, config, expected, at_once=True)


async def test_an_image_larger_than_the_step_budget_runs_whole(adapter, gemma3_dir):
    """An image span (16 tokens, 8 blocks of 2) is never split: with `max_batched_tokens` 2 its chunk
    is 8 times the budget, and more blocks than the reserve's step estimate — it gets them (the
    reserve is asked for the whole chunk) and runs as its step's prefill, token for token equal to
    `generate` (before, the request waited for `request_timeout_s`)."""
    n = max(PROMPTS)
    expected = {n: PARITY.generate(adapter, hf_inputs(adapter, n))}
    config = on_device(Config(models=(ModelConfig("g3", str(gemma3_dir), default=True),))).replace(
        kv_cache={"block_size": 2}, generator={"max_batched_tokens": 2}, limits={"request_timeout_s": 20})
    await PARITY.assert_runtime_equals_generate(adapter, config, expected, at_once=True)

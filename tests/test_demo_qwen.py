"""The Qwen2-VL demo model family: the committed ``demo-qwen`` answers held-out questions on
images of different sizes (through transformers' own ``generate``, inputs built by hand), and the
random-weight presets build, save and reload."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

from mmserve.models.demo import QWEN_PRESETS, build_untrained, checkpoint_dir, render_image
from mmserve.models.demo.qwen import build_inputs, build_qwen_config
from mmserve.models.demo.render import Q_BACKGROUND, Q_COLOR, Q_FIRST, Q_SECOND, Q_SHAPE
from mmserve.models.demo.tokenizer import build_qwen_tokenizer

HELD_OUT_SEED = (1 << 30) + 4242  # training draws image seeds below 1 << 30

EXPECTED_PROMPT = (
    "<s>system: Answer briefly.\n"
    "user: <|vision_start|><|image_pad|><|vision_end|>What color is the shape?\n"
    "assistant: red</s>\n"
    "user: What shape is it?\n"
    "assistant:"
)


def _load(path):
    return (AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessorPil.from_pretrained(path),
            AutoModelForImageTextToText.from_pretrained(path).eval())


@pytest.fixture(scope="module")
def demo_qwen():
    path = checkpoint_dir("demo-qwen")
    assert (path / "model.safetensors").exists(), f"the committed checkpoint is missing at {path}"
    return _load(path)


def _user(n_images: int, question: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": question}]}


def _answer(loaded, messages, images) -> str:
    tok, ip, model = loaded
    inputs = build_inputs(tok, ip, messages, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert new[-1].item() == tok.eos_token_id
    return tok.decode(new, skip_special_tokens=True).strip()


def test_checkpoint_layout_and_ids(demo_qwen):
    tok, ip, model = demo_qwen
    cfg = model.config
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (
        tok.image_token_id, tok.convert_tokens_to_ids("<|vision_start|>"), tok.convert_tokens_to_ids("<|vision_end|>"))
    assert tok.image_token == "<|image_pad|>"
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert len({cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
                tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 7
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (8, 2, 2) == (
        cfg.vision_config.patch_size, cfg.vision_config.spatial_merge_size, cfg.vision_config.temporal_patch_size)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert (checkpoint_dir("demo-qwen") / "model.safetensors").stat().st_size < 5e6
    messages = [
        {"role": "system", "content": "Answer briefly."},
        _user(1, Q_COLOR),
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": Q_SHAPE},
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == EXPECTED_PROMPT


def test_tokens_per_image_follow_the_size(demo_qwen):
    tok, ip, model = demo_qwen
    sizes = {(32, 32): 4, (128, 128): 64, (128, 43): 24, (40, 100): 12, (500, 500): 64, (20, 20): 4}
    for (w, h), expected in sizes.items():
        image = render_image("red", "circle", None, seed=1, size=(w, h))
        inputs = build_inputs(tok, ip, [_user(1, Q_COLOR)], [image])
        n_pad = int((inputs["input_ids"] == model.config.image_token_id).sum())
        assert n_pad == int(inputs["mm_token_type_ids"].sum()) == expected, (w, h)
        assert n_pad == int(inputs["image_grid_thw"].prod()) // 4
        assert QWEN_PRESETS["demo-qwen"].image_tokens(w, h) == expected
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                               image_grid_thw=inputs["image_grid_thw"]).pooler_output
    assert feats[0].shape == (4, model.config.text_config.hidden_size)


# (images as (colour, shape, background, (width, height)), question(s), expected)
CASES = [
    ([("purple", "triangle", "gray", (128, 43))], Q_COLOR, "purple"),
    ([("yellow", "square", "black", (40, 100))], Q_BACKGROUND, "black"),
    ([("green", "circle", "white", (96, 80))], Q_SHAPE, "circle"),
    ([("orange", "square", "gray", (120, 120))], Q_SHAPE, "square"),
    ([("red", "square", "white", (32, 90)), ("blue", "circle", "black", (128, 64))], Q_FIRST, "red"),
    ([("red", "square", "white", (32, 90)), ("blue", "circle", "black", (128, 64))], Q_SECOND, "blue"),
    ([("green", "triangle", "gray", (110, 48)), ("orange", "circle", "white", (36, 36))], Q_SECOND, "orange"),
]


@pytest.mark.parametrize("specs,question,expected", CASES)
def test_answers_on_images_of_different_sizes(demo_qwen, specs, question, expected):
    images = [render_image(c, s, b, seed=HELD_OUT_SEED + i, size=size) for i, (c, s, b, size) in enumerate(specs)]
    assert _answer(demo_qwen, [_user(len(images), question)], images) == expected


def test_later_turn_questions(demo_qwen):
    one = [render_image("blue", "triangle", "white", seed=HELD_OUT_SEED + 7, size=(100, 56))]
    messages = [_user(1, Q_BACKGROUND), {"role": "assistant", "content": "white"}, {"role": "user", "content": Q_COLOR}]
    assert _answer(demo_qwen, messages, one) == "blue"
    two = [render_image("yellow", "circle", "black", seed=HELD_OUT_SEED + 8, size=(64, 128)),
           render_image("purple", "square", "gray", seed=HELD_OUT_SEED + 9, size=(48, 48))]
    messages = [_user(2, Q_FIRST), {"role": "assistant", "content": "yellow"}, {"role": "user", "content": Q_SECOND}]
    assert _answer(demo_qwen, messages, two) == "purple"


def test_tiny_qwen_builds_saves_and_reloads(tmp_path):
    out = build_untrained("tiny-qwen", tmp_path / "tiny-qwen")
    tok, ip, model = _load(out)
    cfg = model.config
    assert (cfg.text_config.num_attention_heads, cfg.text_config.num_key_value_heads) == (4, 2)
    assert cfg.vision_config.depth <= 2 and cfg.image_token_id == tok.image_token_id
    image = render_image("red", "circle", seed=1, size=(70, 40))
    inputs = build_inputs(tok, ip, [_user(1, Q_COLOR)], [image])
    out_ids = model.generate(**inputs, max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert out_ids.shape[1] == inputs["input_ids"].shape[1] + 3
    again = build_untrained("tiny-qwen", tmp_path / "again")  # same seed: byte-identical weights
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


def test_large_preset_configs():
    """Configs only: these presets are never built in tests (qwen2-vl-7b is ~15 GB)."""
    tok = build_qwen_tokenizer()
    bench = build_qwen_config("bench-qwen", tok)
    assert (bench.text_config.hidden_size, bench.text_config.num_hidden_layers) == (512, 8)
    assert 64 <= QWEN_PRESETS["bench-qwen"].image_tokens(224, 224) <= 256
    big = build_qwen_config("qwen2-vl-7b", tok)
    t, v = big.text_config, big.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.intermediate_size) == (3584, 28, 28, 4, 18944)
    assert t.rope_parameters["mrope_section"] == [16, 24, 24] and t.rope_parameters["rope_theta"] == 1e6
    assert (v.embed_dim, v.depth, v.num_heads, v.patch_size, v.spatial_merge_size, v.temporal_patch_size,
            v.hidden_size) == (1280, 32, 16, 14, 2, 2, 3584)


def test_render_sizes_keep_the_default():
    assert render_image("red", "circle", "white", seed=3).tobytes() == render_image(
        "red", "circle", "white", seed=3, size=(64, 64)).tobytes()
    assert render_image("red", "circle", "white", seed=3, size=(128, 43)).size == (128, 43)

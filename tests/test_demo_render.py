"""Fast tests of the demo-model helpers: synthetic images, builders, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.models.demo import (
    BACKGROUNDS,
    COLORS,
    PRESETS,
    Q_COLOR,
    Q_FIRST,
    Q_SHAPE,
    SHAPES,
    build_untrained,
    checkpoint_dir,
    render_image,
)
from mmserve.models.demo.render import BACKGROUND_RGB, COLOR_RGB


def _nearest(rgb, palette: dict[str, tuple[int, int, int]]) -> str:
    return min(palette, key=lambda k: sum((float(a) - b) ** 2 for a, b in zip(rgb, palette[k])))


def _shape_mask(img: np.ndarray) -> np.ndarray:
    bg = img[0, 0].astype(float)  # corners are always background (the shape keeps a margin)
    return np.abs(img.astype(float) - bg).sum(-1) > 60


def test_render_basic_and_deterministic():
    a = render_image("red", "circle", "white", seed=3)
    b = render_image("red", "circle", "white", seed=3)
    assert a.mode == "RGB" and a.size == (64, 64)
    assert a.tobytes() == b.tobytes()
    assert render_image("red", "circle", seed=7).tobytes() == render_image("red", "circle", seed=7).tobytes()


def test_different_seeds_differ():
    imgs = {render_image("blue", "square", "gray", seed=s).tobytes() for s in range(20)}
    assert len(imgs) == 20


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("color", COLORS)
def test_dominant_colours(color, shape):
    for seed, background in enumerate(BACKGROUNDS):
        img = np.asarray(render_image(color, shape, background, seed=seed))
        for corner in (img[0, 0], img[0, -1], img[-1, 0], img[-1, -1]):
            assert _nearest(corner, BACKGROUND_RGB) == background
        mask = _shape_mask(img)
        assert 0.12 < mask.mean() < 0.6, mask.mean()  # large enough to read the shape
        assert _nearest(np.median(img[mask], axis=0), COLOR_RGB) == color


def test_random_background_uses_seed():
    seen = set()
    for seed in range(40):
        img = np.asarray(render_image("green", "triangle", None, seed=seed))
        seen.add(_nearest(img[0, 0], BACKGROUND_RGB))
    assert seen == set(BACKGROUNDS)


def test_shapes_are_distinguishable_by_fill_ratio():
    """Fraction of the shape's bounding box it covers: circle ~0.79, square ~0.8-1, triangle ~0.5."""
    for seed in range(10):
        ratios = {}
        for shape in SHAPES:
            m = _shape_mask(np.asarray(render_image("orange", shape, "black", seed=seed)))
            ys, xs = np.nonzero(m)
            ratios[shape] = m.sum() / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))
        assert ratios["triangle"] < 0.62 < ratios["circle"]
        assert ratios["triangle"] < 0.62 < ratios["square"]


def test_unknown_names_rejected():
    with pytest.raises(ValueError):
        render_image("pink", "circle")
    with pytest.raises(ValueError):
        render_image("red", "hexagon")


def test_presets():
    assert {"demo", "demo-wide", "tiny", "bench"} <= set(PRESETS)
    assert PRESETS["demo"].text_hidden != PRESETS["demo-wide"].text_hidden
    bench = PRESETS["bench"]
    assert (bench.text_hidden, bench.text_layers, bench.image_size, bench.patch_size) == (512, 8, 224, 14)
    assert bench.num_image_tokens == 256


EXPECTED_PROMPT = (
    "<s>system: Answer briefly.\n"
    "user: <image>What color is the shape?\n"
    "assistant: red</s>\n"
    "user: What shape is it?\n"
    "assistant:"
)


def _load(path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoProcessor.from_pretrained(path), AutoModelForImageTextToText.from_pretrained(path).eval()


def test_build_untrained_tiny_round_trip(tmp_path):
    out = build_untrained("tiny", tmp_path / "tiny")
    processor, model = _load(out)
    tok = processor.tokenizer
    assert model.config.image_token_id == tok.image_token_id == tok.convert_tokens_to_ids("<image>")
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.config.text_config.max_position_embeddings >= 2048

    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": Q_COLOR}]},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": Q_SHAPE},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == EXPECTED_PROMPT
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text

    inputs = processor(text=text, images=[render_image("red", "circle", seed=1)], return_tensors="pt")
    n_placeholders = int((inputs["input_ids"] == model.config.image_token_id).sum())
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    assert n_placeholders == feats[0].shape[0] == PRESETS["tiny"].num_image_tokens
    out_ids = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out_ids.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.parametrize("name", ["demo", "demo-wide"])
def test_trained_checkpoint_answers(name):
    path = checkpoint_dir(name)
    assert (path / "model.safetensors").exists(), f"the committed checkpoint is missing at {path}"
    processor, model = _load(path)
    cases = [
        ([("purple", "triangle", "gray")], Q_COLOR, "purple"),
        ([("yellow", "square", "black")], "What color is the background?", "black"),
        ([("green", "circle", "white")], Q_SHAPE, "circle"),
        ([("red", "square", "white"), ("blue", "circle", "black")], Q_FIRST, "red"),
    ]
    for specs, question, expected in cases:
        images = [render_image(c, s, b, seed=(1 << 30) + 99) for c, s, b in specs]
        messages = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=text, images=images, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1] :]
        assert new[-1].item() == processor.tokenizer.eos_token_id
        assert processor.tokenizer.decode(new, skip_special_tokens=True).strip() == expected

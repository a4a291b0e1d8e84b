"""The Qwen2-VL adapter reproduces the model's own forward: image token counts from each image's
size, M-RoPE positions that depend on the grids, the paged step (whole, chunked, decoding) equal
to transformers' own logits and greedy `generate`, and content keys that carry the grid."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmserve.cache.keys import MM_HASH_GRID_LAYOUT_VERSION, image_identity
from mmserve.engine.arena import KVArena, Segment
from mmserve.engine.paged_forward import forward_paged
from mmserve.models.demo import render_image
from mmserve.models.loading import load_adapter
from mmserve.models.qwen2_vl import Qwen2VLAdapter


@pytest.fixture(scope="module")
def adapter(tiny_qwen_dir):
    a = load_adapter("tiny-qwen", tiny_qwen_dir)
    assert isinstance(a, Qwen2VLAdapter)
    return a


def image(colour: str, size: tuple[int, int], seed: int = 0):
    return render_image(colour, "circle", seed=seed).resize(size)


def chat(n_images: int, text: str = "What color is the shape?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


def model_inputs(adapter, prompt, items) -> dict:
    ids = torch.tensor([prompt.input_ids])
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == adapter.image_token_id).int()}
    if items:
        inputs["pixel_values"] = torch.cat([it.patches for it in items])
        inputs["image_grid_thw"] = torch.tensor([it.grid for it in items])
    return inputs


def paged_prefill(adapter, prompt, embeds, chunk: int):
    n = len(prompt.input_ids)
    arena = KVArena.for_model(adapter, 1 << 22, 16)
    table = tuple(range(-(-(n + 16) // 16)))
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        logits = forward_paged(adapter, embeds[:, s:e], [Segment(table, s, e - s)], arena,
                                       adapter.rope_positions(prompt, n, s, e))
    return logits, arena, table


def test_token_counts_follow_each_image_size(adapter):
    imgs = [image("red", (128, 32)), image("blue", (64, 64)), image("green", (40, 100))]
    prompt = adapter.tokenize(chat(3), imgs)
    grids = [adapter.grid(i) for i in imgs]
    assert grids[0] != grids[1] and [s.length for s in prompt.spans] == [16, 16, adapter.tokens_per_image(grids[2])]
    items = adapter.pixel_values(imgs)
    assert [it.grid for it in items] == grids  # the processor's own grids
    assert [e.shape[0] for e in adapter.encode_images(items)] == [s.length for s in prompt.spans]


def test_same_token_count_different_grid_shifts_the_text_after(adapter):
    """A 4x16 and an 8x8 patch grid both make 16 tokens, but the text after an image resumes at
    its start + max(h, w) / merge, so every later position differs (M-RoPE)."""
    wide = adapter.tokenize(chat(1), [image("red", (128, 32))])
    square = adapter.tokenize(chat(1), [image("red", (64, 64))])
    assert wide.input_ids == square.input_ids
    end = wide.spans[0].start + wide.spans[0].length
    assert int(wide.rope_positions[0, end]) != int(square.rope_positions[0, end])
    assert wide.rope_delta != square.rope_delta


@pytest.mark.parametrize("chunk", [1000, 7])
def test_paged_prefill_equals_the_models_own_logits(adapter, chunk):
    imgs = [image("red", (128, 32), 1), image("blue", (48, 80), 2)]
    prompt = adapter.tokenize(chat(2), imgs)
    items = adapter.pixel_values(imgs)
    embeds = adapter.embed(prompt.input_ids, [(s.start, e) for s, e in zip(prompt.spans, adapter.encode_images(items))])
    with torch.inference_mode():
        ref = adapter.model(**model_inputs(adapter, prompt, items)).logits[0, -1]
    logits, _, _ = paged_prefill(adapter, prompt, embeds, chunk)
    torch.testing.assert_close(logits[0], ref, atol=1e-5, rtol=1e-5)


def test_paged_greedy_decode_equals_generate(adapter):
    imgs = [image("green", (96, 40), 3), image("red", (32, 32), 4)]
    prompt = adapter.tokenize(chat(2), imgs)
    items = adapter.pixel_values(imgs)
    embeds = adapter.embed(prompt.input_ids, [(s.start, e) for s, e in zip(prompt.spans, adapter.encode_images(items))])
    n = len(prompt.input_ids)
    with torch.inference_mode():
        out = adapter.model.generate(**model_inputs(adapter, prompt, items), max_new_tokens=10, min_new_tokens=10,
                                     do_sample=False)
    logits, arena, table = paged_prefill(adapter, prompt, embeds, 1000)
    ids = list(prompt.input_ids) + [int(logits[0].argmax())]
    while len(ids) < n + 10:
        m = len(ids)
        logits = forward_paged(adapter, adapter.embed(ids[-1:]), [Segment(table, m - 1, 1)], arena,
                                       adapter.rope_positions(prompt, m, m - 1, m))
        ids.append(int(logits[0].argmax()))
    assert ids[n:] == out[0, n:].tolist()


def test_answer_positions_continue_at_index_plus_delta(adapter):
    prompt = adapter.tokenize(chat(1), [image("red", (128, 32))])
    n = len(prompt.input_ids)
    pos = adapter.rope_positions(prompt, n + 3, n - 2, n + 3)
    assert torch.equal(pos[:, :2], prompt.rope_positions[:, n - 2:])
    assert pos[:, 2:].tolist() == [[n + prompt.rope_delta + k for k in range(3)]] * 3


def test_image_key_folds_in_the_grid(adapter):
    img = image("red", (128, 32))
    key = adapter.image_key(img)
    assert key == image_identity(adapter.model_sig, adapter.processor_digest, img, grid=adapter.grid(img))
    assert key != image_identity(adapter.model_sig, adapter.processor_digest, img)  # layout v1
    assert MM_HASH_GRID_LAYOUT_VERSION == 2


def test_a_processor_that_needs_torchvision_fails_at_load(tiny_qwen_dir, tmp_path):
    copy = shutil.copytree(tiny_qwen_dir, tmp_path / "ckpt")
    config = copy / "preprocessor_config.json"
    settings = json.loads(config.read_text())
    settings["image_processor_type"] = "Qwen2VLVideoProcessor"
    config.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="needs torchvision"):
        load_adapter("broken", copy)


def test_an_unknown_family_is_named(tiny_qwen_dir, tmp_path):
    copy = shutil.copytree(tiny_qwen_dir, tmp_path / "ckpt")
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "whisper"
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'whisper' is not served"):
        load_adapter("other", copy)

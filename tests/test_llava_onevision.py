"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): the tiny-llava-onevision preset as
`mmserve make-model --random-weights` writes it loads with transformers' own classes (no
torchvision), each image's encoder rows are exactly its placeholder count (anyres tiles, unpadding,
pooling, newline rows) and equal one by one or batched, mmserve's first-step logits equal
transformers' own within 1e-4 and its greedy tokens equal `generate`'s — through the whole
runtime, caches on, first time and on cache hits — over prompts of 0, 1 and 3 images of sizes that
make different tile grids; the content key carries every processor setting and the tiling."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import xxhash
from transformers import LlavaOnevisionImageProcessorPil

from mmserve.cache.keys import SEED_MM_HASH, image_header
from mmserve.cli import main as cli
from mmserve.config import Config, ModelConfig
from mmserve.errors import UnsupportedModelType
from mmserve.models.demo import build_untrained, render_image
from mmserve.models.demo.onevision import ONEVISION_PRESETS, build_onevision_config
from mmserve.models.demo.tokenizer import build_tokenizer
from mmserve.models.llava_onevision import LlavaOnevisionAdapter
from mmserve.models.loading import check_checkpoint, load_adapter
from mmserve.models.random_weights import MARKER, read_marker
from tests.family_parity import FamilyParity, chunked_prefill

# (width, height) -> tiles (rows x columns) and tokens under the preset (32 px tiles of 4x4
# patches, anyres_max_4): 48x40 -> 2x2 tiles, unpadded: 70; 32x32 -> 1x1: 36;
# 100x40 -> 2x3, pooled down: 68; 40x100 -> 3x2, pooled: 76; 64x64 -> 2x2, no padding: 88
PROMPTS = {0: [], 1: [(48, 40)], 3: [(32, 32), (100, 40), (40, 100)]}
EXPECTED = {(48, 40): ((2, 2), 70), (32, 32): ((1, 1), 36), (100, 40): ((2, 3), 68), (40, 100): ((3, 2), 76),
            (64, 64): ((2, 2), 88)}
PARITY = FamilyParity("tiny-llava-onevision", PROMPTS)
images_of, hf_chat = PARITY.images_of, PARITY.hf_chat


def hf_processor(adapter):
    """transformers' own LlavaOnevisionProcessor over the checkpoint's tokenizer and image
    processor. Its constructor insists on a video processor, whose class needs torchvision: the
    class check is skipped (no video is ever passed)."""
    from unittest import mock

    from transformers import LlavaOnevisionProcessor
    from transformers.processing_utils import ProcessorMixin

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return LlavaOnevisionProcessor(image_processor=adapter.image_processor, tokenizer=adapter.tokenizer,
                                       video_processor=None, chat_template=adapter.tokenizer.chat_template,
                                       **adapter.processor_settings)


def hf_inputs(adapter, n_images: int) -> dict:
    """What LlavaOnevisionProcessor gives for the chat and a flat list of its images (each image
    tiled: `batch_num_images` all 1): input_ids with its own placeholder expansion, pixels, sizes."""
    imgs = images_of(n_images)
    processor = hf_processor(adapter)
    text = processor.apply_chat_template(hf_chat(n_images), add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], images=imgs or None, return_tensors="pt")
    if imgs:
        assert batch["batch_num_images"].tolist() == [1] * n_images
    return dict(batch)


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory):
    return build_untrained("tiny-llava-onevision", tmp_path_factory.mktemp("tiny-ov"), seed=0, random_weights=True)


@pytest.fixture(scope="module")
def adapter(ov_dir):
    a = load_adapter("tiny-ov", ov_dir)
    assert isinstance(a, LlavaOnevisionAdapter)
    return a


# -- the checkpoint directory ------------------------------------------------------------------


def test_make_model_writes_a_directory_transformers_reloads(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "ov"
    assert cli(["make-model", "--random-weights", "--preset", "tiny-llava-onevision", "--out", str(out)]) == 0
    for name in ("config.json", "preprocessor_config.json", "processor_config.json", "tokenizer.json", MARKER):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llava_onevision"
    assert config["architectures"] == ["LlavaOnevisionForConditionalGeneration"]
    assert AutoConfig.from_pretrained(out).vision_config.model_type == "siglip_vision_model"
    assert AutoTokenizer.from_pretrained(out).image_token == "<image>"
    assert isinstance(LlavaOnevisionImageProcessorPil.from_pretrained(out), LlavaOnevisionImageProcessorPil)
    assert read_marker(out)["seed"] == 0
    assert check_checkpoint("ov", out) == "llava_onevision"


def test_a_processor_that_needs_torchvision_is_refused(ov_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ov_dir, bad)
    settings = json.loads((bad / "preprocessor_config.json").read_text())
    settings["image_processor_type"] = "LlavaNextImageProcessorFast"
    (bad / "preprocessor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="torchvision"):
        load_adapter("bad", bad)


def test_processor_settings_that_disagree_with_the_model_are_refused(ov_dir, tmp_path):
    """processor_config.json's vision_aspect_ratio counts the placeholders, the model config's
    packs the rows: a checkpoint where they differ would fail at every image."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ov_dir, bad)
    settings = json.loads((bad / "processor_config.json").read_text())
    settings["vision_aspect_ratio"] = "anyres_max_9"
    (bad / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="vision_aspect_ratio"):
        load_adapter("bad", bad)


def test_an_unserved_model_type_names_llava_onevision(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(UnsupportedModelType, match=r"llava_onevision \(LLaVA-OneVision\)"):
        check_checkpoint("other", tmp_path)


def test_the_7b_preset_has_llava_onevision_7b_shapes():
    """Config (and a parameter count on the meta device) only: the model is ~14 GB in bfloat16."""
    from transformers import AutoModelForImageTextToText

    config = build_onevision_config("llava-onevision-7b", build_tokenizer())
    t, v = config.text_config, config.vision_config
    assert type(config).__name__ == "LlavaOnevisionConfig" and config.dtype == "bfloat16"
    assert (t.model_type, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.intermediate_size) == ("qwen2", 3584, 28, 28, 4, 18944)
    assert (v.model_type, v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size,
            v.image_size, v.patch_size) == ("siglip_vision_model", 1152, 26, 16, 4304, 384, 14)
    assert config.vision_aspect_ratio == "anyres_max_9" and len(config.image_grid_pinpoints) == 36
    assert config.vision_feature_select_strategy == "full"
    assert ONEVISION_PRESETS["llava-onevision-7b"].tile_tokens == 729
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert 6.8e9 < params < 7.1e9, params  # 6.9e9; 8.0e9 with Qwen2's 152k vocabulary (the demo's is ~300)


# -- the vision tower --------------------------------------------------------------------------


def test_each_image_is_exactly_its_placeholder_rows_batched_or_alone(adapter):
    imgs = [render_image("red", "square", seed=3).resize(size) for size in EXPECTED]
    for img, (tiles, tokens) in zip(imgs, EXPECTED.values()):
        assert (adapter.tiles(img), adapter.tokens_per_image(img)) == (tiles, tokens), img.size
    items = adapter.pixel_values(imgs)
    together = adapter.encode_images(items)
    alone = [adapter.encode_images([it])[0] for it in items]
    assert [e.shape[0] for e in together] == [t for _, t in EXPECTED.values()]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    # the rows are what transformers' forward scatters: the model's own image features
    vis = adapter.image_processor(images=imgs, return_tensors="pt")
    with torch.inference_mode():
        hf = adapter.model.model.get_image_features(pixel_values=vis["pixel_values"], image_sizes=vis["image_sizes"],
                                                    batch_num_images=vis["batch_num_images"]).pooler_output
    assert all(torch.equal(a, b) for a, b in zip(together, hf))
    newline = adapter.model.model.image_newline
    assert torch.equal(together[1][-1], newline)  # each row of the tile map ends with image_newline


# -- exact against transformers ----------------------------------------------------------------


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_first_step_logits_equal_transformers(adapter, n_images):
    """The prompt mmserve builds (its own placeholder expansion, per-image encoding, chunked paged
    prefill) against the model's own forward on the processor's inputs."""
    imgs = images_of(n_images)
    hf = hf_inputs(adapter, n_images)
    prompt = adapter.tokenize(hf_chat(n_images), imgs)
    assert list(prompt.input_ids) == hf["input_ids"][0].tolist()
    rows = adapter.encode_images(adapter.pixel_values(imgs)) if imgs else []
    PARITY.assert_first_step_logits(adapter, hf, prompt, chunked_prefill(adapter, prompt, rows), n_images)


async def test_greedy_tokens_through_the_runtime_equal_generate(adapter, ov_dir):
    """Each prompt twice through the runtime (caches on: the second time a prefix and encoder
    hit), token for token equal to `generate`, each step's top-2 margin within 1e-4 of its own."""
    expected = {n: PARITY.generate(adapter, hf_inputs(adapter, n)) for n in PROMPTS}
    config = Config(models=(ModelConfig("ov", str(ov_dir), default=True),)).replace(kv_cache={"block_size": 4})
    await PARITY.assert_runtime_equals_generate(adapter, config, expected)


# -- the content key ---------------------------------------------------------------------------


def test_the_image_key_is_layout_2_over_every_processor_setting_and_the_tiling(adapter):
    img = images_of(1)[0]
    grid = (70, 2, 2)  # tokens, tile rows, tile columns
    pixels = np.asarray(img)
    header = image_header(adapter.model_sig, adapter.processor_digest, "RGB", img.size, pixels, grid)
    assert header[:2] == b"\x02\x00" and header.endswith(b"".join(n.to_bytes(4, "little") for n in grid))
    assert adapter.image_key(img) == xxhash.xxh3_128_digest(header + pixels.tobytes(), seed=SEED_MM_HASH)
    keys = {adapter.image_key(img)}
    settings = {k: v for k, v in adapter.image_processor.to_dict().items() if k != "image_processor_type"}
    for change in ({"image_grid_pinpoints": [[32, 32], [64, 64]]}, {"size": {"height": 48, "width": 48}},
                   {"do_center_crop": True, "crop_size": {"height": 32, "width": 32}}, {"image_mean": [0.4] * 3}):
        other = copy.copy(adapter)
        other.image_processor = LlavaOnevisionImageProcessorPil(**{**settings, **change})
        other.processor_digest = other._processor_digest()
        keys.add(other.image_key(img))
    other = copy.copy(adapter)
    other.processor_settings = {**adapter.processor_settings, "vision_aspect_ratio": "anyres_max_9"}
    other.processor_digest = other._processor_digest()
    keys.add(other.image_key(img))
    assert len(keys) == 6
    # the tiling is in the key: two sizes of one picture never share one, and neither do two
    # images whose pixels are the same bytes in another shape
    assert adapter.image_key(img) != adapter.image_key(img.resize((40, 48)))

"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the tiny-qwen2.5-vl preset as `mmserve
make-model --random-weights` writes it loads with transformers' own classes (no torchvision),
mmserve's first-step logits equal transformers' own within 1e-4 and its greedy tokens equal
`generate`'s — through the whole runtime, caches on, first time and on cache hits — over prompts
of 0, 1 and 3 images of sizes that make different token counts; window attention stays per image
(batched encoding ≡ one by one); the content key carries every processor setting."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import xxhash
from transformers import Qwen2VLImageProcessorPil

from mmserve.cache.keys import SEED_MM_HASH, image_header
from mmserve.cli import main as cli
from mmserve.config import Config, ModelConfig
from mmserve.errors import UnsupportedModelType
from mmserve.models.demo.qwen import QWEN_PRESETS, build_image_processor, build_inputs, build_qwen_config
from mmserve.models.demo.tokenizer import build_qwen_tokenizer
from mmserve.models.loading import check_checkpoint, load_adapter
from mmserve.models.qwen2_5_vl import Qwen2_5_VLAdapter
from mmserve.models.random_weights import MARKER, checkpoint_sig, read_marker
from tests.family_parity import FamilyParity, chunked_prefill

# image sizes -> (token count) under the preset's processor (patch 8, merge 2, 32^2..128^2 px):
# 96x96 -> 36, 128x32 -> 16, 40x100 -> 12, 200x150 -> 54 (scaled down to the pixel cap)
PROMPTS = {0: [], 1: [(96, 96)], 3: [(128, 32), (40, 100), (200, 150)]}
PARITY = FamilyParity("tiny-qwen2.5-vl", PROMPTS)
images_of, hf_chat = PARITY.images_of, PARITY.hf_chat


def hf_inputs(adapter, n_images: int) -> dict:
    """The model's inputs for the chat and its images, built by hand as Qwen2VLProcessor builds them."""
    return build_inputs(adapter.tokenizer, adapter.image_processor, hf_chat(n_images), images_of(n_images))


@pytest.fixture(scope="module")
def adapter(tiny_qwen25_dir):
    a = load_adapter("tiny-qwen2.5-vl", tiny_qwen25_dir)
    assert isinstance(a, Qwen2_5_VLAdapter)
    return a


# -- the preset and loading -------------------------------------------------------------------


def test_make_model_writes_a_directory_transformers_reloads(tmp_path):
    out = tmp_path / "q25"
    assert cli(["make-model", "--preset", "tiny-qwen2.5-vl", "--out", str(out), "--random-weights", "--seed", "3"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "preprocessor_config.json", "tokenizer.json", MARKER} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["vision_config"]["fullatt_block_indexes"] == [1] and config["vision_config"]["window_size"] == 32
    assert read_marker(out)["preset"] == "tiny-qwen2.5-vl" and read_marker(out)["seed"] == 3
    saved = json.loads((out / "preprocessor_config.json").read_text())
    assert saved["image_processor_type"] == "Qwen2VLImageProcessor"  # what Qwen's own checkpoints say
    # it reloads with every setting (min/max pixels as `size`; the legacy keys are read into it)
    built = build_image_processor("tiny-qwen2.5-vl").to_dict()
    reloaded = Qwen2VLImageProcessorPil.from_pretrained(out).to_dict()
    assert reloaded == {k: v for k, v in built.items() if k not in ("min_pixels", "max_pixels")}
    assert reloaded["size"] == {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}
    assert check_checkpoint("q25", out) == "qwen2_5_vl"


def test_the_adapter_loads_transformers_own_classes(adapter):
    assert type(adapter.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(adapter.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    visual = adapter.model.model.visual
    assert visual.fullatt_block_indexes == [1] and len(visual.blocks) == 2  # one windowed block, one full
    assert adapter.mrope and adapter.merge_size == 2


def test_an_unserved_model_type_names_qwen2_5_vl(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(UnsupportedModelType, match=r"qwen2_5_vl \(Qwen2\.5-VL\)"):
        check_checkpoint("other", tmp_path)


def test_the_7b_preset_has_qwen2_5_vl_7b_shapes():
    """Config (and a parameter count on the meta device) only: the model is ~14 GB in bfloat16."""
    from transformers import AutoModelForImageTextToText

    config = build_qwen_config("qwen2.5-vl-7b", build_qwen_tokenizer())
    t, v = config.text_config, config.vision_config
    assert type(config).__name__ == "Qwen2_5_VLConfig" and config.dtype == "bfloat16"
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.intermediate_size) == (3584, 28, 28, 4, 18944)
    assert t.rope_parameters["mrope_section"] == [16, 24, 24] and t.rope_parameters["rope_theta"] == 1e6
    assert (v.hidden_size, v.depth, v.num_heads, v.intermediate_size, v.out_hidden_size, v.window_size,
            list(v.fullatt_block_indexes), v.patch_size, v.spatial_merge_size) == (
        1280, 32, 16, 3420, 3584, 112, [7, 15, 23, 31], 14, 2)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert 7.0e9 < params < 7.5e9, params  # 8.3e9 with Qwen's 152k vocabulary; the demo's is ~360
    assert QWEN_PRESETS["qwen2.5-vl-7b"].image_tokens(448, 448) == 256


# -- the vision tower --------------------------------------------------------------------------


def test_window_attention_is_per_image_so_batching_changes_nothing(adapter):
    imgs = images_of(3) + images_of(1)
    items = adapter.pixel_values(imgs)
    together = adapter.encode_images(items)
    alone = [adapter.encode_images([it])[0] for it in items]
    assert [e.shape[0] for e in together] == [16, 12, 54, 36]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    # and the windows matter: with every block attending to the whole image the output differs
    visual = adapter.model.model.visual
    saved = visual.fullatt_block_indexes
    try:
        visual.fullatt_block_indexes = [0, 1]
        full = adapter.encode_images(items[3:])[0]
    finally:
        visual.fullatt_block_indexes = saved
    assert not torch.allclose(full, together[3])


# -- exact against transformers ----------------------------------------------------------------


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_first_step_logits_equal_transformers(adapter, n_images):
    """The prompt mmserve builds (its own placeholder expansion, M-RoPE positions, per-image
    encoding, chunked paged prefill) against the model's own forward on the processor's inputs."""
    imgs = images_of(n_images)
    hf = hf_inputs(adapter, n_images)
    prompt = adapter.tokenize(hf_chat(n_images), imgs)
    assert list(prompt.input_ids) == hf["input_ids"][0].tolist()
    rows = adapter.encode_images(adapter.pixel_values(imgs)) if imgs else []
    PARITY.assert_first_step_logits(adapter, hf, prompt, chunked_prefill(adapter, prompt, rows), n_images)


async def test_greedy_tokens_through_the_runtime_equal_generate(adapter, tiny_qwen25_dir):
    """Each prompt twice through the runtime (caches on: the second time a prefix and encoder
    hit), token for token equal to `generate`, each step's top-2 margin within 1e-4 of its own."""
    expected = {n: PARITY.generate(adapter, hf_inputs(adapter, n)) for n in PROMPTS}
    config = Config(models=(ModelConfig("q25", str(tiny_qwen25_dir), default=True),)).replace(
        kv_cache={"block_size": 4})
    await PARITY.assert_runtime_equals_generate(adapter, config, expected)


# -- the content key ---------------------------------------------------------------------------


def test_the_image_key_is_layout_2_over_every_processor_setting(adapter, tiny_qwen_dir):
    import numpy as np

    img = images_of(1)[0]
    grid = adapter.grid(img)
    pixels = np.asarray(img)
    header = image_header(adapter.model_sig, adapter.processor_digest, "RGB", img.size, pixels, grid)
    assert header[:2] == b"\x02\x00" and header.endswith(b"".join(n.to_bytes(4, "little") for n in grid))
    assert adapter.image_key(img) == xxhash.xxh3_128_digest(header + pixels.tobytes(), seed=SEED_MM_HASH)
    keys = {adapter.image_key(img)}
    for change in ({"min_pixels": 48 * 48}, {"max_pixels": 64 * 64}, {"patch_size": 4}, {"merge_size": 4}):
        other = copy.copy(adapter)
        settings = {k: v for k, v in adapter.image_processor.to_dict().items() if k != "image_processor_type"}
        size = {"shortest_edge": change.pop("min_pixels", settings["size"]["shortest_edge"]),
                "longest_edge": change.pop("max_pixels", settings["size"]["longest_edge"])}
        other.image_processor = Qwen2VLImageProcessorPil(**{**settings, **change, "size": size})
        other.merge_size = other.image_processor.merge_size
        other.processor_digest = other._processor_digest()
        keys.add(other.image_key(img))
    assert len(keys) == 5
    # Qwen2-VL's tiny preset has the very same processor settings: only the model signature parts them
    assert build_image_processor("tiny-qwen").to_dict() == build_image_processor("tiny-qwen2.5-vl").to_dict()
    assert checkpoint_sig("m", tiny_qwen_dir, dtype="float32", device_type="cpu") != checkpoint_sig(
        "m", adapter.path, dtype="float32", device_type="cpu")


# -- the benchmark -----------------------------------------------------------------------------


def test_the_bench_runs_it_the_qwen_way(tiny_qwen25_dir):
    from mmserve.bench.baselines import QwenHFBaseline, hf_baseline
    from mmserve.bench.model import RANDOM_ONLY, family, family_name
    from mmserve.bench.peer import unsupported

    assert family(tiny_qwen25_dir) == "qwen2_5_vl" and family_name("qwen2_5_vl") == "Qwen2.5-VL"
    assert "torchvision" in unsupported("qwen2_5_vl") and "qwen2.5-vl-7b" in RANDOM_ONLY
    assert isinstance(hf_baseline(tiny_qwen25_dir), QwenHFBaseline)

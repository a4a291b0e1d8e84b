"""Idefics3 / SmolVLM (`Idefics3ForConditionalGeneration`): the tiny-idefics3 preset as
`mmserve make-model --random-weights` writes it loads with transformers' own classes (no
torchvision); an image's span covers its whole expansion — tiles, row/column markers, newlines,
the global view — and its encoder rows are the tower's at the `<image>` positions and the markers'
own embeddings between them, equal one by one or batched; mmserve's prompt is
`Idefics3Processor`'s, its first-step logits equal transformers' own within 1e-4 and its greedy
tokens equal `generate`'s — through the whole runtime, caches on, first time and on cache hits —
over prompts of 0, 1 and 3 images of sizes that make different tile grids; the content key
carries every processor setting and the tiling (its header's bytes pinned)."""

from __future__ import annotations

import copy
import json
import shutil
import struct

import numpy as np
import pytest
import torch
import xxhash
from transformers import AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor

from mmserve.cache import keys as K
from mmserve.cache.keys import SEED_MM_HASH, image_header
from mmserve.cli import main as cli
from mmserve.config import Config, ModelConfig
from mmserve.errors import UnsupportedModelType
from mmserve.models.demo import build_untrained, render_image
from mmserve.models.demo.idefics3 import (IDEFICS3_PRESETS, build_idefics3_config, build_idefics3_image_processor,
                                          build_idefics3_tokenizer)
from mmserve.models.idefics3 import Idefics3Adapter, idefics3_processor_digest, image_grid
from mmserve.models.loading import check_checkpoint, load_adapter
from mmserve.models.random_weights import MARKER, read_marker
from tests.family_parity import FamilyParity, chunked_prefill

# (width, height) -> tile grid (rows, columns) under the preset (images resized to a 96 px
# longest edge, 32 px tiles): 50x30 -> 2x3, 30x50 -> 3x2, 64x64 -> 3x3, 100x20 -> 1x3
PROMPTS = {0: [], 1: [(50, 30)], 3: [(30, 50), (64, 64), (100, 20)]}
GRIDS = {(50, 30): (2, 3), (30, 50): (3, 2), (64, 64): (3, 3), (100, 20): (1, 3)}
PARITY = FamilyParity("tiny-idefics3", PROMPTS)
images_of, hf_chat = PARITY.images_of, PARITY.hf_chat


def hf_processor(path, image_processor=None, tokenizer=None) -> Idefics3Processor:
    """transformers' own Idefics3Processor over the checkpoint's own files (loaded afresh)."""
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
    return Idefics3Processor(image_processor=image_processor or Idefics3ImageProcessorPil.from_pretrained(path),
                             tokenizer=tokenizer, image_seq_len=IDEFICS3_PRESETS["tiny-idefics3"].image_seq_len,
                             chat_template=(path / "chat_template.jinja").read_text())


def hf_inputs(path, n_images: int) -> dict:
    """What Idefics3Processor gives for the chat and its images: input_ids with its own expansion,
    the views' pixels and masks."""
    processor = hf_processor(path)
    imgs = images_of(n_images)
    text = processor.apply_chat_template(hf_chat(n_images), add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=[imgs] if imgs else None, return_tensors="pt"))


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory):
    return build_untrained("tiny-idefics3", tmp_path_factory.mktemp("tiny-idefics3"), seed=0, random_weights=True)


@pytest.fixture(scope="module")
def adapter(idefics3_dir):
    a = load_adapter("tiny-idefics3", idefics3_dir)
    assert isinstance(a, Idefics3Adapter)
    return a


# -- the checkpoint directory ------------------------------------------------------------------


def test_make_model_writes_a_directory_transformers_reloads(tmp_path):
    from transformers import AutoConfig

    out = tmp_path / "idefics3"
    assert cli(["make-model", "--random-weights", "--preset", "tiny-idefics3", "--out", str(out)]) == 0
    for name in ("config.json", "processor_config.json", "tokenizer.json", "chat_template.jinja", MARKER):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "idefics3"
    assert config["architectures"] == ["Idefics3ForConditionalGeneration"]
    assert AutoConfig.from_pretrained(out).text_config.model_type == "llama"
    assert json.loads((out / "processor_config.json").read_text())["image_seq_len"] == 16
    tok = AutoTokenizer.from_pretrained(out)
    for token in ("<image>", "<fake_token_around_image>", "<global-img>", "<row_6_col_6>", "<end_of_utterance>"):
        assert tok.convert_ids_to_tokens(tok(token, add_special_tokens=False)["input_ids"]) == [token]
    ip = Idefics3ImageProcessorPil.from_pretrained(out)
    assert (dict(ip.size)["longest_edge"], ip.max_image_size) == (96, {"longest_edge": 32})
    assert read_marker(out)["seed"] == 0
    assert check_checkpoint("idefics3", out) == "idefics3"


def test_a_checkpoint_in_the_transformers_4_layout_loads_the_same(adapter, idefics3_dir, tmp_path):
    """SmolVLM's own directories keep the image processor in preprocessor_config.json and only
    image_seq_len in processor_config.json: the same processor, the same keys."""
    old = tmp_path / "old"
    shutil.copytree(idefics3_dir, old)
    settings = json.loads((old / "processor_config.json").read_text())
    (old / "preprocessor_config.json").write_text(json.dumps(settings.pop("image_processor")))
    (old / "processor_config.json").write_text(json.dumps(settings))
    other = load_adapter("old", old)
    assert other.image_processor.to_dict() == adapter.image_processor.to_dict()
    assert other.processor_digest == adapter.processor_digest


def _edited(src, dst, **changes):
    shutil.copytree(src, dst)
    settings = json.loads((dst / "processor_config.json").read_text())
    for key, value in changes.items():
        if key == "image_seq_len":
            settings[key] = value
        else:
            settings["image_processor"][key] = value
    (dst / "processor_config.json").write_text(json.dumps(settings))
    return dst


def test_a_processor_that_needs_torchvision_is_refused(idefics3_dir, tmp_path):
    bad = _edited(idefics3_dir, tmp_path / "bad", image_processor_type="LlavaNextImageProcessorFast")
    with pytest.raises(ValueError, match="torchvision"):
        load_adapter("bad", bad)


@pytest.mark.parametrize("change, message", [({"image_seq_len": 64}, "image_seq_len"),
                                             ({"max_image_size": {"longest_edge": 64}}, "64 px tiles")])
def test_processor_settings_that_disagree_with_the_model_are_refused(idefics3_dir, tmp_path, change, message):
    """The processor counts the placeholders (image_seq_len) and cuts the tiles, the model makes
    the rows: a checkpoint where they disagree would fail at every image."""
    with pytest.raises(ValueError, match=message):
        load_adapter("bad", _edited(idefics3_dir, tmp_path / "bad", **change))


def test_an_unserved_model_type_names_idefics3(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(UnsupportedModelType, match=r"idefics3 \(Idefics3/SmolVLM\)"):
        check_checkpoint("other", tmp_path)


def test_the_smolvlm_preset_has_smolvlm_instruct_shapes():
    """Config (and a parameter count on the meta device) only: the model is ~4 GB in bfloat16."""
    from transformers import AutoModelForImageTextToText

    config = build_idefics3_config("smolvlm-2b", build_idefics3_tokenizer())
    t, v = config.text_config, config.vision_config
    assert type(config).__name__ == "Idefics3Config" and config.dtype == "bfloat16" and config.scale_factor == 3
    assert (t.model_type, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
            t.intermediate_size, t.max_position_embeddings) == ("llama", 2048, 24, 32, 32, 8192, 16384)
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size, v.image_size,
            v.patch_size) == (1152, 27, 16, 4304, 384, 14)
    assert IDEFICS3_PRESETS["smolvlm-2b"].image_seq_len == 81
    ip = build_idefics3_image_processor("smolvlm-2b")
    assert image_grid(ip, 1000, 1000) == (4, 4) and image_grid(ip, 384, 1536) == (1, 4)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert 1.9e9 < params < 2.1e9, params  # 2.0e9; SmolVLM-Instruct's 2.25e9 with its 49k vocabulary


# -- the prompt and the vision tower -----------------------------------------------------------


def test_the_tile_grid_is_the_image_processors_own(adapter):
    """`image_grid` (from the size alone) against the grid the processor reports cutting, over
    sizes of every aspect and scale, under the preset's settings and SmolVLM's."""
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [*GRIDS, (1, 1), (1, 300), (300, 1), (97, 96), (96, 97), *map(tuple, rng.integers(1, 700, (40, 2)))]
    for ip in (adapter.image_processor, build_idefics3_image_processor("smolvlm-2b")):
        for w, h in sizes:
            batch = ip(images=[[Image.new("RGB", (int(w), int(h)))]], return_row_col_info=True)
            assert image_grid(ip, int(h), int(w)) == (batch["rows"][0][0], batch["cols"][0][0]), (w, h)
    for size, grid in GRIDS.items():
        assert adapter.grid(Image.new("RGB", size)) == grid


def test_the_image_budget_follows_the_processors_resizes(monkeypatch, adapter):
    """`check_image_size` bounds an Idefics3 image by the processor's own steps: the resize to the
    longest edge, the one up to whole tiles, then the tiles and the global view."""
    from PIL import Image

    from mmserve.inputs.image_budget import processing_pixels, processing_steps

    ip = Idefics3ImageProcessorPil(**{k: v for k, v in adapter.image_processor.to_dict().items()
                                      if k != "image_processor_type"})
    resized, resize = [], ip.resize

    def recorded(image, size, *args, **kwargs):
        out = resize(image, size, *args, **kwargs)
        resized.append(tuple(out.shape[-2:]))
        return out

    monkeypatch.setattr(ip, "resize", recorded)
    for w, h in [*GRIDS, (1, 300), (300, 1), (7, 5), (1000, 999)]:
        resized.clear()
        views = ip(images=[[Image.new("RGB", (w, h))]], return_tensors="np")["pixel_values"].shape[1]
        steps = processing_steps(ip, w, h)
        assert [s.name for s in steps] == ["decoded", "resize", "resize to whole tiles", "tiles and global view"]
        assert resized[:2] == [(s.height, s.width) for s in steps[1:3]], (w, h)
        assert (steps[3].height, steps[3].width, steps[3].copies) == (32, 32, views)
    assert processing_pixels(ip, 1, 1) == 96 * 96 + 32 * 32  # 3x3 tiles and the global view


def test_an_images_span_is_its_whole_expansion_and_its_rows_are_what_transformers_feeds(adapter):
    """Each span covers the image's markers too; the rows over it are the tower's at `<image>`
    (the model's own get_image_features over the processor's views) and the tokens' own
    embeddings elsewhere; batching images changes no row."""
    imgs = [render_image("red", "square", seed=3).resize(size) for size in GRIDS]
    prompt = adapter.tokenize(hf_chat(len(imgs)), imgs)
    items = adapter.pixel_values(imgs)
    together = adapter.encode_images(items)
    alone = [adapter.encode_images([it])[0] for it in items]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    vis = adapter.image_processor(images=[imgs], return_tensors="pt")
    with torch.inference_mode():
        features = adapter.model.model.get_image_features(pixel_values=vis["pixel_values"],
                                                          pixel_attention_mask=vis["pixel_attention_mask"])
        features = torch.cat(list(features.pooler_output))
        embed = adapter.model.get_input_embeddings()
        at = 0
        for span, rows, grid in zip(prompt.spans, together, GRIDS.values()):
            ids = torch.tensor(prompt.input_ids[span.start:span.start + span.length])
            assert rows.shape[0] == span.length == len(adapter.expansion(grid))
            image = ids == adapter.image_token_id
            assert int(image.sum()) == (grid[0] * grid[1] + 1) * 16
            assert torch.equal(rows[image], features[at:at + int(image.sum())])
            assert torch.equal(rows[~image], embed(ids[~image]))
            at += int(image.sum())
            tokens = adapter.tokenizer.convert_ids_to_tokens(ids.tolist())
            assert tokens[0] == tokens[-1] == "<fake_token_around_image>" and tokens[1] == "<row_1_col_1>"
            assert "<global-img>" in tokens and f"<row_{grid[0]}_col_{grid[1]}>" in tokens
        assert at == features.shape[0]


def test_an_image_too_small_to_split_is_its_global_view_alone(adapter, idefics3_dir):
    """Without splitting (do_image_splitting false) an image is one view: <fake><global-img>
    <image>*16<fake>, as the processor writes it, and its rows are still exact."""
    ip = Idefics3ImageProcessorPil(**{**adapter.image_processor.to_dict(), "do_image_splitting": False})
    other = copy.copy(adapter)
    other.image_processor, other._expansions = ip, {}
    other.processor = hf_processor(idefics3_dir, ip, adapter.tokenizer)
    imgs = images_of(1)
    assert other.grid(imgs[0]) == (0, 0)
    prompt = other.tokenize(hf_chat(1), imgs)
    hf = other.processor(text=[other.render_prompt(hf_chat(1))], images=[imgs], return_tensors="pt")
    assert list(prompt.input_ids) == hf["input_ids"][0].tolist() and prompt.spans[0].length == 19
    rows = other.encode_images(other.pixel_values(imgs))[0]
    with torch.inference_mode():
        features = adapter.model.model.get_image_features(
            pixel_values=hf["pixel_values"], pixel_attention_mask=hf["pixel_attention_mask"]).pooler_output[0]
    assert torch.equal(rows[2:-1], features)


def test_a_tokenizer_that_merges_the_double_newline_expands_as_the_processor(adapter, idefics3_dir):
    """SmolVLM's tokenizer makes the last row's "\\n" and the global view's one token; the
    expansion is tokenized whole, so it does so in mmserve's prompt too."""
    tok = AutoTokenizer.from_pretrained(idefics3_dir)
    tok.add_tokens(["\n\n"])
    other = copy.copy(adapter)
    other.processor = hf_processor(idefics3_dir, tokenizer=tok)
    other.tokenizer, other._expansions = other.processor.tokenizer, {}
    imgs = images_of(3)
    prompt = other.tokenize(hf_chat(3), imgs)
    hf = other.processor(text=[other.render_prompt(hf_chat(3))], images=[imgs], return_tensors="pt")
    assert list(prompt.input_ids) == hf["input_ids"][0].tolist()
    assert [s.length for s in prompt.spans] == [len(adapter.expansion(other.grid(i))) - 1 for i in imgs]


# -- exact against transformers ----------------------------------------------------------------


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_first_step_logits_equal_transformers(adapter, idefics3_dir, n_images):
    """The prompt mmserve builds (its own expansion, per-image encoding, chunked paged prefill)
    against the model's own forward on the processor's inputs."""
    imgs = images_of(n_images)
    hf = hf_inputs(idefics3_dir, n_images)
    prompt = adapter.tokenize(hf_chat(n_images), imgs)
    assert list(prompt.input_ids) == hf["input_ids"][0].tolist()
    rows = adapter.encode_images(adapter.pixel_values(imgs)) if imgs else []
    PARITY.assert_first_step_logits(adapter, hf, prompt, chunked_prefill(adapter, prompt, rows), n_images)


async def test_greedy_tokens_through_the_runtime_equal_generate(adapter, idefics3_dir):
    """Each prompt twice through the runtime (caches on: the second time a prefix and encoder
    hit), token for token equal to `generate`, each step's top-2 margin within 1e-4 of its own."""
    expected = {n: PARITY.generate(adapter, hf_inputs(idefics3_dir, n)) for n in PROMPTS}
    config = Config(models=(ModelConfig("idefics3", str(idefics3_dir), default=True),)).replace(
        kv_cache={"block_size": 4})
    await PARITY.assert_runtime_equals_generate(adapter, config, expected)


# -- the content key ---------------------------------------------------------------------------

SIG = 0x0102030405060708


def _lp(text: str) -> bytes:
    return struct.pack("<I", len(text)) + text.encode()


def test_the_image_header_is_layout_2_with_the_processor_settings_and_tiling_pinned(tmp_path):
    """An Idefics3 image under the tiny-idefics3 preset's processor as a checkpoint holds it
    (saved, then loaded as the adapter loads it): layout 2; the processor digest over the image
    processor's settings — resize edge, tile size, splitting, resampling, normalisation, padding —
    and, under "processor", image_seq_len; then the size, the array header, and as the grid
    (tokens, tile rows, tile columns): a 70x30 image is resized to 96x42, rounded up to 96x64 and
    cut into 2x3 tiles: 7 views of 16 tokens and 18 marker tokens = 130."""
    build_idefics3_image_processor("tiny-idefics3").save_pretrained(tmp_path)
    ip = Idefics3ImageProcessorPil.from_pretrained(tmp_path)
    settings = ip.to_dict()
    assert K.canonical_json({**settings, "processor": {"image_seq_len": 16}}) == (
        b'{"do_convert_rgb":true,"do_image_splitting":true,"do_normalize":true,"do_pad":true,"do_rescale":true,'
        b'"do_resize":true,"image_mean":[0.5,0.5,0.5],"image_processor_type":"Idefics3ImageProcessor",'
        b'"image_std":[0.5,0.5,0.5],"max_image_size":{"longest_edge":32},"processor":{"image_seq_len":16},'
        b'"resample":1,"rescale_factor":0.00392156862745098,"size":{"longest_edge":96}}')
    digest = idefics3_processor_digest(settings, 16)
    assert digest == 0xA429133E29646C3F
    assert image_grid(ip, 30, 70) == (2, 3)
    grid = (130, 2, 3)
    pixels = np.arange(70 * 30 * 3, dtype=np.uint16).astype(np.uint8).reshape(30, 70, 3)
    header = image_header(SIG, digest, "RGB", (70, 30), pixels, grid)
    assert header == b"".join([struct.pack("<HBQQ", 2, 1, SIG, digest), _lp("RGB"), struct.pack("<II", 70, 30),
                               _lp("|u1"), struct.pack("<IIII", 3, 30, 70, 3), struct.pack("<III", *grid)])
    assert header.hex() == (
        "02000108070605040302013f6c64293e1329a403000000524742460000001e000000030000007c7531030000001e00000046"
        "00000003000000820000000200000003000000"
    )
    assert K.mm_hash_image(SIG, digest, "RGB", (70, 30), pixels, grid=grid).hex() == "ace5154d17656921dfe5ef295ecd78e0"


def test_the_adapters_image_key_is_that_layout_and_changes_with_every_setting(adapter):
    img = images_of(1)[0]
    rows, cols = adapter.grid(img)
    grid = (len(adapter.expansion((rows, cols))), rows, cols)
    assert grid == (130, 2, 3)
    pixels = np.asarray(img)
    header = image_header(adapter.model_sig, adapter.processor_digest, "RGB", img.size, pixels, grid)
    assert adapter.image_key(img) == xxhash.xxh3_128_digest(header + pixels.tobytes(), seed=SEED_MM_HASH)
    keys = {adapter.image_key(img)}
    settings = {k: v for k, v in adapter.image_processor.to_dict().items() if k != "image_processor_type"}
    for change in ({"size": {"longest_edge": 64}}, {"max_image_size": {"longest_edge": 48}},
                   {"do_image_splitting": False}, {"image_mean": [0.4] * 3}, {"resample": 3}):
        other = copy.copy(adapter)
        other.image_processor, other._expansions = Idefics3ImageProcessorPil(**{**settings, **change}), {}
        other.processor_digest = other._processor_digest()
        keys.add(other.image_key(img))
    other = copy.copy(adapter)
    other.image_seq_len = 9
    other.processor_digest = other._processor_digest()
    keys.add(other.image_key(img))
    assert len(keys) == 7
    # the tiling is in the key: two sizes of one picture never share one, and neither do two
    # images whose pixels are the same bytes in another shape
    assert adapter.image_key(img) != adapter.image_key(img.resize((30, 50)))

"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): the tiny-qwen3-vl preset as `mmserve make-model
--random-weights` writes it loads with transformers' own classes (no torchvision); an image's
encoder output is one tensor, its input embedding then every DeepStack level along the hidden
dim, equal to transformers' `get_image_features` (and per image: batched ≡ one by one);
`step_inputs` hands each level's rows to the text model at the right positions of a ragged step
whose chunks end inside images; mmserve's first-step logits equal transformers' own (its
Qwen3VLProcessor's inputs) within 1e-4 and its greedy tokens equal `generate`'s — through the
whole runtime, caches on, first time and on cache hits — over prompts of 0, 1 and 3 images of
sizes that make different token counts; the content key carries every processor setting and
its header is pinned."""

from __future__ import annotations

import copy
import json
import shutil
import struct

import numpy as np
import pytest
import torch
import xxhash
from transformers import Qwen2VLImageProcessorPil

from mmserve.cache import keys as K
from mmserve.cache.keys import SEED_MM_HASH, image_header, mm_hash_image, processor_digest
from mmserve.cli import main as cli
from mmserve.config import Config, ModelConfig
from mmserve.engine.arena import KVArena, Segment
from mmserve.engine.paged_forward import forward_paged
from mmserve.errors import UnsupportedModelType
from mmserve.models.demo import build_untrained
from mmserve.models.demo.qwen import QWEN_PRESETS, build_image_processor, build_qwen_config
from mmserve.models.demo.tokenizer import build_qwen_tokenizer
from mmserve.models.loading import check_checkpoint, load_adapter
from mmserve.models.qwen3_vl import Qwen3VLAdapter
from mmserve.models.random_weights import MARKER, read_marker
from tests.family_parity import MARGIN_ABS, FamilyParity

# image sizes -> (token count) under the preset's processor (patch 8, merge 2, 32^2..128^2 px):
# 96x96 -> 36, 128x32 -> 16, 40x100 -> 12, 200x150 -> 54 (scaled down to the pixel cap)
PROMPTS = {0: [], 1: [(96, 96)], 3: [(128, 32), (40, 100), (200, 150)]}
HIDDEN, LEVELS = 64, 3  # tiny-qwen3-vl: text hidden size; DeepStack from vision blocks 0, 1 and 3
PARITY = FamilyParity("tiny-qwen3-vl", PROMPTS)
images_of, hf_chat, openai_chat = PARITY.images_of, PARITY.hf_chat, PARITY.openai_chat


def hf_processor(adapter):
    """transformers' own Qwen3VLProcessor over the checkpoint's tokenizer and image processor. Its
    constructor insists on a video processor, whose class needs torchvision: the class check is
    skipped (no video is ever passed)."""
    from unittest import mock

    from transformers import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return Qwen3VLProcessor(image_processor=adapter.image_processor, tokenizer=adapter.tokenizer,
                                video_processor=None, chat_template=adapter.tokenizer.chat_template)


def hf_inputs(adapter, n_images: int, images=None) -> dict:
    """What Qwen3VLProcessor gives for the chat and its images (its own placeholder expansion,
    mm_token_type_ids, patches and grids)."""
    imgs = images_of(n_images) if images is None else images
    processor = hf_processor(adapter)
    text = processor.apply_chat_template(hf_chat(len(imgs)), add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=imgs or None, return_tensors="pt"))


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory):
    return build_untrained("tiny-qwen3-vl", tmp_path_factory.mktemp("tiny-qwen3-vl"), seed=0, random_weights=True)


@pytest.fixture(scope="module")
def adapter(q3_dir):
    a = load_adapter("tiny-qwen3-vl", q3_dir)
    assert isinstance(a, Qwen3VLAdapter)
    return a


def chunk_pieces(prompt, rows, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
    """The generator's pieces of tokens [start, end): (offset, the encoder rows over them)."""
    pieces = []
    for span, emb in zip(prompt.spans, rows):
        lo, hi = max(span.start, start), min(span.start + span.length, end)
        if lo < hi:
            pieces.append((lo - start, emb[lo - span.start:hi - span.start]))
    return pieces


# -- the preset and loading -------------------------------------------------------------------


def test_make_model_writes_a_directory_transformers_reloads(tmp_path):
    from transformers import AutoConfig

    out = tmp_path / "q3"
    assert cli(["make-model", "--preset", "tiny-qwen3-vl", "--out", str(out), "--random-weights", "--seed", "3"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "preprocessor_config.json", "tokenizer.json", MARKER} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1, 3]
    reloaded = AutoConfig.from_pretrained(out)
    assert reloaded.text_config.rope_parameters["mrope_section"] == [6, 5, 5]
    assert reloaded.text_config.rope_parameters["mrope_interleaved"] is True
    assert read_marker(out)["preset"] == "tiny-qwen3-vl" and read_marker(out)["seed"] == 3
    saved = json.loads((out / "preprocessor_config.json").read_text())
    assert saved["image_processor_type"] == "Qwen2VLImageProcessor" and saved["image_mean"] == [0.5, 0.5, 0.5]
    assert Qwen2VLImageProcessorPil.from_pretrained(out).to_dict() == build_image_processor("tiny-qwen3-vl").to_dict()
    assert check_checkpoint("q3", out) == "qwen3_vl"


def test_the_adapter_loads_transformers_own_classes(adapter):
    assert type(adapter.model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(adapter.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert adapter.model.model.visual.deepstack_visual_indexes == [0, 1, 3]
    assert adapter.mrope and adapter.merge_size == 2
    assert (adapter.deepstack_levels, adapter.encoder_width) == (LEVELS, HIDDEN * (1 + LEVELS))


def test_an_image_processor_that_needs_torchvision_is_refused(q3_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(q3_dir, bad)
    settings = json.loads((bad / "preprocessor_config.json").read_text())
    settings["image_processor_type"] = "SiglipImageProcessorFast"
    (bad / "preprocessor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="torchvision"):
        load_adapter("bad", bad)


def test_an_unserved_model_type_names_qwen3_vl(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(UnsupportedModelType, match=r"qwen3_vl \(Qwen3-VL\)"):
        check_checkpoint("other", tmp_path)


def test_the_8b_preset_has_qwen3_vl_8b_shapes():
    """Config (and a parameter count on the meta device) only: the model is ~15 GB in bfloat16."""
    from transformers import AutoModelForImageTextToText

    config = build_qwen_config("qwen3-vl-8b", build_qwen_tokenizer())
    t, v = config.text_config, config.vision_config
    assert type(config).__name__ == "Qwen3VLConfig" and config.dtype == "bfloat16"
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.intermediate_size) == (4096, 36, 32, 8, 128, 12288)
    assert t.rope_parameters["mrope_section"] == [24, 20, 20] and t.rope_parameters["rope_theta"] == 5e6
    assert (v.hidden_size, v.depth, v.num_heads, v.intermediate_size, v.out_hidden_size, v.num_position_embeddings,
            list(v.deepstack_visual_indexes), v.patch_size, v.spatial_merge_size) == (
        1152, 27, 16, 4304, 4096, 2304, [8, 16, 24], 16, 2)
    assert not config.tie_word_embeddings
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert 7.4e9 < params < 7.6e9, params  # 8.77e9 with Qwen's 152k vocabulary; the demo's is ~360
    # Qwen3-VL's processor: 256^2..4096^2 px, 32 px a token; a 448x448 image is 196 tokens
    assert QWEN_PRESETS["qwen3-vl-8b"].image_tokens(448, 448) == 196


# -- the encoder output: the embedding and every DeepStack level --------------------------------


def test_an_encoder_output_is_the_embedding_then_every_deepstack_level(adapter):
    imgs = images_of(3) + images_of(1)
    items = adapter.pixel_values(imgs)
    together = adapter.encode_images(items)
    assert [tuple(e.shape) for e in together] == [(n, HIDDEN * (1 + LEVELS)) for n in (16, 12, 54, 36)]
    hf = hf_inputs(adapter, 0, imgs)
    with torch.inference_mode():
        ref = adapter.model.model.get_image_features(hf["pixel_values"], hf["image_grid_thw"], return_dict=True)
    assert len(ref.deepstack_features) == LEVELS
    for i, out in enumerate(together):
        assert torch.equal(out[:, :HIDDEN], ref.pooler_output[i])
        for k in range(LEVELS):
            assert torch.equal(out[:, HIDDEN * (k + 1):HIDDEN * (k + 2)], ref.deepstack_features[k][i])
    # attention is per image: one image's output does not depend on the others encoded with it
    alone = [adapter.encode_images([it])[0] for it in items]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    # the levels differ from each other and from the embedding (a swapped level would show)
    parts = together[0].split(HIDDEN, dim=1)
    assert all(not torch.allclose(parts[a], parts[b]) for a in range(4) for b in range(a + 1, 4))


def test_step_inputs_split_the_rows_over_a_ragged_step(adapter):
    """Two pieces of one step (one cut inside an image): the input embeddings over their
    placeholders, the mask over exactly their rows of the step's tokens, each level's rows in
    the mask's order (pieces given out of order are put in position order)."""
    imgs = images_of(3)
    rows = adapter.encode_images(adapter.pixel_values(imgs))
    ids = [7] * 40
    a, b = rows[2][10:25], rows[0]  # 15 rows from inside an image, then a whole 16-row image
    embeds, kw = adapter.step_inputs(ids, [(20, b), (2, a)])
    mask = kw["visual_pos_masks"]
    assert mask.shape == (1, 40) and mask[0].nonzero().flatten().tolist() == [*range(2, 17), *range(20, 36)]
    assert torch.equal(embeds[0, 2:17], a[:, :HIDDEN]) and torch.equal(embeds[0, 20:36], b[:, :HIDDEN])
    assert len(kw["deepstack_visual_embeds"]) == LEVELS
    for k, level in enumerate(kw["deepstack_visual_embeds"]):
        cols = slice(HIDDEN * (k + 1), HIDDEN * (k + 2))
        assert torch.equal(level, torch.cat([a[:, cols], b[:, cols]]))
    text_only, none = adapter.step_inputs(ids)
    assert none == {} and text_only.shape == (1, 40, HIDDEN)
    with pytest.raises(ValueError, match="wide"):
        adapter.step_inputs(ids, [(2, a[:, :HIDDEN])])


def _paged_logits(adapter, steps, prompts, rows, lm_kwargs: bool = True):
    """The last logits of each prompt after `steps`: each step a list of (prompt index, start,
    end) chunks run as ONE ragged forward (the generator's way: pieces offset into the step)."""
    n = [len(p.input_ids) for p in prompts]
    arena = KVArena.for_model(adapter, 1 << 23, 8)
    tables, at = [], 0
    for m in n:
        tables.append(tuple(range(at, at + -(-m // 8))))
        at += -(-m // 8)
    last = {}
    for step in steps:
        ids, pieces, segments, positions = [], [], [], []
        for i, s, e in step:
            pieces += [(len(ids) + off, r) for off, r in chunk_pieces(prompts[i], rows[i], s, e)]
            ids += prompts[i].input_ids[s:e]
            segments.append(Segment(tables[i], s, e - s))
            positions.append(adapter.rope_positions(prompts[i], n[i], s, e))
        embeds, kw = adapter.step_inputs(ids, pieces)
        logits = forward_paged(adapter, embeds, segments, arena, torch.cat(positions, dim=1),
                                       lm_kwargs=kw if lm_kwargs else None)
        for (i, s, e), row in zip(step, logits):
            if e == n[i]:
                last[i] = row
    return [last[i] for i in range(len(prompts))]


def test_deepstack_rows_line_up_in_ragged_steps_that_end_inside_images(adapter):
    """Two prompts (1 and 3 images) prefilled together, each step ragged over both, its chunks
    ending inside images: each prompt's last logits equal transformers' own forward. Without
    the DeepStack arguments they do not (the test would see a level dropped or misplaced)."""
    chats = (1, 3)
    hf = [hf_inputs(adapter, n) for n in chats]
    prompts = [adapter.tokenize(hf_chat(n), images_of(n)) for n in chats]
    rows = [adapter.encode_images(adapter.pixel_values(images_of(n))) for n in chats]
    one, three = prompts
    inside = [one.spans[0].start + 10, three.spans[1].start + 5, three.spans[2].start + 30]
    assert all(s.start < c < s.start + s.length for s, c in zip([one.spans[0], *three.spans[1:]], inside))
    n1, n3 = len(one.input_ids), len(three.input_ids)
    steps = [[(0, 0, inside[0]), (1, 0, inside[1])],
             [(1, inside[1], inside[2]), (0, inside[0], n1)],
             [(1, inside[2], n3)]]
    with torch.inference_mode():
        refs = [adapter.model(**h).logits[0, -1] for h in hf]
    got = _paged_logits(adapter, steps, prompts, rows)
    diffs = [float((g - r).abs().max()) for g, r in zip(got, refs)]
    print(f"tiny-qwen3-vl, ragged DeepStack steps: max |logit diff| = {max(diffs):.3g}")
    assert max(diffs) < MARGIN_ABS
    without = _paged_logits(adapter, steps, prompts, rows, lm_kwargs=False)
    assert all(float((g - r).abs().max()) > 1e-2 for g, r in zip(without, refs))


# -- exact against transformers ----------------------------------------------------------------


@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_first_step_logits_equal_transformers(adapter, n_images):
    """The prompt mmserve builds (its own placeholder expansion, M-RoPE positions, per-image
    encoding, DeepStack split per chunk, chunked paged prefill) against the model's own forward
    on transformers' Qwen3VLProcessor's inputs."""
    imgs = images_of(n_images)
    hf = hf_inputs(adapter, n_images)
    prompt = adapter.tokenize(hf_chat(n_images), imgs)
    assert list(prompt.input_ids) == hf["input_ids"][0].tolist()
    rows = adapter.encode_images(adapter.pixel_values(imgs)) if imgs else []
    n = len(prompt.input_ids)
    logits = _paged_logits(adapter, [[(0, s, min(n, s + 7))] for s in range(0, n, 7)], [prompt], [rows])[0]
    PARITY.assert_first_step_logits(adapter, hf, prompt, logits, n_images)


async def test_greedy_tokens_through_the_runtime_equal_generate(adapter, q3_dir):
    """Each prompt twice through the runtime (caches on: the second time a prefix and encoder
    hit), token for token equal to `generate`, each step's top-2 margin within 1e-4 of its own."""
    expected = {n: PARITY.generate(adapter, hf_inputs(adapter, n)) for n in PROMPTS}
    config = Config(models=(ModelConfig("q3", str(q3_dir), default=True),)).replace(kv_cache={"block_size": 4})
    await PARITY.assert_runtime_equals_generate(adapter, config, expected)


# -- the content key ---------------------------------------------------------------------------


def test_the_image_key_is_layout_2_over_every_processor_setting(adapter, tiny_qwen25_dir):
    img = images_of(1)[0]
    grid = adapter.grid(img)
    pixels = np.asarray(img)
    header = image_header(adapter.model_sig, adapter.processor_digest, "RGB", img.size, pixels, grid)
    assert header[:2] == b"\x02\x00" and header.endswith(b"".join(n.to_bytes(4, "little") for n in grid))
    assert adapter.image_key(img) == xxhash.xxh3_128_digest(header + pixels.tobytes(), seed=SEED_MM_HASH)
    keys = {adapter.image_key(img)}
    for change in ({"min_pixels": 48 * 48}, {"max_pixels": 64 * 64}, {"patch_size": 4}, {"merge_size": 4},
                   {"image_mean": [0.48145466, 0.4578275, 0.40821073]}):
        other = copy.copy(adapter)
        settings = {k: v for k, v in adapter.image_processor.to_dict().items() if k != "image_processor_type"}
        size = {"shortest_edge": change.pop("min_pixels", settings["size"]["shortest_edge"]),
                "longest_edge": change.pop("max_pixels", settings["size"]["longest_edge"])}
        other.image_processor = Qwen2VLImageProcessorPil(**{**settings, **change, "size": size})
        other.merge_size = other.image_processor.merge_size
        other.processor_digest = other._processor_digest()
        keys.add(other.image_key(img))
    assert len(keys) == 6
    # a Qwen2.5-VL with the same grid geometry never shares a key (digest and signature differ)
    q25 = load_adapter("tiny-qwen2.5-vl", tiny_qwen25_dir)
    assert q25.grid(img) == grid and q25.image_key(img) != adapter.image_key(img)


SIG = 0x0102030405060708


def _lp(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<I", len(data)) + data


def test_qwen3_vl_image_header_is_layout_2_with_the_processor_settings_and_pinned(tmp_path):
    """A Qwen3-VL image under the tiny-qwen3-vl preset's processor as a checkpoint holds it
    (saved, then loaded as the adapter loads it): layout 2; the processor digest over every
    setting — min/max pixels (as `size`), patch, merge and temporal patch size, resampling,
    normalisation (Qwen3-VL's 0.5); then the size, the array header, and the grid those settings
    give a 20x12 image (upscaled to 48x32 to reach min_pixels: 4x6 patches)."""
    build_image_processor("tiny-qwen3-vl").save_pretrained(tmp_path)
    settings = Qwen2VLImageProcessorPil.from_pretrained(tmp_path).to_dict()
    assert K.canonical_json(settings) == (
        b'{"do_convert_rgb":true,"do_normalize":true,"do_rescale":true,"do_resize":true,'
        b'"image_mean":[0.5,0.5,0.5],"image_processor_type":"Qwen2VLImageProcessor",'
        b'"image_std":[0.5,0.5,0.5],"merge_size":2,"patch_size":8,"resample":3,'
        b'"rescale_factor":0.00392156862745098,"size":{"longest_edge":16384,"shortest_edge":1024},'
        b'"temporal_patch_size":2}')
    digest = processor_digest(settings)
    assert digest == 0x7BB0FF2E40EF9AF6
    grid = QWEN_PRESETS["tiny-qwen3-vl"].grid(20, 12)
    assert grid == (1, 4, 6)
    pixels = np.arange(20 * 12 * 3, dtype=np.uint16).astype(np.uint8).reshape(12, 20, 3)
    header = K.image_header(SIG, digest, "RGB", (20, 12), pixels, grid)
    assert header == b"".join([struct.pack("<HBQQ", 2, 1, SIG, digest), _lp("RGB"), struct.pack("<II", 20, 12),
                               _lp("|u1"), struct.pack("<IIII", 3, 12, 20, 3), struct.pack("<III", *grid)])
    assert header.hex() == (
        "0200010807060504030201f69aef402effb07b03000000524742140000000c000000030000007c7531030000000c00000014"
        "00000003000000010000000400000006000000"
    )
    assert mm_hash_image(SIG, digest, "RGB", (20, 12), pixels, grid=grid).hex() == "64cb709f7a81b12dba593f80c1eacf9c"


def test_the_8b_preset_processor_is_what_qwen3_vl_checkpoints_save(tmp_path):
    """Qwen3-VL's published preprocessor_config.json (a Qwen2VLImageProcessorFast, read by its PIL
    twin) and the qwen3-vl-8b preset's give one settings dict, so one digest: pinned."""
    published = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                 "image_processor_type": "Qwen2VLImageProcessorFast"}
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "preprocessor_config.json").write_text(json.dumps(published))
    build_image_processor("qwen3-vl-8b").save_pretrained(tmp_path / "preset")
    digests = {processor_digest(Qwen2VLImageProcessorPil.from_pretrained(tmp_path / d).to_dict())
               for d in ("hub", "preset")}
    assert digests == {0xA7515FB155BB0789}


# -- the benchmark -----------------------------------------------------------------------------


def test_the_bench_runs_it_the_qwen_way(q3_dir):
    from mmserve.bench.baselines import QwenHFBaseline, hf_baseline
    from mmserve.bench.model import RANDOM_ONLY, family, family_name
    from mmserve.bench.peer import unsupported

    assert family(q3_dir) == "qwen3_vl" and family_name("qwen3_vl") == "Qwen3-VL"
    assert "torchvision" in unsupported("qwen3_vl") and "qwen3-vl-8b" in RANDOM_ONLY
    assert isinstance(hf_baseline(q3_dir), QwenHFBaseline)


def test_the_bench_suffix_prefill_carries_deepstack(adapter):
    """The benchmark's least-work hit (a suffix prefilled over a precomputed prefix, here cut
    inside the second image) gives the model's own last logits: DeepStack's rows reach both
    halves."""
    from mmserve.bench.baselines import SuffixPrefill

    imgs = images_of(3)
    messages = openai_chat(imgs)
    prompt = adapter.tokenize(hf_chat(3), imgs)
    hit = prompt.spans[1].start + 5
    logits = SuffixPrefill(None, adapter=adapter).suffix_logits(messages, hit)
    with torch.inference_mode():
        ref = adapter.model(**hf_inputs(adapter, 3)).logits[0, -1]
    assert float((logits[0] - ref).abs().max()) < MARGIN_ABS

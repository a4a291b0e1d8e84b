"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL presets and builders: the trained ``demo-qwen`` and random-weight shapes.

Every preset is a plain ``Qwen2VLForConditionalGeneration`` (a :class:`Qwen25Preset`:
``Qwen2_5_VLForConditionalGeneration``, whose vision tower has window attention and an MLP of its
own width; its text model, M-RoPE and image processor are Qwen2-VL's; a :class:`Qwen3Preset`:
``Qwen3VLForConditionalGeneration``, DeepStack, a Qwen3 text model with interleaved M-RoPE, the
same image processor normalising with 0.5) saved with ``save_pretrained`` next to
the demo byte-level BPE tokenizer (Qwen's vision tokens, :func:`.tokenizer.build_qwen_tokenizer`)
and a ``Qwen2VLImageProcessorPil``. ``Qwen2VLProcessor`` is never built: its video processor needs
torchvision. A checkpoint directory therefore loads, offline, with three calls::

    tok = AutoTokenizer.from_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)

The chat template writes one ``<|vision_start|><|image_pad|><|vision_end|>`` per image; the caller
expands ``<|image_pad|>`` to the image's token count (grid_h * grid_w / merge**2), as
``Qwen2VLProcessor`` does. :func:`build_inputs` does exactly that, for tests and evaluation.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import ClassVar

import torch
from transformers import (AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen3VLConfig)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mmserve.config import DEMO_CHECKPOINTS
from mmserve.models.random_weights import remove_marker, write_random_weights

from .common import lookup_preset, save_checkpoint
from .tokenizer import build_qwen_tokenizer, generation_config


@dataclasses.dataclass(frozen=True)
class QwenPreset:
    """Sizes of one Qwen2-VL model and its image processor."""

    model_type: ClassVar[str] = "qwen2_vl"

    name: str
    # image processor (and the vision config's patch geometry)
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    # vision tower
    vision_embed: int
    vision_depth: int
    vision_heads: int
    # text model
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    mrope_section: tuple[int, int, int]  # sums to head_dim / 2 (temporal, height, width)
    rope_theta: float = 1e6
    temporal_patch_size: int = 2
    max_position_embeddings: int = 4096
    dtype: str = "float32"  # the 7B shape is built in bfloat16 (its real checkpoints' dtype)
    trained: bool = False  # True: a committed checkpoint exists (see qwen_checkpoint_dir)

    @property
    def factor(self) -> int:
        """Resized image sides are multiples of this (one merged token covers factor x factor px)."""
        return self.patch_size * self.merge_size

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``image_grid_thw`` of a ``width`` x ``height`` image (in patches, before merging)."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def image_tokens(self, width: int, height: int) -> int:
        _, gh, gw = self.grid(width, height)
        return gh * gw // self.merge_size**2


@dataclasses.dataclass(frozen=True)
class Qwen25Preset(QwenPreset):
    """Sizes of one Qwen2.5-VL model. Its vision tower differs from Qwen2-VL's: blocks of width
    ``vision_embed`` with a gated MLP of ``vision_intermediate``, attention within windows of
    ``window_size`` pixels except in ``fullatt_blocks``, and a merger straight to the text width."""

    model_type: ClassVar[str] = "qwen2_5_vl"

    vision_intermediate: int = 0
    window_size: int = 112  # pixels: a window is window_size // (patch_size * merge_size) merged tokens a side
    fullatt_blocks: tuple[int, ...] = ()  # vision blocks with full attention (the others: windows)
    tokens_per_second: int = 2  # video only (temporal positions); images do not use it


@dataclasses.dataclass(frozen=True)
class Qwen3Preset(QwenPreset):
    """Sizes of one Qwen3-VL model. Its vision tower has learned position embeddings
    (``num_position_embeddings``, a square grid resampled to each image's), blocks of width
    ``vision_embed`` with an MLP of ``vision_intermediate``, and DeepStack: the outputs of the
    blocks in ``deepstack_indexes``, each merged by a merger of its own, are added to the hidden
    states of the first ``len(deepstack_indexes)`` text layers at the image positions. The text
    model (Qwen3: q/k norms) has a head size of its own (``text_head_dim``) and interleaved
    M-RoPE; the image processor normalises with mean = std = 0.5."""

    model_type: ClassVar[str] = "qwen3_vl"

    vision_intermediate: int = 0
    num_position_embeddings: int = 2304  # a sqrt x sqrt grid of learned positions
    deepstack_indexes: tuple[int, ...] = ()
    text_head_dim: int = 128
    tie_word_embeddings: bool = False


QWEN_PRESETS: dict[str, QwenPreset] = {
    # trained demo model: 32..128 px images give 4..64 tokens
    "demo-qwen": QwenPreset(
        name="demo-qwen",
        patch_size=8, merge_size=2, min_pixels=32 * 32, max_pixels=128 * 128,
        vision_embed=96, vision_depth=3, vision_heads=3,
        text_hidden=128, text_layers=2, text_heads=4, text_kv_heads=2, text_intermediate=344,
        mrope_section=(4, 6, 6), rope_theta=1e4, trained=True,
    ),
    # random weights, smallest: fast unit tests (GQA: 4 query heads share 2 KV heads)
    "tiny-qwen": QwenPreset(
        name="tiny-qwen",
        patch_size=8, merge_size=2, min_pixels=32 * 32, max_pixels=128 * 128,
        vision_embed=32, vision_depth=1, vision_heads=2,
        text_hidden=64, text_layers=2, text_heads=4, text_kv_heads=2, text_intermediate=128,
        mrope_section=(2, 3, 3), rope_theta=1e4,
    ),
    # random weights, CPU benchmark shape: 224x224 -> 64 tokens, 448x448 (the cap) -> 256
    "bench-qwen": QwenPreset(
        name="bench-qwen",
        patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=448 * 448,
        vision_embed=384, vision_depth=6, vision_heads=6,
        text_hidden=512, text_layers=8, text_heads=8, text_kv_heads=2, text_intermediate=1408,
        mrope_section=(8, 12, 12),
    ),
    # Qwen2-VL-7B's real shape (the demo vocabulary); ~15 GB in bfloat16: built only on request
    "qwen2-vl-7b": QwenPreset(
        name="qwen2-vl-7b",
        patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
        vision_embed=1280, vision_depth=32, vision_heads=16,
        text_hidden=3584, text_layers=28, text_heads=28, text_kv_heads=4, text_intermediate=18944,
        mrope_section=(16, 24, 24), max_position_embeddings=32768, dtype="bfloat16",
    ),
    # Qwen2.5-VL, random weights, smallest: 2 vision blocks, the first windowed (windows of 2x2
    # merged tokens: 32 px), the second full; 32..128 px images give 4..64 tokens
    "tiny-qwen2.5-vl": Qwen25Preset(
        name="tiny-qwen2.5-vl",
        patch_size=8, merge_size=2, min_pixels=32 * 32, max_pixels=128 * 128,
        vision_embed=32, vision_depth=2, vision_heads=2, vision_intermediate=64,
        window_size=32, fullatt_blocks=(1,),
        text_hidden=64, text_layers=2, text_heads=4, text_kv_heads=2, text_intermediate=128,
        mrope_section=(2, 3, 3), rope_theta=1e4,
    ),
    # Qwen2.5-VL-7B-Instruct's real shape (the demo vocabulary; max_pixels as qwen2-vl-7b's, the
    # model card's recommended 1280 tokens an image); 7.2e9 parameters, ~14 GB in bfloat16: built only on request
    "qwen2.5-vl-7b": Qwen25Preset(
        name="qwen2.5-vl-7b",
        patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
        vision_embed=1280, vision_depth=32, vision_heads=16, vision_intermediate=3420,
        window_size=112, fullatt_blocks=(7, 15, 23, 31),
        text_hidden=3584, text_layers=28, text_heads=28, text_kv_heads=4, text_intermediate=18944,
        mrope_section=(16, 24, 24), max_position_embeddings=128000, dtype="bfloat16",
    ),
    # Qwen3-VL, random weights, smallest: 4 vision blocks, DeepStack from blocks 0, 1 and 3 into
    # the first 3 of 4 text layers; 32..128 px images give 4..64 tokens
    "tiny-qwen3-vl": Qwen3Preset(
        name="tiny-qwen3-vl",
        patch_size=8, merge_size=2, min_pixels=32 * 32, max_pixels=128 * 128,
        vision_embed=32, vision_depth=4, vision_heads=2, vision_intermediate=64,
        num_position_embeddings=64, deepstack_indexes=(0, 1, 3),
        text_hidden=64, text_layers=4, text_heads=4, text_kv_heads=2, text_intermediate=128, text_head_dim=32,
        mrope_section=(6, 5, 5), rope_theta=1e4,
    ),
    # Qwen3-VL-8B-Instruct's real shape (the demo vocabulary; its processor's settings: patch 16,
    # 256^2..4096^2 px); 7.5e9 parameters, ~15 GB in bfloat16: built only on request
    "qwen3-vl-8b": Qwen3Preset(
        name="qwen3-vl-8b",
        patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216,
        vision_embed=1152, vision_depth=27, vision_heads=16, vision_intermediate=4304,
        num_position_embeddings=2304, deepstack_indexes=(8, 16, 24),
        text_hidden=4096, text_layers=36, text_heads=32, text_kv_heads=8, text_intermediate=12288, text_head_dim=128,
        mrope_section=(24, 20, 20), rope_theta=5e6, max_position_embeddings=262144, dtype="bfloat16",
    ),
}


def get_qwen_preset(preset: str | QwenPreset) -> QwenPreset:
    return lookup_preset(preset, QWEN_PRESETS, QwenPreset, "Qwen2-VL / Qwen2.5-VL / Qwen3-VL")


def build_image_processor(preset: str | QwenPreset) -> Qwen2VLImageProcessorPil:
    p = get_qwen_preset(preset)
    ip = Qwen2VLImageProcessorPil(
        patch_size=p.patch_size,
        merge_size=p.merge_size,
        temporal_patch_size=p.temporal_patch_size,
        size={"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels},
        # Qwen3-VL normalises with 0.5 (its checkpoints' preprocessor_config.json); Qwen2(.5)-VL with CLIP's
        **(dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]) if isinstance(p, Qwen3Preset) else {}),
    )
    if not isinstance(p, Qwen3Preset):  # Qwen3-VL's checkpoints save `size` only
        # saved beside `size` (as in Qwen's own checkpoints) for loaders that read the old keys
        ip.min_pixels, ip.max_pixels = p.min_pixels, p.max_pixels
    return ip


def build_qwen_config(preset: str | QwenPreset, tokenizer) -> Qwen2VLConfig | Qwen2_5_VLConfig | Qwen3VLConfig:
    p = get_qwen_preset(preset)
    if isinstance(p, Qwen3Preset):
        return _qwen3_config(p, tokenizer)
    head_dim = p.text_hidden // p.text_heads
    if sum(p.mrope_section) * 2 != head_dim:
        raise ValueError(f"{p.name}: mrope_section {p.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    geometry = dict(patch_size=p.patch_size, spatial_merge_size=p.merge_size, temporal_patch_size=p.temporal_patch_size)
    if isinstance(p, Qwen25Preset):
        vision = dict(
            depth=p.vision_depth,
            hidden_size=p.vision_embed,
            intermediate_size=p.vision_intermediate,
            num_heads=p.vision_heads,
            out_hidden_size=p.text_hidden,  # the merger's output feeds the text model directly
            window_size=p.window_size,
            fullatt_block_indexes=list(p.fullatt_blocks),
            tokens_per_second=p.tokens_per_second,
            **geometry,
        )
    else:
        vision = dict(
            depth=p.vision_depth,
            embed_dim=p.vision_embed,
            hidden_size=p.text_hidden,  # the merger's output feeds the text model directly
            num_heads=p.vision_heads,
            mlp_ratio=4,
            **geometry,
        )
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=p.text_hidden,
        intermediate_size=p.text_intermediate,
        num_hidden_layers=p.text_layers,
        num_attention_heads=p.text_heads,
        num_key_value_heads=p.text_kv_heads,
        max_position_embeddings=p.max_position_embeddings,
        max_window_layers=p.text_layers,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta,
                         "mrope_section": list(p.mrope_section)},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config_class = Qwen2_5_VLConfig if isinstance(p, Qwen25Preset) else Qwen2VLConfig
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id,
        vision_start_token_id=tokenizer.vision_start_token_id,
        vision_end_token_id=tokenizer.vision_end_token_id,
        tie_word_embeddings=False,
    )
    config.dtype = p.dtype
    return config


def _qwen3_config(p: Qwen3Preset, tokenizer) -> Qwen3VLConfig:
    if sum(p.mrope_section) * 2 != p.text_head_dim:
        raise ValueError(f"{p.name}: mrope_section {p.mrope_section} must sum to head_dim/2 = {p.text_head_dim // 2}")
    side = int(p.num_position_embeddings ** 0.5)
    if side * side != p.num_position_embeddings:
        raise ValueError(f"{p.name}: num_position_embeddings {p.num_position_embeddings} is not a square grid")
    if any(not 0 <= i < p.vision_depth for i in p.deepstack_indexes) or len(p.deepstack_indexes) > p.text_layers:
        raise ValueError(f"{p.name}: deepstack_indexes {p.deepstack_indexes} must be vision blocks (depth "
                         f"{p.vision_depth}), at most one per text layer ({p.text_layers})")
    vision = dict(
        depth=p.vision_depth,
        hidden_size=p.vision_embed,
        intermediate_size=p.vision_intermediate,
        num_heads=p.vision_heads,
        out_hidden_size=p.text_hidden,  # the mergers' outputs feed the text model directly
        num_position_embeddings=p.num_position_embeddings,
        deepstack_visual_indexes=list(p.deepstack_indexes),
        patch_size=p.patch_size,
        spatial_merge_size=p.merge_size,
        temporal_patch_size=p.temporal_patch_size,
    )
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=p.text_hidden,
        intermediate_size=p.text_intermediate,
        num_hidden_layers=p.text_layers,
        num_attention_heads=p.text_heads,
        num_key_value_heads=p.text_kv_heads,
        head_dim=p.text_head_dim,
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta,
                         "mrope_section": list(p.mrope_section), "mrope_interleaved": True},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id,
        vision_start_token_id=tokenizer.vision_start_token_id,
        vision_end_token_id=tokenizer.vision_end_token_id,
        tie_word_embeddings=p.tie_word_embeddings,
    )
    config.dtype = p.dtype
    return config


def build_qwen_model(preset: str | QwenPreset, tokenizer, seed: int = 0) -> Qwen2VLForConditionalGeneration:
    """The preset's model (Qwen2VL-, Qwen2_5_VL- or Qwen3VLForConditionalGeneration) with
    transformers' own random init from `seed`."""
    p = get_qwen_preset(preset)
    config = build_qwen_config(p, tokenizer)
    torch.manual_seed(seed)
    model_class = AutoModelForImageTextToText._model_mapping[type(config)]
    model = model_class._from_config(config, dtype=getattr(torch, p.dtype))
    model.generation_config = generation_config(tokenizer)
    model.eval()
    return model


def save_qwen(model, tokenizer, image_processor, out_dir) -> pathlib.Path:
    """Config, generation_config and safetensors; tokenizer.json, tokenizer_config.json and
    chat_template.jinja; preprocessor_config.json."""
    return save_checkpoint(model, [tokenizer, image_processor], out_dir)


def build_untrained_qwen(preset: str, out_dir, seed: int = 0) -> pathlib.Path:
    """Build tokenizer + image processor + random-init model for ``preset`` and save them to out_dir."""
    p = get_qwen_preset(preset)
    tokenizer = build_qwen_tokenizer()
    model = build_qwen_model(p, tokenizer, seed=seed)
    remove_marker(out_dir)
    return save_qwen(model, tokenizer, build_image_processor(p), out_dir)


def write_random_qwen(preset: str, out_dir, seed: int = 0) -> pathlib.Path:
    """A random-weights directory of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL preset: config, tokenizer,
    image processor and the marker, no weight file (:mod:`mmserve.models.random_weights`)."""
    p = get_qwen_preset(preset)
    tok = build_qwen_tokenizer()
    return write_random_weights(out_dir, build_qwen_config(p, tok), generation_config(tok),
                                [tok, build_image_processor(p)], tok, seed=seed, dtype=p.dtype, preset=p.name)


def qwen_checkpoint_dir(name: str = "demo-qwen") -> pathlib.Path:
    """The committed trained checkpoint directory ``mmserve/models/demo/checkpoints/<name>``."""
    return DEMO_CHECKPOINTS / name


# --------------------------------------------------------------------------------------------
# model inputs by hand (what Qwen2VLProcessor would return)


def expand_image_pads(ids: list[int], counts: list[int], image_token_id: int) -> tuple[list[int], list[int]]:
    """Repeat the i-th ``<|image_pad|>`` counts[i] times; returns (input_ids, mm_token_type_ids)."""
    out, types = [], []
    k = 0
    for t in ids:
        if t == image_token_id:
            if k >= len(counts):
                raise ValueError(f"more image placeholders than images ({len(counts)})")
            out += [t] * counts[k]
            types += [1] * counts[k]
            k += 1
        else:
            out.append(t)
            types.append(0)
    if k != len(counts):
        raise ValueError(f"{k} image placeholders for {len(counts)} images")
    return out, types


def build_inputs(tokenizer, image_processor, messages, images, add_generation_prompt: bool = True) -> dict:
    """Tensors for ``model(**inputs)`` / ``model.generate(**inputs)`` of one conversation.

    ``input_ids`` / ``attention_mask`` / ``mm_token_type_ids`` are [1, seq]; ``pixel_values`` are
    the images' flattened patches, concatenated; ``image_grid_thw`` is [n_images, 3].
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    out: dict = {}
    counts: list[int] = []
    if images:
        vis = image_processor(images=list(images), return_tensors="pt")
        merge = image_processor.merge_size
        counts = [int(g.prod()) // merge**2 for g in vis["image_grid_thw"]]
        out["pixel_values"], out["image_grid_thw"] = vis["pixel_values"], vis["image_grid_thw"]
    ids, types = expand_image_pads(ids, counts, tokenizer.image_token_id)
    out["input_ids"] = torch.tensor([ids])
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    out["mm_token_type_ids"] = torch.tensor([types])
    return out

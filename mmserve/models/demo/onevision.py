"""LLaVA-OneVision presets and builders (random weights only).

Every preset is a plain ``LlavaOnevisionForConditionalGeneration`` (a SigLIP vision tower, a
Qwen2 text model, anyres tiling over ``image_grid_pinpoints`` with ``image_newline`` rows) saved
with ``save_pretrained`` next to the demo byte-level BPE tokenizer (its ``<image>`` token) and a
``LlavaOnevisionImageProcessorPil`` (the torchvision-free image processor), and a
``processor_config.json`` holding the processor's own settings (``num_image_tokens``,
``vision_feature_select_strategy``, ``vision_aspect_ratio``). ``LlavaOnevisionProcessor`` is
built by mmserve from those parts (its video processor needs torchvision, and is never loaded).
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                          LlavaOnevisionImageProcessorPil, Qwen2Config, SiglipVisionConfig)

from mmserve.models.random_weights import remove_marker, write_random_weights

from .common import ProcessorSettings, lookup_preset, save_checkpoint
from .tokenizer import build_onevision_tokenizer, generation_config

@dataclasses.dataclass(frozen=True)
class OnevisionPreset:
    """Sizes of one LLaVA-OneVision model and its image processor."""

    name: str
    image_size: int  # a tile's side in pixels (the processor's size, the tower's image_size)
    patch_size: int
    grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width) resolutions the tiles may cover
    vision_aspect_ratio: str  # "anyres_max_N": grids past ~N tiles are pooled down (bilinear)
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    rope_theta: float = 1e6
    max_position_embeddings: int = 4096
    dtype: str = "float32"

    @property
    def tile_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2


ONEVISION_PRESETS: dict[str, OnevisionPreset] = {
    # random weights, smallest: 32 px tiles of 4x4 patches; grids of 1..6 tiles (and 2x3 = 6
    # tiles pooled down by anyres_max_4), so image sizes cross tile counts
    "tiny-llava-onevision": OnevisionPreset(
        name="tiny-llava-onevision",
        image_size=32, patch_size=8,
        grid_pinpoints=((32, 32), (32, 64), (64, 32), (64, 64), (32, 96), (96, 32), (64, 96), (96, 64)),
        vision_aspect_ratio="anyres_max_4",
        vision_hidden=32, vision_layers=2, vision_heads=2, vision_intermediate=64,
        text_hidden=64, text_layers=2, text_heads=4, text_kv_heads=2, text_intermediate=128,
        rope_theta=1e4,
    ),
    # llava-onevision-qwen2-7b-ov's shape (SigLIP so400m at 384 px, Qwen2-7B; the demo
    # vocabulary): 6.9e9 parameters, ~14 GB in bfloat16: built only on request
    "llava-onevision-7b": OnevisionPreset(
        name="llava-onevision-7b",
        image_size=384, patch_size=14,
        grid_pinpoints=tuple((h * 384, w * 384) for h in range(1, 7) for w in range(1, 7)),
        vision_aspect_ratio="anyres_max_9",
        vision_hidden=1152, vision_layers=26, vision_heads=16, vision_intermediate=4304,
        text_hidden=3584, text_layers=28, text_heads=28, text_kv_heads=4, text_intermediate=18944,
        max_position_embeddings=32768, dtype="bfloat16",
    ),
}


def get_onevision_preset(preset: str | OnevisionPreset) -> OnevisionPreset:
    return lookup_preset(preset, ONEVISION_PRESETS, OnevisionPreset, "LLaVA-OneVision")


def build_onevision_image_processor(preset: str | OnevisionPreset) -> LlavaOnevisionImageProcessorPil:
    p = get_onevision_preset(preset)
    return LlavaOnevisionImageProcessorPil(
        size={"height": p.image_size, "width": p.image_size},
        image_grid_pinpoints=[list(g) for g in p.grid_pinpoints],
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],  # SigLIP's
    )


def processor_settings(preset: str | OnevisionPreset) -> dict:
    """What processor_config.json holds: LlavaOnevisionProcessor's own arguments."""
    p = get_onevision_preset(preset)
    return {"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": p.tile_tokens,
            "vision_feature_select_strategy": "full", "vision_aspect_ratio": p.vision_aspect_ratio,
            "image_token": "<image>", "video_token": "<video>"}


def build_onevision_config(preset: str | OnevisionPreset, tokenizer) -> LlavaOnevisionConfig:
    p = get_onevision_preset(preset)
    vision = SiglipVisionConfig(
        hidden_size=p.vision_hidden, intermediate_size=p.vision_intermediate,
        num_hidden_layers=p.vision_layers, num_attention_heads=p.vision_heads,
        image_size=p.image_size, patch_size=p.patch_size, vision_use_head=False,
    )
    text = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=p.text_hidden, intermediate_size=p.text_intermediate,
        num_hidden_layers=p.text_layers, num_attention_heads=p.text_heads, num_key_value_heads=p.text_kv_heads,
        max_position_embeddings=p.max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    config = LlavaOnevisionConfig(
        vision_config=vision, text_config=text,
        image_token_id=tokenizer.image_token_id,
        # without a <video> token (the LLaVA demo's tokenizer): an id no prompt holds as video
        video_token_id=getattr(tokenizer, "video_token_id", None) or tokenizer.pad_token_id,
        vision_feature_select_strategy="full", vision_feature_layer=-1,
        vision_aspect_ratio=p.vision_aspect_ratio,
        image_grid_pinpoints=[list(g) for g in p.grid_pinpoints],
        projector_hidden_act="gelu", tie_word_embeddings=False,
    )
    config.dtype = p.dtype
    return config


def build_onevision_model(preset: str | OnevisionPreset, tokenizer, seed: int = 0):
    p = get_onevision_preset(preset)
    config = build_onevision_config(p, tokenizer)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration._from_config(config, dtype=getattr(torch, p.dtype))
    model.generation_config = generation_config(tokenizer)
    return model.eval()


def checkpoint_parts(p: OnevisionPreset, tokenizer) -> list:
    """What a LLaVA-OneVision checkpoint saves besides the model: tokenizer, image processor and
    processor settings (the builders here and the benchmark's save them alike)."""
    return [tokenizer, build_onevision_image_processor(p), ProcessorSettings(processor_settings(p))]


def build_untrained_onevision(preset: str, out_dir, seed: int = 0) -> pathlib.Path:
    """Tokenizer + image processor + processor settings + random-init model, saved to out_dir."""
    p = get_onevision_preset(preset)
    tokenizer = build_onevision_tokenizer()
    model = build_onevision_model(p, tokenizer, seed=seed)
    remove_marker(out_dir)
    return save_checkpoint(model, checkpoint_parts(p, tokenizer), out_dir)


def write_random_onevision(preset: str, out_dir, seed: int = 0) -> pathlib.Path:
    """A random-weights directory of a LLaVA-OneVision preset (no weight file)."""
    p = get_onevision_preset(preset)
    tok = build_onevision_tokenizer()
    return write_random_weights(out_dir, build_onevision_config(p, tok), generation_config(tok), checkpoint_parts(p, tok),
                                tok, seed=seed, dtype=p.dtype, preset=p.name)

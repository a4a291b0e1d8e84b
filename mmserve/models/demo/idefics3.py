"""Idefics3 / SmolVLM presets and builders (random weights only).

Every preset is a plain ``Idefics3ForConditionalGeneration`` (a SigLIP-style vision tower, a pixel
shuffle connector, a Llama text model) saved with ``save_pretrained`` next to an
``Idefics3Processor`` saved the same way: the demo byte-level BPE tokenizer with Idefics3's image
tokens (``<image>``, ``<fake_token_around_image>``, ``<global-img>``, ``<row_i_col_j>`` for
i, j <= 6, ``<end_of_utterance>``; the demo chat template), an ``Idefics3ImageProcessorPil`` (the
torchvision-free image processor; its ``preprocessor_config.json`` names
``Idefics3ImageProcessor``, as SmolVLM's do) and ``processor_config.json`` (``image_seq_len``).

The image processor resizes every image so its longest edge is ``size["longest_edge"]``, rounds
both sides up to whole tiles of ``max_image_size["longest_edge"]`` (the tower's ``image_size``)
and cuts them, row by row, then adds the whole image at tile size (the global view): an image makes
``rows x cols + 1`` views of ``image_seq_len`` tokens each, with row/column markers between them.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                          Idefics3Processor, LlamaConfig, PreTrainedTokenizerFast)
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

from mmserve.models.random_weights import remove_marker, write_random_weights

from .common import lookup_preset, save_checkpoint
from .tokenizer import BOS, CHAT_TEMPLATE, EOS, IMAGE, PAD, demo_tokenizer, generation_config

FAKE_TOKEN, GLOBAL_IMAGE, END_OF_UTTERANCE = "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"
TILE_TOKENS = tuple(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6))
IDEFICS3_SPECIAL_TOKENS = (BOS, EOS, PAD, IMAGE, FAKE_TOKEN, GLOBAL_IMAGE, END_OF_UTTERANCE, *TILE_TOKENS)


@dataclasses.dataclass(frozen=True)
class Idefics3Preset:
    """Sizes of one Idefics3 model and its image processor."""

    name: str
    image_size: int  # a tile's side in pixels (the tower's image_size, the processor's max_image_size)
    patch_size: int
    scale_factor: int  # the connector's pixel shuffle: scale_factor**2 patches make one token
    longest_edge: int  # the processor resizes the image's longest edge to this, then tiles it
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    rope_theta: float = 1e4
    max_position_embeddings: int = 4096
    dtype: str = "float32"

    @property
    def image_seq_len(self) -> int:
        """Tokens a view (tile or global) makes: its patches after the pixel shuffle."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor ** 2


IDEFICS3_PRESETS: dict[str, Idefics3Preset] = {
    # random weights, smallest: 32 px tiles of 4x4-pixel patches, 16 tokens a view; images are
    # resized to a 96 px longest edge, so they split into 1..3 x 1..3 tiles plus the global view
    # (a square one: 3x3 + 1 = 10 views, 160 image tokens and 25 markers)
    "tiny-idefics3": Idefics3Preset(
        name="tiny-idefics3",
        image_size=32, patch_size=4, scale_factor=2, longest_edge=96,
        vision_hidden=32, vision_layers=2, vision_heads=2, vision_intermediate=64,
        text_hidden=64, text_layers=2, text_heads=4, text_kv_heads=2, text_intermediate=128,
    ),
    # SmolVLM-Instruct's shape (SigLIP so400m at 384 px, 3x3 pixel shuffle: 81 tokens a view;
    # images resized to a 1536 px longest edge, up to 4x4 tiles; SmolLM2-1.7B; the demo
    # vocabulary): 2.0e9 parameters, ~4 GB in bfloat16
    "smolvlm-2b": Idefics3Preset(
        name="smolvlm-2b",
        image_size=384, patch_size=14, scale_factor=3, longest_edge=4 * 384,
        vision_hidden=1152, vision_layers=27, vision_heads=16, vision_intermediate=4304,
        text_hidden=2048, text_layers=24, text_heads=32, text_kv_heads=32, text_intermediate=8192,
        rope_theta=273768.0, max_position_embeddings=16384, dtype="bfloat16",
    ),
}


def get_idefics3_preset(preset: str | Idefics3Preset) -> Idefics3Preset:
    return lookup_preset(preset, IDEFICS3_PRESETS, Idefics3Preset, "Idefics3")


def build_idefics3_tokenizer() -> PreTrainedTokenizerFast:
    """The demo BPE with Idefics3's image tokens, all special (`Idefics3Processor` then keeps only
    its own three on the tokenizer's list, as with SmolVLM's: the others stay special added tokens)."""
    tok = demo_tokenizer(IDEFICS3_SPECIAL_TOKENS, image_token=IMAGE)
    tok.add_special_tokens({"additional_special_tokens": list(IDEFICS3_SPECIAL_TOKENS[3:])})
    return tok


def build_idefics3_image_processor(preset: str | Idefics3Preset) -> Idefics3ImageProcessorPil:
    p = get_idefics3_preset(preset)
    return Idefics3ImageProcessorPil(
        size={"longest_edge": p.longest_edge}, max_image_size={"longest_edge": p.image_size},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],  # SigLIP's (SmolVLM's)
    )


def build_idefics3_processor(preset: str | Idefics3Preset, tokenizer=None) -> Idefics3Processor:
    """transformers' own processor over the demo tokenizer and the preset's image processor."""
    p = get_idefics3_preset(preset)
    tokenizer = tokenizer if tokenizer is not None else build_idefics3_tokenizer()
    return Idefics3Processor(image_processor=build_idefics3_image_processor(p), tokenizer=tokenizer,
                             image_seq_len=p.image_seq_len, chat_template=CHAT_TEMPLATE)


def build_idefics3_config(preset: str | Idefics3Preset, tokenizer) -> Idefics3Config:
    p = get_idefics3_preset(preset)
    vision = Idefics3VisionConfig(
        hidden_size=p.vision_hidden, intermediate_size=p.vision_intermediate,
        num_hidden_layers=p.vision_layers, num_attention_heads=p.vision_heads,
        image_size=p.image_size, patch_size=p.patch_size,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=p.text_hidden, intermediate_size=p.text_intermediate,
        num_hidden_layers=p.text_layers, num_attention_heads=p.text_heads, num_key_value_heads=p.text_kv_heads,
        max_position_embeddings=p.max_position_embeddings, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=p.scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE), pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config.dtype = p.dtype
    return config


def build_idefics3_model(preset: str | Idefics3Preset, tokenizer, seed: int = 0):
    p = get_idefics3_preset(preset)
    config = build_idefics3_config(p, tokenizer)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration._from_config(config, dtype=getattr(torch, p.dtype))
    model.generation_config = generation_config(tokenizer)
    return model.eval()


def build_untrained_idefics3(preset: str, out_dir, seed: int = 0) -> pathlib.Path:
    """Processor (tokenizer, image processor, image_seq_len) + random-init model, saved to out_dir."""
    p = get_idefics3_preset(preset)
    processor = build_idefics3_processor(p)
    model = build_idefics3_model(p, processor.tokenizer, seed=seed)
    remove_marker(out_dir)
    return save_checkpoint(model, [processor], out_dir)


def write_random_idefics3(preset: str, out_dir, seed: int = 0) -> pathlib.Path:
    """A random-weights directory of an Idefics3 preset (no weight file). The silenced tokens are
    those of the tokenizer before `Idefics3Processor` adds its own three special tokens (which
    leaves the markers' ids off its list of special tokens): the markers are silenced too."""
    p = get_idefics3_preset(preset)
    tok = build_idefics3_tokenizer()
    processor = build_idefics3_processor(p, build_idefics3_tokenizer())
    return write_random_weights(out_dir, build_idefics3_config(p, tok), generation_config(tok), [processor], tok,
                                seed=seed, dtype=p.dtype, preset=p.name)

"""Gemma 3 presets and builders (random weights only).

Every preset is a plain ``Gemma3ForConditionalGeneration`` (a SigLIP vision tower, the
multimodal projector's average pool down to ``mm_tokens_per_image`` tokens, Gemma 3's text model
with sliding-window and global layers) saved with ``save_pretrained`` next to the demo byte-level
BPE tokenizer carrying Gemma 3's image tokens (``<start_of_image>`` where the chat template puts
an image, ``<image_soft_token>`` for its placeholders, ``<end_of_image>``), a
``Gemma3ImageProcessorPil`` (the torchvision-free image processor) and a
``processor_config.json`` with the processor's ``image_seq_length``. The tiny preset's window (32
tokens) is shorter than a two-image prompt, and its layers mix both kinds, so the tests cross it.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3TextConfig,
                          PreTrainedTokenizerFast, SiglipVisionConfig)

from mmserve.models.random_weights import remove_marker, write_random_weights

from .common import ProcessorSettings, lookup_preset, save_checkpoint
from .tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, demo_tokenizer, generation_config

BOI, SOFT, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
GEMMA3_SPECIAL_TOKENS = (BOS, EOS, PAD, BOI, SOFT, EOI)
GEMMA3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{{- '<image>' -}}", "{{- '" + BOI + "' -}}")


@dataclasses.dataclass(frozen=True)
class Gemma3Preset:
    """Sizes of one Gemma 3 model and its image processor."""

    name: str
    image_size: int
    patch_size: int
    mm_tokens_per_image: int  # a square number; the tower's patches are average-pooled down to it
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    head_dim: int
    text_intermediate: int
    sliding_window: int
    global_every: int  # every n-th layer is global (full attention), the others slide
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    pan_and_scan: bool = False

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.global_every == 0 else "sliding_attention"
                for i in range(self.text_layers)]


GEMMA3_PRESETS: dict[str, Gemma3Preset] = {
    # random weights, smallest: 32 px images of 8 px patches -> 16 tokens; a 32-token window; layers
    # sliding, global, sliding
    "tiny-gemma3": Gemma3Preset(
        name="tiny-gemma3", image_size=32, patch_size=8, mm_tokens_per_image=16,
        vision_hidden=32, vision_layers=2, vision_heads=2, vision_intermediate=64,
        text_hidden=64, text_layers=3, text_heads=4, text_kv_heads=2, head_dim=16, text_intermediate=128,
        sliding_window=32, global_every=2,
    ),
    # gemma-3-4b-it's shape (SigLIP so400m at 896 px -> 256 tokens; 34 layers, 5 sliding of 1024
    # tokens to 1 global; the demo vocabulary): ~3.9e9 parameters, ~8 GB in bfloat16
    "gemma3-4b": Gemma3Preset(
        name="gemma3-4b", image_size=896, patch_size=14, mm_tokens_per_image=256,
        vision_hidden=1152, vision_layers=27, vision_heads=16, vision_intermediate=4304,
        text_hidden=2560, text_layers=34, text_heads=8, text_kv_heads=4, head_dim=256, text_intermediate=10240,
        sliding_window=1024, global_every=6, max_position_embeddings=131072, dtype="bfloat16",
    ),
}


def get_gemma3_preset(preset: str | Gemma3Preset) -> Gemma3Preset:
    return lookup_preset(preset, GEMMA3_PRESETS, Gemma3Preset, "Gemma 3")


def build_gemma3_tokenizer() -> PreTrainedTokenizerFast:
    """The demo BPE with Gemma 3's image tokens (``tokenizer.image_token`` is the soft token,
    ``boi_token`` what the chat template writes per image)."""
    return demo_tokenizer(GEMMA3_SPECIAL_TOKENS, GEMMA3_CHAT_TEMPLATE, image_token=SOFT, boi_token=BOI, eoi_token=EOI)


def build_gemma3_image_processor(preset: str | Gemma3Preset) -> Gemma3ImageProcessorPil:
    p = get_gemma3_preset(preset)
    return Gemma3ImageProcessorPil(size={"height": p.image_size, "width": p.image_size},
                                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                                   do_pan_and_scan=p.pan_and_scan, pan_and_scan_min_crop_size=p.image_size,
                                   pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)


def build_gemma3_config(preset: str | Gemma3Preset, tokenizer) -> Gemma3Config:
    p = get_gemma3_preset(preset)
    vision = SiglipVisionConfig(
        hidden_size=p.vision_hidden, intermediate_size=p.vision_intermediate, num_hidden_layers=p.vision_layers,
        num_attention_heads=p.vision_heads, image_size=p.image_size, patch_size=p.patch_size, vision_use_head=False,
    )
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=p.text_hidden, intermediate_size=p.text_intermediate,
        num_hidden_layers=p.text_layers, num_attention_heads=p.text_heads, num_key_value_heads=p.text_kv_heads,
        head_dim=p.head_dim, query_pre_attn_scalar=p.head_dim, sliding_window=p.sliding_window,
        layer_types=p.layer_types, max_position_embeddings=p.max_position_embeddings,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    config = Gemma3Config(
        vision_config=vision, text_config=text, mm_tokens_per_image=p.mm_tokens_per_image,
        boi_token_id=tokenizer.convert_tokens_to_ids(BOI), eoi_token_id=tokenizer.convert_tokens_to_ids(EOI),
        image_token_id=tokenizer.convert_tokens_to_ids(SOFT), tie_word_embeddings=False,
    )
    config.dtype = p.dtype
    return config


def build_gemma3_model(preset: str | Gemma3Preset, tokenizer, seed: int = 0):
    from mmserve.models.random_weights import draw_zero_initialised

    p = get_gemma3_preset(preset)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration._from_config(build_gemma3_config(p, tokenizer), dtype=getattr(torch, p.dtype))
    draw_zero_initialised(model)
    model.generation_config = generation_config(tokenizer)
    return model.eval()


def checkpoint_parts(p: Gemma3Preset, tokenizer) -> list:
    """What a Gemma 3 checkpoint saves besides the model: tokenizer, image processor and
    processor settings (the builders here and the benchmark's save them alike)."""
    settings = {"processor_class": "Gemma3Processor", "image_seq_length": p.mm_tokens_per_image}
    return [tokenizer, build_gemma3_image_processor(p), ProcessorSettings(settings)]


def build_untrained_gemma3(preset: str, out_dir, seed: int = 0) -> pathlib.Path:
    """Tokenizer + image processor + processor settings + random-init model, saved to out_dir."""
    p = get_gemma3_preset(preset)
    tokenizer = build_gemma3_tokenizer()
    model = build_gemma3_model(p, tokenizer, seed=seed)
    remove_marker(out_dir)
    return save_checkpoint(model, checkpoint_parts(p, tokenizer), out_dir)


def write_random_gemma3(preset: str, out_dir, seed: int = 0) -> pathlib.Path:
    """A random-weights directory of a Gemma 3 preset (no weight file)."""
    p = get_gemma3_preset(preset)
    tok = build_gemma3_tokenizer()
    return write_random_weights(out_dir, build_gemma3_config(p, tok), generation_config(tok), checkpoint_parts(p, tok),
                                tok, seed=seed, dtype=p.dtype, preset=p.name)

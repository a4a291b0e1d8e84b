"""Model presets and builders for the demo LLaVA checkpoints.

Every preset is a real ``LlavaForConditionalGeneration`` (CLIP vision tower + Llama text model)
with a ``LlavaProcessor`` (``CLIPImageProcessorPil`` + byte-level BPE fast tokenizer), saved with
``save_pretrained`` so the ``Auto*`` classes load it.
"""

from __future__ import annotations

import dataclasses
import pathlib

import torch
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from mmserve.config import DEMO_CHECKPOINTS
from mmserve.models.random_weights import remove_marker, write_random_weights

from .common import lookup_preset, save_checkpoint
from .tokenizer import CHAT_TEMPLATE, build_tokenizer, generation_config

CHECKPOINTS_ROOT = DEMO_CHECKPOINTS  # one place knows where the committed checkpoints live


@dataclasses.dataclass(frozen=True)
class Preset:
    """Sizes of one demo model."""

    name: str
    # vision tower (CLIP)
    image_size: int  # the processor's crop size, in pixels
    patch_size: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    # text model (Llama)
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    max_position_embeddings: int = 4096
    trained: bool = False  # True: a committed checkpoint exists (see checkpoint_dir)
    vocab_size: int | None = None  # None: the tokenizer's; larger: ids it lacks decode to nothing
    dtype: str = "float32"  # the dtype the model is built (and saved) in
    vision_act: str = "quick_gelu"  # the CLIP tower's activation
    vision_feature_layer: int = -1  # -1 for tiny towers (PITFALLS.md); LLaVA-1.5 reads -2

    @property
    def num_image_tokens(self) -> int:
        """Placeholders per image (= image features; the CLS token is dropped)."""
        return (self.image_size // self.patch_size) ** 2


PRESETS: dict[str, Preset] = {
    # trained demo models (text hidden sizes differ on purpose: cross-model isolation tests)
    "demo": Preset(
        name="demo",
        image_size=32,
        patch_size=8,
        vision_hidden=96,
        vision_layers=3,
        vision_heads=3,
        vision_intermediate=384,
        text_hidden=128,
        text_layers=2,
        text_heads=4,
        text_kv_heads=4,
        text_intermediate=344,
        trained=True,
    ),
    "demo-wide": Preset(
        name="demo-wide",
        image_size=32,
        patch_size=8,
        vision_hidden=96,
        vision_layers=3,
        vision_heads=3,
        vision_intermediate=384,
        text_hidden=192,
        text_layers=2,
        text_heads=6,
        text_kv_heads=6,
        text_intermediate=512,
        trained=True,
    ),
    # random weights, smallest: fast unit tests (GQA: 4 query heads share 2 KV heads)
    "tiny": Preset(
        name="tiny",
        image_size=32,
        patch_size=8,
        vision_hidden=32,
        vision_layers=1,
        vision_heads=2,
        vision_intermediate=64,
        text_hidden=64,
        text_layers=2,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=128,
    ),
    # random weights, realistic CPU benchmark shape: 256 image tokens
    "bench": Preset(
        name="bench",
        image_size=224,
        patch_size=14,
        vision_hidden=384,
        vision_layers=6,
        vision_heads=6,
        vision_intermediate=1536,
        text_hidden=512,
        text_layers=8,
        text_heads=8,
        text_kv_heads=8,
        text_intermediate=1408,
    ),
    # random weights, LLaVA-1.5-7B's shape: Llama-2-7B + CLIP ViT-L/14 at 336 px (576 image tokens), its
    # vocabulary padded to 32064 as the real one; ~14 GB in bfloat16: make-model --random-weights, or the GPU
    "llava-7b": Preset(
        name="llava-7b",
        image_size=336,
        patch_size=14,
        vision_hidden=1024,
        vision_layers=24,
        vision_heads=16,
        vision_intermediate=4096,
        text_hidden=4096,
        text_layers=32,
        text_heads=32,
        text_kv_heads=32,
        text_intermediate=11008,
        max_position_embeddings=4096,
        vocab_size=32064,
        dtype="bfloat16",
        vision_feature_layer=-2,
    ),
}


def get_preset(preset: str | Preset) -> Preset:
    return lookup_preset(preset, PRESETS, Preset, "demo")


def checkpoint_dir(name: str) -> pathlib.Path:
    """The committed trained checkpoint directory ``mmserve/models/demo/checkpoints/<name>``."""
    return CHECKPOINTS_ROOT / name


def build_processor(preset: str | Preset) -> LlavaProcessor:
    p = get_preset(preset)
    tokenizer = build_tokenizer()
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": p.image_size},
        crop_size={"height": p.image_size, "width": p.image_size},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=p.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token (dropped by the "default" strategy)
        chat_template=CHAT_TEMPLATE,
    )


def build_config(preset: str | Preset, tokenizer) -> LlavaConfig:
    p = get_preset(preset)
    vision = CLIPVisionConfig(
        hidden_size=p.vision_hidden,
        intermediate_size=p.vision_intermediate,
        num_hidden_layers=p.vision_layers,
        num_attention_heads=p.vision_heads,
        image_size=p.image_size,
        patch_size=p.patch_size,
        projection_dim=p.vision_hidden,
        hidden_act=p.vision_act,
    )
    text = LlamaConfig(
        vocab_size=p.vocab_size or len(tokenizer),
        hidden_size=p.text_hidden,
        intermediate_size=p.text_intermediate,
        num_hidden_layers=p.text_layers,
        num_attention_heads=p.text_heads,
        num_key_value_heads=p.text_kv_heads,
        max_position_embeddings=p.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.image_token_id,
        image_seq_length=p.num_image_tokens,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=p.vision_feature_layer,
    )
    if p.dtype != "float32":  # the float32 presets' saved configs stay as they were
        config.dtype = p.dtype
    return config


def build_model(preset: str | Preset, tokenizer, seed: int = 0) -> LlavaForConditionalGeneration:
    p = get_preset(preset)
    config = build_config(p, tokenizer)
    torch.manual_seed(seed)
    if p.dtype == "float32":
        model = LlavaForConditionalGeneration(config)
    else:  # built in its dtype: a float32 copy of the 7B shape would take 28 GB
        model = LlavaForConditionalGeneration._from_config(config, dtype=getattr(torch, p.dtype))
    model.generation_config = generation_config(tokenizer)
    model.eval()
    return model


def save(model, processor, out_dir) -> pathlib.Path:
    return save_checkpoint(model, [processor], out_dir)


def build_untrained(preset: str, out_dir, seed: int = 0, random_weights: bool = False) -> pathlib.Path:
    """Build tokenizer + processor + random-init model for ``preset`` and save them to out_dir.

    ``random_weights``: save no weights, only the config, processor and a marker; the model is
    drawn from ``seed`` where it is loaded (:mod:`mmserve.models.random_weights`).
    Qwen2-VL preset names (``tiny-qwen``, ``bench-qwen``, ...) go to :mod:`.qwen`, LLaVA-OneVision
    ones (``tiny-llava-onevision``, ``llava-onevision-7b``) to :mod:`.onevision`, Idefics3 ones
    (``tiny-idefics3``, ``smolvlm-2b``) to :mod:`.idefics3`, Gemma 3 ones (``tiny-gemma3``,
    ``gemma3-4b``) to :mod:`.gemma3`.
    """
    from .qwen import QWEN_PRESETS, build_untrained_qwen, write_random_qwen  # lazy: most callers build LLaVA only

    from .onevision import ONEVISION_PRESETS, build_untrained_onevision, write_random_onevision

    from .idefics3 import IDEFICS3_PRESETS, build_untrained_idefics3, write_random_idefics3

    from .gemma3 import GEMMA3_PRESETS, build_untrained_gemma3, write_random_gemma3

    if isinstance(preset, str) and preset in GEMMA3_PRESETS:
        if random_weights:
            return write_random_gemma3(preset, out_dir, seed=seed)
        return build_untrained_gemma3(preset, out_dir, seed=seed)
    if isinstance(preset, str) and preset in IDEFICS3_PRESETS:
        if random_weights:
            return write_random_idefics3(preset, out_dir, seed=seed)
        return build_untrained_idefics3(preset, out_dir, seed=seed)
    if isinstance(preset, str) and preset in ONEVISION_PRESETS:
        if random_weights:
            return write_random_onevision(preset, out_dir, seed=seed)
        return build_untrained_onevision(preset, out_dir, seed=seed)
    if isinstance(preset, str) and preset in QWEN_PRESETS:
        if random_weights:
            return write_random_qwen(preset, out_dir, seed=seed)
        return build_untrained_qwen(preset, out_dir, seed=seed)
    if random_weights:
        return write_random_llava(preset, out_dir, seed=seed)
    processor = build_processor(preset)
    model = build_model(preset, processor.tokenizer, seed=seed)
    remove_marker(out_dir)
    return save(model, processor, out_dir)


def write_random_llava(preset: str | Preset, out_dir, seed: int = 0) -> pathlib.Path:
    """A random-weights directory of a LLaVA preset (no weight file; see build_untrained)."""
    p = get_preset(preset)
    processor = build_processor(p)
    tok = processor.tokenizer
    return write_random_weights(out_dir, build_config(p, tok), generation_config(tok), [processor], tok,
                                seed=seed, dtype=p.dtype, preset=p.name)

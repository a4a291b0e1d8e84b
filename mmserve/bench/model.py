"""The benchmark's model: a random-weight demo preset whose every generated token streams as text.

A random-weight byte-level model under greedy decoding often settles on one token; if that token is
a lone non-ASCII byte (incomplete UTF-8), or whitespace the chat template's answer lead strips, the
server rightly holds its text back and a client sees nothing until the end — TTFT and decode
tokens/s measured at the client would then be meaningless. So the builder zeroes the output-head
rows of every token that does not decode to visible text on its own (special tokens included):
their logits are 0 while the best of the ~200 others is positive, so greedy decoding never picks
them. Shapes and costs are those of the preset; nothing else changes.

Every family is built this way: LLaVA presets (`bench`, `tiny`, ...), Qwen2-VL ones (`bench-qwen`,
`tiny-qwen`, ...), Qwen2.5-VL ones (`tiny-qwen2.5-vl`, `qwen2.5-vl-7b`), Qwen3-VL ones
(`tiny-qwen3-vl`, `qwen3-vl-8b`; the Qwen tokenizer's vision tokens are special, so a random Qwen
model never emits an image pad either), LLaVA-OneVision ones (`tiny-llava-onevision`,
`llava-onevision-7b`), Idefics3 ones (`tiny-idefics3`, `smolvlm-2b`; the tile markers are silenced
too, as the random-weights builder does) and Gemma 3 ones (`tiny-gemma3`, `gemma3-4b`). Which
family a checkpoint is comes from its config.json, as for `mmserve serve`.

Presets too large for a weights file to be worth writing (`llava-7b`, `qwen2-vl-7b`,
`qwen2.5-vl-7b`, `qwen3-vl-8b`, `llava-onevision-7b`, `smolvlm-2b`, `gemma3-4b`), or any preset with
`random_weights`, are built as random-weights directories instead (no weight file; the model is
drawn from a seed, on the device, where it is loaded: mmserve.models.random_weights). Their
silenced tokens are the same ones, listed in the directory's marker and zeroed at load.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mmserve.models.demo import gemma3, idefics3, onevision
from mmserve.models.demo.build import PRESETS, build_model, build_processor, build_untrained, get_preset, save
from mmserve.models.demo.common import save_checkpoint
from mmserve.models.demo.qwen import (QWEN_PRESETS, build_image_processor, build_qwen_model, get_qwen_preset,
                                      save_qwen)
from mmserve.models.demo.tokenizer import build_qwen_tokenizer, build_tokenizer
from mmserve.models.loading import FAMILIES, model_type
from mmserve.models.random_weights import remove_marker, silence, silent_token_ids

MARKER = "bench-model.json"
QWEN = "qwen2_vl"
QWEN_FAMILIES = frozenset({QWEN, "qwen2_5_vl", "qwen3_vl"})
"""model_types run the Qwen2-VL way: dynamic image sizes, inputs built by hand, M-RoPE positions."""
ADAPTER_INPUT_FAMILIES = frozenset({"llava_onevision", "idefics3", "gemma3"})
"""model_types whose HF baseline takes its `generate` inputs from the adapter's own tokens and pixel
items, laid out as the family's processor lays them out (`Adapter.generate_inputs`):
LlavaOnevisionProcessor needs torchvision here; Idefics3's and Gemma 3's go the same one way."""
SIZED_FAMILIES = QWEN_FAMILIES | {"llava_onevision", "idefics3"}
"""model_types whose image token count follows the image's size: the benchmark varies its sizes."""
FAMILY_PRESETS = {"LLaVA": tuple(PRESETS), "Qwen2-VL / Qwen2.5-VL / Qwen3-VL": tuple(QWEN_PRESETS),
                  "LLaVA-OneVision": tuple(onevision.ONEVISION_PRESETS),
                  "Idefics3/SmolVLM": tuple(idefics3.IDEFICS3_PRESETS), "Gemma 3": tuple(gemma3.GEMMA3_PRESETS)}
"""The presets `--preset` takes, by family."""
RANDOM_ONLY = frozenset({"llava-7b", "qwen2-vl-7b", "qwen2.5-vl-7b", "qwen3-vl-8b", "llava-onevision-7b",
                         "smolvlm-2b", "gemma3-4b"})
"""Presets the benchmark always builds as random-weights directories (a weights file of 4-16 GB
would only be written to be read back)."""


def family(model_dir) -> str:
    """The checkpoint's model_type as the benchmark treats it: one of QWEN_FAMILIES or
    ADAPTER_INPUT_FAMILIES, else "llava" (a directory without a readable config.json is refused by
    `load_adapter` before the benchmark reaches it)."""
    kind = model_type(model_dir)
    return kind if kind in QWEN_FAMILIES | ADAPTER_INPUT_FAMILIES else "llava"


def is_qwen(kind: str) -> bool:
    """Whether a `family` runs the Qwen2-VL way (QWEN_FAMILIES)."""
    return kind in QWEN_FAMILIES


def sizes_vary(kind: str) -> bool:
    """Whether a `family`'s image token count follows the image's size (SIZED_FAMILIES)."""
    return kind in SIZED_FAMILIES


def is_preset(name: str) -> bool:
    return any(name in presets for presets in FAMILY_PRESETS.values())


def family_name(kind: str) -> str:
    return FAMILIES.get(kind, kind)


def _silence(model, tok) -> int:
    silent = silent_token_ids(tok, model.lm_head.weight.shape[0])
    silence(model, silent)
    return len(silent)


def uses_random_weights(preset: str, random_weights: bool = False) -> bool:
    return random_weights or preset in RANDOM_ONLY


def default_model_dir(out, preset: str, random_weights: bool = False) -> Path:
    """Where the benchmark builds `preset` under its output directory."""
    return Path(out) / (f"{preset}-random-model" if uses_random_weights(preset, random_weights) else f"{preset}-model")


def build_bench_model(preset: str, out_dir, random_weights: bool = False) -> Path:
    if uses_random_weights(preset, random_weights):
        out = build_untrained(preset, out_dir, seed=0, random_weights=True)
        (out / MARKER).write_text(json.dumps(_identity(preset, True)) + "\n")
        return out
    remove_marker(out_dir)
    if preset in QWEN_PRESETS:
        tok = build_qwen_tokenizer()
        model = build_qwen_model(preset, tok, seed=0)
        silent = _silence(model, tok)
        out = save_qwen(model, tok, build_image_processor(preset), out_dir)
    elif preset in PRESETS:
        processor = build_processor(preset)
        model = build_model(preset, processor.tokenizer, seed=0)
        silent = _silence(model, processor.tokenizer)
        out = save(model, processor, out_dir)
    else:
        tok, model, parts = _family_parts(preset)
        silent = _silence(model, tok)
        out = save_checkpoint(model, parts, out_dir)
    (out / MARKER).write_text(json.dumps(dict(_identity(preset), silent_tokens_zeroed=silent)) + "\n")
    return out


def _family_parts(preset: str) -> tuple:
    """(the tokenizer whose silent tokens are zeroed, the seed-0 model, the parts saved beside it)
    of a LLaVA-OneVision, Idefics3 or Gemma 3 preset: what its demo builder saves
    (`build_untrained_*`). Idefics3's silent tokens are those of its tokenizer before
    `Idefics3Processor` adds its own (the tile markers included), as its random-weights directory's."""
    if preset in onevision.ONEVISION_PRESETS:
        tok = build_tokenizer()
        return tok, onevision.build_onevision_model(preset, tok, seed=0), onevision.checkpoint_parts(
            onevision.get_onevision_preset(preset), tok)
    if preset in idefics3.IDEFICS3_PRESETS:
        processor = idefics3.build_idefics3_processor(preset)
        return (idefics3.build_idefics3_tokenizer(), idefics3.build_idefics3_model(preset, processor.tokenizer, seed=0),
                [processor])
    if preset in gemma3.GEMMA3_PRESETS:
        tok = gemma3.build_gemma3_tokenizer()
        parts = gemma3.checkpoint_parts(gemma3.get_gemma3_preset(preset), tok)
        return tok, gemma3.build_gemma3_model(preset, tok, seed=0), parts
    raise ValueError(f"unknown preset {preset!r}")


def _preset_shape(preset: str):
    for names, get in ((QWEN_PRESETS, get_qwen_preset), (onevision.ONEVISION_PRESETS, onevision.get_onevision_preset),
                       (idefics3.IDEFICS3_PRESETS, idefics3.get_idefics3_preset),
                       (gemma3.GEMMA3_PRESETS, gemma3.get_gemma3_preset)):
        if preset in names:
            return get(preset)
    return get_preset(preset)


def _identity(preset: str, random_weights: bool = False) -> dict:
    shape = _preset_shape(preset)
    identity = {"preset": preset, "shape": dataclasses.asdict(shape), "seed": 0}
    if uses_random_weights(preset, random_weights):
        identity["random_weights"] = True
    # through JSON, as the marker holds it: a tuple field reads back as a list
    return json.loads(json.dumps(identity))


def ensure_model(model_dir, preset: str, random_weights: bool = False) -> Path:
    """The benchmark checkpoint of `preset` in `model_dir`, built there unless one of the same preset
    and shape (and kind: weights file or random weights) is already there."""
    model_dir = Path(model_dir)
    marker = model_dir / MARKER
    built = json.loads(marker.read_text()) if marker.exists() else {}
    wanted = _identity(preset, random_weights)
    if {k: built.get(k) for k in wanted} != wanted or set(built) - set(wanted) - {"silent_tokens_zeroed"}:
        build_bench_model(preset, model_dir, random_weights)
    return model_dir


def built_preset(model_dir) -> str | None:
    """The preset a benchmark checkpoint was built from; None for any other checkpoint."""
    try:
        return json.loads((Path(model_dir) / MARKER).read_text()).get("preset")
    except (OSError, ValueError):
        return None


def tokens_per_image(model_dir, images, n: int) -> dict[str, int]:
    """Image tokens of images(0..n-1), keyed "WxH": the run of prompt tokens each image takes, as
    the checkpoint's own processor arithmetic counts it, without loading the model (Qwen2-VL /
    Qwen2.5-VL / Qwen3-VL: the image's grid, merged; LLaVA-OneVision: LlavaOnevisionProcessor's
    count over its tiles; Idefics3: Idefics3Processor's expansion, tiles, markers and global view)."""
    count = _image_token_counter(Path(model_dir))
    return {f"{img.width}x{img.height}": count(img) for img in (images(i) for i in range(n))}


def _image_token_counter(model_dir: Path):
    kind = model_type(model_dir)
    if kind == "llava_onevision":
        from transformers import AutoConfig, LlavaOnevisionImageProcessorPil

        from mmserve.models.llava_onevision import image_tokens

        config = AutoConfig.from_pretrained(model_dir)
        vision = config.vision_config
        settings = {"num_image_tokens": (vision.image_size // vision.patch_size) ** 2,
                    "vision_feature_select_strategy": config.vision_feature_select_strategy,
                    "vision_aspect_ratio": config.vision_aspect_ratio}
        ip = LlavaOnevisionImageProcessorPil.from_pretrained(model_dir)
        return lambda img: image_tokens(ip, settings, img.height, img.width)
    if kind == "idefics3":
        from transformers import AutoConfig, AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor

        config = AutoConfig.from_pretrained(model_dir)
        side = config.vision_config.image_size // config.vision_config.patch_size
        processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil.from_pretrained(model_dir),
                                      tokenizer=AutoTokenizer.from_pretrained(model_dir),
                                      image_seq_len=(side // config.scale_factor) ** 2)
        return lambda img: len(processor(text=[processor.image_token], images=[[img]], add_special_tokens=False,
                                         return_tensors="pt")["input_ids"][0])
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)

    def qwen(img) -> int:
        grid = processor(images=[img], return_tensors="pt")["image_grid_thw"][0]
        return int(grid.prod()) // processor.merge_size ** 2

    return qwen

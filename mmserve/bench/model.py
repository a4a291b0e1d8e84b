"""The benchmark's model: a random-weight demo preset whose every generated token streams as text.

A random-weight byte-level model under greedy decoding often settles on one token; if that token is
a lone non-ASCII byte (incomplete UTF-8), or whitespace the chat template's answer lead strips, the
server rightly holds its text back and a client sees nothing until the end — TTFT and decode
tokens/s measured at the client would then be meaningless. So the builder zeroes the output-head
rows of every token that does not decode to visible text on its own (special tokens included):
their logits are 0 while the best of the ~200 others is positive, so greedy decoding never picks
them. Shapes and costs are those of the preset; nothing else changes.

Every family is built this way: LLaVA presets (`bench`, `tiny`, ...), Qwen2-VL ones (`bench-qwen`,
`tiny-qwen`, ...), Qwen2.5-VL ones (`tiny-qwen2.5-vl`, `qwen2.5-vl-7b`) and Qwen3-VL ones
(`tiny-qwen3-vl`, `qwen3-vl-8b`; the Qwen tokenizer's vision tokens are special, so a random Qwen
model never emits an image pad either). Which family a checkpoint is comes from its config.json,
as for `mmserve serve`.

Presets too large for a weights file to be worth writing (`llava-7b`, `qwen2-vl-7b`,
`qwen2.5-vl-7b`, `qwen3-vl-8b`), or any preset with `random_weights`, are built as random-weights directories
instead (no weight file; the model is drawn from a seed, on the device, where it is loaded:
mmserve.models.random_weights). Their silenced tokens are the same ones, listed in the
directory's marker and zeroed at load.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mmserve.models.demo.build import build_model, build_processor, build_untrained, get_preset, save
from mmserve.models.demo.qwen import (QWEN_PRESETS, build_image_processor, build_qwen_model, get_qwen_preset,
                                      save_qwen)
from mmserve.models.demo.tokenizer import build_qwen_tokenizer
from mmserve.models.loading import FAMILIES, model_type
from mmserve.models.random_weights import remove_marker, silence, silent_token_ids

MARKER = "bench-model.json"
QWEN = "qwen2_vl"
QWEN_FAMILIES = frozenset({QWEN, "qwen2_5_vl", "qwen3_vl"})
"""model_types run the Qwen2-VL way: dynamic image sizes, inputs built by hand, M-RoPE positions."""
RANDOM_ONLY = frozenset({"llava-7b", "qwen2-vl-7b", "qwen2.5-vl-7b", "qwen3-vl-8b"})
"""Presets the benchmark always builds as random-weights directories (a weights file of 14-15 GB
would only be written to be read back)."""


def family(model_dir) -> str:
    """The checkpoint's model_type as the benchmark treats it: "qwen2_vl", "qwen2_5_vl" or
    "qwen3_vl", else "llava" (a directory without a readable config.json is refused by
    `load_adapter` before the benchmark reaches it)."""
    kind = model_type(model_dir)
    return kind if kind in QWEN_FAMILIES else "llava"


def is_qwen(kind: str) -> bool:
    """Whether a `family` runs the Qwen2-VL way (QWEN_FAMILIES)."""
    return kind in QWEN_FAMILIES


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
    else:
        processor = build_processor(preset)
        model = build_model(preset, processor.tokenizer, seed=0)
        silent = _silence(model, processor.tokenizer)
        out = save(model, processor, out_dir)
    (out / MARKER).write_text(json.dumps(dict(_identity(preset), silent_tokens_zeroed=silent)) + "\n")
    return out


def _identity(preset: str, random_weights: bool = False) -> dict:
    shape = get_qwen_preset(preset) if preset in QWEN_PRESETS else get_preset(preset)
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
    """Image tokens of images(0..n-1), keyed "WxH", as the checkpoint's Qwen2-VL image processor
    (Qwen2.5-VL's is the same) counts them (the image's grid, merged): the placeholder run each
    image takes in a prompt."""
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    out = {}
    for i in range(n):
        img = images(i)
        grid = processor(images=[img], return_tensors="pt")["image_grid_thw"][0]
        out[f"{img.width}x{img.height}"] = int(grid.prod()) // processor.merge_size ** 2
    return out

"""What the demo families' builders share: a preset looked up by name, a full checkpoint saved with
its processor parts, and processor_config.json as one of those parts."""

from __future__ import annotations

import json
import pathlib
from typing import Mapping, Sequence, TypeVar

P = TypeVar("P")
PROCESSOR_CONFIG = "processor_config.json"


def lookup_preset(preset: str | P, presets: Mapping[str, P], kind: type, family: str) -> P:
    """`preset` itself when it is a `kind`, else the one of `presets` so named."""
    if isinstance(preset, kind):
        return preset
    try:
        return presets[preset]
    except KeyError:
        raise ValueError(f"unknown {family} preset {preset!r}; expected one of {sorted(presets)}") from None


def save_checkpoint(model, parts: Sequence, out_dir) -> pathlib.Path:
    """The model (safetensors, config.json, generation_config.json) and each of `parts` (processor,
    tokenizer, image processor, processor settings: anything with `save_pretrained`) in out_dir."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for part in parts:
        part.save_pretrained(out)
    return out


class ProcessorSettings:
    """save_pretrained of processor_config.json (a part of write_random_weights and save_checkpoint)."""

    def __init__(self, settings: dict):
        self.settings = settings

    def save_pretrained(self, out) -> None:
        (pathlib.Path(out) / PROCESSOR_CONFIG).write_text(json.dumps(self.settings, indent=2) + "\n")

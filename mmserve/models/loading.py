"""Which adapter a checkpoint needs: the family named by its `config.json` `model_type`.

`check_checkpoint` reads only that file (no torch, no transformers), so `mmserve serve` can refuse
a directory that is not a servable checkpoint in one line before it starts anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.errors import NotACheckpoint, UnsupportedModelType

if TYPE_CHECKING:
    from mmserve.models.adapter import Adapter

FAMILIES = {"llava": "LLaVA", "qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL",
            "llava_onevision": "LLaVA-OneVision", "qwen3_vl": "Qwen3-VL",
            "idefics3": "Idefics3/SmolVLM", "gemma3": "Gemma 3"}
"""model_type -> family name, for every family mmserve serves."""


def served_model_types() -> str:
    """`llava (LLaVA), qwen2_vl (Qwen2-VL), qwen2_5_vl (Qwen2.5-VL)`: for messages and help texts."""
    return ", ".join(f"{kind} ({family})" for kind, family in FAMILIES.items())


def model_type(path: str | Path) -> str | None:
    """The checkpoint's `model_type`, or None when its config.json is missing or unreadable."""
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def check_checkpoint(name: str, path: str | Path) -> str:
    """The `model_type` of the checkpoint at `path`, one that mmserve serves; NotACheckpoint or
    UnsupportedModelType, saying what is wrong and what is served, otherwise."""
    path = Path(path)
    served = f"mmserve serves model_type {served_model_types()}"
    if not path.is_dir():
        raise NotACheckpoint(f"model {name!r}: the checkpoint directory {path} does not exist")
    config = path / "config.json"
    if not config.is_file():
        raise NotACheckpoint(f"model {name!r}: {path} is not a checkpoint: it has no config.json "
                             f"(a directory written by save_pretrained has it; {served})")
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise NotACheckpoint(f"model {name!r}: {config} cannot be read as JSON ({e})") from None
    kind = settings.get("model_type") if isinstance(settings, dict) else None
    if not isinstance(kind, str) or not kind:
        raise NotACheckpoint(f"model {name!r}: {config} names no model_type, so the model's family is "
                             f"unknown ({served})")
    if kind not in FAMILIES:
        raise UnsupportedModelType(f"model {name!r}: model_type {kind!r} is not served by mmserve "
                                   f"({config}); {served}")
    return kind


def load_adapter(name: str, path: str | Path, device: str = "cpu", dtype: str = "float32", *,
                 hash_algorithm: str = "xxh3_128") -> Adapter:
    """Loads the checkpoint at `path` with its family's adapter."""
    kind = check_checkpoint(name, path)
    if kind == "qwen2_vl":
        from mmserve.models.qwen2_vl import Qwen2VLAdapter as cls
    elif kind == "qwen2_5_vl":
        from mmserve.models.qwen2_5_vl import Qwen2_5_VLAdapter as cls
    elif kind == "qwen3_vl":
        from mmserve.models.qwen3_vl import Qwen3VLAdapter as cls
    elif kind == "llava_onevision":
        from mmserve.models.llava_onevision import LlavaOnevisionAdapter as cls
    elif kind == "idefics3":
        from mmserve.models.idefics3 import Idefics3Adapter as cls
    elif kind == "gemma3":
        from mmserve.models.gemma3 import Gemma3Adapter as cls
    else:
        from mmserve.models.llava import LlavaAdapter as cls
    return cls(name, path, device=device, dtype=dtype, hash_algorithm=hash_algorithm)

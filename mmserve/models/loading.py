"""Which adapter a checkpoint needs: the family named by its `config.json` `model_type`."""

from __future__ import annotations

import json
from pathlib import Path

from mmserve.models.adapter import Adapter

FAMILIES = {"llava": "LLaVA", "qwen2_vl": "Qwen2-VL"}
"""model_type -> family name, for every family mmserve serves."""


def model_type(path: str | Path) -> str | None:
    """The checkpoint's `model_type`, or None when its config.json is missing or unreadable."""
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def load_adapter(name: str, path: str | Path, device: str = "cpu", dtype: str = "float32", *,
                 hash_algorithm: str = "xxh3_128") -> Adapter:
    """Loads the checkpoint at `path` with its family's adapter."""
    kind = model_type(path)
    if kind == "qwen2_vl":
        from mmserve.models.qwen2_vl import Qwen2VLAdapter as cls
    elif kind == "llava" or kind is None:  # None: the LLaVA loader says what is missing
        from mmserve.models.llava import LlavaAdapter as cls
    else:
        supported = ", ".join(f"{k} ({v})" for k, v in FAMILIES.items())
        raise ValueError(f"model {name!r}: checkpoint model_type {kind!r} is not served by mmserve; "
                         f"supported: {supported}")
    return cls(name, path, device=device, dtype=dtype, hash_algorithm=hash_algorithm)

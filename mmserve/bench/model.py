"""The benchmark's model: a random-weight demo preset whose every generated token streams as text.

A random-weight byte-level model under greedy decoding often settles on one token; if that token is
a lone non-ASCII byte (incomplete UTF-8), or whitespace the chat template's answer lead strips, the
server rightly holds its text back and a client sees nothing until the end — TTFT and decode
tokens/s measured at the client would then be meaningless. So the builder zeroes the output-head
rows of every token that does not decode to visible text on its own (special tokens included):
their logits are 0 while the best of the ~200 others is positive, so greedy decoding never picks
them. Shapes and costs are those of the preset; nothing else changes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from mmserve.models.demo.build import build_model, build_processor, get_preset, save

MARKER = "bench-model.json"


def _streams_as_text(tokenizer, token_id: int) -> bool:
    text = tokenizer.decode([token_id])
    return bool(text.strip()) and "\ufffd" not in text and token_id not in tokenizer.all_special_ids


def build_bench_model(preset: str, out_dir) -> Path:
    processor = build_processor(preset)
    tok = processor.tokenizer
    model = build_model(preset, tok, seed=0)
    silent = [i for i in range(model.lm_head.weight.shape[0]) if not _streams_as_text(tok, i)]
    with torch.no_grad():
        model.lm_head.weight[silent] = 0
    out = save(model, processor, out_dir)
    (out / MARKER).write_text(json.dumps(dict(_identity(preset), silent_tokens_zeroed=len(silent))) + "\n")
    return out


def _identity(preset: str) -> dict:
    return {"preset": preset, "shape": dataclasses.asdict(get_preset(preset)), "seed": 0}


def ensure_model(model_dir, preset: str) -> Path:
    """The benchmark checkpoint of `preset` in `model_dir`, built there unless one of the same preset
    and shape is already there."""
    model_dir = Path(model_dir)
    marker = model_dir / MARKER
    built = json.loads(marker.read_text()) if marker.exists() else {}
    if {k: built.get(k) for k in ("preset", "shape", "seed")} != _identity(preset):
        build_bench_model(preset, model_dir)
    return model_dir

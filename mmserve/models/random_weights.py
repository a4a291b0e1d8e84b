"""Random-weights checkpoint directories: a model's config, processor and tokenizer files and a
small marker, but no weight file. The weights are made where the model is loaded, directly on the
target device (a 7B model is 13.5 GB in bfloat16: writing and reading it back would cost far more
than drawing it), from a fixed seed, so every load of one directory on one device gives
bit-identical weights.

The marker, ``mmserve-random-weights.json``, holds the seed, the dtype the directory was made for
(the loader builds in the dtype it is asked for, as `from_pretrained` loads in it), and the token
ids whose output-head rows are zeroed after the random init, as half-open ``[start, end)`` ranges:
the tokens that do not decode to visible text on their own (special tokens, lone bytes of UTF-8
sequences, whitespace, ids past the tokenizer's vocabulary), so that greedy decoding of a random
model streams text from its first token (see mmserve/bench/model.py).

The model signature (mmserve.cache.signature) covers a checkpoint's weight files; here the marker
stands in for them (`checkpoint_sig`): two directories of different seeds never share a signature.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

from mmserve.cache.signature import (WeightFile, file_digest, model_sig, model_sig_from_parts, read_config_files,
                                     WEIGHT_SUFFIXES)

MARKER = "mmserve-random-weights.json"
FORMAT = 1
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# -- which tokens are silenced -------------------------------------------------------------

def streams_as_text(tokenizer, token_id: int) -> bool:
    """Whether the token decodes, on its own, to visible text (not special, whitespace or a
    fragment of a UTF-8 sequence)."""
    if token_id >= len(tokenizer):  # the model's vocabulary is padded past the tokenizer's
        return False
    text = tokenizer.decode([token_id])
    return bool(text.strip()) and "\ufffd" not in text and token_id not in tokenizer.all_special_ids


def silent_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Ids in [0, vocab_size) whose output-head rows are zeroed (see the module docstring)."""
    return [i for i in range(vocab_size) if not streams_as_text(tokenizer, i)]


def to_ranges(ids: Iterable[int]) -> list[list[int]]:
    """Sorted ids as half-open [start, end) ranges: [0, 1, 2, 5] -> [[0, 3], [5, 6]]."""
    out: list[list[int]] = []
    for i in sorted(set(ids)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def from_ranges(ranges: Sequence[Sequence[int]]) -> list[int]:
    return [i for start, end in ranges for i in range(int(start), int(end))]


def silence(model, ids: Sequence[int]) -> None:
    """Zeroes the output-head rows of `ids`."""
    if ids:
        with torch.no_grad():
            rows = torch.tensor(list(ids), dtype=torch.long, device=model.lm_head.weight.device)
            model.lm_head.weight.index_fill_(0, rows, 0)


# -- writing a directory -------------------------------------------------------------------

def write_random_weights(out_dir, config, generation_config: GenerationConfig, parts: Sequence, tokenizer, *,
                         seed: int = 0, dtype: str = "float32", preset: str | None = None) -> Path:
    """Saves `config`, `generation_config` and each of `parts` (processor, tokenizer, image
    processor: anything with `save_pretrained`) into `out_dir`, and the marker. Refuses a
    directory that holds weight files (they would say one model and the marker another)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = sorted(p.name for p in out.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    if weights:
        raise FileExistsError(f"{out} holds weight files ({', '.join(weights)}): use an empty directory")
    config.dtype = dtype
    config.architectures = [AutoModelForImageTextToText._model_mapping[type(config)].__name__]  # as save_pretrained
    config.save_pretrained(out)
    generation_config.save_pretrained(out)
    for part in parts:
        part.save_pretrained(out)
    vocab = int(config.get_text_config().vocab_size)
    marker = {"format": FORMAT, "seed": int(seed), "dtype": dtype, "preset": preset, "vocab_size": vocab,
              "silent_token_ranges": to_ranges(silent_token_ids(tokenizer, vocab))}
    (out / MARKER).write_text(json.dumps(marker) + "\n")
    return out


def remove_marker(out_dir) -> None:
    """Removes the marker of a directory a full checkpoint is about to be saved into."""
    (Path(out_dir) / MARKER).unlink(missing_ok=True)


def read_marker(path) -> dict | None:
    """The directory's marker, or None when it is an ordinary checkpoint."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        return None
    data = json.loads(marker.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{marker}: unknown random-weights format {data.get('format')!r} (expected {FORMAT})")
    return data


def is_random_weights(path) -> bool:
    return (Path(path) / MARKER).is_file()


# -- loading -------------------------------------------------------------------------------

def load_model(path, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"):
    """The checkpoint's `AutoModelForImageTextToText` in `dtype`, in eval mode: from its weight
    files (on the CPU, as `from_pretrained` loads it; the caller moves it), or, for a
    random-weights directory, drawn from its seed directly on `device`."""
    dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    marker = read_marker(path)
    if marker is None:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    return build_random_model(path, marker, dtype, device)


def build_random_model(path, marker: dict, dtype: torch.dtype, device: str | torch.device):
    """The model class of the directory's config with transformers' own random init from the
    marker's seed, built under `torch.device(device)` in `dtype` (no CPU copy), then silenced.
    The global RNG state is left as it was."""
    device = torch.device(device)
    config = AutoConfig.from_pretrained(path)
    forked = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(int(marker["seed"]))
        with torch.device(device):
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        draw_zero_initialised(model)
    silence(model, from_ranges(marker["silent_token_ranges"]))
    model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


ZERO_INITIALISED = ("mm_input_projection_weight",)
"""Parameters transformers' init sets to zero (Gemma 3's multimodal projector: a fine-tuning
start), which in a random model would make every image's embedding zero, and so every image alike."""


def draw_zero_initialised(model) -> None:
    """Draws `ZERO_INITIALISED` parameters from N(0, 0.02) instead (from the current RNG state)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ZERO_INITIALISED:
                param.normal_(0.0, 0.02)


def checkpoint_sig(name: str, path, *, dtype: str, device_type: str) -> int:
    """`model_sig` of a checkpoint directory; for a random-weights one the marker is its one
    weight file (its seed and silenced tokens are what its weights are)."""
    root = Path(path)
    marker = root / MARKER
    if not marker.is_file():
        return model_sig(name, root, dtype=dtype, device_type=device_type)
    weight = WeightFile(MARKER, marker.stat().st_size, b"", file_digest(marker))
    return model_sig_from_parts(name, read_config_files(root), [weight], dtype=dtype, device_type=device_type)

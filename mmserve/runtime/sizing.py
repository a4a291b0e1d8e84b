"""Sizes chosen from the machine and the model where the config says "auto": the dtype a checkpoint
loads in (`[runtime] dtype`) and the bytes of its KV arena (`[kv_cache] budget_bytes`).

Each answer carries the sentence that says why, for the model's load log line: a user whose arena
came out small reads there which key to set."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mmserve.config import DTYPES, Config

AUTO = "auto"
FALLBACK_BUDGET_BYTES = 256 * 1024 * 1024  # where the memory left cannot be read (mps)


@dataclass(frozen=True)
class Choice:
    value: object  # the dtype name, or the arena's bytes
    why: str


def checkpoint_dtype(path: str | Path) -> str | None:
    """The dtype the checkpoint's config.json says its weights are in (`dtype`, or the older
    `torch_dtype`; the text model's when the top level has none), or None."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (cfg, cfg.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = section.get(key)
            if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
                return value.removeprefix("torch.")
    return None


def device_runs(dtype: str, device: str) -> bool:
    """Whether `device` runs a model in `dtype` at a usable speed. The CPU: float32 and bfloat16
    (torch's CPU kernels cover bfloat16; float16 matmuls on many CPUs are emulated, several times
    slower than float32). CUDA: float16 always, bfloat16 where the GPU has it (Ampere and later)."""
    kind = torch.device(device).type
    if dtype == "float32":
        return True
    if kind == "cpu":
        return dtype == "bfloat16"
    if kind == "cuda":
        return dtype == "float16" or torch.cuda.is_bf16_supported()
    return dtype == "float16"  # mps: bfloat16 only on recent macOS; float16 everywhere


def choose_dtype(setting: str, path: str | Path, device: str) -> Choice:
    """`[runtime] dtype`: as set, or for "auto" the checkpoint's own dtype where `device` runs it
    (a bfloat16 checkpoint on a GPU without bfloat16: float16; anything else it cannot: float32)."""
    if setting != AUTO:
        return Choice(setting, f"[runtime] dtype = {setting!r}")
    own = checkpoint_dtype(path)
    if own is None:
        return Choice("float32", "auto: the checkpoint names no dtype")
    if device_runs(own, device):
        return Choice(own, f"auto: the checkpoint's own dtype on {device}")
    if own == "bfloat16" and device_runs("float16", device):
        return Choice("float16", f"auto: the checkpoint is bfloat16, which {device} lacks")
    return Choice("float32", f"auto: the checkpoint is {own}, slow or missing on {device}")


def memory_left(device: str) -> int | None:
    """Bytes the device has free now: CUDA's free memory (`torch.cuda.mem_get_info`), the CPU's
    MemAvailable (/proc/meminfo: free plus reclaimable page cache); None where neither applies."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def kv_budget(config: Config, device: str, block_bytes: int, context_tokens: int,
              left: int | None = None) -> Choice:
    """`[kv_cache] budget_bytes`: as set, or for "auto" `[kv_cache] memory_fraction` of the memory
    left on the device once the model's weights are in (read when the model has loaded), capped at
    what `[generator] max_running_requests` sequences of `context_tokens` each can use, and at
    least one block."""
    kv = config.kv_cache
    if kv.budget_bytes != AUTO:
        return Choice(kv.budget_bytes, "[kv_cache] budget_bytes")
    left = memory_left(device) if left is None else left
    if left is None:
        return Choice(FALLBACK_BUDGET_BYTES, f"auto: the free memory of {device} cannot be read; "
                                             f"{FALLBACK_BUDGET_BYTES >> 20} MiB")
    share = int(left * kv.memory_fraction)
    blocks_per_seq = -(-context_tokens // kv.block_size)
    cap = config.generator.max_running_requests * blocks_per_seq * block_bytes
    if cap < share:
        return Choice(cap, f"auto: {config.generator.max_running_requests} sequences "
                           f"([generator] max_running_requests) of {context_tokens} tokens")
    return Choice(max(share, block_bytes), f"auto: [kv_cache] memory_fraction = {kv.memory_fraction:g} of "
                                           f"{left / 2**30:.1f} GiB left on {device} after the weights")


def context_tokens(config: Config, adapter) -> int:
    """The most tokens one sequence can hold: the prompt and answer limits, within the model's context."""
    limits = config.limits
    most = limits.max_prompt_tokens + limits.max_tokens
    max_pos = int(getattr(adapter.text_config, "max_position_embeddings", 0) or 0)
    return min(most, max_pos) if max_pos else most

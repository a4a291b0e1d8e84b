"""`select`: the attention backend `[runtime] attention_backend` names, on a device; `check_attention`:
whether a checkpoint needs an attention feature the serving path lacks (before its weights load)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .backend import NAMES, AttentionBackend, AttentionBackendUnavailable, ModelFeatures, UnsupportedAttentionFeature
from .sdpa import SdpaBackend


def select(name: str, device: torch.device | str, deterministic: bool = False) -> AttentionBackend:
    """The backend `[runtime] attention_backend = name` gives on `device`: "sdpa"; "triton" (CUDA,
    or the CPU under Triton's interpreter only); "auto" (triton on CUDA when it imports, else sdpa).

    "triton" on the CPU without the interpreter is an error, not a quiet fall-back to sdpa: a
    configuration that names a backend gets that backend or a reason, and a test that means to
    exercise the kernels can never pass by running the reference instead.

    `deterministic` (`[runtime] deterministic`): the batch-invariant variants — the sdpa path's
    (`deterministic.DeterministicSdpaBackend`) for "sdpa" and "auto"; for "triton" the kernels'
    (`triton_deterministic.DeterministicTritonBackend`), on the CPU under the interpreter only
    (deterministic mode is refused on CUDA: `models.batch_invariant.check_available`)."""
    device = torch.device(device)
    if deterministic and name in ("auto", "sdpa"):
        from .deterministic import DeterministicSdpaBackend
        return DeterministicSdpaBackend()
    if deterministic and name == "triton" and device.type == "cuda":
        raise AttentionBackendUnavailable(
            "[runtime] deterministic = true runs on the CPU only (the linear layers are not batch-invariant on "
            "CUDA); the 'triton' backend's deterministic variant runs there under Triton's interpreter")
    if name == "sdpa":
        return SdpaBackend()
    if name == "auto":
        if device.type == "cuda":
            try:
                from . import triton_paged
            except ImportError:
                return SdpaBackend()
            if not triton_paged.INTERPRETING:  # auto never picks the interpreter (TRITON_INTERPRET=1)
                return triton_paged.TritonBackend()
        return SdpaBackend()
    if name != "triton":
        raise AttentionBackendUnavailable(f"unknown attention backend {name!r}: choose one of {', '.join(NAMES)}")
    try:
        from . import triton_paged
    except ImportError as e:
        raise AttentionBackendUnavailable(
            f"the 'triton' attention backend needs the triton package ({e}); torch's CUDA wheels bring it, "
            "or pip install 'triton>=3.6,<4'") from e
    if device.type == "cuda":
        return triton_paged.TritonBackend()
    if device.type == "cpu" and triton_paged.interpreter_ready():
        if deterministic:
            from .triton_deterministic import DeterministicTritonBackend
            return DeterministicTritonBackend()
        return triton_paged.TritonBackend()
    hint = (" (TRITON_INTERPRET=1 is set now, but was not when triton was first imported: set it before that)"
            if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "")
    raise AttentionBackendUnavailable(
        f"the 'triton' attention backend runs on CUDA; on {device.type!r} it runs only under Triton's interpreter "
        f"(TRITON_INTERPRET=1 before triton is imported), which is for tests{hint}. Use attention_backend = "
        "\"sdpa\" or \"auto\" here")


def check_attention(name: str, path: str | Path) -> None:
    """Refuses (UnsupportedAttentionFeature) a checkpoint whose language model needs an attention
    feature the serving path does not implement — soft-capping today; sliding windows and
    bidirectional image spans are implemented — before its weights load: served anyway, it would
    give wrong answers, not an error. Checked against the sdpa backend, which implements every
    feature another backend does (the runner checks the configured backend again); the registry
    calls it before `models.loading.load_adapter`, `mmserve serve` for every configured model."""
    from transformers import AutoConfig

    try:
        SdpaBackend().check(ModelFeatures.from_config(AutoConfig.from_pretrained(path)))
    except UnsupportedAttentionFeature as e:
        raise UnsupportedAttentionFeature(f"model {name!r} ({path}): {e}") from None

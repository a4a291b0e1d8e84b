"""Batch-invariant operations for `[runtime] deterministic = true`: installed on one loaded model
(`install`), so a token's every value — hidden states, K/V, logits — is a function of its
request alone, whatever other rows share the call. The default mode never runs any of it.

Measured on this CPU build (torch 2.13, MKL 2024.2, oneDNN 3.12, AVX-512), what varies and how it
is fixed (`tests/test_deterministic.py` pins each):

- **linear layers**: MKL's sgemm (torch's `F.linear`) gives a row one of three results by the
  call's row count: M = 1 is a GEMV, the rows of M's last (M mod 4) take a tail kernel, the rest
  the main one. oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`, its brgemm over a
  fixed K blocking) gives every row of any call of M >= 2 rows the same bits (M from 2 to 2047,
  any position, 1 or 2 threads, every layer shape of the served families): every `nn.Linear` of
  the model runs through it, a single row padded to two, the row counts bucketed (`call_rows`:
  oneDNN keeps memory for every count it has seen).
- **elementwise transcendental ops** (the MLP's activation, the rotary cos/sin): ATen's CPU loops
  compute the tail of a thread's chunk with the scalar function, a different last bit than the
  vector one, so a row's activation follows the call's row count: they run padded to whole
  vectors (`pointwise`).
- norms (RMSNorm, LayerNorm), softmax and log-softmax reduce each row on its own: measured
  invariant from 1 to 1,000 rows, left as they are. Attention: `engine.attention.deterministic`.
- **vision towers** encode one image per call (`encode_images` per item): an image's encoder
  output never depends on which images share its call (convolutions and attention over a batch
  of images are not measured invariant; one image at a time they run the same shapes every time).
"""

from __future__ import annotations

import math
import types
from typing import Sequence

import torch
from torch import nn

from mmserve.errors import CheckpointError

FINGERPRINT = "mmserve-det2"
"""`system_fingerprint` of an answer in deterministic mode: the version of the construction."""

INVARIANT_OVER = ("batch", "prefix_cache", "chunking", "preemption")
"""What a deterministic answer does not depend on (the fingerprint names them)."""

_INSTALLED = "_mmserve_batch_invariant"


class DeterministicModeUnavailable(CheckpointError):
    """`[runtime] deterministic = true` where its operations are not built (not the CPU, no oneDNN)."""

    code = "deterministic_mode_unavailable"


def fingerprint(deterministic: bool) -> str | None:
    """The responses' `system_fingerprint`: the mode and what it is invariant over (None: default mode)."""
    return f"{FINGERPRINT}:{'+'.join(INVARIANT_OVER)}" if deterministic else None


def check_available(device: torch.device | str) -> None:
    """Refuses deterministic mode where its operations were neither built nor tested."""
    device = torch.device(device)
    if device.type != "cpu":
        raise DeterministicModeUnavailable(
            f"[runtime] deterministic = true runs on the CPU only (batch-invariant linear layers through oneDNN); "
            f"not on {device.type!r} yet")
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        raise DeterministicModeUnavailable("[runtime] deterministic = true needs torch built with oneDNN (mkldnn)")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered once into oneDNN's blocked layout (`invariant_linear` takes
    it): unpacked, oneDNN reorders it at every call (measured 100x slower for one row)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


PACKED_FOR_ROWS = 16
"""The batch-size hint the weights are packed for (the same layout, hence the same bits, for any M)."""


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose every row's bits do not depend on the other rows of `x`;
    `weight` as `pack` returns it (or plain: the same bits, slower). oneDNN sees only the row
    counts of `call_rows`: calls of at most `ROW_CHUNK` rows, padded with zeros to a bucket."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    m = rows.shape[0]
    if m <= ROW_CHUNK:  # every decode step and most prefill chunks: one call
        out = _call(rows, weight, bias)
    else:
        out = torch.cat([_call(rows[start:start + ROW_CHUNK], weight, bias) for start in range(0, m, ROW_CHUNK)])
    return out.view(*shape[:-1], out.shape[-1])


ROW_CHUNK = 256
"""The most rows of one oneDNN call. oneDNN keeps what it builds for a row count for the life of
the process — a buffer of the output's size among it (measured: ~rows x out_features x 4 bytes a
new count, never freed, whatever its primitive cache's capacity) — so every distinct row count
costs memory for good: prefill chunks of every length up to `max_batched_tokens` grew the
process by ~130 MiB per 1,000 requests on the CPU bench. Longer inputs run as several calls."""


def call_rows(m: int) -> int:
    """The row count a call of `m` rows (1 <= m <= ROW_CHUNK) runs with: `m` itself up to 16 (a
    decode batch: a padded row there costs as much as a real one), one row padded to two (alone
    it takes oneDNN's GEMV path), else rounded up to 8 steps an octave (at most 12.5% more rows):
    47 counts in all, so what oneDNN keeps is bounded."""
    if m <= 16:
        return max(m, 2)
    step = 1 << ((m - 1).bit_length() - 4)
    return -(-m // step) * step


def _call(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = rows.shape[0]
    padded = call_rows(m)
    if padded != m:  # zero rows: every row's bits are its own whatever the count (M >= 2)
        rows = torch.cat([rows, rows.new_zeros(padded - m, rows.shape[1])])
    elif not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out[:m] if padded != m else out


def install(adapter) -> None:
    """Makes `adapter`'s model batch-invariant (the module docstring), once: every `nn.Linear`,
    the language model's activations and rotary embeddings, and its `encode_images` (one image a
    call)."""
    model = adapter.model
    if getattr(model, _INSTALLED, False):
        return
    for module in model.modules():
        if isinstance(module, nn.Linear):
            # a copy of the weight in oneDNN's layout (the module's own stays: tied embeddings read it)
            module._mmserve_packed = pack(module.weight)
            module.forward = types.MethodType(_linear_forward, module)
    for module in adapter.language_model.modules():
        act = getattr(module, "act_fn", None)
        if isinstance(act, nn.Module) and not getattr(act, _INSTALLED, False):
            act.forward = _padded(act.forward)
            setattr(act, _INSTALLED, True)
        if type(module).__name__.endswith("RotaryEmbedding"):
            module.forward = _padded_rotary(module.forward)
    encode = adapter.encode_images
    adapter.encode_images = lambda items: one_at_a_time(encode, items)
    setattr(model, _INSTALLED, True)


def one_at_a_time(encode, items: Sequence) -> list[torch.Tensor]:
    """`encode(items)` one item per call: an image's output never follows its batch."""
    return [out for item in items for out in encode([item])]


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return invariant_linear(x, self._mmserve_packed, self.bias)


def _padded(forward):
    return lambda x: pointwise(forward, x)


def _padded_rotary(forward):
    """A rotary embedding's forward (x, position_ids, ...) -> (cos, sin) [..., T, d], computed over
    the positions padded to whole vectors (its cos and sin are elementwise over [..., T, d])."""
    def run(x, position_ids, *args, **kwargs):
        t = position_ids.shape[-1]
        unit = 32 * math.lcm(*range(1, max(1, torch.get_num_threads()) + 1))
        padded = -(-t // unit) * unit
        if padded != t:
            pad = position_ids.new_zeros(*position_ids.shape[:-1], padded - t)
            position_ids = torch.cat([position_ids, pad], -1)
        return tuple(o[..., :t, :] for o in forward(x, position_ids, *args, **kwargs))
    return run


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """`fn` (an elementwise op) of `x`, with every element on the op's vectorized path. ATen's CPU
    loops compute the last `numel % 32` elements of a thread's chunk with the scalar function,
    whose last bit can differ from the vector one (measured: silu, tanh-gelu, quick-gelu, cos of a
    row of 344 elements differ between a call of 1 row and of 16): so a row's result would follow
    the number of rows. Padded with zeros to a multiple of 32 x lcm(1..threads) elements, every
    thread's chunk is whole vectors."""
    flat = x.reshape(-1)
    n = flat.numel()
    unit = _pointwise_unit(torch.get_num_threads())
    padded = -(-n // unit) * unit
    if padded != n or not flat.is_contiguous():
        flat = torch.cat([flat, flat.new_zeros(padded - n)])
    return fn(flat)[:n].view(x.shape)


def _pointwise_unit(threads: int) -> int:
    return 32 * math.lcm(*range(1, max(1, threads) + 1))

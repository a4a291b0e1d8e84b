"""What a fixed-shape family's vision tower offers the static encoder path (`engine.vision_step`).

A family whose tower sees every view at one size — LLaVA's CLIP at its one resolution, Gemma 3's
SigLIP at its fixed size (pan-and-scan crops are views of that size too), Idefics3's SigLIP per tile
and global view — can run its tower and projector from static buffers: a batch of V views is padded
to a view-count bucket, and the same body reads the same addresses on every call (on CUDA: a graph
per bucket). The family's adapter (`Adapter.fixed_tower`) splits its `encode_images` into three:

- `views(items)` (host): the call's views [V, C, H, W] in order (and, for Idefics3, their pixel
  masks [V, H, W]); it refuses what the eager path refuses (Idefics3's all-zero view);
- `body(pixels, mask)`: the tower and projector over a padded batch -> [B, rows, width]. It must be
  capturable — no host synchronisation, no shape that follows values — and row-independent: view b's
  rows depend on view b alone (a vision transformer attends within a view), so padding rows, whatever
  they hold, never reach a real view's rows;
- `assemble(items, rows)`: each item's encoder output from the views' rows [V, rows, width] (Gemma 3's
  and Idefics3's markers between views: the same code the eager path runs).

Families whose views change shape with the image (Qwen2-VL's and Qwen2.5/3-VL's native-resolution
patches, LLaVA-OneVision's anyres grids) have no fixed tower: their towers stay eager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class TowerViews:
    """One encoder call's views, in the order `assemble` takes their rows."""

    pixels: torch.Tensor  # [V, C, H, W], on the host or the device, in any float dtype
    mask: torch.Tensor | None = None  # [V, H, W] pixel masks (True: a real pixel), for a masked tower


@dataclass(frozen=True)
class FixedTower:
    """A family's tower split for the static path (see the module docstring)."""

    view_shape: tuple[int, int, int]  # (channels, height, width) of every view
    masked: bool  # whether the body takes pixel masks (Idefics3's padded global view)
    views: Callable[[Sequence], TowerViews]
    body: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    assemble: Callable[[Sequence, torch.Tensor], list[torch.Tensor]]

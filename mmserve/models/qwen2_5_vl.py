"""Adapter for Qwen2.5-VL checkpoints (`Qwen2_5_VLForConditionalGeneration`, model_type
`qwen2_5_vl`): everything the runtime does with them is Qwen2-VL's, so this is Qwen2VLAdapter.

What is new in the family lives where mmserve does not reach:
- The vision tower attends within windows (`window_size` pixels a side) in most blocks and over
  the whole image in `fullatt_block_indexes`; the windows, their padding and the reordering back
  are transformers' own, inside `get_image_features`, and per image: one image's output does not
  depend on the others encoded with it (tests/test_qwen2_5_vl.py checks batched ≡ one by one), so
  the encoder cache and batching across requests stay exact.
- `get_rope_index` gains `second_per_grid_ts`, which spaces a *video's* temporal positions
  (`tokens_per_second`); an image's temporal positions are its start, as in Qwen2-VL, so the
  prompt's 3-D positions and `rope_delta` come from the same call.
- The image processor is Qwen2-VL's (`Qwen2VLImageProcessor`, run here by its PIL twin), and its
  settings — min/max pixels, patch, merge and temporal patch size — are in every mm_hash through
  the processor digest, with the image's grid (key layout v2), as for Qwen2-VL; the model
  signature keeps the two families' keys apart.
"""

from __future__ import annotations

from typing import Sequence

import torch

from mmserve.models.qwen2_vl import Qwen2VLAdapter


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    """One loaded Qwen2.5-VL model (tokenizer, image processor, weights) on a device."""

    def _load(self) -> None:
        super()._load()
        if self.model.config.model_type != "qwen2_5_vl":
            raise ValueError(f"model {self.name!r}: {self.path} holds a {self.model.config.model_type!r} model, "
                             f"not Qwen2.5-VL")

    def video_rope_kwargs(self, videos: Sequence) -> dict:
        """`second_per_grid_ts`: the seconds one temporal patch of each video spans (temporal patch
        size / the sampled frames' fps, as `Qwen2_5_VLProcessor` computes it), which spaces the
        video's temporal positions at `tokens_per_second` (absolute-time M-RoPE)."""
        tps = self.video_settings.temporal_patch_size
        return {"second_per_grid_ts": torch.tensor([tps / v.sampled_fps for v in videos], dtype=torch.float32)}

"""Adapter for Qwen3-VL checkpoints (`Qwen3VLForConditionalGeneration`, model_type `qwen3_vl`):
DeepStack, over Qwen2-VL's preprocessing and positions.

What is Qwen2-VL's and so shared (`Qwen2VLAdapter`): the tokenizer and chat template, the image
processor (`Qwen2VLImageProcessor`, run by its PIL twin: Qwen3-VL checkpoints save
`Qwen2VLImageProcessorFast`, patch 16, mean = std = 0.5), an image's grid and token count, and
the prompt's 3-D positions, which come from the model's own `get_rope_index`: for images Qwen3-VL
places the tokens as Qwen2-VL does (start, start + row, start + column; text resumes at start +
max(rows, columns)) — its changes are for video (timestamps between frames) and in how the
rotary embedding spreads the three rows over the frequencies (interleaved M-RoPE, inside the
text model). Keys: layout v2 with the grid, as Qwen2-VL's.

What is new is DeepStack. Besides the merged image embeddings, the vision tower returns the
features of several of its blocks (`deepstack_visual_indexes`), each merged to the text width by a
merger of its own; the text model adds level k to the hidden states of the image positions after
its decoder layer k (`Qwen3VLTextModel.forward(visual_pos_masks=[B, T] bool,
deepstack_visual_embeds=[level][n_visual_tokens, hidden])`, the rows in the order of the mask's
True positions). So an image's encoder output is ONE tensor [tokens, hidden * (1 + levels)]: its
input embedding, then each level, along the hidden dim. Every path that handles an image's rows
by slicing them — a prefix hit or a prefill chunk that ends inside an image (`emb[lo:hi]`), the
re-encoding after a preemption, the encoder cache's bytes, the shared tier — carries all levels
for the very same tokens. `step_inputs` splits a step's rows again: the input embeddings over the
placeholders, and `visual_pos_masks` over the step's [1, T] tokens (every sequence of a ragged
step) with each level's rows in that order.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from mmserve.cache.keys import mm_hash_video
from mmserve.models.adapter import PromptInputs
from mmserve.models.qwen2_vl import Qwen2VLAdapter, QwenPixels
from mmserve.models.qwen3_video import (group_frames, groups, load_qwen3_settings, resized_size, sample_indices,
                                        timestamped_prompt)
from mmserve.models.qwen_video import expand_placeholders, video_patches
from mmserve.models.video_item import Plan, VideoGroup, VideoItem, VideoSampling, is_video


class Qwen3VLAdapter(Qwen2VLAdapter):
    """One loaded Qwen3-VL model (tokenizer, image processor, weights) on a device."""

    def _load(self) -> None:
        super()._load()
        config = self.model.config
        if config.model_type != "qwen3_vl":
            raise ValueError(f"model {self.name!r}: {self.path} holds a {config.model_type!r} model, not Qwen3-VL")
        self.hidden_size = int(config.text_config.hidden_size)
        self.deepstack_levels = len(config.vision_config.deepstack_visual_indexes)
        text = self.language_model
        text._deepstack_process = dense_deepstack(text._deepstack_process)
        self.video_settings = load_qwen3_settings(self.path)
        self.video_digest = self.video_settings.digest()

    # -- video (`qwen3_video`: timestamps in the prompt, one item per temporal group) -------------

    def video_plan(self, sampling: VideoSampling, frame_cap: int) -> Plan:
        return lambda meta: sample_indices(meta, sampling, self.video_settings, frame_cap)

    def item_grid(self, item) -> tuple[int, int, int]:
        if isinstance(item, VideoGroup):
            h, w = resized_size(item.video, self.video_settings)
            return (1, h // self.video_settings.patch_size, w // self.video_settings.patch_size)
        return super().item_grid(item)

    def tokenize(self, messages: list[dict], images: Sequence, tools: list[dict] | None = None,
                 template: Mapping | None = None) -> PromptInputs:
        """Each video becomes its temporal groups, each after its timestamp (`qwen3_video`)."""
        if not any(isinstance(item, VideoItem) for item in images):
            return super().tokenize(messages, images, tools, template)
        tok = self.tokenizer
        videos = [groups(item, self.video_settings) for item in images if isinstance(item, VideoItem)]
        text = timestamped_prompt(self.render_prompt(messages, tools, template), videos,
                                  tok.convert_ids_to_tokens(self.model.config.vision_start_token_id),
                                  tok.convert_ids_to_tokens(self.video_token_id),
                                  tok.convert_ids_to_tokens(self.model.config.vision_end_token_id))
        it = iter(videos)
        items = [g for item in images for g in (next(it) if isinstance(item, VideoItem) else [item])]
        grids = [self.item_grid(item) for item in items]
        pads = [self.video_token_id if is_video(item) else self.image_token_id for item in items]
        input_ids, spans = expand_placeholders(tok([text])["input_ids"][0],
                                               list(zip(pads, (self.tokens_per_image(g) for g in grids))))
        positions, delta = self._rope_index(input_ids, spans, grids, items)
        return PromptInputs(input_ids, None, spans, images=tuple(items), rope_positions=positions, rope_delta=delta)

    def image_key(self, image) -> bytes | None:
        """A video group's key: the video's key fields, with the group and its timestamp in the settings."""
        if not isinstance(image, VideoGroup):
            return super().image_key(image)
        video, meta = image.video, image.video.meta
        settings = {"kind": video.kind, **video.sampling.settings(), "group": image.group, "groups": image.groups,
                    "timestamp": image.timestamp}
        return mm_hash_video(self.model_sig, self.video_digest, video.content, algorithm=self.hash_algorithm,
                             settings=settings, indices=video.indices, source_fps=meta.fps,
                             total_frames=meta.total_frames, size=(meta.width, meta.height),
                             resized=resized_size(video, self.video_settings), grid=self.item_grid(image))

    def pixel_values(self, images: Sequence) -> list[QwenPixels]:
        out = []
        for item in images:
            if isinstance(item, VideoGroup):
                frames = group_frames(item, self.video_settings)
                patches = video_patches(frames, resized_size(item.video, self.video_settings), self.video_settings)
                out.append(QwenPixels(patches, self.item_grid(item), video=True))
            else:
                out += super().pixel_values([item])
        return out

    @property
    def encoder_width(self) -> int:
        """An image's encoder-output row: the input embedding and each DeepStack level."""
        return self.hidden_size * (1 + self.deepstack_levels)

    # -- model steps -------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, items: Sequence[QwenPixels]) -> list[torch.Tensor]:
        """The vision tower, merger and DeepStack mergers over images of any sizes in one call
        (its attention is per image): one [tokens_per_image, hidden * (1 + levels)] tensor per
        image, the input embedding first, then each level in the order of the text layers. A video
        group's patches go the same way (`get_video_features` is `get_image_features`)."""
        patches = torch.cat([it.patches for it in items]).to(self.device, self.dtype)
        grid_thw = torch.tensor([it.grid for it in items], dtype=torch.long, device=self.device)
        out = self.model.model.get_image_features(pixel_values=patches, image_grid_thw=grid_thw, return_dict=True)
        levels = out.deepstack_features
        if len(levels) != self.deepstack_levels:
            raise RuntimeError(f"the vision tower gave {len(levels)} DeepStack levels, its config "
                               f"{self.deepstack_levels}")
        return [torch.cat([main, *(level[i] for level in levels)], dim=-1).contiguous()
                for i, main in enumerate(out.pooler_output)]

    @torch.inference_mode()
    def embed(self, input_ids: Sequence[int], pieces: Sequence[tuple[int, torch.Tensor]] = ()) -> torch.Tensor:
        """Token embeddings [1, T, H] with each piece's input-embedding columns (its first H)
        written over the placeholders starting at its position (the DeepStack levels are
        `step_inputs`')."""
        return super().embed(input_ids, [(pos, rows[:, :self.hidden_size]) for pos, rows in pieces])

    def step_inputs(self, input_ids: Sequence[int],
                    pieces: Sequence[tuple[int, torch.Tensor]] = ()) -> tuple[torch.Tensor, dict]:
        """`inputs_embeds` [1, T, H] and, when the step holds image rows, DeepStack's arguments:
        `visual_pos_masks` [1, T] (True over every piece's rows) and `deepstack_visual_embeds`,
        one [n_true, H] tensor per level, its rows in the mask's order (the pieces sorted by
        position: the step's sequences one after another, each one's images in prompt order)."""
        embeds = self.embed(input_ids, pieces)
        pieces = sorted((p for p in pieces if p[1].shape[0]), key=lambda p: p[0])
        if not pieces:
            return embeds, {}
        width, h = self.encoder_width, self.hidden_size
        mask = torch.zeros(1, len(input_ids), dtype=torch.bool)
        for pos, rows in pieces:
            if rows.shape[-1] != width:
                raise ValueError(f"an image's encoder rows are {rows.shape[-1]} wide; Qwen3-VL's are {width} "
                                 f"(hidden {h} x (1 + {self.deepstack_levels} DeepStack levels))")
            mask[0, pos:pos + rows.shape[0]] = True
        rows = torch.cat([r for _, r in pieces]).to(self.device, self.dtype)
        if int(mask.sum()) != rows.shape[0]:
            raise ValueError("the step's image pieces overlap")
        levels = [rows[:, h * (k + 1):h * (k + 2)] for k in range(self.deepstack_levels)]
        return embeds, {"visual_pos_masks": mask.to(self.device), "deepstack_visual_embeds": levels}


def dense_deepstack(merge):
    """Qwen3-VL's DeepStack merge (`Qwen3VLTextModel._deepstack_process(hidden [1, T, H], mask
    [1, T], rows [n, H])`: `hidden[mask] += rows`), which also takes one row per token — a static
    step's dense level, zero off the images (`engine.mixed_step`) — and then adds it whole,
    with no boolean index (whose output shape follows the mask: a host sync, no CUDA graph). The
    two agree wherever both apply: transformers' form with n == T has every token an image token."""

    def process(hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor | None, visual_embeds: torch.Tensor):
        if hidden_states.shape[0] == 1 and visual_embeds.shape[0] == hidden_states.shape[1]:
            return hidden_states + visual_embeds.to(hidden_states.device, hidden_states.dtype).unsqueeze(0)
        return merge(hidden_states, visual_pos_masks, visual_embeds)

    return process

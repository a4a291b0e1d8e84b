"""Adapter for LLaVA-family checkpoints: the model steps the actors need, one by one.

The steps — preprocess, encode images, scatter image embeddings into placeholder positions,
prefill with optional past KV and explicit positions, decode a batch by one token — reproduce the
model's own forward (pinned by tests/test_adapter.py). Each step is a plain synchronous function
that the actors run in worker threads.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from transformers import AutoProcessor, DynamicCache

from mmserve.cache.keys import processor_digest
from mmserve.models.adapter import Adapter, ImageSpan, PromptInputs, StepOutput
from mmserve.models.fixed_tower import FixedTower, TowerViews
from mmserve.models.random_weights import load_model

__all__ = ["ImageSpan", "LlavaAdapter", "PromptInputs", "StepOutput"]


class LlavaAdapter(Adapter):
    """One loaded LLaVA-family model (processor + weights) on a device."""

    def _load(self) -> None:
        self.processor = AutoProcessor.from_pretrained(self.path)
        self.tokenizer = self.processor.tokenizer
        self.image_processor = self.processor.image_processor
        self.model = load_model(self.path, self.dtype, self.device)  # random-weights dirs: drawn on the device
        self.image_token_id = int(self.model.config.image_token_id)
        self._token_counts: dict[tuple[int, int], int | None] = {}  # image size -> placeholders

    def _processor_digest(self) -> int:
        return processor_digest(self.image_processor.to_dict())

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None,
                **template) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  tools=tools, **template)

    # -- preprocessing ---------------------------------------------------------------------

    def preprocess(self, messages: list[dict], images: Sequence, tools: list[dict] | None = None,
                   template: Mapping | None = None) -> PromptInputs:
        """Applies the chat template and the processor; images are PIL images in prompt order."""
        text = self.render_prompt(messages, tools, template)
        batch = self.processor(text=[text], images=list(images) or None, return_tensors="pt")
        input_ids = tuple(int(t) for t in batch["input_ids"][0])
        pixel_values = batch.get("pixel_values") if images else None
        spans = self.image_spans(input_ids, len(images))
        return PromptInputs(input_ids, pixel_values, spans)

    def tokenize(self, messages: list[dict], images: Sequence, tools: list[dict] | None = None,
                 template: Mapping | None = None) -> PromptInputs:
        """Like `preprocess`, but without the image processor's pixel work, which only an encoder
        cache miss needs (the encoder computes it then, with `pixel_values`). The placeholder
        expansion is the processor's own (`_get_num_multimodal_tokens`, as vLLM uses it); a
        processor that cannot tell its counts without pixels takes the full `preprocess` path.
        tests/test_adapter.py pins that both paths give the same tokens."""
        counts = self._image_token_counts(images)
        if counts is None:
            return self.preprocess(messages, images, tools, template)
        input_ids, spans = self._expanded_prompt(messages, counts, tools, template)
        return PromptInputs(input_ids, None, spans, images=tuple(images))

    def _image_token_counts(self, images: Sequence) -> list[int] | None:
        token = getattr(self.processor, "image_token", None)
        if not images:
            return [] if token else None
        counts = [self._image_token_count(img.height, img.width) for img in images]
        return None if None in counts else counts

    def _image_token_count(self, height: int, width: int) -> int | None:
        """The placeholder count of an image of this size; remembered per size, since the
        processor's own answer costs a kwargs merge and validation (~0.4 ms) every call."""
        memo = self._token_counts
        if (height, width) not in memo:
            if len(memo) >= 4096:  # sizes are the client's choice: bounded
                memo.clear()
            memo[(height, width)] = self._processor_token_count(height, width)
        return memo[(height, width)]

    def _processor_token_count(self, height: int, width: int) -> int | None:
        count = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if count is None or not isinstance(getattr(self.processor, "image_token", None), str):
            return None
        try:
            counts = list(count(image_sizes=[(height, width)]).num_image_tokens)
        except Exception:  # a processor whose counts need more than sizes: take the full path
            return None
        return int(counts[0]) if len(counts) == 1 else None

    def pixel_values(self, images: Sequence) -> torch.Tensor:
        """The image processor's pixel tensor for `images`, [N, C, H, W] (worker thread): row i
        is image i's pixel item."""
        return self.image_processor(images=list(images), return_tensors="pt")["pixel_values"]

    def image_spans(self, input_ids: Sequence[int], n_images: int) -> tuple[ImageSpan, ...]:
        """Splits the placeholder positions into one contiguous span per image."""
        positions = [i for i, t in enumerate(input_ids) if t == self.image_token_id]
        if n_images == 0:
            if positions:
                raise ValueError("prompt contains image placeholders but no image was given")
            return ()
        if len(positions) % n_images:
            raise ValueError(f"{len(positions)} image placeholders cannot be split over {n_images} images")
        per = len(positions) // n_images
        spans = []
        for k in range(n_images):
            chunk = positions[k * per : (k + 1) * per]
            if chunk[-1] - chunk[0] != per - 1:
                raise ValueError("an image's placeholder tokens are not contiguous")
            spans.append(ImageSpan(chunk[0], per))
        return tuple(spans)

    # -- model steps -------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, pixel_values) -> list[torch.Tensor]:
        """Runs the vision tower and projector over [N, C, H, W] pixels (or a list of [C, H, W]
        items): one [num_image_tokens, hidden] tensor per image."""
        if not isinstance(pixel_values, torch.Tensor):
            pixel_values = torch.stack(list(pixel_values))
        pixel_values = pixel_values.to(self.device, self.dtype)
        out = self.model.model.get_image_features(pixel_values=pixel_values, return_dict=True)
        return [f.contiguous() for f in out.pooler_output]

    def fixed_tower(self) -> FixedTower:
        """CLIP at its one resolution: every image one view (`models.fixed_tower`)."""
        vision = self.model.config.vision_config
        side = int(vision.image_size)
        return FixedTower((int(getattr(vision, "num_channels", 3)), side, side), False,
                          lambda items: TowerViews(torch.stack(list(items))),  # a tensor's rows, or a list
                          self._tower, lambda items, rows: list(rows.unbind(0)))

    def _tower(self, pixels: torch.Tensor, mask: None) -> torch.Tensor:
        """[images, C, H, W] -> [images, tokens, hidden]: `encode_images`' forward, stacked."""
        out = self.model.model.get_image_features(pixel_values=pixels, return_dict=True)
        return torch.stack(list(out.pooler_output))

    @torch.inference_mode()
    def decode(
        self,
        token_ids: Sequence[int],
        cache: DynamicCache,
        positions: Sequence[int],
        attention_mask: torch.Tensor | None = None,
    ) -> StepOutput:
        """One decode step for a batch: token_ids[b] at positions[b], over a contiguous cache. The
        runtime decodes through the paged step (`engine.runner`); this is the model's own path, the reference the
        paged one is tested against (as is `Adapter.prefill`, which serves the benchmark's baselines too)."""
        ids = torch.tensor([[t] for t in token_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([[p] for p in positions], dtype=torch.long, device=self.device)
        embeds = self.model.get_input_embeddings()(ids)
        out = self.language_model(inputs_embeds=embeds, position_ids=pos, attention_mask=attention_mask, cache=cache,
                                  use_cache=True)
        logits = self.model.lm_head(out.last_hidden_state[:, -1, :])
        return StepOutput(logits.float(), out.cache)

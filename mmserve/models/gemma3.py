"""Adapter for Gemma 3 checkpoints (`Gemma3ForConditionalGeneration`, model_type `gemma3`).

What Gemma 3 changes for the serving path is its attention, not its inputs:

- **Bidirectional image attention.** An image's soft tokens see each other both ways (transformers'
  `token_type_ids` mask: OR(causal, same image)), so its K/V — and every later token's — depends on
  the whole image. Each run of soft tokens is a bidirectional span (`PromptInputs.bidirectional`):
  the scheduler never ends a prefill chunk inside one, and the step masks it explicitly
  (`attention.key_ends`). A prefix hit may end inside an image: the cached part was computed in a
  step that held the whole image, so its K/V are exactly what a full prefill computes.
- **Sliding-window layers.** Five of every six layers (`layer_types`) see only the last
  `sliding_window` keys (AND(window, ...)); the attention reads the window only. The arena keeps
  every layer's K/V for every token (a global layer needs it), so block hashes are unchanged.

Inputs: the chat template writes `<start_of_image>` per image; `Gemma3Processor` replaces it with
"\\n\\n<start_of_image>" + `image_seq_length` soft tokens + "<end_of_image>\\n\\n" — with pan-and-scan
(`do_pan_and_scan` in the image processor's settings) the original image's sequence, then one per
crop, in a sentence of its own. mmserve builds the same text with one soft token per sequence,
tokenizes it (the soft token is special: the text around it tokenizes as the processor's does)
and repeats each soft token's id. An image's span runs from its first soft token to its last; with
crops, the markers between two crops' runs are inside it and its encoder output holds their token
embeddings there (what transformers' forward feeds the language model), as for Idefics3. Image
rows are the model's own `get_image_features` (tower, average pool, soft-embedding norm,
projection), per image.

The checkpoint loads without `AutoProcessor` (transformers 5 maps `Gemma3ImageProcessor` to its
torchvision class): tokenizer, `Gemma3ImageProcessorPil` and model load separately. Soft-capping:
Gemma 3's attention passes none to its attention function (its configs set none); a config asking
for it is refused at load (`attention.ModelFeatures`), as is `use_bidirectional_attention` (the
text-only embedding variant, not a generator).
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

import numpy as np
import torch
from transformers import AutoTokenizer, Gemma3ImageProcessorPil
from transformers.models.gemma3.modeling_gemma3 import (create_masks_for_vision_model,
                                                      get_block_sequence_ids_for_mask)

from mmserve.cache.keys import processor_digest
from mmserve.errors import CheckpointError
from mmserve.models.adapter import Adapter, ImageSpan, PromptInputs
from mmserve.models.fixed_tower import FixedTower, TowerViews
from mmserve.models.qwen2_vl import _saved_template
from mmserve.models.random_weights import load_model

_PIL_COMPATIBLE = frozenset({"Gemma3ImageProcessor", "Gemma3ImageProcessorFast", "Gemma3ImageProcessorPil"})


def soft_runs(input_ids: Sequence[int], token_id: int) -> tuple[tuple[int, int], ...]:
    """Maximal runs [lo, hi) of `token_id` in `input_ids`: transformers' image groups
    (`get_block_sequence_ids_for_mask`), each one bidirectional span."""
    ids = np.asarray(input_ids, dtype=np.int64)
    is_tok = np.concatenate([[False], ids == token_id, [False]])
    edges = np.flatnonzero(is_tok[1:] != is_tok[:-1])
    return tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2]))


class Gemma3Adapter(Adapter):
    """One loaded Gemma 3 model (tokenizer, image processor, weights) on a device."""

    def _load(self) -> None:
        settings = _json(self.path / "preprocessor_config.json")
        kind = settings.get("image_processor_type")
        if kind is not None and kind not in _PIL_COMPATIBLE:
            raise CheckpointError(f"model {self.name!r}: image processor {kind!r} is not Gemma 3's")
        self.image_processor = Gemma3ImageProcessorPil.from_pretrained(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        template = _saved_template(self.path) or self.tokenizer.chat_template
        if template is None:
            raise CheckpointError(f"model {self.name!r}: {self.path} has no chat template")
        self.tokenizer.chat_template = template
        self.model = load_model(self.path, self.dtype, self.device)
        config = self.model.config
        text = config.get_text_config()
        if getattr(text, "use_bidirectional_attention", False):
            raise CheckpointError(f"model {self.name!r}: use_bidirectional_attention (an embedding model) is not served")
        self.image_token_id = int(config.image_token_id)
        self.tokens_per_image = int(config.mm_tokens_per_image)
        saved = _json(self.path / "processor_config.json").get("image_seq_length")
        if saved is not None and int(saved) != self.tokens_per_image:
            raise CheckpointError(f"model {self.name!r}: processor_config.json says image_seq_length = {saved}, "
                                  f"the model config mm_tokens_per_image = {self.tokens_per_image}")
        tok = self.tokenizer.convert_ids_to_tokens
        self.boi, self.soft, self.eoi = (tok(int(config.boi_token_id)), tok(self.image_token_id),
                                         tok(int(config.eoi_token_id)))
        self._between: dict[int, tuple[int, ...]] = {}

    def _processor_digest(self) -> int:
        return processor_digest({**self.image_processor.to_dict(), "image_seq_length": self.tokens_per_image})

    # -- preprocessing ---------------------------------------------------------------------

    def crops(self, image) -> int:
        """How many pan-and-scan crops the image processor cuts `image` into (0: none)."""
        ip = self.image_processor
        if not ip.do_pan_and_scan:
            return 0
        probe = np.empty((1, image.height, image.width), dtype=np.uint8)  # only its size is read
        return len(ip.pan_and_scan(probe, ip.pan_and_scan_min_crop_size, ip.pan_and_scan_max_num_crops,
                                   ip.pan_and_scan_min_ratio_to_activate))

    def _replacement(self, crops: int) -> str:
        """What `Gemma3Processor.replace_image_token` writes for an image, one soft token a view."""
        full = f"\n\n{self.boi}{self.soft}{self.eoi}\n\n"
        if not crops:
            return full
        return (f"Here is the original image {full} and here are some crops to help you see better "
                + " ".join([full] * crops))

    def _tokenize_text(self, text: str) -> list[int]:
        bos = self.tokenizer.bos_token
        add = not (bos and text.startswith(bos))  # a template that writes the BOS: no second one
        return list(self.tokenizer([text], add_special_tokens=add)["input_ids"][0])

    def _expand(self, ids: Sequence[int]) -> tuple[int, ...]:
        out: list[int] = []
        for t in ids:
            out += [t] * self.tokens_per_image if t == self.image_token_id else [t]
        return tuple(int(t) for t in out)

    def tokenize(self, messages: list[dict], images: Sequence, tools: list[dict] | None = None,
                 template: Mapping | None = None) -> PromptInputs:
        text = self.render_prompt(messages, tools, template)
        parts = text.split(self.boi)
        if len(parts) != len(images) + 1:
            raise ValueError(f"the prompt has {len(parts) - 1} image placeholders for {len(images)} images")
        crops = [self.crops(img) for img in images]
        compact = self._tokenize_text(parts[0] + "".join(self._replacement(n) + p for n, p in zip(crops, parts[1:])))
        input_ids = self._expand(compact)
        runs = soft_runs(input_ids, self.image_token_id)
        if len(runs) != sum(1 + n for n in crops):
            raise ValueError("the prompt's image soft tokens do not match its images")
        spans, at = [], 0
        for n in crops:
            first, last = runs[at], runs[at + n]
            spans.append(ImageSpan(first[0], last[1] - first[0]))
            at += 1 + n
        return PromptInputs(input_ids, None, tuple(spans), images=tuple(images), bidirectional=runs)

    def tokenize_raw(self, input_ids: Sequence[int]) -> PromptInputs:
        ids = tuple(int(t) for t in input_ids)
        return PromptInputs(ids, None, (), bidirectional=soft_runs(ids, self.image_token_id))

    def between(self, crops: int) -> tuple[int, ...]:
        """The token ids of an image's span with `crops` crops: from its first soft token to its
        last (markers between the views' runs included; they lie between special tokens, so they
        tokenize alike in every prompt)."""
        ids = self._between.get(crops)
        if ids is None:
            full = self._expand(self._tokenize_text(self._replacement(crops)))
            runs = soft_runs(full, self.image_token_id)
            ids = self._between[crops] = full[runs[0][0]:runs[-1][1]]
        return ids

    def pixel_values(self, images: Sequence) -> list[torch.Tensor]:
        """Per image its views [1 + crops, C, H, W]: the image, then its pan-and-scan crops."""
        out = []
        for image in images:
            batch = self.image_processor(images=[image], return_tensors="pt")
            out.append(batch["pixel_values"])
        return out

    def generate_inputs(self, prompt: PromptInputs, items: Sequence[torch.Tensor] = ()) -> dict:
        """What Gemma3Processor gives for the prompt and its images: input_ids, attention_mask,
        token_type_ids (1 at the soft tokens: transformers' bidirectional image mask) and
        pixel_values [views, C, H, W] (every image's views in prompt order)."""
        out = self._token_inputs(prompt)
        types = torch.zeros_like(out["input_ids"])
        for lo, hi in prompt.bidirectional:
            types[0, lo:hi] = 1
        out["token_type_ids"] = types
        if items:
            out["pixel_values"] = torch.cat([i if i.dim() == 4 else i.unsqueeze(0) for i in items])
        return out

    def prefill_masks(self, inputs_embeds: torch.Tensor, cache, position_ids: torch.Tensor, start: int,
                      spans: Sequence[tuple[int, int]]) -> dict:
        """transformers' own Gemma 3 masks for tokens [start, start+T) over `cache`: causal (and
        the sliding window) OR the same image run, from the runs' token types since the sequence's
        start (what `generate` passes a prefill). Runs past the new tokens are not seen yet."""
        end = start + inputs_embeds.shape[1]
        types = torch.zeros((1, end), dtype=torch.long, device=inputs_embeds.device)
        for lo, hi in spans:
            types[0, lo:min(hi, end)] = 1
        masks = create_masks_for_vision_model(
            config=self.text_config, inputs_embeds=inputs_embeds, attention_mask=None, cache=cache,
            position_ids=position_ids, block_sequence_ids=get_block_sequence_ids_for_mask(types))
        return {"attention_mask": masks}

    @torch.inference_mode()
    def encode_images(self, items) -> list[torch.Tensor]:
        """One [span length, hidden] tensor per image: its views' rows over their soft tokens, the
        markers' token embeddings between them."""
        items = [i if i.dim() == 4 else i.unsqueeze(0) for i in items]
        pixels = torch.cat(list(items)).to(self.device, self.dtype)
        return self._assemble(items, self._tower(pixels, None))

    def fixed_tower(self) -> FixedTower:
        """SigLIP at its fixed size: an image's views (the image, its pan-and-scan crops) in a row."""
        vision = self.model.config.vision_config
        side = int(vision.image_size)
        return FixedTower((int(getattr(vision, "num_channels", 3)), side, side), False,
                          lambda items: TowerViews(torch.cat([i if i.dim() == 4 else i.unsqueeze(0) for i in items])),
                          self._tower, self._assemble)

    def _tower(self, pixels: torch.Tensor, mask: None) -> torch.Tensor:
        """[views, C, H, W] -> [views, tokens_per_image, hidden]: tower, pooling, norm, projection."""
        return self.model.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output

    def _assemble(self, items, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each image's output from its views' rows (in order): the rows over the soft tokens, the
        markers' token embeddings between crops."""
        items = [i if i.dim() == 4 else i.unsqueeze(0) for i in items]
        out, at = [], 0
        for item in items:
            views = rows[at:at + item.shape[0]]
            at += item.shape[0]
            if item.shape[0] == 1:
                out.append(views[0].contiguous())
                continue
            ids = torch.tensor(self.between(item.shape[0] - 1), device=self.device)
            emb = self.model.get_input_embeddings()(ids).to(views.dtype)
            emb[ids == self.image_token_id] = views.reshape(-1, views.shape[-1])
            out.append(emb)
        return out


def _json(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}

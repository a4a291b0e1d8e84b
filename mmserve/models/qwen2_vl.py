"""Adapter for Qwen2-VL checkpoints: dynamic resolution and M-RoPE.

Two things set this family apart from LLaVA. An image's token count depends on its size: the image
processor resizes it (`smart_resize`) to a multiple of patch_size * merge_size within
[min_pixels, max_pixels], and every merge_size x merge_size patches make one token. And positions
are 3-D: text tokens advance one position each (equal in all three), an image's tokens take
(start, start + row, start + column) over its merged grid, and the text after an image resumes at
start + max(rows, columns) — so the position of every later token depends on the grids before it,
not only on the token count. The prompt's positions come from the model's own `get_rope_index`;
an answer token at index i sits at i + rope_delta.

The checkpoint is loaded without `Qwen2VLProcessor` (its video processor needs torchvision, which
has no CPU build beside this torch): the tokenizer (its chat template renders each image as
``<|vision_start|><|image_pad|><|vision_end|>``), `Qwen2VLImageProcessorPil` and the model load
separately, and the intake expands each image's single pad token to its count, as the processor
would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from transformers import AutoTokenizer, Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mmserve.cache.keys import image_identity, mm_hash_video, processor_digest
from mmserve.models.adapter import Adapter, PromptInputs
from mmserve.models.qwen_video import (expand_placeholders, load_settings, resized_size, video_grid, video_patches,
                                       video_plan)
from mmserve.models.random_weights import load_model
from mmserve.models.video_item import Plan, VideoSampling, is_video

# image processors whose arithmetic the PIL one reproduces (the fast one's torchvision resize
# differs from PIL's by rounding only); any other needs code this install cannot run
_PIL_COMPATIBLE = frozenset({"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil"})


@dataclass(frozen=True)
class QwenPixels:
    """One image's encoder input: flattened patches [grid_t * grid_h * grid_w, C * t * p * p]."""

    patches: torch.Tensor
    grid: tuple[int, int, int]  # (t, h, w) in patches
    video: bool = False  # a video's frames (the tower's video path), not an image


class Qwen2VLAdapter(Adapter):
    """One loaded Qwen2-VL model (tokenizer, image processor, weights) on a device."""

    mrope = True

    def _load(self) -> None:
        self.image_processor = _image_processor(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        if self.tokenizer.chat_template is None:
            self.tokenizer.chat_template = _saved_template(self.path)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"model {self.name!r}: {self.path} has no chat template (tokenizer or chat_template.jinja)")
        self.model = load_model(self.path, self.dtype, self.device)  # random-weights dirs: drawn on the device
        self.image_token_id = int(self.model.config.image_token_id)
        self.merge_size = int(self.image_processor.merge_size)
        if int(self.model.config.vision_config.spatial_merge_size) != self.merge_size:
            raise ValueError(f"model {self.name!r}: the image processor merges {self.merge_size}x{self.merge_size} "
                             f"patches, the vision tower {self.model.config.vision_config.spatial_merge_size}")
        self.video_token_id = getattr(self.model.config, "video_token_id", None)
        self.video_settings = load_settings(self.path)
        self.video_digest = self.video_settings.digest()

    @property
    def supports_video(self) -> bool:
        """The model has a video token and its chat template renders a video part as it (probed once)."""
        known = getattr(self, "_supports_video", None)
        if known is None:
            try:
                text = self.render_prompt([{"role": "user", "content": [{"type": "video"}]}])
                ids = self.tokenizer([text])["input_ids"][0]
                known = self.video_token_id is not None and ids.count(self.video_token_id) == 1
            except Exception:  # a template that cannot render a video part
                known = False
            self._supports_video = known
        return known

    def video_plan(self, sampling: VideoSampling, frame_cap: int) -> Plan:
        """Which frames of a video to keep, from its metadata (the video processor's sampling)."""
        return video_plan(sampling, self.video_settings, frame_cap)

    def _processor_digest(self) -> int:
        return processor_digest(self.image_processor.to_dict())

    # -- preprocessing ---------------------------------------------------------------------

    def grid(self, image) -> tuple[int, int, int]:
        """The (t, h, w) patch grid the image processor gives `image`, from its size alone."""
        ip = self.image_processor
        factor = int(ip.patch_size) * self.merge_size
        h, w = smart_resize(image.height, image.width, factor=factor,
                            min_pixels=ip.size["shortest_edge"], max_pixels=ip.size["longest_edge"])
        return (1, h // int(ip.patch_size), w // int(ip.patch_size))

    def item_grid(self, item) -> tuple[int, int, int]:
        """An image's grid, or a video's (`qwen_video.video_grid`)."""
        return video_grid(item, self.video_settings) if is_video(item) else self.grid(item)

    def tokens_per_image(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge_size ** 2)

    def tokenize(self, messages: list[dict], images: Sequence, tools: list[dict] | None = None,
                 template: Mapping | None = None) -> PromptInputs:
        """The prompt's tokens with each image's (or video's) pad token repeated to its count, its
        spans, and its 3-D positions; pixels are left for the encoder (`pixel_values`) to make on a
        miss. `images` holds the prompt's images and videos (`VideoItem`) in prompt order."""
        grids = [self.item_grid(item) for item in images]
        counts = [self.tokens_per_image(g) for g in grids]
        if not any(is_video(item) for item in images):
            input_ids, spans = self._expanded_prompt(messages, counts, tools, template)
        else:
            compact = self.tokenizer([self.render_prompt(messages, tools, template)])["input_ids"][0]
            pads = [self.video_token_id if is_video(item) else self.image_token_id for item in images]
            input_ids, spans = expand_placeholders(compact, list(zip(pads, counts)))
        positions, delta = self._rope_index(input_ids, spans, grids, images)
        return PromptInputs(input_ids, None, spans, images=tuple(images), rope_positions=positions, rope_delta=delta)

    def tokenize_raw(self, input_ids: Sequence[int]) -> PromptInputs:
        """A text-only prompt's tokens and its (1-D, repeated) M-RoPE positions."""
        input_ids = tuple(int(t) for t in input_ids)
        positions, delta = self._rope_index(input_ids, (), [], ())
        return PromptInputs(input_ids, None, (), rope_positions=positions, rope_delta=delta)

    def _rope_index(self, input_ids, spans, grids, items) -> tuple[torch.Tensor, int]:
        """The model's own `get_rope_index` (images typed 1, videos 2, as its processor types them)."""
        ids = torch.tensor([input_ids], dtype=torch.long)
        types = torch.zeros_like(ids, dtype=torch.int)
        videos = [is_video(item) for item in items]
        for span, video in zip(spans, videos):
            types[0, span.start:span.start + span.length] = 2 if video else 1
        image_grids = [g for g, v in zip(grids, videos) if not v]
        video_grids = [g for g, v in zip(grids, videos) if v]
        kwargs = {}
        if video_grids:
            kwargs["video_grid_thw"] = torch.tensor(video_grids, dtype=torch.long)
            kwargs.update(self.video_rope_kwargs([item for item, v in zip(items, videos) if v]))
        grid_thw = torch.tensor(image_grids, dtype=torch.long) if image_grids else None
        positions, deltas = self.model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid_thw,
                                                            **kwargs)
        return positions[:, 0].contiguous(), int(deltas[0, 0])

    def video_rope_kwargs(self, videos: Sequence) -> dict:
        """What the family's `get_rope_index` takes about the prompt's videos beyond their grids."""
        return {}

    def rope_positions(self, prompt: PromptInputs, ids_len: int, start: int, end: int) -> torch.Tensor:
        """Positions of tokens [start, end): the prompt's own, then index + rope_delta."""
        n_prompt = len(prompt.input_ids)
        parts = []
        if start < n_prompt:
            parts.append(prompt.rope_positions[:, start:min(end, n_prompt)])
        if end > n_prompt:
            after = torch.arange(max(start, n_prompt), end, dtype=torch.long) + prompt.rope_delta
            parts.append(after.unsqueeze(0).expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def image_key(self, image) -> bytes | None:
        """The mm_hash with the image's grid folded in (layout v2): the grid fixes the image's
        token count and the positions of everything after it. A video's: `keys.video_header`."""
        if is_video(image):
            meta, n = image.meta, len(image.indices)
            return mm_hash_video(
                self.model_sig, self.video_digest, image.content, algorithm=self.hash_algorithm,
                settings={"kind": image.kind, **image.sampling.settings()}, indices=image.indices,
                source_fps=meta.fps, total_frames=meta.total_frames, size=(meta.width, meta.height),
                resized=resized_size(meta.height, meta.width, n, image.sampling, self.video_settings),
                grid=self.item_grid(image))
        return image_identity(self.model_sig, self.processor_digest, image, algorithm=self.hash_algorithm,
                              grid=self.grid(image))

    def pixel_values(self, images: Sequence) -> list[QwenPixels]:
        """Each image's flattened patches and grid (worker thread); the grid must be the one the
        prompt's placeholders were counted with."""
        out = []
        for img in images:
            if is_video(img):
                out.append(self._video_pixels(img))
                continue
            batch = self.image_processor(images=[img], return_tensors="pt")
            grid = tuple(int(x) for x in batch["image_grid_thw"][0])
            if grid != self.grid(img):
                raise RuntimeError(f"the image processor gave a {grid} grid where its settings give {self.grid(img)}")
            out.append(QwenPixels(batch["pixel_values"], grid))
        return out

    def _video_pixels(self, item) -> QwenPixels:
        """A video's patches (`qwen_video.video_patches`), from its frames (decoded now if not kept)."""
        s, n = self.video_settings, len(item.indices)
        resized = resized_size(item.meta.height, item.meta.width, n, item.sampling, s)
        return QwenPixels(video_patches(item.frames(), resized, s), self.item_grid(item), video=True)

    # -- model steps -------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, items: Sequence[QwenPixels]) -> list[torch.Tensor]:
        """The vision tower and merger over images (and videos) of any sizes, one call per kind
        (its attention is per image, per video): one [tokens, hidden] tensor per item, in order."""
        out: list[torch.Tensor | None] = [None] * len(items)
        for video in (False, True):
            which = [i for i, it in enumerate(items) if it.video == video]
            if which:
                for i, rows in zip(which, self._tower([items[i] for i in which], video)):
                    out[i] = rows
        return out

    def _tower(self, items: Sequence[QwenPixels], video: bool) -> list[torch.Tensor]:
        patches = torch.cat([it.patches for it in items]).to(self.device, self.dtype)
        grid_thw = torch.tensor([it.grid for it in items], dtype=torch.long, device=self.device)
        if video:
            out = self.model.model.get_video_features(pixel_values_videos=patches, video_grid_thw=grid_thw,
                                                      return_dict=True)
        else:
            out = self.model.model.get_image_features(pixel_values=patches, image_grid_thw=grid_thw, return_dict=True)
        return [f.contiguous() for f in out.pooler_output]


def _image_processor(path) -> Qwen2VLImageProcessorPil:
    config = path / "preprocessor_config.json"
    kind = json.loads(config.read_text()).get("image_processor_type") if config.is_file() else None
    if kind is not None and kind not in _PIL_COMPATIBLE:
        raise ValueError(f"{path}: the image processor {kind!r} needs torchvision, which this install does not "
                         f"have; save the checkpoint with a Qwen2VLImageProcessor(Pil) instead")
    return Qwen2VLImageProcessorPil.from_pretrained(path)


def _saved_template(path) -> str | None:
    """The chat template a processor saved beside the tokenizer (chat_template.jinja or .json)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    saved = path / "chat_template.json"
    return json.loads(saved.read_text()).get("chat_template") if saved.is_file() else None

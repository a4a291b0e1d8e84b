"""Adapter for LLaVA-OneVision checkpoints (`LlavaOnevisionForConditionalGeneration`, model_type
`llava_onevision`): anyres tiling with `image_newline` rows.

An image's token count follows from its size: the image processor picks the grid pinpoint
(`select_best_resolution`) that fits the image best, cuts the resized and padded image into tiles
of the tower's size and adds a base view of the whole image; the model packs the tiles' features
into one map, drops the rows or columns that are padding (`unpad_image`), pools the map down when
it holds more than ~N tiles' worth (`vision_aspect_ratio = "anyres_max_N"`), appends the learned
`image_newline` to each row and puts the base view first. The counts come from
`LlavaOnevisionProcessor`'s own arithmetic (`_get_number_of_features`), the rows from the
model's own `get_image_features` (which packs with `pack_image_features`): one image's rows are
exactly what HF's forward scatters into its placeholders, and per image, so batching images of
several requests into one encoder call changes no row.

Every image is tiled, as transformers' processor does for a flat list of images (each image its
own sample: `batch_num_images` all 1) and as `get_image_features` does without `batch_num_images`.
The processor's other multi-image mode (a nested list: each image one untiled view plus one
newline) is not served.

The checkpoint loads without `LlavaOnevisionProcessor` (its video processor needs torchvision,
which has no CPU build beside this torch): the tokenizer, `LlavaOnevisionImageProcessorPil` and the
model load separately, and the processor's settings (`num_image_tokens`,
`vision_feature_select_strategy`, `vision_aspect_ratio`) are the model config's, checked against
`processor_config.json` when there is one. Keys: layout v2 with the image's (tokens, tile rows,
tile columns) as its grid, over a processor digest that covers the image processor's settings
(grid pinpoints, size, crop, normalisation) and those three.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from transformers import AutoTokenizer, LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor
from transformers.models.llava_onevision.modeling_llava_onevision import (get_anyres_image_grid_shape,
                                                                          image_size_to_num_patches)

from mmserve.cache.keys import image_identity, mm_hash_video, processor_digest
from mmserve.models.adapter import Adapter, PromptInputs
from mmserve.models.onevision_video import onevision_settings, sample_indices, video_pixels
from mmserve.models.qwen2_vl import _saved_template
from mmserve.models.qwen_video import expand_placeholders
from mmserve.models.video_item import Plan, VideoItem, VideoSampling, is_video
from mmserve.models.random_weights import load_model

# image processors whose arithmetic the PIL one reproduces (the torchvision one's resize differs
# from PIL's by rounding only); any other needs code this install cannot run
_PIL_COMPATIBLE = frozenset({"LlavaOnevisionImageProcessor", "LlavaOnevisionImageProcessorFast",
                             "LlavaOnevisionImageProcessorPil"})
_PROCESSOR_KEYS = ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio")


@dataclass(frozen=True)
class OnevisionPixels:
    """One image's encoder input: its base view and tiles [1 + tiles, C, S, S], and its size."""

    patches: torch.Tensor
    size: tuple[int, int]  # (height, width) of the image as the processor got it
    video: bool = False  # a video's frames [T, C, S, S] (`onevision_video`), pooled by the tower's video path


class LlavaOnevisionAdapter(Adapter):
    """One loaded LLaVA-OneVision model (tokenizer, image processor, weights) on a device."""

    def _load(self) -> None:
        self.image_processor = _image_processor(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        if self.tokenizer.chat_template is None:
            self.tokenizer.chat_template = _saved_template(self.path)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"model {self.name!r}: {self.path} has no chat template "
                             f"(tokenizer or chat_template.jinja)")
        self.model = load_model(self.path, self.dtype, self.device)  # random-weights dirs: drawn on the device
        config = self.model.config
        if config.model_type != "llava_onevision":
            raise ValueError(f"model {self.name!r}: {self.path} holds a {config.model_type!r} model, "
                             f"not LLaVA-OneVision")
        self.image_token_id = int(config.image_token_id)
        vision = config.vision_config
        tile = int(vision.image_size)
        settings = {"num_image_tokens": (tile // int(vision.patch_size)) ** 2,
                    "vision_feature_select_strategy": config.vision_feature_select_strategy,
                    "vision_aspect_ratio": config.vision_aspect_ratio}
        saved = _saved_processor_settings(self.path)
        for key in _PROCESSOR_KEYS:
            if key in saved and saved[key] != settings[key]:
                raise ValueError(f"model {self.name!r}: processor_config.json says {key} = {saved[key]!r}, "
                                 f"the model config {settings[key]!r}")
        ip = self.image_processor
        if [list(g) for g in ip.image_grid_pinpoints] != [list(g) for g in config.image_grid_pinpoints]:
            raise ValueError(f"model {self.name!r}: the image processor's grid pinpoints differ from the model's")
        if _tile_size(ip) != tile:
            raise ValueError(f"model {self.name!r}: the image processor makes {ip.size} tiles, the vision tower "
                             f"takes {tile}x{tile}")
        self.processor_settings = settings
        self.tile = tile
        vid = getattr(config, "video_token_id", None)
        self.video_token_id = None if vid in (None, config.text_config.pad_token_id) else int(vid)
        self.video_settings = onevision_settings(ip, vision)
        self.video_digest = self.video_settings.digest()

    @property
    def supports_video(self) -> bool:
        """A video token of its own that the chat template writes for a video part (probed once)."""
        if getattr(self, "_supports_video", None) is None:
            try:
                text = self.render_prompt([{"role": "user", "content": [{"type": "video"}]}])
                ids = self.tokenizer([text])["input_ids"][0]
                self._supports_video = self.video_token_id is not None and ids.count(self.video_token_id) == 1
            except Exception:  # a template that cannot render a video part
                self._supports_video = False
        return self._supports_video

    def video_plan(self, sampling: VideoSampling, frame_cap: int) -> Plan:
        return lambda meta: sample_indices(meta, sampling, frame_cap)

    def _processor_digest(self) -> int:
        return onevision_processor_digest(self.image_processor.to_dict(), self.processor_settings)

    # -- preprocessing ---------------------------------------------------------------------

    def tiles(self, image) -> tuple[int, int]:
        """(rows, columns) of tiles the grid pinpoint chosen for this image's size gives."""
        return image_tiles(self.image_processor, image.height, image.width)

    def tokens_per_image(self, image) -> int:
        """The placeholder count of `image` (LlavaOnevisionProcessor's own arithmetic)."""
        return image_tokens(self.image_processor, self.processor_settings, image.height, image.width)

    def tokenize(self, messages: list[dict], images: Sequence, tools: list[dict] | None = None,
                 template: Mapping | None = None) -> PromptInputs:
        """The prompt's tokens with each image's `<image>` repeated to its count, and its spans;
        pixels are left for the encoder (`pixel_values`) to make on a miss."""
        counts = [self.video_settings.tokens(len(img.indices)) if is_video(img) else self.tokens_per_image(img)
                  for img in images]
        if any(is_video(img) for img in images):  # `<video>` pads too: T pooled frame maps and one newline each
            compact = self.tokenizer([self.render_prompt(messages, tools, template)])["input_ids"][0]
            pads = [self.video_token_id if is_video(img) else self.image_token_id for img in images]
            input_ids, spans = expand_placeholders(compact, list(zip(pads, counts)))
        else:
            input_ids, spans = self._expanded_prompt(messages, counts, tools, template)
        return PromptInputs(input_ids, None, spans, images=tuple(images))

    def image_key(self, image) -> bytes | None:
        """The mm_hash with the image's tiling folded in (layout v2: tokens, tile rows, tile
        columns): it fixes the image's token count and so where the text after it sits. A video's:
        `keys.video_header`, its grid (frames, pooled side, pooled side)."""
        if is_video(image):
            meta, s = image.meta, self.video_settings
            return mm_hash_video(self.model_sig, self.video_digest, image.content, algorithm=self.hash_algorithm,
                                 settings={"kind": image.kind, **image.sampling.settings()}, indices=image.indices,
                                 source_fps=meta.fps, total_frames=meta.total_frames, size=(meta.width, meta.height),
                                 resized=(s.tile, s.tile), grid=(len(image.indices), s.pooled_side, s.pooled_side))
        rows, cols = self.tiles(image)
        return image_identity(self.model_sig, self.processor_digest, image, algorithm=self.hash_algorithm,
                              grid=(self.tokens_per_image(image), rows, cols))

    def pixel_values(self, images: Sequence) -> list[OnevisionPixels]:
        """Each image's base view and tiles (worker thread), one image per processor call (each
        is tiled, as the processor tiles every image of a flat list)."""
        out = []
        grid = self.model.config.image_grid_pinpoints
        for img in images:
            if isinstance(img, VideoItem):
                out.append(OnevisionPixels(video_pixels(img.frames(), self.video_settings), (self.tile, self.tile), True))
                continue
            batch = self.image_processor(images=[img], return_tensors="pt")
            patches = batch["pixel_values"][0]
            size = (img.height, img.width)
            want = image_size_to_num_patches(list(size), grid, self.tile)
            if patches.shape[0] != want:
                raise RuntimeError(f"the image processor gave {patches.shape[0]} tiles where the model expects {want}")
            out.append(OnevisionPixels(patches, size))
        return out

    def generate_inputs(self, prompt: PromptInputs, items: Sequence[OnevisionPixels] = ()) -> dict:
        """What LlavaOnevisionProcessor gives for the prompt and a flat list of its images (each
        tiled): input_ids, attention_mask, pixel_values [images, most tiles, C, S, S] (each image's
        base view and tiles, zero-padded to the most tiles) and image_sizes [images, 2]."""
        out = self._token_inputs(prompt)
        if items:
            most = max(it.patches.shape[0] for it in items)
            out["pixel_values"] = torch.stack([torch.cat([it.patches, it.patches.new_zeros(
                (most - it.patches.shape[0], *it.patches.shape[1:]))]) for it in items])
            out["image_sizes"] = torch.tensor([it.size for it in items], dtype=torch.long)
        return out

    # -- model steps -------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, items: Sequence[OnevisionPixels]) -> list[torch.Tensor]:
        """The vision tower, projector and transformers' packing (unpad, pooling, newline rows)
        over images of any sizes in one call: one [tokens_per_image, hidden] tensor per image.
        Videos go one per call through the tower's video path (frames pooled, one newline row)."""
        out: list = [None] * len(items)
        images = [i for i, it in enumerate(items) if not it.video]
        if images:
            for i, rows in zip(images, self._encode_images([items[i] for i in images])):
                out[i] = rows
        for i, it in enumerate(items):
            if it.video:
                pixels = it.patches.unsqueeze(0).to(self.device, self.dtype)
                out[i] = self.model.model.get_video_features(pixel_values_videos=pixels,
                                                             return_dict=True).pooler_output[0].contiguous()
        return out

    def _encode_images(self, items: Sequence[OnevisionPixels]) -> list[torch.Tensor]:
        pixels = torch.cat([it.patches for it in items]).to(self.device, self.dtype)
        sizes = torch.tensor([it.size for it in items], dtype=torch.long, device=self.device)
        out = self.model.model.get_image_features(pixel_values=pixels, image_sizes=sizes, return_dict=True)
        return [f.contiguous() for f in out.pooler_output]


def onevision_processor_digest(image_processor_settings: Mapping, processor_settings: Mapping) -> int:
    """The digest every mm_hash folds in: the image processor's settings (`to_dict()`: grid
    pinpoints, tile size, crop, resampling, normalisation) and, under "processor", the processor's
    own (`num_image_tokens`, `vision_feature_select_strategy`, `vision_aspect_ratio`)."""
    return processor_digest({**image_processor_settings, "processor": dict(processor_settings)})


def image_tiles(image_processor, height: int, width: int) -> tuple[int, int]:
    """(rows, columns) of tiles of a height x width image (transformers' `get_anyres_image_grid_shape`)."""
    tile = _tile_size(image_processor)
    rows, cols = get_anyres_image_grid_shape([height, width], image_processor.image_grid_pinpoints, tile)
    return int(rows), int(cols)


def image_tokens(image_processor, processor_settings: Mapping, height: int, width: int) -> int:
    """The placeholder count of a height x width image: LlavaOnevisionProcessor's own
    `_get_number_of_features`, run without building the processor (whose video processor needs
    torchvision)."""
    counter = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    counter.image_processor = image_processor
    counter.num_image_tokens = processor_settings["num_image_tokens"]
    counter.vision_aspect_ratio = processor_settings["vision_aspect_ratio"]
    tile = _tile_size(image_processor)
    n = int(counter._get_number_of_features(height, width, tile, tile))
    return n - 1 if processor_settings["vision_feature_select_strategy"] == "default" else n


def _tile_size(image_processor) -> int | None:
    """The side of the square tiles the image processor makes (its `size`), None if not square."""
    size = dict(image_processor.size)
    if size.get("height") and size.get("width"):
        return int(size["height"]) if size["height"] == size["width"] else None
    return int(size["shortest_edge"]) if size.get("shortest_edge") else None


def _image_processor(path) -> LlavaOnevisionImageProcessorPil:
    config = path / "preprocessor_config.json"
    kind = json.loads(config.read_text()).get("image_processor_type") if config.is_file() else None
    if kind is not None and kind not in _PIL_COMPATIBLE:
        raise ValueError(f"{path}: the image processor {kind!r} is not LLaVA-OneVision's, or needs torchvision, "
                         f"which this install does not have; save the checkpoint with a "
                         f"LlavaOnevisionImageProcessor(Pil) instead")
    return LlavaOnevisionImageProcessorPil.from_pretrained(path)


def _saved_processor_settings(path) -> dict:
    saved = path / "processor_config.json"
    try:
        data = json.loads(saved.read_text()) if saved.is_file() else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}

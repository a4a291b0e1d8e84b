"""Adapter for Idefics3 checkpoints (`Idefics3ForConditionalGeneration`, model_type `idefics3`;
SmolVLM's architecture): image splitting into tiles plus a global view, pixel shuffle.

The image processor resizes an image so its longest edge is `size["longest_edge"]`, rounds its
sides up to whole tiles of `max_image_size["longest_edge"]` and cuts them row by row, then adds the
whole image at tile size (the global view); each view becomes `image_seq_len` tokens (the tower's
patches, pixel-shuffled `scale_factor`² into one). `Idefics3Processor` writes an image as text
around those tokens, so its placeholders are not one run:

    <fake_token_around_image><row_1_col_1><image>*n<fake_token_around_image><row_1_col_2><image>*n\\n
    ...
    \\n<fake_token_around_image><global-img><image>*n<fake_token_around_image>

(an image too small to split: only the last line, without its leading newline). mmserve keeps one
span per image over that whole expansion, markers and newlines included, and the image's encoder
output has one row per position of the span: the tower's rows at the `<image>` positions, the
markers' own token embeddings between them — exactly what transformers' forward feeds the
language model there (`inputs_merger` scatters the image rows into the token embeddings). So the
runtime's span arithmetic holds unchanged: a block's key folds in the image's mm_hash for every
block the expansion touches (a block of markers alone between two tiles included), a prefix hit
that ends anywhere inside the image — in a tile, at a marker — hands over exactly the rows after
it, and the encoder cache and the shared tier hold [span length, hidden] as for every family.

The expansion's token ids are the tokenizer's over the expansion text (memoized per tile grid) and
spliced in where the chat template wrote `<image>`: the expansion starts and ends with a special
token, so it tokenizes alone exactly as inside the prompt (a tokenizer that merges "\\n\\n" merges
the last row's newline with the global view's there too). The tile grid follows from the image's
size by the image processor's own resize arithmetic (`image_grid`), checked against the grid the
processor reports when it makes the pixels.

The checkpoint loads without `AutoProcessor` (transformers 5 maps `Idefics3ImageProcessor` to its
torchvision class): the tokenizer, `Idefics3ImageProcessorPil` and the model load separately and
`Idefics3Processor` is built from them; `image_seq_len` is the model config's, checked against
`processor_config.json`. Keys: layout v2 with the image's (tokens, tile rows, tile columns) as its
grid (an image that is not split: 1 x 1, which splitting never makes), over a processor digest that
covers the image processor's settings and `image_seq_len`.

transformers names Idefics3's decoder stack `model.text_model` (`language_model` says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from transformers import AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor
from transformers.image_processing_utils import ImageProcessingMixin
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.idefics3.image_processing_pil_idefics3 import (
    MAX_IMAGE_SIZE, _resize_output_size_rescale_to_max_len, _resize_output_size_scale_below_upper_bound)

from mmserve.cache.keys import image_identity, processor_digest
from mmserve.models.adapter import Adapter, ImageSpan, PromptInputs
from mmserve.models.fixed_tower import FixedTower, TowerViews
from mmserve.models.llava_onevision import _saved_processor_settings
from mmserve.models.qwen2_vl import _saved_template
from mmserve.models.random_weights import load_model

# image processors whose arithmetic the PIL one reproduces (transformers 5's torchvision class,
# and 4.x's slow and fast ones, share its resize and tiling; the resize itself differs by rounding)
_PIL_COMPATIBLE = frozenset({"Idefics3ImageProcessor", "Idefics3ImageProcessorFast", "Idefics3ImageProcessorPil"})
FAKE_TOKEN = "<fake_token_around_image>"


@dataclass(frozen=True)
class Idefics3Pixels:
    """One image's encoder input: its views [tiles + 1, C, S, S] (the tiles row by row, then the
    global view; one view when not split), their pixel masks [tiles + 1, S, S], its tile grid."""

    views: torch.Tensor
    mask: torch.Tensor
    grid: tuple[int, int]  # (rows, columns) of tiles; (0, 0): not split


class Idefics3Adapter(Adapter):
    """One loaded Idefics3 model (tokenizer, image processor, weights) on a device."""

    def _load(self) -> None:
        self.image_processor = _image_processor(self.path)
        tokenizer = AutoTokenizer.from_pretrained(self.path)
        template = _saved_template(self.path) or tokenizer.chat_template  # the processor's, as HF renders
        if template is None:
            raise ValueError(f"model {self.name!r}: {self.path} has no chat template "
                             f"(chat_template.jinja / .json or the tokenizer's)")
        self.model = load_model(self.path, self.dtype, self.device)  # random-weights dirs: drawn on the device
        config = self.model.config
        if config.model_type != "idefics3":
            raise ValueError(f"model {self.name!r}: {self.path} holds a {config.model_type!r} model, not Idefics3")
        vision = config.vision_config
        side = int(vision.image_size) // int(vision.patch_size)
        if side % int(config.scale_factor):
            raise ValueError(f"model {self.name!r}: {side}x{side} patches a view cannot be pixel-shuffled by "
                             f"{config.scale_factor}")
        seq_len = (side // int(config.scale_factor)) ** 2
        saved = _saved_processor_settings(self.path).get("image_seq_len")
        if saved is not None and int(saved) != seq_len:
            raise ValueError(f"model {self.name!r}: processor_config.json says image_seq_len = {saved}, the model "
                             f"config makes {seq_len} tokens a view")
        tile = _edge(self.image_processor.max_image_size)
        if tile != int(vision.image_size):
            raise ValueError(f"model {self.name!r}: the image processor makes {tile} px tiles, the vision tower "
                             f"takes {vision.image_size}x{vision.image_size}")
        # transformers' own processor (it adds its three tokens to the tokenizer, as it does for HF)
        self.processor = Idefics3Processor(image_processor=self.image_processor, tokenizer=tokenizer,
                                           image_seq_len=seq_len, chat_template=template)
        self.tokenizer = self.processor.tokenizer
        self.tokenizer.chat_template = template
        self.image_token_id = int(config.image_token_id)
        vocab = int(config.get_text_config().vocab_size)
        for token in (self.processor.image_token, FAKE_TOKEN):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if tid is None or tid == self.tokenizer.unk_token_id or tid >= vocab:
                raise ValueError(f"model {self.name!r}: the tokenizer has no {token} token the model knows")
        if self.processor.image_token_id != self.image_token_id:
            raise ValueError(f"model {self.name!r}: the tokenizer's <image> is id {self.processor.image_token_id}, "
                             f"the model config's image_token_id {self.image_token_id}")
        self.image_seq_len = seq_len
        self._expansions: dict[tuple[int, int], tuple[int, ...]] = {}

    @property
    def language_model(self) -> torch.nn.Module:
        return self.model.model.text_model

    def _processor_digest(self) -> int:
        return idefics3_processor_digest(self.image_processor.to_dict(), self.image_seq_len)

    # -- preprocessing ---------------------------------------------------------------------

    def grid(self, image) -> tuple[int, int]:
        """(rows, columns) of tiles the image processor cuts `image` into; (0, 0): not split."""
        return image_grid(self.image_processor, image.height, image.width)

    def expansion(self, grid: tuple[int, int]) -> tuple[int, ...]:
        """The token ids that stand for an image of this tile grid in the prompt (memoized)."""
        ids = self._expansions.get(grid)
        if ids is None:
            rows, cols = grid
            text = self.processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
            ids = tuple(int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"])
            views = rows * cols + 1
            if sum(t == self.image_token_id for t in ids) != views * self.image_seq_len:
                raise RuntimeError(f"the {rows}x{cols} image text tokenizes to {ids.count(self.image_token_id)} "
                                   f"<image> tokens, not {views} x {self.image_seq_len}")
            if len(self._expansions) < 4096:
                self._expansions[grid] = ids
        return ids

    def tokens_per_image(self, image) -> int:
        """The image's tokens in the prompt: its views' `<image>` tokens and the markers around them."""
        return len(self.expansion(self.grid(image)))

    def tokenize(self, messages: list[dict], images: Sequence, tools: list[dict] | None = None,
                 template: Mapping | None = None) -> PromptInputs:
        """The prompt's tokens with each `<image>` the chat template wrote replaced by the image's
        expansion (tiles, markers, global view), and one span per image over its expansion; pixels
        are left for the encoder (`pixel_values`) to make on a miss."""
        compact = self.tokenizer([self.render_prompt(messages, tools, template)])["input_ids"][0]
        where = [i for i, t in enumerate(compact) if t == self.image_token_id]
        if len(where) != len(images):
            raise ValueError(f"the prompt has {len(where)} image placeholders for {len(images)} images")
        input_ids: list[int] = []
        spans = []
        start = 0
        for i, img in zip(where, images):
            input_ids += compact[start:i]
            ids = self.expansion(self.grid(img))
            spans.append(ImageSpan(len(input_ids), len(ids)))
            input_ids += ids
            start = i + 1
        input_ids += compact[start:]
        return PromptInputs(tuple(int(t) for t in input_ids), None, tuple(spans), images=tuple(images))

    def image_key(self, image) -> bytes | None:
        """The mm_hash with the image's tiling folded in (layout v2: tokens, tile rows, tile
        columns; 1 x 1 when not split): it fixes the image's token count and its markers."""
        rows, cols = self.grid(image)
        return image_identity(self.model_sig, self.processor_digest, image, algorithm=self.hash_algorithm,
                              grid=(len(self.expansion((rows, cols))), max(rows, 1), max(cols, 1)))

    def pixel_values(self, images: Sequence) -> list[Idefics3Pixels]:
        """Each image's views and pixel masks (worker thread), one image per processor call; the
        grid must be the one the prompt's expansion was made for."""
        out = []
        for img in images:
            batch = self.image_processor(images=[[img]], return_tensors="pt", return_row_col_info=True)
            grid = (int(batch["rows"][0][0]), int(batch["cols"][0][0]))
            if grid != self.grid(img):
                raise RuntimeError(f"the image processor cut {grid} tiles where its settings give {self.grid(img)}")
            out.append(Idefics3Pixels(batch["pixel_values"][0], batch["pixel_attention_mask"][0], grid))
        return out

    def generate_inputs(self, prompt: PromptInputs, items: Sequence[Idefics3Pixels] = ()) -> dict:
        """What Idefics3Processor gives for the prompt and its images (one sample): input_ids,
        attention_mask, pixel_values [1, views, C, S, S] and pixel_attention_mask [1, views, S, S]
        (every image's views in prompt order, as `encode_images` takes them)."""
        out = self._token_inputs(prompt)
        if items:
            out["pixel_values"] = torch.cat([it.views for it in items]).unsqueeze(0)
            out["pixel_attention_mask"] = torch.cat([it.mask for it in items]).unsqueeze(0)
        return out

    # -- model steps -------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, items: Sequence[Idefics3Pixels]) -> list[torch.Tensor]:
        """The vision tower and connector over every view of the images in one call (each view
        attends within itself), then each image's rows over its whole expansion: the views' rows
        at its `<image>` positions, the markers' token embeddings between them."""
        views = torch.cat([it.views for it in items]).unsqueeze(0).to(self.device, self.dtype)
        mask = torch.cat([it.mask for it in items]).unsqueeze(0).to(self.device)
        out = self.model.model.get_image_features(pixel_values=views, pixel_attention_mask=mask, return_dict=True)
        features = out.pooler_output[0]
        if features.shape[0] != views.shape[1] * self.image_seq_len:  # transformers drops all-zero views as padding
            raise RuntimeError(f"the vision tower gave {features.shape[0] // self.image_seq_len} views of "
                               f"{views.shape[1]}: a view whose pixels are all 0.0 is taken for padding")
        return self._assemble(items, features)

    def fixed_tower(self) -> FixedTower:
        """SigLIP per tile: every view (tile or global view) one tile's size, with its pixel mask (a
        global view of a non-square image is padded); `_tower` is `get_image_features` less its
        dropping of all-zero views (a shape that follows values), which `_tower_views` refuses instead."""
        vision = self.model.config.vision_config
        side = int(vision.image_size)
        return FixedTower((int(getattr(vision, "num_channels", 3)), side, side), True,
                          self._tower_views, self._tower, self._assemble)

    def _tower_views(self, items: Sequence[Idefics3Pixels]) -> TowerViews:
        views = torch.cat([it.views for it in items])
        empty = int((views.flatten(1) == 0).all(1).sum())
        if empty:  # as the eager path fails for it
            raise RuntimeError(f"the vision tower gave {views.shape[0] - empty} views of {views.shape[0]}: "
                               f"a view whose pixels are all 0.0 is taken for padding")
        return TowerViews(views, torch.cat([it.mask for it in items]).bool())

    def _tower(self, pixels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[views, C, S, S] and pixel masks [views, S, S] -> [views, image_seq_len, hidden]."""
        model = self.model.model
        patch = int(model.config.vision_config.patch_size)
        patches = mask.unfold(1, patch, patch).unfold(2, patch, patch)
        patch_mask = patches.sum(dim=(-1, -2)) > 0
        # `Idefics3VisionTransformer.forward` but for its mask: built even when no patch is padding
        # (transformers skips it then, asking the device whether any is: a host synchronisation)
        vision = model.vision_model
        embeds = vision.embeddings(pixel_values=pixels, patch_attention_mask=patch_mask)
        attention = create_bidirectional_mask(config=vision.config, inputs_embeds=embeds,
                                              attention_mask=patch_mask.view(pixels.shape[0], -1),
                                              allow_is_bidirectional_skip=False)
        hidden = vision.encoder(inputs_embeds=embeds, attention_mask=attention).last_hidden_state
        return model.connector(vision.post_layernorm(hidden))

    def _assemble(self, items: Sequence[Idefics3Pixels], features: torch.Tensor) -> list[torch.Tensor]:
        """Each image's rows over its expansion: its views' rows (`features`: every view's, in
        order, [V * image_seq_len, hidden] or [V, image_seq_len, hidden]) at its `<image>`
        positions, the markers' token embeddings between them."""
        features = features.reshape(-1, features.shape[-1])
        rows, at = [], 0
        embed = self.model.get_input_embeddings()
        for it in items:
            ids = torch.tensor(self.expansion(it.grid), dtype=torch.long, device=self.device)
            n = it.views.shape[0] * self.image_seq_len
            full = embed(ids).to(features.dtype)
            full[ids == self.image_token_id] = features[at:at + n]
            rows.append(full)
            at += n
        return rows


def idefics3_processor_digest(image_processor_settings: Mapping, image_seq_len: int) -> int:
    """The digest every mm_hash folds in: the image processor's settings (`to_dict()`: resize edge,
    tile size, splitting, resampling, normalisation, padding) and, under "processor", the
    processor's own `image_seq_len` (tokens a view)."""
    return processor_digest({**image_processor_settings, "processor": {"image_seq_len": int(image_seq_len)}})


def image_grid(image_processor, height: int, width: int) -> tuple[int, int]:
    """(rows, columns) of tiles a height x width image is cut into, (0, 0) when it is not split
    (`split_images`: the sides `processed_sizes` gives are whole tiles)."""
    _, tiled = processed_sizes(image_processor, height, width)
    tile = _edge(image_processor.max_image_size)
    if tiled is None or (tiled[0] <= tile and tiled[1] <= tile):
        return 0, 0
    return (tiled[0] - tile) // tile + 1, (tiled[1] - tile) // tile + 1


def processed_sizes(image_processor, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(height, width) of a height x width image after `resize` (to the longest edge), and after
    `resize_for_vision_encoder` (up to whole tiles; None when the processor does not split):
    `Idefics3ImageProcessorPil`'s own arithmetic, from the size alone."""
    ip = image_processor
    if ip.do_resize:
        size = _fields(ip.size)
        if size.get("longest_edge"):
            height, width = _resize_output_size_rescale_to_max_len(height, width, max_len=size["longest_edge"])
            height, width = _resize_output_size_scale_below_upper_bound(height, width, max_len=MAX_IMAGE_SIZE)
        elif size.get("height") and size.get("width"):
            height, width = size["height"], size["width"]
        else:
            raise ValueError("size must be a dictionary with key 'longest_edge' or 'height' and 'width'.")
    if not ip.do_image_splitting:
        return (height, width), None
    tile = _edge(ip.max_image_size)
    aspect_ratio = width / height
    if width >= height:
        tiled_w = math.ceil(width / tile) * tile
        tiled_h = math.ceil(int(tiled_w / aspect_ratio) / tile) * tile
    else:
        tiled_h = math.ceil(height / tile) * tile
        tiled_w = math.ceil(int(tiled_h * aspect_ratio) / tile) * tile
    return (height, width), (tiled_h, tiled_w)


def _fields(size) -> dict:
    return {k: v for k, v in dict(size).items() if v is not None} if size is not None else {}


def _edge(size) -> int:
    return int(_fields(size)["longest_edge"])


def _image_processor(path) -> Idefics3ImageProcessorPil:
    try:
        settings, _ = ImageProcessingMixin.get_image_processor_dict(path)
    except OSError:
        settings = {}
    kind = settings.get("image_processor_type")
    if kind is not None and kind not in _PIL_COMPATIBLE:
        raise ValueError(f"{path}: the image processor {kind!r} is not Idefics3's, or needs torchvision, which this "
                         f"install does not have; save the checkpoint with an Idefics3ImageProcessor(Pil) instead")
    return Idefics3ImageProcessorPil.from_pretrained(path)

"""Synthetic training data for the Qwen2-VL demo model: images of many sizes, inputs built by hand.

The conversations are the LLaVA demo's (:mod:`.data`); what differs is the image side. Every image
has its own size (sides 32..128 px, aspect up to 3:1), so it becomes a different number of patches
and of ``<|image_pad|>`` tokens. Images are rendered once into an :class:`ImageBank`, resized like
``Qwen2VLImageProcessorPil`` (``smart_resize``, bicubic) and kept as uint8 patches; a batch
normalises and patchifies them in torch (:func:`normalize_patches`), which matches the processor to
float rounding. Model inputs follow ``Qwen2VLProcessor``: each pad expanded to the image's token
count, ``mm_token_type_ids`` 1 on image tokens, ``image_grid_thw`` per image.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch
from PIL import Image

from . import data, render
from .qwen import QwenPreset, expand_image_pads

MIN_SIDE, MAX_SIDE, MAX_ASPECT = 32, 128, 3.0
CLIP_MEAN = torch.tensor(data.CLIP_MEAN)
CLIP_STD = torch.tensor(data.CLIP_STD)


@dataclasses.dataclass
class SizedSpec(data.ImageSpec):
    """An :class:`.data.ImageSpec` drawn at ``size`` = (width, height)."""

    size: tuple[int, int] = (render.IMAGE_SIZE, render.IMAGE_SIZE)

    def render(self) -> Image.Image:
        return render.render_image(self.color, self.shape, self.background, self.seed, size=self.size)


def random_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): the long side uniform in 32..128, the aspect log-uniform up to 3:1."""
    long = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
    aspect = math.exp(float(rng.uniform(0.0, math.log(MAX_ASPECT))))
    short = max(MIN_SIDE, int(round(long / aspect)))
    return (long, short) if rng.random() < 0.5 else (short, long)


def with_size(spec: data.ImageSpec, size: tuple[int, int]) -> SizedSpec:
    return SizedSpec(spec.color, spec.shape, spec.background, spec.seed, size=tuple(size))


def patches_uint8(image: Image.Image, preset: QwenPreset) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Resize like the processor; uint8 patches [gh*gw, 3*p*p] in its (merge-block) order, and the grid."""
    t, gh, gw = preset.grid(*image.size)
    p, m = preset.patch_size, preset.merge_size
    image = image.convert("RGB")
    if image.size != (gw * p, gh * p):
        image = image.resize((gw * p, gh * p), Image.Resampling.BICUBIC)
    x = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)  # C, H, W
    x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * p * p)), (t, gh, gw)


def normalize_patches(patches: torch.Tensor, patch_size: int, temporal: int) -> torch.Tensor:
    """uint8 [n, 3*p*p] -> float32 [n, 3*temporal*p*p]: rescale, CLIP mean/std, frame repeated."""
    x = patches.float().view(-1, 3, 1, patch_size * patch_size) * (1 / 255)
    x = (x - CLIP_MEAN.view(1, 3, 1, 1)) / CLIP_STD.view(1, 3, 1, 1)
    return x.expand(-1, 3, temporal, patch_size * patch_size).reshape(len(patches), -1)


class ImageBank:
    """Pre-rendered training images of random sizes, stored as uint8 patches back to back."""

    def __init__(self, preset: QwenPreset, count: int, seed: int = 0):
        rng = np.random.default_rng([seed, 0x51BA4C])
        self.preset = preset
        self.specs = [with_size(data.random_spec(rng), random_size(rng)) for _ in range(count)]
        chunks, grids = [], []
        for s in self.specs:
            x, g = patches_uint8(s.render(), preset)
            chunks.append(x)
            grids.append(g)
        self.grids = torch.tensor(grids, dtype=torch.long)  # [N, 3]
        self.n_patches = self.grids.prod(-1)
        self.offsets = torch.cumsum(self.n_patches, 0) - self.n_patches
        self.patches = torch.from_numpy(np.concatenate(chunks))  # [sum patches, 3*p*p] uint8
        self.tokens = (self.n_patches // preset.merge_size**2).tolist()

    def __len__(self) -> int:
        return len(self.specs)

    def patch_index(self, idx) -> torch.Tensor:
        """Row indices into :attr:`patches` of images ``idx``, concatenated in order."""
        return torch.cat([torch.arange(int(self.offsets[i]), int(self.offsets[i] + self.n_patches[i]))
                          for i in idx])

    def pixel_values(self, idx) -> torch.Tensor:
        p = self.preset
        return normalize_patches(self.patches[self.patch_index(idx)], p.patch_size, p.temporal_patch_size)


class Encoder:
    """Chat template + tokenize + expand image pads to each image's token count (cached)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.image_id = tokenizer.image_token_id
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one Encoder per training run
    def prompt_ids(self, messages_key, attrs) -> tuple[tuple[int, ...], tuple[int, ...]]:
        final, history, system, text_first = messages_key
        specs = [data.ImageSpec(c, sh, bg, 0) for c, sh, bg in attrs]
        messages, answer = data.conversation(final, specs, history, system, text_first)
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ans = tuple(self.tok.encode(" " + answer, add_special_tokens=False)) + (self.eos_id,)
        return tuple(self.tok.encode(text, add_special_tokens=False)), ans

    def encode(self, messages_key, specs, counts: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(input_ids, labels, mm_token_type_ids); labels only on the final answer + ``</s>``."""
        attrs = tuple((s.color, s.shape, s.background) for s in specs)
        prompt, ans = self.prompt_ids(messages_key, attrs)
        ids, types = expand_image_pads(list(prompt), counts, self.image_id)
        return ids + list(ans), [-100] * len(ids) + list(ans), types + [0] * len(ans)


def collate(examples, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (training only): input_ids, labels, attention_mask, mm_token_type_ids."""
    out = data.collate([(ids, lab) for ids, lab, _ in examples], pad_id)
    types = torch.zeros_like(out["input_ids"])
    for i, (_, _, ty) in enumerate(examples):
        types[i, : len(ty)] = torch.tensor(ty)
    out["mm_token_type_ids"] = types
    return out


class BatchSampler:
    """Training batches from an :class:`ImageBank`; lengths sorted within a pool (little padding).

    A batch carries the bank indices of its images (``image_index``, in prompt order) and their
    ``image_grid_thw``; the trainer turns them into pixels or cached vision features.
    """

    def __init__(self, tokenizer, bank: ImageBank, seed: int, mix: data.TaskMix | None = None, pool: int = 16):
        self.enc = Encoder(tokenizer)
        self.bank = bank
        self.mix = mix or data.TaskMix()
        self.pool = pool
        self.rng = np.random.default_rng([seed, 0x51DA7A])
        self._queue: list[dict[str, torch.Tensor]] = []

    def _example(self, n_images: int):
        rng = self.rng
        idx = [int(j) for j in rng.integers(len(self.bank), size=n_images)]
        specs = [self.bank.specs[j] for j in idx]
        key = data.sample_dialogue(rng, n_images, self.mix)
        ids, labels, types = self.enc.encode(key, specs, [self.bank.tokens[j] for j in idx])
        return (ids, labels, types), idx, data.TASK_OF_QUESTION[key[0]]

    def _make(self, examples) -> dict[str, torch.Tensor]:
        out = collate([e for e, _, _ in examples], self.enc.pad_id)
        idx = [j for _, im, _ in examples for j in im]
        out["image_index"] = torch.tensor(idx)
        out["image_grid_thw"] = self.bank.grids[out["image_index"]]
        out["task"] = torch.tensor([t for _, _, t in examples])
        return out

    def batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        if not self._queue:
            rng = self.rng
            n = batch_size * self.pool
            examples = [self._example(2 if rng.random() < self.mix.p_pair else 1) for _ in range(n)]
            order = np.argsort([len(e[0][0]) for e in examples], kind="stable")
            chunks = [[examples[int(i)] for i in order[k : k + batch_size]] for k in range(0, n, batch_size)]
            self._queue = [self._make(chunks[int(i)]) for i in rng.permutation(len(chunks))]
        return self._queue.pop()

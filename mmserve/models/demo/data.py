"""Synthetic training data for the demo models.

Images come from :func:`render.render_image` and are preprocessed in numpy exactly like the
processor (bicubic resize to the crop size, rescale, CLIP mean/std). Conversations follow the chat
template in :mod:`tokenizer`: single-image questions (colour / background / shape), two images in
one user message (first / second colour), multi-turn histories (the image(s) only in the first user
turn, earlier answers in the history) and optional system prompts. Labels are -100 everywhere but
on the final answer token(s) and the closing ``</s>``.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
from PIL import Image

from . import render

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer briefly.",
    "You are a helpful assistant. Answer with a single word.",
    "You are a vision assistant. Look at the image carefully and answer the question.",
    "Be concise.",
    "You are a friendly and precise assistant that describes images. Keep answers short and "
    "accurate, and reply in English.",
)

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)

# Image seeds: training draws from [0, TRAIN_SEED_LIMIT); evaluation uses seeds above it.
TRAIN_SEED_LIMIT = 1 << 30
EVAL_SEED_BASE = 1 << 30

SINGLE_QUESTIONS = (render.Q_COLOR, render.Q_BACKGROUND, render.Q_SHAPE)
PAIR_QUESTIONS = (render.Q_FIRST, render.Q_SECOND)
TRAIN_TASKS = ("color", "background", "shape", "first", "second")
TASK_OF_QUESTION = {q: i for i, q in enumerate((*SINGLE_QUESTIONS, *PAIR_QUESTIONS))}


# --------------------------------------------------------------------------------------------
# images


def resize_uint8(image: Image.Image, size: int) -> np.ndarray:
    """[size, size, 3] uint8 of a square image, resized like CLIPImageProcessorPil (bicubic).

    For a square input the processor's shortest-edge resize + centre crop is a plain resize.
    """
    image = image.convert("RGB")
    if image.size[0] != image.size[1]:
        raise ValueError(f"expected a square image, got {image.size}")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(image, dtype=np.uint8)


def normalize(pixels_uint8: np.ndarray) -> np.ndarray:
    """uint8 [..., H, W, 3] -> float32 [..., 3, H, W] normalised with CLIP mean/std."""
    x = pixels_uint8.astype(np.float32) * np.float32(1 / 255)
    x = (x - CLIP_MEAN) / CLIP_STD
    return np.moveaxis(x, -1, -3).copy()


@dataclasses.dataclass
class ImageSpec:
    color: str
    shape: str
    background: str
    seed: int

    def render(self) -> Image.Image:
        return render.render_image(self.color, self.shape, self.background, self.seed)


def random_spec(rng: np.random.Generator, seed_lo: int = 0, seed_hi: int = TRAIN_SEED_LIMIT) -> ImageSpec:
    return ImageSpec(
        color=render.COLORS[int(rng.integers(len(render.COLORS)))],
        shape=render.SHAPES[int(rng.integers(len(render.SHAPES)))],
        background=render.BACKGROUNDS[int(rng.integers(len(render.BACKGROUNDS)))],
        seed=int(rng.integers(seed_lo, seed_hi)),
    )


class ImageBank:
    """A pool of pre-rendered training images (rendering is the slow part of a training step)."""

    def __init__(self, size: int, count: int, seed: int = 0):
        rng = np.random.default_rng([seed, 0xBA4C])
        self.size = size
        self.specs = [random_spec(rng) for _ in range(count)]
        self.pixels = np.stack([resize_uint8(s.render(), size) for s in self.specs])

    def __len__(self) -> int:
        return len(self.specs)


# --------------------------------------------------------------------------------------------
# conversations


def answer_for(question: str, specs: list[ImageSpec]) -> str:
    if question == render.Q_COLOR:
        return specs[0].color
    if question == render.Q_BACKGROUND:
        return specs[0].background
    if question == render.Q_SHAPE:
        return specs[0].shape
    if question == render.Q_FIRST:
        return specs[0].color
    if question == render.Q_SECOND:
        return specs[1].color
    raise ValueError(question)


def user_content(question: str, n_images: int, text_first: bool = False) -> list[dict]:
    images = [{"type": "image"}] * n_images
    text = [{"type": "text", "text": question}]
    return text + images if text_first else images + text


def conversation(
    final_question: str,
    specs: list[ImageSpec],
    history: tuple[str, ...] = (),
    system: str | None = None,
    text_first: bool = False,
) -> tuple[list[dict], str]:
    """Messages (ending with the final user turn) and the expected answer."""
    messages: list[dict] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    questions = (*history, final_question)
    for i, q in enumerate(questions):
        if i == 0:
            messages.append({"role": "user", "content": user_content(q, len(specs), text_first)})
        else:
            messages.append({"role": "user", "content": q})
        if i < len(questions) - 1:
            messages.append({"role": "assistant", "content": answer_for(q, specs)})
    return messages, answer_for(final_question, specs)


@dataclasses.dataclass
class TaskMix:
    """Sampling weights of the training conversations."""

    p_pair: float = 0.5  # examples with two images
    single_final: tuple[float, float, float] = (0.3, 0.25, 0.45)  # color, background, shape
    history_len: tuple[float, ...] = (0.6, 0.28, 0.12)  # 0, 1, 2 earlier turns
    p_system: float = 0.2
    p_text_first: float = 0.15


def sample_dialogue(rng: np.random.Generator, n_images: int, mix: TaskMix):
    """(final_question, history, system, text_first) for an example with n_images images."""
    if n_images == 1:
        final = SINGLE_QUESTIONS[int(rng.choice(3, p=mix.single_final))]
        others = [q for q in SINGLE_QUESTIONS if q != final]
    else:
        final = PAIR_QUESTIONS[int(rng.integers(2))]
        others = [q for q in PAIR_QUESTIONS if q != final]
    k = int(rng.choice(len(mix.history_len), p=mix.history_len))
    history: list[str] = []
    for _ in range(k):
        # mostly a different question than the final one; now and then a repeat of anything
        pool = others if rng.random() < 0.85 else list(SINGLE_QUESTIONS if n_images == 1 else PAIR_QUESTIONS)
        history.append(pool[int(rng.integers(len(pool)))])
    system = SYSTEM_PROMPTS[int(rng.integers(len(SYSTEM_PROMPTS)))] if rng.random() < mix.p_system else None
    text_first = bool(rng.random() < mix.p_text_first)
    return final, tuple(history), system, text_first


class Encoder:
    """Chat-template + tokenize + expand image placeholders (cached per distinct prompt)."""

    def __init__(self, tokenizer, num_image_tokens: int):
        self.tok = tokenizer
        self.n_img = num_image_tokens
        self.image_id = tokenizer.image_token_id
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id

    def encode(self, messages_key, specs: list[ImageSpec]) -> tuple[list[int], list[int]]:
        """(input_ids, labels) for one example; labels only on the final answer + eos."""
        attrs = tuple((s.color, s.shape, s.background) for s in specs)
        return self._encode(messages_key, attrs)

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one Encoder per training run
    def _encode(self, messages_key, attrs) -> tuple[list[int], list[int]]:
        final, history, system, text_first = messages_key
        specs = [ImageSpec(c, sh, bg, 0) for c, sh, bg in attrs]
        messages, answer = conversation(final, specs, history, system, text_first)
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt: list[int] = []
        for t in self.tok.encode(text, add_special_tokens=False):
            prompt.extend([t] * self.n_img if t == self.image_id else [t])
        ans = list(self.tok.encode(" " + answer, add_special_tokens=False)) + [self.eos_id]
        return prompt + ans, [-100] * len(prompt) + ans


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (training only; positions of real tokens are unaffected)."""
    n = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), n), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


class BatchSampler:
    """Draws training batches from an :class:`ImageBank`.

    Examples are generated ``pool`` batches at a time, sorted by length and cut into batches (in
    shuffled order), so a batch is padded only to similar lengths: the compute goes to real tokens.
    """

    def __init__(self, tokenizer, num_image_tokens: int, bank: ImageBank, seed: int,
                 mix: TaskMix | None = None, pool: int = 16):
        self.enc = Encoder(tokenizer, num_image_tokens)
        self.bank = bank
        self.mix = mix or TaskMix()
        self.pool = pool
        self.rng = np.random.default_rng([seed, 0xDA7A])
        self.normalized = torch.from_numpy(normalize(bank.pixels))  # [N, 3, H, W]
        self._queue: list[dict[str, torch.Tensor]] = []

    def _example(self, n_images: int):
        rng = self.rng
        idx = rng.integers(len(self.bank), size=n_images)
        specs = [self.bank.specs[int(j)] for j in idx]
        key = sample_dialogue(rng, n_images, self.mix)
        ids, labels = self.enc.encode(key, specs)
        return ids, labels, idx, TASK_OF_QUESTION[key[0]]

    def _make(self, examples) -> dict[str, torch.Tensor]:
        out = collate([(ids, lab) for ids, lab, _, _ in examples], self.enc.pad_id)
        idx = np.concatenate([im for _, _, im, _ in examples])
        out["pixel_values"] = self.normalized[torch.from_numpy(idx)]
        out["task"] = torch.tensor([t for _, _, _, t in examples])
        return out

    def batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        if not self._queue:
            rng = self.rng
            n = batch_size * self.pool
            examples = [self._example(2 if rng.random() < self.mix.p_pair else 1) for _ in range(n)]
            order = np.argsort([len(e[0]) for e in examples], kind="stable")
            chunks = [[examples[int(i)] for i in order[k : k + batch_size]] for k in range(0, n, batch_size)]
            self._queue = [self._make(chunks[int(i)]) for i in rng.permutation(len(chunks))]
        return self._queue.pop()

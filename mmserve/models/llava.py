"""Adapter for LLaVA-family checkpoints: the model steps the actors need, one by one.

The steps — preprocess, encode images, scatter image embeddings into placeholder positions,
prefill with optional past KV and explicit positions, decode a batch by one token — reproduce the
model's own forward (pinned by tests/test_adapter.py). Each step is a plain synchronous function
that the actors run in worker threads.
"""

from __future__ import annotations

from dataclasses import dataclass
import os
from pathlib import Path
from typing import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models load from local directories only

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, DynamicCache

from transformers.utils import logging as hf_logging

from mmserve.cache.keys import check_hash_algorithm, processor_digest
from mmserve.cache.signature import model_sig

hf_logging.disable_progress_bar()

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's placeholder tokens sit in the prompt: positions [start, start+length)."""

    start: int
    length: int


@dataclass(frozen=True)
class PromptInputs:
    """A tokenized prompt and its per-image pixel tensors (row i belongs to spans[i])."""

    input_ids: tuple[int, ...]
    pixel_values: torch.Tensor | None
    spans: tuple[ImageSpan, ...]
    mm_keys: tuple[bytes | None, ...] = ()  # content key per image; None = uncacheable
    images: tuple = ()  # the decoded images, when pixel_values is left for the encoder to compute

    def pixels(self, adapter: "LlavaAdapter", i: int) -> torch.Tensor:
        """Image i's pixel tensor [C, H, W] (computed now if `tokenize` left it out)."""
        if self.pixel_values is not None:
            return self.pixel_values[i]
        return adapter.pixel_values([self.images[i]])[0]


@dataclass
class StepOutput:
    """Logits of the last position of each sequence, and the KV cache after the step."""

    logits: torch.Tensor
    cache: DynamicCache


class LlavaAdapter:
    """One loaded LLaVA-family model (processor + weights) on a device."""

    def __init__(self, name: str, path: str | Path, device: str = "cpu", dtype: str = "float32", *,
                 hash_algorithm: str = "xxh3_128"):
        self.hash_algorithm = check_hash_algorithm(hash_algorithm)  # of block and multimodal keys
        self.name = name
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"model {name!r}: checkpoint directory {self.path} does not exist")
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.processor = AutoProcessor.from_pretrained(self.path)
        self.tokenizer = self.processor.tokenizer
        model = AutoModelForImageTextToText.from_pretrained(self.path, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        self.config = self.model.config
        self.text_config = self.config.get_text_config()
        self.image_token_id = int(self.config.image_token_id)
        self.eos_token_ids = frozenset(self._eos_ids())
        self.vocab_size = int(self.text_config.vocab_size)
        tc = self.text_config
        self.kv_layers = int(tc.num_hidden_layers)
        self.kv_heads = int(getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)
        self.head_dim = int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
        self.answer_lead = self._answer_lead()
        dtype_name = str(self.dtype).removeprefix("torch.")  # 'float32', 'float16', 'bfloat16'
        self.model_sig = model_sig(name, self.path, dtype=dtype_name, device_type=self.device.type)
        self.processor_digest = processor_digest(self.processor.image_processor.to_dict())

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]

    def _answer_lead(self) -> str:
        """Whitespace the chat template puts between the generation prompt and an assistant
        message's content (e.g. "assistant:" + " " + content). The model generates it as part of
        its answer; it is removed from responses so that a client sending the answer back in the
        history reproduces the very tokens that were generated."""
        user = [{"role": "user", "content": "q"}]
        try:
            prompt = self.processor.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
            full = self.processor.apply_chat_template(
                user + [{"role": "assistant", "content": "ANSWER"}], tokenize=False)
        except Exception:  # a template that cannot render the probe: strip nothing
            return ""
        if not full.startswith(prompt):
            return ""
        rest = full[len(prompt):]
        lead = rest[: len(rest) - len(rest.lstrip())]
        return lead if rest[len(lead):].startswith("ANSWER") else ""

    # -- preprocessing ---------------------------------------------------------------------

    def render_prompt(self, messages: list[dict]) -> str:
        """The chat-templated prompt text, ending with the generation prompt."""
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def preprocess(self, messages: list[dict], images: Sequence) -> PromptInputs:
        """Applies the chat template and the processor; images are PIL images in prompt order."""
        text = self.render_prompt(messages)
        batch = self.processor(text=[text], images=list(images) or None, return_tensors="pt")
        input_ids = tuple(int(t) for t in batch["input_ids"][0])
        pixel_values = batch.get("pixel_values") if images else None
        spans = self.image_spans(input_ids, len(images))
        return PromptInputs(input_ids, pixel_values, spans)

    def tokenize(self, messages: list[dict], images: Sequence) -> PromptInputs:
        """Like `preprocess`, but without the image processor's pixel work, which only an encoder
        cache miss needs (the encoder computes it then, with `pixel_values`). The placeholder
        expansion is the processor's own (`_get_num_multimodal_tokens`, as vLLM uses it); a
        processor that cannot tell its counts without pixels takes the full `preprocess` path.
        tests/test_adapter.py pins that both paths give the same tokens."""
        counts = self._image_token_counts(images)
        if counts is None:
            return self.preprocess(messages, images)
        # the image token is special, so it splits the text before the tokenizer's own rules run:
        # one placeholder per image tokenizes like the processor's expanded text, then its id is
        # repeated (tokenizing hundreds of placeholder strings costs more than the rest together)
        compact = self.tokenizer([self.render_prompt(messages)])["input_ids"][0]
        where = [i for i, t in enumerate(compact) if t == self.image_token_id]
        if len(where) != len(images):
            raise ValueError(f"the prompt has {len(where)} image placeholders for {len(images)} images")
        input_ids: list[int] = []
        start = 0
        for i, n in zip(where, counts):
            input_ids += compact[start:i] + [self.image_token_id] * n
            start = i + 1
        input_ids = tuple(int(t) for t in input_ids + compact[start:])
        spans = self.image_spans(input_ids, len(images))
        return PromptInputs(input_ids, None, spans, images=tuple(images))

    def _image_token_counts(self, images: Sequence) -> list[int] | None:
        count = getattr(self.processor, "_get_num_multimodal_tokens", None)
        token = getattr(self.processor, "image_token", None)
        if not images or count is None or not isinstance(token, str):
            return [] if not images and token else None
        try:
            data = count(image_sizes=[(img.height, img.width) for img in images])
            counts = list(data.num_image_tokens)
        except Exception:  # a processor whose counts need more than sizes: take the full path
            return None
        return counts if len(counts) == len(images) else None

    def pixel_values(self, images: Sequence) -> torch.Tensor:
        """The image processor's pixel tensor for `images`, [N, C, H, W] (worker thread)."""
        return self.processor.image_processor(images=list(images), return_tensors="pt")["pixel_values"]

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
    def encode_images(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Runs the vision tower and projector: one [num_image_tokens, hidden] tensor per image."""
        pixel_values = pixel_values.to(self.device, self.dtype)
        out = self.model.model.get_image_features(pixel_values=pixel_values, return_dict=True)
        return [f.contiguous() for f in out.pooler_output]

    @torch.inference_mode()
    def embed(self, input_ids: Sequence[int], pieces: Sequence[tuple[int, torch.Tensor]] = ()) -> torch.Tensor:
        """Token embeddings [1, T, H] with each (position, rows) piece of image embeddings
        written over the placeholders starting at that position."""
        ids = torch.tensor([list(input_ids)], dtype=torch.long, device=self.device)
        embeds = self.model.get_input_embeddings()(ids)
        for pos, rows in pieces:
            embeds[0, pos : pos + rows.shape[0]] = rows.to(embeds.dtype)
        return embeds

    @torch.inference_mode()
    def prefill(self, inputs_embeds: torch.Tensor, cache: DynamicCache | None = None, start: int = 0) -> StepOutput:
        """Runs the text model over [1, T, H] embeddings after `start` cached positions."""
        cache = cache if cache is not None else DynamicCache(config=self.text_config)
        t = inputs_embeds.shape[1]
        positions = torch.arange(start, start + t, device=self.device).unsqueeze(0)
        out = self.model.model.language_model(
            inputs_embeds=inputs_embeds, position_ids=positions, past_key_values=cache, use_cache=True
        )
        logits = self.model.lm_head(out.last_hidden_state[:, -1, :])
        return StepOutput(logits.float(), out.past_key_values)

    @torch.inference_mode()
    def decode(
        self,
        token_ids: Sequence[int],
        cache: DynamicCache,
        positions: Sequence[int],
        attention_mask: torch.Tensor | None = None,
    ) -> StepOutput:
        """One decode step for a batch: token_ids[b] at positions[b], over a contiguous cache. The
        runtime decodes through `forward_paged`; this is the model's own path, the reference the
        paged one is tested against (and `prefill` serves the benchmark's baselines)."""
        ids = torch.tensor([[t] for t in token_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([[p] for p in positions], dtype=torch.long, device=self.device)
        embeds = self.model.get_input_embeddings()(ids)
        out = self.model.model.language_model(
            inputs_embeds=embeds,
            position_ids=pos,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
        )
        logits = self.model.lm_head(out.last_hidden_state[:, -1, :])
        return StepOutput(logits.float(), out.past_key_values)

    @torch.inference_mode()
    def forward_paged(self, inputs_embeds: torch.Tensor, segments: Sequence, arena) -> torch.Tensor:
        """One ragged step over a paged KV arena (mmserve.models.paged): `inputs_embeds`
        [1, T, H] is the concatenation of every segment's new tokens (a decode token of each
        running sequence, prefill chunks of waiting ones); their KV is written into the arena at
        their block-table slots. Returns float logits [len(segments), vocab] of each segment's
        last token.

        The paged attention is selected for this call only: it runs a twin of the language
        model that shares every parameter and buffer (no weights copied) but has its own config
        whose attention implementation is "mmserve_paged". The model's own config is never
        switched, so `prefill`/`decode` in other threads keep their attention meanwhile."""
        from mmserve.models import paged

        twin = getattr(self, "_paged_lm", None)
        if twin is None:
            import copy

            lm = self.model.model.language_model
            shared = {id(t): t for t in (*lm.parameters(), *lm.buffers())}
            twin = copy.deepcopy(lm, shared)  # the memo makes the copy reuse every tensor
            twin.config._attn_implementation = paged.ATTN_IMPLEMENTATION
            self._paged_lm = twin
        batch = paged.PagedBatch(arena, segments)
        if inputs_embeds.shape[:2] != (1, batch.tokens):
            raise ValueError(f"inputs_embeds {tuple(inputs_embeds.shape)} does not hold the segments' "
                             f"{batch.tokens} new tokens as [1, T, hidden]")
        out = twin(inputs_embeds=inputs_embeds.to(self.device, self.dtype), position_ids=batch.position_ids,
                   use_cache=False, **{paged.KWARG: batch})
        last = out.last_hidden_state[0].index_select(0, batch.last_index)
        return self.model.lm_head(last).float()

    def decode_text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

"""What mmserve is compared with: raw transformers `model.generate`, and the pure-compute
reference "prefill only the suffix on top of a precomputed KV cache" (via the adapter).

Both exist for each family the benchmark runs. LLaVA loads with AutoProcessor. A Qwen2-VL
checkpoint has no usable AutoProcessor here (Qwen2VLProcessor's video processor needs torchvision),
so its inputs are built by hand from the tokenizer and `Qwen2VLImageProcessorPil`, as
`mmserve.models.demo.qwen.build_inputs` does, and a batch is those rows left-padded by hand.
LLaVA-OneVision has none either (LlavaOnevisionProcessor's video processor needs torchvision).
Its inputs, and Idefics3's and Gemma 3's (whose AutoProcessor does load here, with the PIL image
processors), are the adapter's own tokens and pixel items laid out as the family's processor lays
them out (`Adapter.generate_inputs`; tests/test_bench_families.py checks them equal to the
processor's tensors), left-padded the same way: one path for the three. The suffix prefill is
`Adapter.prefill` for every family.

Both load the model on the benchmark's device in its dtype, as mmserve does (a random-weights
directory through the same loader, so all sides run the very same weights), and put their inputs
there. On CUDA a timing waits for the GPU (`sync`) wherever it would otherwise stop early: `generate`
hands each token to the streamer as a host tensor, which already waits for it."""

from __future__ import annotations

import copy
from pathlib import Path
from time import perf_counter

import torch
from transformers import (AutoProcessor, AutoTokenizer, DynamicCache,
                          Qwen2VLImageProcessorPil)
from transformers.generation.streamers import BaseStreamer

from mmserve.actors.intake import decode_images, hf_messages
from mmserve.bench.common import MODEL, Timing, median
from mmserve.bench.model import ADAPTER_INPUT_FAMILIES, family, is_qwen
from mmserve.config import LimitsConfig
from mmserve.inputs.request import parse_chat_request
from mmserve.models.adapter import StepOutput
from mmserve.models.demo.qwen import build_inputs
from mmserve.models.loading import load_adapter
from mmserve.models.random_weights import load_model
from mmserve.models.qwen2_vl import _saved_template


def hf_prompt(messages: list[dict]) -> tuple[list[dict], list]:
    """OpenAI-shaped messages as transformers takes them (messages, PIL images), exactly as
    mmserve's intake prepares them."""
    limits = LimitsConfig()
    request = parse_chat_request({"messages": messages}, limits, MODEL)
    return hf_messages(request), decode_images(request, limits)


class _TokenTimes(BaseStreamer):
    """A `generate` streamer that only records when each new token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def sync(device: torch.device | str) -> None:
    """Waits for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release_device_memory(device: torch.device | str) -> None:
    """Hands freed CUDA memory back (a closed runtime's weights and KV arena), so that the next
    runtime, or a server in its own process, can have it; nothing to do on the CPU."""
    if torch.device(device).type == "cuda":
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def hf_baseline(path, device: str = "cpu", dtype: str = "float32", model=None, adapter=None) -> "HFBaseline":
    """The raw-transformers baseline of the checkpoint's family (on `adapter`'s model, or `model`,
    when given: the benchmark shares one loaded model with `SuffixPrefill`, which a 7B model on a
    GPU needs)."""
    kind = family(path)
    if kind in ADAPTER_INPUT_FAMILIES:
        return AdapterHFBaseline(path, device, dtype, adapter=adapter)
    model = adapter.model if adapter is not None and model is None else model
    cls = QwenHFBaseline if is_qwen(kind) else HFBaseline
    return cls(path, device, dtype, model=model)


class HFBaseline:
    """The checkpoint loaded with AutoProcessor / AutoModelForImageTextToText, run with `generate`."""

    def __init__(self, path, device: str = "cpu", dtype: str = "float32", model=None):
        self.device = torch.device(device)
        self._load_preprocessing(path)
        self.model = (model if model is not None else load_model(path, dtype, self.device)).to(self.device).eval()

    def _on_device(self, inputs) -> dict:
        """The model inputs on the model's device, pixels in its dtype (as mmserve's encoder casts them)."""
        dtype = self.model.dtype
        return {k: (v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device))
                if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def _load_preprocessing(self, path) -> None:
        self.processor = AutoProcessor.from_pretrained(path)

    def _inputs(self, messages: list[dict]):
        msgs, images = hf_prompt(messages)
        text = self.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return self.processor(text=[text], images=images or None, return_tensors="pt")

    def _batch_inputs(self, requests: list[list[dict]]):
        """All `requests` as one left-padded batch, their images in request order."""
        prompts = [hf_prompt(m) for m in requests]
        texts = [self.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                 for msgs, _ in prompts]
        images = [img for _, imgs in prompts for img in imgs]
        return self.processor(text=texts, images=images or None, padding=True, padding_side="left",
                              return_tensors="pt")

    @torch.inference_mode()
    def generate(self, messages: list[dict], tokens: int) -> Timing:
        """Greedy generation of exactly `tokens` new tokens, timed like an mmserve request:
        from the raw request (image decoding and preprocessing included) to each token."""
        clock = _TokenTimes()
        start = perf_counter()
        inputs = self._on_device(self._inputs(messages))
        self.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                            streamer=clock)
        first, last = clock.times[0], clock.times[-1]
        return Timing(first - start, last - start, len(clock.times))

    @torch.inference_mode()
    def generate_batch(self, requests: list[list[dict]], tokens: int) -> Timing:
        """All `requests` (with their images) preprocessed at once, left-padded, and one greedy
        `generate` call of exactly `tokens` new tokens each, timed from the raw requests.
        The Timing is the batch's: its first and last step (every row gets its token at once);
        `completion_tokens` is the tokens of one row (steps), checked against the output."""
        clock = _TokenTimes()
        start = perf_counter()
        inputs = self._on_device(self._batch_inputs(requests))
        out = self.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                  streamer=clock)
        first, last = clock.times[0], clock.times[-1]
        generated = out.shape[1] - inputs["input_ids"].shape[1]
        if out.shape[0] != len(requests) or generated != tokens or len(clock.times) != tokens:
            raise RuntimeError(f"batched generate: {out.shape[0]} rows x {generated} new tokens "
                               f"({len(clock.times)} steps), asked for {len(requests)} x {tokens}")
        return Timing(first - start, last - start, tokens)


class QwenHFBaseline(HFBaseline):
    """A Qwen2-VL or Qwen2.5-VL checkpoint: tokenizer + `Qwen2VLImageProcessorPil` + the model,
    inputs by hand. transformers computes M-RoPE positions with the attention mask (left padding is skipped), so
    a padded row generates what it generates alone (tests/test_bench_qwen.py checks it)."""

    def _load_preprocessing(self, path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.chat_template is None:
            self.tokenizer.chat_template = _saved_template(Path(path))  # the adapter's fallback: both render alike
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)

    def _inputs(self, messages: list[dict]) -> dict:
        msgs, images = hf_prompt(messages)
        return build_inputs(self.tokenizer, self.image_processor, msgs, images)

    def _batch_inputs(self, requests: list[list[dict]]) -> dict:
        return left_pad([self._inputs(m) for m in requests], self.tokenizer.pad_token_id)


class AdapterHFBaseline(HFBaseline):
    """A LLaVA-OneVision, Idefics3 or Gemma 3 checkpoint: `generate` on the adapter's model, its
    inputs from the adapter's own tokens and pixel items laid out as the family's processor gives
    them (`Adapter.generate_inputs`), the images decoded and preprocessed inside the timing."""

    def __init__(self, path, device: str = "cpu", dtype: str = "float32", adapter=None):
        self.adapter = adapter if adapter is not None else load_adapter(MODEL, path, device=device, dtype=dtype)
        super().__init__(path, device, dtype, model=self.adapter.model)

    def _load_preprocessing(self, path) -> None:
        pass  # the adapter's

    def _inputs(self, messages: list[dict]) -> dict:
        msgs, images = hf_prompt(messages)
        a = self.adapter
        return a.generate_inputs(a.tokenize(msgs, images), a.pixel_values(images) if images else [])

    def _batch_inputs(self, requests: list[list[dict]]) -> dict:
        return left_pad([self._inputs(m) for m in requests], self.adapter.tokenizer.pad_token_id)


TOKEN_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
"""The per-token tensors [1, T] of a model's inputs (left-padded in a batch)."""


def left_pad(rows: list[dict], pad_id: int) -> dict:
    """One batch of single-row inputs: the per-token tensors (TOKEN_KEYS) left-padded, input_ids
    with pad_id and the others with 0; every other tensor (the images', per image or per row)
    concatenated in row order, dimension 1 zero-padded to the widest first, as the processors
    pad (LLaVA-OneVision's tiles per image, Idefics3's views per row: an all-zero view is padding
    to the model). Qwen2-VL's pixel_values and image_grid_thw are concatenated as they are (the
    model takes each image's patches by its grid, in the order its placeholders appear)."""
    width = max(r["input_ids"].shape[1] for r in rows)
    out = {}
    for key in (k for k in TOKEN_KEYS if k in rows[0]):
        value = pad_id if key == "input_ids" else 0
        out[key] = torch.cat([torch.nn.functional.pad(r[key], (width - r[key].shape[1], 0), value=value)
                              for r in rows])
    for key in dict.fromkeys(k for r in rows for k in r if k not in TOKEN_KEYS):
        parts = [r[key] for r in rows if key in r]
        wide = max(p.shape[1] for p in parts)
        out[key] = torch.cat([p if p.shape[1] == wide else torch.cat([p, p.new_zeros(
            (p.shape[0], wide - p.shape[1], *p.shape[2:]))], dim=1) for p in parts])
    return out


class SuffixPrefill:
    """Times the prefill of a prompt's suffix on top of a precomputed KV cache of its first `hit`
    tokens: the least work a prefix-cache hit can cost. Every family through `Adapter.prefill`
    (the model's own language model over a contiguous cache), with the family's positions (M-RoPE),
    language-model arguments (Qwen3-VL's DeepStack rows) and masks (Gemma 3's bidirectional image
    runs)."""

    def __init__(self, path, device: str = "cpu", dtype: str = "float32", adapter=None):
        self.adapter = adapter if adapter is not None else load_adapter(MODEL, path, device=device, dtype=dtype)

    def _prompt(self, messages: list[dict]):
        """(embeddings [1, T, H], M-RoPE positions [3, T] or None, T) of the whole prompt."""
        inputs, positions, n, _ = self._steps(messages)
        return inputs(0, n)[0], positions, n

    def _steps(self, messages: list[dict]):
        """(inputs, M-RoPE positions [3, T] or None, T, bidirectional spans) of the whole prompt:
        `inputs(start, end)` gives tokens [start, end)'s embeddings [1, end - start, H] and the
        family's language-model arguments (Qwen3-VL's DeepStack rows), from the image rows over
        them, as the generator cuts them (`Adapter.step_inputs`)."""
        a = self.adapter
        msgs, images = hf_prompt(messages)
        prompt = a.tokenize(msgs, images)
        embeds = a.encode_images(a.pixel_values(images)) if images else []
        n = len(prompt.input_ids)

        def inputs(start: int, end: int) -> tuple[torch.Tensor, dict]:
            pieces = []
            for span, emb in zip(prompt.spans, embeds):
                lo, hi = max(span.start, start), min(span.start + span.length, end)
                if lo < hi:
                    pieces.append((lo - start, emb[lo - span.start:hi - span.start]))
            return a.step_inputs(prompt.input_ids[start:end], pieces)

        return inputs, a.rope_positions(prompt, n, 0, n), n, prompt.bidirectional

    @torch.inference_mode()
    def time(self, messages: list[dict], hit: int, repeats: int = 3) -> tuple[float, int]:
        """(median seconds, suffix tokens) of prefilling the tokens after `hit`."""
        inputs, positions, n, spans = self._steps(messages)
        prefix = self._prefill(inputs(0, hit), None, 0, _cols(positions, 0, hit), spans).cache if hit else None
        suffix = inputs(hit, n)
        times = []
        for _ in range(repeats):
            cache = self._copy(prefix)
            sync(self.adapter.device)  # the copy (and anything before it) is not part of the time
            t0 = perf_counter()
            self._prefill(suffix, cache, hit, _cols(positions, hit, n), spans)
            sync(self.adapter.device)
            times.append(perf_counter() - t0)
        return median(times), n - hit

    @torch.inference_mode()
    def suffix_logits(self, messages: list[dict], hit: int) -> torch.Tensor:
        """The last position's logits after the suffix prefill (what `time` times, on a copy of the
        prefix cache as it is), for tests. A hit inside a bidirectional run (Gemma 3's image) is
        timed the same, but its prefix did not see the run's rest (the runtime's did): its logits
        are not the model's own."""
        inputs, positions, n, spans = self._steps(messages)
        prefix = self._prefill(inputs(0, hit), None, 0, _cols(positions, 0, hit), spans).cache if hit else None
        return self._prefill(inputs(hit, n), self._copy(prefix), hit, _cols(positions, hit, n), spans).logits

    def _prefill(self, step: tuple[torch.Tensor, dict], cache, start: int, positions, spans=()) -> StepOutput:
        embeds, lm_kwargs = step
        return self.prefill(embeds, cache, start, positions, lm_kwargs=lm_kwargs, spans=spans)

    @torch.inference_mode()
    def prefill(self, inputs_embeds: torch.Tensor, cache: DynamicCache | None, start: int,
                positions: torch.Tensor | None, lm_kwargs: dict | None = None, spans=()) -> StepOutput:
        """The text model over [1, T, H] embeddings after `start` cached positions: `Adapter.prefill`.
        M-RoPE `positions` [3, T] are passed as position_ids [3, 1, T], since the language model's
        default (index, equal in all three) is wrong for every token at or after an image."""
        return self.adapter.prefill(inputs_embeds, cache, start, positions, lm_kwargs, spans)

    def _copy(self, cache: DynamicCache | None) -> DynamicCache | None:
        """A fresh copy (a cache grows in place); a deep copy keeps a sliding-window layer's count
        of the tokens it has seen (Gemma 3), which rebuilding from its tensors would lose."""
        return None if cache is None else copy.deepcopy(cache)


def _cols(positions: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if positions is None else positions[:, start:end]

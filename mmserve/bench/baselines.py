"""What mmserve is compared with: raw transformers `model.generate`, and the pure-compute
reference "prefill only the suffix on top of a precomputed KV cache" (via the adapter).

Both exist for each family the benchmark runs. LLaVA loads with AutoProcessor. A Qwen2-VL
checkpoint has no usable AutoProcessor here (Qwen2VLProcessor's video processor needs torchvision),
so its inputs are built by hand from the tokenizer and `Qwen2VLImageProcessorPil`, as
`mmserve.models.demo.qwen.build_inputs` does, and a batch is those rows left-padded by hand.

Both load the model on the benchmark's device in its dtype, as mmserve does (a random-weights
directory through the same loader, so all sides run the very same weights), and put their inputs
there. On CUDA a timing waits for the GPU (`sync`) wherever it would otherwise stop early: `generate`
hands each token to the streamer as a host tensor, which already waits for it."""

from __future__ import annotations

from pathlib import Path
from time import perf_counter

import torch
from transformers import (AutoProcessor, AutoTokenizer, DynamicCache,
                          Qwen2VLImageProcessorPil)
from transformers.generation.streamers import BaseStreamer

from mmserve.actors.intake import decode_images, hf_messages
from mmserve.bench.common import MODEL, Timing, median
from mmserve.bench.model import family, is_qwen
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


def hf_baseline(path, device: str = "cpu", dtype: str = "float32", model=None) -> "HFBaseline":
    """The raw-transformers baseline of the checkpoint's family (on `model`, when given: the
    benchmark shares one loaded model with `SuffixPrefill`, which a 7B model on a GPU needs)."""
    cls = QwenHFBaseline if is_qwen(family(path)) else HFBaseline
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


def left_pad(rows: list[dict], pad_id: int) -> dict:
    """One batch of single-row Qwen2-VL inputs: input_ids / attention_mask / mm_token_type_ids
    left-padded with pad_id / 0 / 0, pixel_values and image_grid_thw concatenated in row order
    (the model takes each image's patches by its grid, in the order its placeholders appear)."""
    width = max(r["input_ids"].shape[1] for r in rows)

    def padded(key: str, value: int) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(r[key], (width - r[key].shape[1], 0), value=value) for r in rows])

    out = {"input_ids": padded("input_ids", pad_id), "attention_mask": padded("attention_mask", 0),
           "mm_token_type_ids": padded("mm_token_type_ids", 0)}
    with_images = [r for r in rows if "pixel_values" in r]
    if with_images:
        out["pixel_values"] = torch.cat([r["pixel_values"] for r in with_images])
        out["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in with_images])
    return out


class SuffixPrefill:
    """Times the prefill of a prompt's suffix on top of a precomputed KV cache of its first `hit`
    tokens: the least work a prefix-cache hit can cost."""

    def __init__(self, path, device: str = "cpu", dtype: str = "float32", adapter=None):
        self.adapter = adapter if adapter is not None else load_adapter(MODEL, path, device=device, dtype=dtype)

    def _prompt(self, messages: list[dict]):
        """(embeddings [1, T, H], M-RoPE positions [3, T] or None, T) of the whole prompt."""
        inputs, positions, n = self._steps(messages)
        return inputs(0, n)[0], positions, n

    def _steps(self, messages: list[dict]):
        """(inputs, M-RoPE positions [3, T] or None, T) of the whole prompt: `inputs(start, end)`
        gives tokens [start, end)'s embeddings [1, end - start, H] and the family's language-model
        arguments (Qwen3-VL's DeepStack rows), from the image rows over them, as the generator
        cuts them (`Adapter.step_inputs`)."""
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

        return inputs, a.rope_positions(prompt, n, 0, n), n

    @torch.inference_mode()
    def time(self, messages: list[dict], hit: int, repeats: int = 3) -> tuple[float, int]:
        """(median seconds, suffix tokens) of prefilling the tokens after `hit`."""
        inputs, positions, n = self._steps(messages)
        prefix = self._prefill(inputs(0, hit), None, 0, _cols(positions, 0, hit)).cache if hit else None
        suffix = inputs(hit, n)
        times = []
        for _ in range(repeats):
            cache = self._copy(prefix)
            sync(self.adapter.device)  # the copy (and anything before it) is not part of the time
            t0 = perf_counter()
            self._prefill(suffix, cache, hit, _cols(positions, hit, n))
            sync(self.adapter.device)
            times.append(perf_counter() - t0)
        return median(times), n - hit

    @torch.inference_mode()
    def suffix_logits(self, messages: list[dict], hit: int) -> torch.Tensor:
        """The last position's logits after the suffix prefill (what `time` times), for tests."""
        inputs, positions, n = self._steps(messages)
        prefix = self._prefill(inputs(0, hit), None, 0, _cols(positions, 0, hit)).cache if hit else None
        return self._prefill(inputs(hit, n), prefix, hit, _cols(positions, hit, n)).logits

    def _prefill(self, step: tuple[torch.Tensor, dict], cache, start: int, positions) -> StepOutput:
        embeds, lm_kwargs = step
        return self.prefill(embeds, cache, start, positions, lm_kwargs=lm_kwargs)

    @torch.inference_mode()
    def prefill(self, inputs_embeds: torch.Tensor, cache: DynamicCache | None, start: int,
                positions: torch.Tensor | None, lm_kwargs: dict | None = None) -> StepOutput:
        """The text model over [1, T, H] embeddings after `start` cached positions. 1-D positions:
        the adapter's own prefill (LLaVA). M-RoPE: `positions` [3, T] are passed as position_ids
        [3, 1, T], since the language model's default (index, equal in all three) is wrong for every
        token at or after an image; `lm_kwargs` (the family's, from `step_inputs`) with them."""
        a = self.adapter
        if positions is None:
            return a.prefill(inputs_embeds, cache, start=start)
        cache = cache if cache is not None else DynamicCache(config=a.text_config)
        out = a.model.model.language_model(inputs_embeds=inputs_embeds, position_ids=positions.to(a.device).unsqueeze(1),
                                           past_key_values=cache, use_cache=True, **(lm_kwargs or {}))
        logits = a.model.lm_head(out.last_hidden_state[:, -1, :])
        return StepOutput(logits.float(), out.past_key_values)

    def _copy(self, cache: DynamicCache | None) -> DynamicCache | None:
        """A fresh copy (DynamicCache grows in place)."""
        if cache is None:
            return None
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        return DynamicCache(ddp_cache_data=layers, config=self.adapter.text_config)


def _cols(positions: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if positions is None else positions[:, start:end]

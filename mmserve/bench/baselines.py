"""What mmserve is compared with: raw transformers `model.generate`, and the pure-compute
reference "prefill only the suffix on top of a precomputed KV cache" (via the adapter)."""

from __future__ import annotations

from time import perf_counter

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, DynamicCache
from transformers.generation.streamers import BaseStreamer

from mmserve.actors.intake import decode_images, hf_messages
from mmserve.bench.common import MODEL, Timing, median
from mmserve.models.llava import LlavaAdapter
from mmserve.config import LimitsConfig
from mmserve.inputs.request import parse_chat_request


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


class HFBaseline:
    """The checkpoint loaded with AutoProcessor / AutoModelForImageTextToText, run with `generate`."""

    def __init__(self, path):
        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def _inputs(self, messages: list[dict]):
        msgs, images = hf_prompt(messages)
        text = self.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return self.processor(text=[text], images=images or None, return_tensors="pt")

    @torch.inference_mode()
    def generate(self, messages: list[dict], tokens: int) -> Timing:
        """Greedy generation of exactly `tokens` new tokens, timed like an mmserve request:
        from the raw request (image decoding and preprocessing included) to each token."""
        clock = _TokenTimes()
        start = perf_counter()
        inputs = self._inputs(messages)
        self.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                            streamer=clock)
        first, last = clock.times[0], clock.times[-1]
        return Timing(first - start, last - start, len(clock.times))

    @torch.inference_mode()
    def generate_batch(self, requests: list[list[dict]], tokens: int) -> Timing:
        """All `requests` (with their images) through the processor at once, left-padded, and one
        greedy `generate` call of exactly `tokens` new tokens each, timed from the raw requests.
        The Timing is the batch's: its first and last step (every row gets its token at once);
        `completion_tokens` is the tokens of one row (steps), checked against the output."""
        clock = _TokenTimes()
        start = perf_counter()
        prompts = [hf_prompt(m) for m in requests]
        texts = [self.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                 for msgs, _ in prompts]
        images = [img for _, imgs in prompts for img in imgs]
        inputs = self.processor(text=texts, images=images or None, padding=True, padding_side="left",
                                return_tensors="pt")
        out = self.model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                  streamer=clock)
        first, last = clock.times[0], clock.times[-1]
        generated = out.shape[1] - inputs["input_ids"].shape[1]
        if out.shape[0] != len(requests) or generated != tokens or len(clock.times) != tokens:
            raise RuntimeError(f"batched generate: {out.shape[0]} rows x {generated} new tokens "
                               f"({len(clock.times)} steps), asked for {len(requests)} x {tokens}")
        return Timing(first - start, last - start, tokens)


class SuffixPrefill:
    """Times `adapter.prefill` of a prompt's suffix on top of a precomputed KV cache of its first
    `hit` tokens: the least work a prefix-cache hit can cost."""

    def __init__(self, path):
        self.adapter = LlavaAdapter(MODEL, path)

    @torch.inference_mode()
    def time(self, messages: list[dict], hit: int, repeats: int = 3) -> tuple[float, int]:
        """(median seconds, suffix tokens) of prefilling the tokens after `hit`."""
        a = self.adapter
        msgs, images = hf_prompt(messages)
        prompt = a.preprocess(msgs, images)
        embeds = a.encode_images(prompt.pixel_values) if images else []
        full = a.embed(prompt.input_ids, [(s.start, e) for s, e in zip(prompt.spans, embeds)])
        prefix = a.prefill(full[:, :hit]).cache if hit else None
        times = []
        for _ in range(repeats):
            cache = self._copy(prefix)
            t0 = perf_counter()
            a.prefill(full[:, hit:], cache, start=hit)
            times.append(perf_counter() - t0)
        return median(times), len(prompt.input_ids) - hit

    def _copy(self, cache: DynamicCache | None) -> DynamicCache | None:
        """A fresh copy (DynamicCache grows in place)."""
        if cache is None:
            return None
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        return DynamicCache(ddp_cache_data=layers, config=self.adapter.text_config)
